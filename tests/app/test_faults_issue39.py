"""Issue 39's app-side faults, each run as a user would (no Ray): a failed ``data prepare``
keeps the data already there; ``generate``/``export`` skip a damaged checkpoint and use the
run's kept tokenizer; the weak answers end in one line naming the cause and the fix, with
nothing written."""
from __future__ import annotations

import json
import socket
import stat

import pytest
import torch

from app import cli
from app.jobs.job import TrainJob, worker_config
from app.jobs.progress import failure_message
from app.jobs.resume import RUN_DATA, save_job
from lm.data import MANIFEST, keep_copy, prepare_dataset
from tests.app.test_faults import _cli, _listing
from workers import checkpoint as ckpt

pytestmark = pytest.mark.faults


# ---- data prepare: a new sibling folder, swapped in only when whole ------------------------------

@pytest.mark.parametrize("bad", ["empty", "binary"])
def test_a_failed_prepare_keeps_the_data_already_there(tmp_path, capsys, bad):
    out = tmp_path / "data"
    prepare_dataset(out, max_bytes=2**15, row_len=256)
    (out / "notes.txt").write_text("mine")  # not ours: stays
    before = {p: (out / p).read_bytes() for p in _listing(out)}
    source = tmp_path / "src.bin"
    source.write_bytes(b"" if bad == "empty" else bytes(range(256)) * 8)
    status, line, _, _ = _cli(["data", "prepare", "--source", str(source), "--out", str(out)], capsys)
    assert status == 1 and line.startswith("mpipemoe data: error: no text in ")
    assert {p: (out / p).read_bytes() for p in _listing(out)} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "src.bin"]  # no staging folder left
    status, line, _, _ = _cli(["data", "prepare", "--source", str(source), "--out", str(tmp_path / "new" / "x")],
                              capsys)
    assert status == 1 and not (tmp_path / "new").exists()  # a fresh --out is not left behind


def test_a_prepare_again_replaces_only_its_own_files(tmp_path):
    out = tmp_path / "data"
    prepare_dataset(out, max_bytes=2**16, row_len=256, rows_per_shard=8)
    (out / "notes.txt").write_text("mine")
    first = json.loads((out / MANIFEST).read_text())
    prepare_dataset(out, max_bytes=2**13, row_len=256, rows_per_shard=8)
    second = json.loads((out / MANIFEST).read_text())
    assert len(first["shards"]) > len(second["shards"]) and second["tokens_crc32"] != first["tokens_crc32"]
    shards = sorted(p.name for p in out.glob("shard-*.parquet"))
    assert shards == [s["file"] for s in second["shards"]]  # stale shards of the first prepare are gone
    assert (out / "notes.txt").read_text() == "mine" and stat.S_IMODE(out.stat().st_mode) & 0o755 == 0o755


# ---- generate / export: checkpoints chosen with checksums, the run's own tokenizer -------------

@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from workers.loop import Trainer

    root = tmp_path_factory.mktemp("run39")
    prepare_dataset(root / "data", max_bytes=2**16, row_len=256, tokenizer="bpe:300")
    job = TrainJob(preset="tiny-gpt", name="r", steps=2, num_workers=1, batch_size=2, seq_len=16,
                   storage_path=str(root / "runs"), data_dir=str(root / "data"), tracking_uri="none")
    save_job(job)
    keep_copy(str(root / "data"), job.run_dir / RUN_DATA)
    config = worker_config(job, use_gpu=False)
    trainer = Trainer(config, 0, 1, torch.device("cpu"))
    for step in (1, 2):
        trainer.step(step)
        ckpt.save(job.run_dir / ckpt.checkpoint_name(step), 0, 1, trainer.parallel, trainer.optimizer,
                  {"step": step, "world_size": 1, "engine": job.engine, "preset": config.preset_dict()})
    return {"job": job, "root": root}


