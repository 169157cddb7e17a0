"""Faults that used to lose or mix a user's work (issue 28), refused or recovered before Ray starts.

Each case runs the command a user would and asserts the exit status, the one line on
stderr (naming the cause and the fix) and that nothing was written: run names that leave
the storage path, a wrong attempt on a run whose settings file is gone, plain-path
tracking URIs, two jobs creating one new store, ``report --out`` where nothing can be
written, ``data prepare`` of empty files and null texts, more partitions than tokens.
The pieces a Ray run would exercise (the failure line of a dead worker, a resumed run's
summary, an engine switch in MLflow and the report, Ray's token file) are checked through
their functions. SIGTERM of a real run is in tests/app/test_faults.py.
"""
from __future__ import annotations

import dataclasses

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app import cli
from app.jobs.job import TrainJob
from app.jobs.progress import failure_message, summarize
from app.jobs.resume import JOB_FILE, record_segment, save_job
from app.reports.report import load_records, write_report
from app.tracking.store import RunLogger, client
from app.jobs.progress import steps_done
from lm.data import MANIFEST, prepare_dataset
from tests.app.test_faults import REPO, _cli, _listing, _read_only_view
from workers import checkpoint as ckpt

pytestmark = pytest.mark.faults


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    prepare_dataset(root, max_bytes=2**17)
    return root


def _train(data: Path, storage: Path, *extra: str) -> list[str]:
    return ["train", "--data-dir", str(data), "--no-gpu", "--seq-len", "32", "--batch-size", "4",
            "--storage-path", str(storage), "--tracking-uri", "none", *extra]


# ---- run names: one folder inside the storage path ------------------------------------------

@pytest.mark.parametrize("name", ["..", "../escape", "a/b", ".", ".hidden", "/abs", " "])
def test_a_run_name_cannot_leave_the_storage_path(data, tmp_path, capsys, name):
    storage = tmp_path / "x" / "rr"
    status, line, _, seconds = _cli(_train(data, storage, "--name", name), capsys)
    assert status == 1 and seconds < 20
    assert line.startswith(f"mpipemoe train: error: TrainJob.name={name!r} is invalid: it ")
    assert "give one folder name such as my-run-1" in line
    status, line, _, _ = _cli(["train", "--resume", name, "--storage-path", str(storage)], capsys)
    assert status == 1 and line.startswith(f"mpipemoe train: error: --resume {name!r} is not a run name: it ")
    assert _listing(tmp_path) == []  # nothing beside the MLflow store, nothing in the storage path


def test_an_empty_experiment_is_refused_before_anything_is_written(data, tmp_path, capsys):
    status, line, _, _ = _cli(_train(data, tmp_path / "rr", "--name", "e", "--experiment", ""), capsys)
    assert status == 1 and line.startswith("mpipemoe train: error: TrainJob.experiment='' is invalid: give an "
                                           "MLflow experiment name")
    assert _listing(tmp_path) == []


def test_more_partitions_than_tokens_per_worker_are_refused(data, tmp_path, capsys):
    status, line, _, _ = _cli(_train(data, tmp_path / "rr", "--name", "p", "--partitions", "1000"), capsys)
    assert status == 1
    assert line == ("mpipemoe train: error: TrainJob.partitions=1000 is invalid: a worker's micro-batch has 128 "
                    "tokens (--batch-size 4 x seq_len 32) and each partition needs at least one: use --partitions 8 "
                    "(at most 128) or auto, or a larger --batch-size (--debug shows the traceback)")
    assert TrainJob(batch_size=4, seq_len=32, partitions=128).partitions == 128  # the edge is allowed
    assert _listing(tmp_path) == []


# ---- a wrong attempt must not make a run unresumable -----------------------------------------

