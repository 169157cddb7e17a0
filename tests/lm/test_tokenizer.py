"""Tokenizers and sources of ``mpipemoe data prepare`` (tier 1, no Ray): byte-level BPE trained
on a folder of text, Parquet and JSONL; a loaded tokenizer.json; the vocabulary reaching the
model; errors that name the flag and the fix."""
from __future__ import annotations

import json
import sys
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("tokenizers")

from app import cli  # noqa: E402
from app.jobs.job import TrainJob, worker_config  # noqa: E402
from app.jobs.preflight import ensure_data  # noqa: E402
from lm.data import BatchSampler, Manifest, load_rank_tokens, open_rank_stream, prepare_dataset  # noqa: E402
from lm.tokenizer import HFTokenizer, TokenizerSpec, load_prepared  # noqa: E402

WORDS = ("the expert router sends each token to two experts; the pipeline overlaps the "
         "all-to-all of one partition with the expert computation of the next. ")


def _prose(seed: int, words: int) -> str:
    """Varied text (a few hundred made-up words), so a BPE finds enough merges to fill 600."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkqjxz"))
    lexicon = ["".join(rng.choice(letters, size=rng.integers(2, 9))) for _ in range(400)]
    return " ".join(lexicon[i] for i in rng.zipf(1.3, size=words) % 400) + "\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A folder of text files, a Parquet file and a JSONL file, each with a `text` column."""
    root = tmp_path_factory.mktemp("corpus")
    (root / "books").mkdir()
    for i in range(3):
        (root / "books" / f"b{i}.txt").write_text(f"chapter {i}. " + WORDS * 40 + _prose(i, 3000) + "ünïcödé ✓\n")
    pq.write_table(pa.table({"text": [f"parquet row {i}: " + WORDS * 3 + _prose(10 + i, 100) for i in range(20)]}),
                   root / "rows.parquet")
    with (root / "lines.jsonl").open("w") as out:
        for i in range(20):
            out.write(json.dumps({"text": f"jsonl line {i}: " + WORDS * 3 + _prose(40 + i, 100), "id": i}) + "\n")
    return root


@pytest.fixture(scope="module")
def bpe_data(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("bpe")
    lines = []
    manifest = prepare_dataset(out, [corpus / "books", corpus / "rows.parquet", corpus / "lines.jsonl"],
                               max_bytes=None, row_len=256, rows_per_shard=8, tokenizer="bpe:600",
                               progress=lines.append)
    return out, manifest, lines


def test_bpe_is_trained_on_the_corpus_and_stored_with_the_shards(bpe_data):
    out, manifest, lines = bpe_data
    assert manifest.tokenizer == "bpe-byte-level-600" and manifest.vocab_size == 600
    assert (manifest.eos_id, manifest.mask_id, manifest.pad_id) == (0, 1, 2)
    assert (out / "tokenizer.json").is_file() and manifest.tokenizer_file == "tokenizer.json"
    assert Manifest.load(out) == manifest
    tokens = load_rank_tokens(out, 0, 1)
    assert tokens.max() < 600 and (out / "tokens.bin").stat().st_size == manifest.num_tokens * 2
    text = load_prepared(out, manifest.tokenizer_file).decode(tokens)
    # BPE merges: far fewer tokens than the text has bytes (the byte tokenizer gives one per byte)
    assert manifest.num_tokens < len(text.encode()) / 2
    assert "chapter 0. the expert router" in text and "ünïcödé ✓" in text        # byte-level: lossless
    assert "<eos>parquet row 0: the expert" in text and "<eos>jsonl line 0: the" in text
    assert lines and lines[-1].startswith("[data] done:")
    # The Parquet shards hold the same tokens as tokens.bin, row for row
    first = pq.read_table(out / manifest.shards[0]["file"]).column("tokens").combine_chunks()
    assert np.array_equal(first.flatten().to_numpy(), tokens[: first.flatten().to_numpy().size])


def test_the_vocabulary_and_special_ids_reach_the_model(bpe_data, tmp_path):
    out, manifest, _ = bpe_data
    job = TrainJob(data_dir=str(out), storage_path=str(tmp_path), seq_len=32, batch_size=2,
                   tracking_uri="none")
    ensure_data(job)
    config = worker_config(job, use_gpu=False)
    assert config.preset.vocab_size == 600 and config.mask_id == 1


def test_a_tokenizer_json_is_loaded_and_encodes_the_same(bpe_data, corpus, tmp_path):
    out, manifest, _ = bpe_data
    again = prepare_dataset(tmp_path / "again", [corpus / "books"], max_bytes=None, row_len=64,
                            tokenizer=str(out / "tokenizer.json"))
    assert again.vocab_size == 600 and again.tokenizer == "file:tokenizer.json"
    trained = HFTokenizer.load(out / "tokenizer.json")
    expected = np.concatenate([np.append(trained.encode((corpus / "books" / f"b{i}.txt").read_text()),
                                         trained.eos_id) for i in range(3)])  # type: ignore[arg-type]  # (a trained tokenizer has an EOS id)
    assert np.array_equal(load_rank_tokens(tmp_path / "again", 0, 1), expected[: again.num_tokens])
    # A prepared directory stands for its tokenizer.json
    assert TokenizerSpec.parse(str(out)).path == str(out / "tokenizer.json")


def test_a_foreign_tokenizer_gets_the_specials_it_lacks(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    plain = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2, "[PAD]": 3}, unk_token="[UNK]"))
    plain.pre_tokenizer = pre_tokenizers.Whitespace()
    plain.save(str(tmp_path / "tokenizer.json"))
    loaded = HFTokenizer.load(tmp_path / "tokenizer.json")
    assert loaded.pad_id == 3                      # its own [PAD] is kept
    assert {loaded.eos_id, loaded.mask_id} == {4, 5} and loaded.vocab_size == 6
    assert loaded.encode("hello world").tolist() == [0, 1]