def test_generate_and_export_skip_a_checkpoint_that_fails_its_checksum(run, capsys):
    job = run["job"]
    newest = job.run_dir / ckpt.checkpoint_name(2)
    shard = next(newest.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2:len(data) // 2 + 64] = bytes(64)  # same size, other bytes
    original = shard.read_bytes()
    shard.write_bytes(bytes(data))
    try:
        status = cli.main(["generate", "--run", "r", "--prompt", "def ", "--max-new-tokens", "3",
                           "--storage-path", job.storage_path])
        out, err = capsys.readouterr()
        assert status == 0 and "\x00" not in out
        assert "[mpipemoe] skipped checkpoint_000002: " in err and "CRC-32 mismatch" in err
        assert "using checkpoint_000001" in err and "at step 1 (checkpoint_000001)" in err
        status = cli.main(["export", "--run", "r", "--out", str(run["root"] / "ex"), "--storage-path",
                           job.storage_path])
        out, err = capsys.readouterr()
        assert status == 0 and "exported r at step 1" in out
    finally:
        shard.write_bytes(original)


def test_the_runs_kept_tokenizer_is_used_after_its_data_is_prepared_again(run, capsys):
    job = run["job"]
    prepare_dataset(job.data_dir, max_bytes=2**14, row_len=256)  # the folder now holds byte data
    status = cli.main(["generate", "--run", "r", "--prompt", "x", "--max-new-tokens", "2", "--storage-path",
                       job.storage_path])
    capsys.readouterr()
    assert status == 0  # the run's BPE (vocabulary 300) from <run>/data, not the folder's bytes
    from app.jobs.resume import check_same_tokenizer

    with pytest.raises(ValueError, match=r"run r trained on tokenizer .*\(vocabulary 300\), but .* now holds data "
                                         r"of tokenizer bytes-v1 \(vocabulary 259\) .*data prepare .*--tokenizer "):
        check_same_tokenizer(job)  # a resume is refused before Ray starts
    (job.run_dir / RUN_DATA / MANIFEST).rename(job.run_dir / "kept.json")  # a run from before runs kept it
    try:
        status, line, _, _ = _cli(["generate", "--run", "r", "--prompt", "x", "--storage-path", job.storage_path],
                                  capsys)
        assert status == 1 and "its model has a vocabulary of 300 tokens, but the tokenizer of" in line
    finally:
        (job.run_dir / "kept.json").rename(job.run_dir / RUN_DATA / MANIFEST)


@pytest.mark.parametrize("case", ["empty", "file", "other"])
def test_export_out_is_refused_where_it_would_overwrite_or_misplace(run, tmp_path, capsys, case):
    target = {"empty": "", "file": str(tmp_path / "f"), "other": str(tmp_path / "o")}[case]
    (tmp_path / "f").write_text("x")
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "config.json").write_text(json.dumps({"mpipemoe_source": {"run": "another"}}))
    status, line, _, _ = _cli(["export", "--run", "r", "--out", target, "--storage-path", run["job"].storage_path],
                              capsys)
    assert status == 1 and {"empty": "is empty", "file": "is a file", "other": "an export of run another"}[case] in line
    assert (tmp_path / "f").read_text() == "x" and _listing(tmp_path / "o") == ["config.json"]


def test_exported_weights_have_the_mode_of_the_other_files(run, tmp_path, capsys):
    out = tmp_path / "ex"
    assert cli.main(["export", "--run", "r", "--out", str(out), "--storage-path", run["job"].storage_path]) == 0
    capsys.readouterr()
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert len(set(modes.values())) == 1, modes
    assert cli.main(["export", "--run", "r", "--out", str(out), "--storage-path", run["job"].storage_path]) == 0
    capsys.readouterr()  # the same run's export is replaced


def test_generate_bounds_its_tokens_and_names_a_run_without_checkpoints(run, tmp_path, capsys):
    status, line, _, _ = _cli(["generate", "--run", "r", "--prompt", "x", "--max-new-tokens", "1000000000",
                               "--storage-path", run["job"].storage_path], capsys)
    assert status == 1 and "--max-new-tokens 1000000000 is invalid: give an integer in 1-65536" in line
    job = TrainJob(name="nock", checkpoint_every=0, storage_path=str(tmp_path), tracking_uri="none")
    save_job(job)
    status, line, _, _ = _cli(["generate", "--run", "nock", "--prompt", "x", "--storage-path", str(tmp_path)], capsys)
    assert status == 1 and "--checkpoint-every 0, so it has no checkpoint" in line and "--resume" not in line