def _run_without_settings_file(storage: Path, name: str = "ck") -> Path:
    """A run of 2 workers (tiny-gpt, seq_len 32) with one complete checkpoint and no settings file."""
    job = TrainJob(preset="tiny-gpt", seq_len=32, num_workers=2, storage_path=str(storage), name=name,
                   tracking_uri="none")
    folder = job.run_dir / "checkpoint_000005"
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"shard" * 100)
    preset = dataclasses_asdict(job.model_preset(vocab_size=259))
    ckpt.write_meta(folder, rank=0, world_size=1, meta={"step": 5, "world_size": 2, "preset": preset})
    return job.run_dir


def dataclasses_asdict(value) -> dict:
    import dataclasses

    return dataclasses.asdict(value)


def test_a_wrong_attempt_on_a_run_without_its_settings_file_changes_nothing(data, tmp_path, capsys):
    storage = tmp_path / "rr"
    run_dir = _run_without_settings_file(storage)
    before = {p: (storage / p).read_bytes() for p in _listing(storage) if (storage / p).is_file()}
    status, line, _, seconds = _cli(_train(data, storage, "--name", "ck", "--num-workers", "1",
                                           "--num-experts", "4"), capsys)
    assert status == 1 and seconds < 30
    assert line == (f"mpipemoe train: error: run ck cannot continue with --num-workers 1 (its checkpoint_000005 has "
                    f"2): its checkpoints hold that model split over its workers (its {JOB_FILE} is missing); "
                    f"continue it with `mpipemoe train --name ck --preset tiny-gpt --seq-len 32 --num-experts 4 "
                    f"--num-layers 2 --num-workers 2 --data-dir {data} --tracking-uri none --storage-path {storage}`, "
                    f"or start a new run with another "
                    f"--name. Nothing was changed (--debug shows the traceback)")
    status, line, _, _ = _cli(["train", "--resume", "ck", "--storage-path", str(storage)], capsys)
    assert status == 1 and line.startswith(
        f"mpipemoe train: error: --resume ck: {JOB_FILE} (its settings) is missing in {run_dir}, but "
        f"checkpoint_000005 is there: continue it with `mpipemoe train --name ck --preset tiny-gpt --seq-len 32 ")
    assert f"--data-dir {Path.cwd() / 'data' / 'stdlib-bytes'} --tracking-uri sqlite:///" in line  # absolute: the same
    # store and data from any folder
    after = {p: (storage / p).read_bytes() for p in _listing(storage) if (storage / p).is_file()}
    assert after == before and not (run_dir / JOB_FILE).exists()
    from app.jobs.resume import check_continues

    check_continues(TrainJob(preset="tiny-gpt", seq_len=32, num_workers=2, storage_path=str(storage), name="ck",
                             tracking_uri="none"))  # the printed settings continue it


def test_routing_overrides_shape_the_model_and_bind_the_run(tmp_path):
    from app.jobs.resume import check_continues, checkpoint_settings, continue_command

    job = TrainJob(preset="tiny-gpt", top_k=1, capacity_factor=1.25, activation="swiglu", storage_path=str(tmp_path),
                   name="rt", tracking_uri="none")
    preset = job.model_preset(vocab_size=259)
    assert (preset.top_k, preset.capacity_factor, preset.activation) == (1, 1.25, "swiglu")
    save_job(job)
    with pytest.raises(ValueError, match=r"^run rt cannot continue with --activation gelu \(the run has swiglu\)"):
        check_continues(dataclasses.replace(job, activation="gelu"))
    # the settings file gone: the checkpoint's preset names the overrides, the preset's defaults stay unsaid
    (job.run_dir / JOB_FILE).unlink()
    folder = job.run_dir / "checkpoint_000005"
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(b"shard")
    ckpt.write_meta(folder, rank=0, world_size=1, meta={"step": 5, "world_size": 2,
                                                          "preset": dataclasses_asdict(preset)})
    found = checkpoint_settings(job.run_dir)
    assert found is not None and found["preset"] == "tiny-gpt"
    command = continue_command("rt", str(tmp_path), found)
    assert "--top-k 1 --capacity-factor 1.25 --activation swiglu --num-workers 2" in command
    assert "--top-k" not in continue_command("rt", str(tmp_path), {**found, "top_k": 2})


