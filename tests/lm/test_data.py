"""Data preparation -> Parquet shards -> per-rank reader (tier 1, no Ray)."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lm.data import (EOS_ID, VOCAB_SIZE, BatchSampler, Manifest, decode, encode, load_rank_tokens,
                      prepare_dataset, stdlib_source_files)


@pytest.fixture(scope="module")
def stdlib_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    prepare_dataset(out, max_bytes=300_000, row_len=1000, rows_per_shard=64)
    return out


def test_encode_decode_round_trip():
    ids = encode("héllo\n")
    assert ids.dtype == np.uint16 and ids.max() < 256
    assert decode(np.append(ids, EOS_ID)) == "héllo\n<eos>"


def test_default_source_is_the_stdlib_without_tests():
    files = stdlib_source_files()
    assert len(files) > 100 and files == sorted(files)
    assert not any("site-packages" in f.parts or "test" in f.parts for f in files)


def test_prepare_writes_shards_and_manifest(stdlib_data):
    manifest = Manifest.load(stdlib_data)
    assert manifest.vocab_size == VOCAB_SIZE and manifest.row_len == 1000
    assert manifest.num_rows == 300 and manifest.num_tokens == 300_000
    assert [s["rows"] for s in manifest.shards] == [64, 64, 64, 64, 44]
    table = pq.read_table(stdlib_data / manifest.shards[0]["file"])
    assert table.column_names == ["tokens"] and len(table.column("tokens")[0]) == 1000
    assert "stdlib" in json.loads((stdlib_data / "manifest.json").read_text())["source"]


def test_rank_shards_are_disjoint_deterministic_and_cover_the_rows(stdlib_data):
    full = load_rank_tokens(stdlib_data, 0, 1).reshape(-1, 1000)
    shards = [load_rank_tokens(stdlib_data, rank, 3).reshape(-1, 1000) for rank in range(3)]
    assert [len(s) for s in shards] == [100, 100, 100]
    for rank, shard in enumerate(shards):
        assert np.array_equal(shard, full[rank::3])
        assert np.array_equal(shard, load_rank_tokens(stdlib_data, rank, 3).reshape(-1, 1000))
    # 7 ranks: each gets 300 // 7 = 42 rows, the 6 rows left over are dropped.
    assert {len(load_rank_tokens(stdlib_data, r, 7)) for r in range(7)} == {42_000}


def test_user_text_and_parquet_sources(tmp_path):
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("alpha " * 100)
    (tmp_path / "texts" / "b.txt").write_text("beta " * 100)
    pq.write_table(pa.table({"text": ["gamma " * 50, "delta " * 50]}), tmp_path / "c.parquet")
    pq.write_table(pa.table({"tokens": [[1, 2, 3] * 40]}), tmp_path / "d.parquet")
    manifest = prepare_dataset(tmp_path / "out", [tmp_path / "texts", tmp_path / "c.parquet",
                                                  tmp_path / "d.parquet"], row_len=100, max_bytes=None)
    text = decode(load_rank_tokens(tmp_path / "out", 0, 1))
    assert text.startswith("alpha alpha") and "<eos>beta" in text and "<eos>gamma" in text
    assert manifest.num_rows == (600 + 500 + 300 + 300 + 120 + 5) // 100
    pq.write_table(pa.table({"tokens": [[1, 999]]}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 259\)"):
        prepare_dataset(tmp_path / "bad", [tmp_path / "bad.parquet"], row_len=1)


def test_missing_data_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="mpipemoe data prepare --out"):
        load_rank_tokens(tmp_path, 0, 1)


def test_batch_sampler_is_addressable_and_reshuffles_per_epoch(stdlib_data):
    tokens = load_rank_tokens(stdlib_data, 1, 2)  # 150_000 tokens -> 2307 windows of 65
    sampler = BatchSampler(tokens, batch_size=8, window=65, seed=3, rank=1)
    fresh = BatchSampler(tokens, batch_size=8, window=65, seed=3, rank=1)
    assert sampler.batch(5).shape == (8, 65)
    assert np.array_equal(sampler.batch(5), fresh.batch(5))          # position alone decides
    assert np.array_equal(sampler.batch(400), fresh.batch(400))      # epoch 1, any order of calls
    assert not np.array_equal(sampler.batch(0), BatchSampler(tokens, 8, 65, seed=4, rank=1).batch(0))
    unique = BatchSampler(np.arange(65 * 80), batch_size=8, window=65, seed=0)  # distinct windows
    epoch0 = np.concatenate([unique.batch(i) for i in range(10)])
    assert sorted(epoch0[:, 0] // 65) == list(range(80))               # each window once per epoch
    assert not np.array_equal(unique.batch(0), unique.batch(10))       # epoch 1 reshuffles
    with pytest.raises(ValueError, match="fewer than batch_size=8"):
        BatchSampler(tokens[:500], batch_size=8, window=65, seed=0)


def test_validation_split_holds_out_every_kth_row(stdlib_data, tmp_path):
    """--val-fraction 0.1 on the same 300 rows: rows 0, 10, ..., 290 go to val.bin/val.parquet,
    the other 270 train; together they are the stream without a split, row for row."""
    from lm.data import VAL_SHARD, open_val_stream

    manifest = prepare_dataset(tmp_path / "split", max_bytes=300_000, row_len=1000, rows_per_shard=64,
                               val_fraction=0.1)
    assert (manifest.num_rows, manifest.val_rows, manifest.num_tokens) == (270, 30, 270_000)
    assert manifest.has_validation and sum(s["rows"] for s in manifest.shards) == 270
    whole_RL = load_rank_tokens(stdlib_data, 0, 1).reshape(-1, 1000)
    held = np.arange(300) % 10 == 0
    assert np.array_equal(load_rank_tokens(tmp_path / "split", 0, 1).reshape(-1, 1000), whole_RL[~held])
    val_RL = open_val_stream(tmp_path / "split").rows_RL
    assert np.array_equal(val_RL, whole_RL[held])
    parquet_RL = np.stack(pq.read_table(tmp_path / "split" / VAL_SHARD).column("tokens").to_pylist())
    assert np.array_equal(parquet_RL, val_RL)
    # no split: data prepared with --val-fraction 0, or before the split existed (no such fields)
    assert open_val_stream(stdlib_data) is None and not Manifest.load(stdlib_data).has_validation
    with pytest.raises(ValueError, match=r"--val-fraction 0.9 is invalid: give a number in \[0, 0.5\]"):
        prepare_dataset(tmp_path / "bad", max_bytes=10_000, row_len=1000, val_fraction=0.9)
    with pytest.raises(ValueError, match="all held out for validation"):
        prepare_dataset(tmp_path / "one", max_bytes=1000, row_len=1000, val_fraction=0.5)


def test_validation_batches_are_fixed_disjoint_and_the_same_for_every_seed(tmp_path):
    from lm.data import ValidationBatches

    stream = np.arange(65 * 100)  # 100 distinct windows of 65 tokens
    ranks = [ValidationBatches(stream, batch_size=4, window=65, batches=3, rank=r, world_size=2) for r in (0, 1)]
    assert [len(v) for v in ranks] == [3, 3] and ranks[0].batch(2).shape == (4, 65)
    first = {int(w[0]) // 65 for v in ranks for i in range(3) for w in v.batch(i)}
    assert len(first) == 24  # 2 ranks x 3 batches x 4 windows, none twice
    again = ValidationBatches(stream, batch_size=4, window=65, batches=3, rank=0, world_size=2)
    assert all(np.array_equal(again.batch(i), ranks[0].batch(i)) for i in range(3))
    few = ValidationBatches(stream[:65 * 9], batch_size=4, window=65, batches=3, rank=1, world_size=2)
    assert few.sequences == 4 and [len(b) for b in few.batches] == [4]  # 9 windows: 4 per rank
    with pytest.raises(ValueError, match="fewer than the 2 workers"):
        ValidationBatches(stream[:65], batch_size=4, window=65, batches=1, rank=0, world_size=2)