def test_generated_text_streams_whole_characters():
    from app.commands.generate import TextStream
    from lm.tokenizer import ByteTokenizer
    import io

    out = io.StringIO()
    stream = TextStream(ByteTokenizer().decode, out)
    for byte in "é✓a".encode():
        stream.add(byte)
    stream.flush()
    assert out.getvalue() == "é✓a"


# ---- weak answers: one line, nothing written ----------------------------------------------------

@pytest.mark.parametrize("flags, words", [
    (["--moe-memory-gib", "inf"], "TrainJob.moe_memory_gib=inf is invalid"),
    (["--moe-memory-gib", "nan"], "TrainJob.moe_memory_gib=nan is invalid"),
    (["--name", "é" * 200], "bytes long in UTF-8 (200 characters), more than 200"),
    (["--name", "a b"], "it holds ' '"),
    (["--name", "run*"], "it holds '*'"),
    (["--name", "x;rm"], "it holds ';'"),
    (["--tracking-uri", "file:mlruns4"], "use sqlite:///{cwd}/mlruns4/mlflow.db"),
    (["--name", "ex", "--steps", "-5"], "TrainJob.steps=-5 is invalid"),
    (["--top-k", "0"], "TrainJob.top_k=0 is invalid: give an integer >= 1 (--top-k"),
    (["--top-k", "5"], "TrainJob.top_k=5 is invalid: choose at most the 4 experts per MoE layer (--top-k)"),
    (["--capacity-factor", "0"], "TrainJob.capacity_factor=0.0 is invalid: give a number > 0 (--capacity-factor"),
    (["--decay-fraction", "1.5"], "TrainJob.decay_fraction=1.5 is invalid: give a fraction in (0, 1]"),
])
def test_weak_train_options_end_in_one_line_and_write_nothing(tmp_path, capsys, monkeypatch, flags, words):
    monkeypatch.chdir(tmp_path)
    save_job(TrainJob(name="ex", storage_path=str(tmp_path / "rr"), tracking_uri="none"))
    before = _listing(tmp_path)
    status, line, _, _ = _cli(["train", "--storage-path", str(tmp_path / "rr"), *flags], capsys)
    assert status == 1 and words.format(cwd=tmp_path) in line
    assert _listing(tmp_path) == before  # no mlflow.db, no data, no run folder


def test_ui_refuses_a_taken_port_and_one_out_of_range(capsys):
    status, line, _, _ = _cli(["ui", "--port", "70000", "--tracking-uri", "none"], capsys)
    assert status == 1 and "--port 70000 is not a TCP port: give one in 1-65535" in line
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status, line, out, _ = _cli(["ui", "--port", str(port), "--tracking-uri", "sqlite:////tmp/x39.db"], capsys)
    assert status == 1 and "Address already in use" in line and "choose another --port" in line and "open" not in out


def test_rays_dead_worker_words_are_said_as_a_dead_worker(tmp_path):
    job = TrainJob(storage_path=str(tmp_path), name="w", tracking_uri="none")
    ray_text = ("Training failed due to worker errors:\nThe actor is dead because its worker process has died. "
                "Worker exit type: SYSTEM_ERROR Worker exit detail: ...\n(raylet) A worker died or was killed")
    line = failure_message(job, RuntimeError(ray_text))
    assert line.startswith("training job w failed: a worker process ended or lost its connection (killed, out of "
                           "memory, or its node went away): RuntimeError: The actor is dead because its worker "
                           "process has died. (no checkpoint"), line


def test_a_run_whose_first_checkpoint_never_finished_trains_again(tmp_path):
    from app.jobs.resume import choose_checkpoint

    job = TrainJob(storage_path=str(tmp_path), name="full", tracking_uri="none")
    (job.run_dir / "checkpoint_000005").mkdir(parents=True)
    (job.run_dir / "checkpoint_000005" / "__0_0.distcp").write_bytes(b"half")
    lines: list[str] = []
    assert choose_checkpoint(job, lines.append) is None  # a fresh start, not a refusal
    assert lines == ["[mpipemoe] skipped checkpoint_000005: meta.json (the completeness marker, written last) is "
                     "missing: the save did not finish; moved to damaged/checkpoint_000005/; no save finished: "
                     "training again from step 1"]
    assert (job.run_dir / "damaged" / "checkpoint_000005" / "__0_0.distcp").read_bytes() == b"half"