def test_a_failed_mlflow_start_leaves_no_settings_that_bind_the_name(data, tmp_path, ray_local, monkeypatch):
    """The store fails after every check passed (a race, a full disk): no run folder, no settings file."""
    from app.jobs import launch as jobs

    def failing_start(*args, **kwargs):
        raise RuntimeError("table experiments already exists")

    monkeypatch.setattr(jobs.RunLogger, "start", failing_start)
    job = TrainJob(preset="tiny-gpt", seq_len=32, batch_size=4, use_gpu=False, data_dir=str(data),
                   storage_path=str(tmp_path / "rr"), name="first", tracking_uri=f"sqlite:///{tmp_path / 'm.db'}",
                   cpus_per_worker=0.5)
    with pytest.raises(RuntimeError, match=r"MLflow store .* failed: RuntimeError: table experiments already exists"):
        jobs.run_job(job, echo=lambda line: None)
    assert not job.run_dir.exists() and _listing(tmp_path / "rr") == []


# ---- tracking stores ---------------------------------------------------------------------------

@pytest.mark.parametrize("given, store", [("{tmp}/mlruns", "{tmp}/mlruns/mlflow.db"),
                                          ("file://{tmp}/mlruns", "{tmp}/mlruns/mlflow.db"),
                                          ("{tmp}/runs.db", "{tmp}/runs.db")])
def test_plain_path_and_file_tracking_uris_name_sqlite(data, tmp_path, capsys, given, store):
    uri, store = given.format(tmp=tmp_path), store.format(tmp=tmp_path)
    argv = _train(data, tmp_path / "rr", "--name", "t")
    argv[argv.index("none")] = uri
    status, line, _, seconds = _cli(argv, capsys)
    assert status == 1 and seconds < 20
    assert line == (f"mpipemoe train: error: --tracking-uri {uri}: a plain path or file:// is MLflow's file store, "
                    f"which MLflow 3 no longer writes by default: use sqlite:///{store} (a SQLite store; 'none': no "
                    f"MLflow) (--debug shows the traceback)")
    status, line, _, _ = _cli(["report", "--tracking-uri", uri, "--out", str(tmp_path / "rep")], capsys)
    assert status == 1 and f"use sqlite:///{store}" in line
    assert _listing(tmp_path) == []


_CREATE = """
import sys, time
from app.tracking.store import RunLogger, check_store
uri, start = sys.argv[1], float(sys.argv[2])
time.sleep(max(0.0, start - time.time()))  # both processes, mlflow imported, begin together
check_store(uri)
RunLogger.start(uri, "race", run_name=sys.argv[3]).finish()
"""