@pytest.mark.parametrize("value, message", [
    ("bpe:10", r"--tokenizer bpe:10 is invalid: give bpe or bpe:VOCAB with VOCAB an integer >= 260"),
    ("bpe:lots", r"--tokenizer bpe:lots is invalid"),
    ("missing/tokenizer.json", r"--tokenizer missing/tokenizer.json is invalid: give bytes, bpe\[:VOCAB\] or"),
])
def test_bad_tokenizer_values_name_the_flag_and_the_fix(value, message):
    with pytest.raises(ValueError, match=message):
        TokenizerSpec.parse(value)


def test_cli_prepares_bpe_data_and_needs_an_out_dir(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["data", "prepare", "--source", str(corpus / "books"), "--tokenizer", "bpe"]) == 1
    assert "--tokenizer bpe needs --out DIR" in capsys.readouterr().err
    assert cli.main(["data", "prepare", "--source", str(corpus / "lines.jsonl"), "--tokenizer", "bpe:400",
                     "--out", "jl", "--row-len", "64", "--max-bytes", "0"]) == 0
    printed = capsys.readouterr().out
    assert "tokenizer: bpe-byte-level-400, vocabulary 400" in printed
    assert f"train on it with: mpipemoe train --data-dir {tmp_path / 'jl'}" in printed


def test_bad_jsonl_and_hugging_face_directories_name_the_fix(tmp_path, monkeypatch):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: each JSONL line needs a JSON object with a 'text' field"):
        prepare_dataset(tmp_path / "out", [tmp_path / "bad.jsonl"], row_len=1)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "state.json").write_text("{}")
    (hf / "dataset_info.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)  # as on a machine without `datasets`
    with pytest.raises(ValueError, match=r"Hugging Face datasets directory, and reading it needs `datasets`: "
                                         r"pip install datasets, or export it to Parquet/JSONL"):
        prepare_dataset(tmp_path / "out", [hf], row_len=1)


def test_memory_mapped_stream_matches_the_loaded_one_and_resumes_exactly(bpe_data):
    out, manifest, _ = bpe_data
    for rank in range(3):
        stream = open_rank_stream(out, rank, 3)
        loaded = load_rank_tokens(out, rank, 3)
        assert len(stream) == loaded.size and np.array_equal(stream[100:700], loaded[100:700])
        mapped = BatchSampler(stream, batch_size=4, window=33, seed=7, rank=rank)
        in_memory = BatchSampler(loaded, batch_size=4, window=33, seed=7, rank=rank)
        resumed = BatchSampler(open_rank_stream(out, rank, 3), batch_size=4, window=33, seed=7, rank=rank)
        for index in (0, 5, mapped.windows // 4 + 2):  # the last one is in epoch 1
            assert np.array_equal(mapped.batch(index), in_memory.batch(index))
        assert np.array_equal(resumed.batch(mapped.windows // 4 + 2), mapped.batch(mapped.windows // 4 + 2))


def test_bpe_trains_on_a_thread_of_its_own_so_the_caller_answers_ctrl_c_at_once(monkeypatch):
    """The merges run in Rust without checking for signals: they run on a training thread,
    while the calling thread waits where a Ctrl-C reaches it; an error in training reaches
    the caller."""
    import types

    import tokenizers

    from lm import tokenizer as tokenizer_module

    trained_on: list[str] = []

    class Recording:
        def __init__(self, model):
            self.inner = tokenizers.Tokenizer(model)

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __setattr__(self, name, value):
            if name == "inner":
                object.__setattr__(self, name, value)
            else:
                setattr(self.inner, name, value)

        def train_from_iterator(self, texts, trainer):
            trained_on.append(threading.current_thread().name)
            return self.inner.train_from_iterator(texts, trainer)

    monkeypatch.setattr(tokenizer_module, "_import_tokenizers", lambda: types.SimpleNamespace(Tokenizer=Recording))
    texts = [f"the quick brown fox {i} jumps over the lazy dog {i * 7}" for i in range(50)]
    trained = HFTokenizer.train_bpe(iter(texts), 300)
    assert trained_on == ["bpe-training"] != [threading.current_thread().name]
    assert trained.encode("the quick brown fox").size > 0

    def broken():
        yield "some text"
        raise OSError("the corpus went away")

    with pytest.raises(Exception, match="the corpus went away"):
        HFTokenizer.train_bpe(broken(), 300)