def test_two_jobs_creating_a_new_store_at_once_both_work(tmp_path):
    uri = f"sqlite:///{tmp_path / 'new.db'}"
    start = time.time() + 12  # after both have imported MLflow (seconds each on 2 busy cores)
    env = {**os.environ, "PYTHONPATH": str(REPO), "MLFLOW_DISABLE_TELEMETRY": "true"}
    procs = [subprocess.Popen([sys.executable, "-c", "import mlflow.tracking\n" + _CREATE, uri, str(start), name],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name in ("a", "b")]
    outcomes = [(p.wait(120), p.stderr.read()) for p in procs]
    assert [status for status, _ in outcomes] == [0, 0], outcomes
    experiment = client(uri).get_experiment_by_name("race")
    names = sorted(r.info.run_name for r in client(uri).search_runs([experiment.experiment_id]))
    assert names == ["a", "b"]


# ---- report --out --------------------------------------------------------------------------------

def test_report_out_on_a_file_is_one_line(tmp_path, capsys):
    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    for out in (taken, taken / "sub"):
        status, line, _, _ = _cli(["report", "--tracking-uri", f"sqlite:///{tmp_path / 'm.db'}", "--out", str(out)],
                                  capsys)
        assert status == 1 and line.startswith(f"mpipemoe report: error: --out {out}: {taken} is a file, not a folder")
    assert taken.read_text() == "mine" and not (tmp_path / "m.db").exists()


def test_report_out_on_a_read_only_folder_is_one_line(tmp_path, capsys):
    folder = tmp_path / "shared"
    folder.mkdir()
    with _read_only_view(folder, tmp_path / "ro") as read_only:
        out = read_only / "report"
        status, line, _, _ = _cli(["report", "--tracking-uri", f"sqlite:///{tmp_path / 'm.db'}", "--out", str(out)],
                                  capsys)
        assert status == 1
        assert line.startswith(f"mpipemoe report: error: --out {out}: folder {read_only} is not writable "
                               f"(read-only or not yours): give a writable folder")
    assert _listing(folder) == []


# ---- data prepare: empty files, null texts -----------------------------------------------------------

def test_a_0_byte_file_says_it_is_empty(tmp_path, capsys):
    (tmp_path / "empty.txt").write_bytes(b"")
    status, line, _, _ = _cli(["data", "prepare", "--source", str(tmp_path / "empty.txt"), "--out",
                               str(tmp_path / "out")], capsys)
    assert status == 1
    assert line.startswith(f"mpipemoe data: error: no text in {tmp_path / 'empty.txt'}: it holds only 1 null or empty "
                           f"text(s) (0-byte files, null 'text' values; empty.txt: 1); give files with text")
    assert _listing(tmp_path / "out") == []


def test_an_all_null_parquet_text_column_says_so(tmp_path, capsys):
    source = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"text": pa.array([None] * 7, type=pa.string())}), source)
    status, line, _, _ = _cli(["data", "prepare", "--source", str(source), "--out", str(tmp_path / "out")], capsys)
    assert status == 1
    assert line.startswith(f"mpipemoe data: error: no text in {source}: it holds only 7 null or empty text(s) "
                           f"(0-byte files, null 'text' values; nulls.parquet: 7)")


def test_null_rows_are_counted_and_reported_not_dropped_silently(tmp_path, capsys):
    source = tmp_path / "mixed.parquet"
    texts = ["a line of real text number %d\n" % i * 40 for i in range(6)]
    pq.write_table(pa.table({"text": texts[:3] + [None, ""] + texts[3:]}), source)
    status = cli.main(["data", "prepare", "--source", str(source), "--out", str(tmp_path / "out"), "--row-len", "64"])
    out = capsys.readouterr().out
    assert status == 0
    assert "skipped 2 null or empty text(s) (mixed.parquet: 2)" in out.splitlines()
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert manifest["skipped_empty_texts"] == 2 and manifest["skipped_empty_by_file"] == {str(source): 2}
    # the null rows make no document (no end-of-document token): the same stream as without them
    clean = tmp_path / "clean.parquet"
    pq.write_table(pa.table({"text": texts}), clean)
    assert cli.main(["data", "prepare", "--source", str(clean), "--out", str(tmp_path / "clean"),
                     "--row-len", "64"]) == 0
    assert (tmp_path / "out" / "tokens.bin").read_bytes() == (tmp_path / "clean" / "tokens.bin").read_bytes()


# ---- what a Ray run ends with: a dead worker, a resumed run's summary ----------------------------------

def test_a_dead_worker_is_said_as_such_with_the_resume_command(tmp_path):
    job = TrainJob(storage_path=str(tmp_path), name="w", tracking_uri="none")
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                        "[127.0.0.1]:4242")
    assert failure_message(job, gloo) == (
        "training job w failed: a worker process ended or lost its connection (killed, out of memory, or its node "
        "went away): RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
        "[127.0.0.1]:4242 (no checkpoint was written yet; to train it again from step 1: mpipemoe train --resume w "
        f"--storage-path {tmp_path})")
    folder = job.run_dir / "checkpoint_000003"
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"x")
    ckpt.write_meta(folder, 0, 1, {"step": 3})
    assert failure_message(job, gloo).endswith(
        f"; resume from checkpoint_000003 with: mpipemoe train --resume w --storage-path {tmp_path}")


def test_a_resumed_runs_summary_names_the_steps_it_trained():
    history = [{"step": s, "loss": 2.0 + s / 100, "lm_loss": 2.0, "aux_loss": 1.0, "tokens_per_s": 100.0,
                "step_time_s": 0.1, "peak_memory_bytes": 1} for s in range(301, 313)]
    summary = {**summarize(history), "steps_run": len(history)}
    assert (summary["first_step"], summary["steps"]) == (301, 312)
    assert summary["first_loss"] == pytest.approx(5.01) and summary["final_loss"] == pytest.approx(5.12)
    assert steps_done(summary) == "steps 301-312 (12 in this run, 312 in all)"
    fresh = [dict(m, step=m["step"] - 300) for m in history]
    assert steps_done({**summarize(fresh), "steps_run": 12}) == "12 steps"


# ---- a resume that switches engine, partitions or strategy ---------------------------------------------

def test_a_resume_with_a_larger_step_target_shows_it_in_the_mlflow_params(tmp_path):
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    first = TrainJob(steps=50, lr_schedule="wsd", storage_path=str(tmp_path), name="ext", tracking_uri=uri,
                     experiment="ext")
    run = RunLogger.start(uri, "ext", run_name="ext", tags={"mpipemoe.kind": "train"})
    run.log_params({k: v for k, v in first.__dict__.items() if v is not None})
    save_job(first)
    recorded = json.loads((first.run_dir / JOB_FILE).read_text())
    lines = []
    record_segment(run, TrainJob(**{**recorded, "steps": 80, "decay_fraction": 0.3}), recorded, 51, echo=lines.append)
    params = client(uri).get_run(run.run_id).data.params
    assert (params["steps"], params["segment.2.steps"], params["segment.2.decay_fraction"]) == ("50", "80", "0.3")
    assert lines == ["[mpipemoe] from step 51 ext trains with steps 50 -> 80, decay_fraction 0.2 -> 0.3 "
                     "(segment 2, recorded in MLflow)"]


def test_an_engine_switch_on_resume_is_recorded_in_mlflow_and_the_report(tmp_path):
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    first = TrainJob(engine="mpipemoe", partitions=2, strategy="S1", storage_path=str(tmp_path), name="sw",
                     tracking_uri=uri, experiment="sw")
    run = RunLogger.start(uri, "sw", run_name="sw", tags={"mpipemoe.kind": "train", "engine": "mpipemoe"})
    run.log_params({k: v for k, v in first.__dict__.items() if v is not None})
    run.log_metrics({"summary_tokens_per_s": 1000.0, "summary_peak_memory_bytes": 2**20}, step=25)
    save_job(first)
    recorded = json.loads((first.run_dir / JOB_FILE).read_text())
    lines = []
    same = record_segment(run, first, recorded, 26, echo=lines.append)  # nothing changed: nothing recorded
    assert len(same) == 1 and lines == []
    second = TrainJob(**{**recorded, "engine": "fastmoe", "partitions": 4})
    segments = record_segment(run, second, recorded, 26, echo=lines.append)
    assert lines == ["[mpipemoe] from step 26 sw trains with engine mpipemoe -> fastmoe, partitions 2 -> 4 "
                     "(segment 2, recorded in MLflow)"]
    run.log_metrics({"summary_tokens_per_s": 3000.0, "summary_peak_memory_bytes": 2**21}, step=50)
    run.finish()
    stored = client(uri).get_run(run.run_id).data
    assert stored.params["engine"] == "mpipemoe" and stored.params["segment.2.engine"] == "fastmoe"
    assert stored.params["segment.2.partitions"] == "4" and stored.tags["engine"] == "fastmoe"
    assert [s["from_step"] for s in json.loads(stored.tags["mpipemoe.segments"])] == [1, 26] == \
        [s["from_step"] for s in segments]
    (record,) = load_records(uri, ["sw"])
    assert (record.engine, record.partitions, record.time_ms) == ("fastmoe", 4, pytest.approx(1e6 / 3000))
    assert record.segments == ("steps 1-25: engine mpipemoe, partitions 2, strategy S1; from step 26: engine "
                               "fastmoe, partitions 4")
    report = write_report([record], tmp_path / "rep").read_text()
    assert f"- run `{run.run_id[:8]}` (sw): {record.segments}" in report


# ---- Ray's token file -------------------------------------------------------------------------------------

def test_rays_token_is_written_private(tmp_path, monkeypatch):
    from app.jobs.ray_start import private_ray_token

    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    token = private_ray_token(create=True)
    assert token == tmp_path / ".ray" / "auth_token" and len(token.read_text()) == 64
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and stat.S_IMODE(token.parent.stat().st_mode) & 0o077 == 0
    written = token.read_text()
    token.chmod(0o644)  # as Ray itself writes it
    assert private_ray_token(create=True) == token and token.read_text() == written  # kept, made private
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    token.unlink()
    assert private_ray_token(create=False) == token and not token.exists()  # a cluster's token is not made up
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert private_ray_token(create=True) is None and not token.exists()


# ---- SIGTERM: the same orderly stop as Ctrl-C ------------------------------------------------------------

class _Trainer:
    """Stands in for a TorchTrainer: ``fit`` trains until the stop flag is set, then returns."""

    def __init__(self):
        import threading

        self.stopped = threading.Event()

    def fit(self):
        if not self.stopped.wait(30):
            raise AssertionError("never asked to stop")
        return type("Result", (), {"error": None, "checkpoint": None, "metrics": None})()


class _Flag:
    def __init__(self, trainer):
        self.request = type("Remote", (), {"remote": staticmethod(trainer.stopped.set)})()


def test_sigterm_asks_the_workers_to_stop_as_ctrl_c_does():
    import signal
    import threading

    from app.jobs.launch import _fit_interruptibly
    from workers.control import SIGTERM_EXIT_CODE, Terminated

    trainer, lines = _Trainer(), []
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    before = signal.getsignal(signal.SIGTERM)
    result, error, interrupted, abandoned = _fit_interruptibly(trainer, _Flag(trainer), lines.append)
    assert isinstance(interrupted, Terminated) and interrupted.exit_code == SIGTERM_EXIT_CODE == 143
    assert error is None and not abandoned and result is not None
    assert lines == ["[mpipemoe] SIGTERM: stopping the workers after their current step, with a checkpoint "
                     "(SIGTERM again to abandon them at once)"]
    assert signal.getsignal(signal.SIGTERM) is before  # the previous handler is back


def test_sigterm_ends_a_command_with_its_own_status_and_line(monkeypatch, capsys):
    import signal

    from app.commands import report
    from app.jobs.launch import TrainingInterrupted

    def stopped(args):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while the command runs
        time.sleep(5)
        raise AssertionError("SIGTERM did not stop the command")

    monkeypatch.setattr(report, "run", stopped)
    assert cli.main(["report"]) == 143
    assert capsys.readouterr().err.strip() == "mpipemoe report: terminated (SIGTERM)"

    def job_stopped(args):
        raise TrainingInterrupted("r stopped after step 3 of 50; resume with: mpipemoe train --resume r", 143)

    monkeypatch.setattr(report, "run", job_stopped)
    assert cli.main(["report"]) == 143
    assert capsys.readouterr().err.strip() == ("mpipemoe report: terminated (SIGTERM): r stopped after step 3 of 50; "
                                               "resume with: mpipemoe train --resume r")
