"""Fault injection (issue 21): faults and bad input a user meets end in one clear line (or a
correct recovery); nothing is lost, mixed or left behind, nothing hangs.

Each scenario runs the command a user would (``mpipemoe train``, ``data prepare``,
``sweep``, ``report``) and asserts the exit status, the one line on stderr, what is on
disk afterwards and, where it matters, the MLflow run's state and its metric counts.
Most are refused before Ray starts, so they take seconds and run in this process. Only
three need real Ray runs, each a ``mpipemoe train`` subprocess in its own session (so a
signal reaches it as Ctrl-C from a terminal would), one after the other on one run name:

1. run A trains; a second run with A's name is refused at once, naming A; Ctrl-C (SIGINT
   to A's process group) stops A's workers after their step with a checkpoint, marks the
   MLflow run KILLED and prints the resume command;
2. the printed resume command continues A; its driver is SIGKILLed mid-run;
3. the resume again: the dead driver's lock is taken over, the run finishes, and MLflow
   holds every step exactly once.

A fourth run (its own name) gets SIGTERM, as a scheduler, systemd or ``docker stop`` sends
it: the same orderly stop as Ctrl-C, with exit status 143.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from app import cli
from app.tracking.store import RunLogger, client, metric_history
from lm.data import MANIFEST, prepare_dataset

pytestmark = pytest.mark.faults

REPO = Path(__file__).resolve().parents[2]
# Steps far beyond what a test waits for: the runs are interrupted, or resumed with fewer.
LONG = 400


@pytest.fixture(scope="module")
def env(tmp_path_factory, monkeypatch_module):
    """One prepared dataset (1 MiB of stdlib text) and the options every train command takes."""
    root = tmp_path_factory.mktemp("faults")
    prepare_dataset(root / "data", max_bytes=2**20)
    monkeypatch_module.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    common = ["--data-dir", str(root / "data"), "--no-gpu", "--seq-len", "32", "--batch-size", "4",
              "--partitions", "2", "--strategy", "S1", "--experiment", "faults"]
    return {"root": root, "data": root / "data", "uri": uri, "storage": root / "ray_results",
            "common": common}


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def _cli(argv: list[str], capsys) -> tuple[int, str, str, float]:
    """Run ``mpipemoe ARGV`` in this process: (status, the one stderr line, stdout, seconds)."""
    started = time.perf_counter()
    status = cli.main(argv)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return status, lines[0], captured.out, time.perf_counter() - started


def _train(env, *extra: str, storage: Path | None = None, uri: str | None = None) -> list[str]:
    return ["train", *env["common"], "--storage-path", str(storage or env["storage"]),
            "--tracking-uri", uri or env["uri"], *extra]


def _listing(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


# ---- tracking stores: checked before Ray starts, one line, within seconds -----------------

def test_unreachable_tracking_server(env, tmp_path, capsys):
    storage = tmp_path / "rr"
    status, line, _, seconds = _cli(_train(env, "--name", "u", storage=storage, uri="http://127.0.0.1:9"), capsys)
    assert status == 1 and seconds < 20
    assert line.startswith("mpipemoe train: error: --tracking-uri http://127.0.0.1:9: no MLflow server answers "
                           "at http://127.0.0.1:9 (")
    assert "--tracking-uri none" in line
    assert _listing(storage) == []  # no run folder, no lock
    status, line, _, seconds = _cli(["report", "--tracking-uri", "http://127.0.0.1:9", "--out",
                                     str(tmp_path / "rep")], capsys)
    assert status == 1 and seconds < 20 and "no MLflow server answers" in line
    assert not (tmp_path / "rep").exists()


def test_missing_sqlite_folder_is_an_error_not_created(env, tmp_path, capsys):
    missing = tmp_path / "nonexistent" / "dir"
    uri = f"sqlite:///{missing}/x.db"
    for argv in (_train(env, "--name", "m", storage=tmp_path / "rr", uri=uri),
                 ["report", "--tracking-uri", uri, "--out", str(tmp_path / "rep")],
                 ["sweep", "smoke", "--tracking-uri", uri, "--storage-path", str(tmp_path / "rr")]):
        status, line, _, seconds = _cli(argv, capsys)
        assert status == 1 and seconds < 20, line
        assert f"--tracking-uri {uri}: folder {missing} does not exist: create it (mkdir -p {missing})" in line
    assert not (tmp_path / "nonexistent").exists() and _listing(tmp_path / "rr") == []
    # report never creates a store: a missing file gives an empty report and says so
    status, line, out, _ = _cli(["report", "--tracking-uri", f"sqlite:///{tmp_path}/typo.db", "--out",
                                 str(tmp_path / "rep")], capsys)
    assert status == 0 and line == (f"note: no MLflow store at {tmp_path}/typo.db yet: train or sweep first, or "
                                    f"check --tracking-uri") and "(0 run(s)" in out
    assert not (tmp_path / "typo.db").exists()


@contextlib.contextmanager
def _mounted_tmpfs(path: Path, size: str):
    """A small tmpfs at ``path`` where mounting is permitted (root, CAP_SYS_ADMIN), else None."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True)
    if done.returncode != 0:
        yield None
        return
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@contextlib.contextmanager
def _read_only_view(folder: Path, view: Path):
    """``folder`` seen read-only: at ``view`` through a read-only bind mount where mounting
    is permitted, else (not root) ``folder`` itself without write permission; else skip."""
    view.mkdir()
    bound = subprocess.run(["mount", "--bind", str(folder), str(view)], capture_output=True).returncode == 0
    if bound and subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], capture_output=True).returncode:
        subprocess.run(["umount", "-l", str(view)], capture_output=True)
        bound = False
    if bound:
        try:
            yield view
        finally:
            subprocess.run(["umount", "-l", str(view)], capture_output=True)
        return
    if os.geteuid() == 0:
        pytest.skip("root without mount permission: no way to make a folder read-only")
    for path in folder.iterdir():
        path.chmod(0o444)
    folder.chmod(0o555)
    try:
        yield folder
    finally:
        folder.chmod(0o755)


def test_read_only_store(env, tmp_path, capsys):
    folder = tmp_path / "store"
    folder.mkdir()
    RunLogger.start(f"sqlite:///{folder / 'mlflow.db'}", "faults", run_name="before").finish()  # an existing store
    capsys.readouterr()  # MLflow's own notes on creating the store
    before = (folder / "mlflow.db").read_bytes()
    with _read_only_view(folder, tmp_path / "ro") as read_only:
        uri = f"sqlite:///{read_only / 'mlflow.db'}"
        status, line, _, seconds = _cli(_train(env, "--name", "ro", storage=tmp_path / "rr", uri=uri), capsys)
        assert status == 1 and seconds < 20
        assert re.match(rf"mpipemoe train: error: --tracking-uri {re.escape(uri)}: the store at .* cannot be "
                        r"written \(attempt to write a readonly database\): fix its permissions or free space", line), line
        assert (folder / "mlflow.db").read_bytes() == before and _listing(tmp_path / "rr") == []


# ---- refused resumes change nothing ----------------------------------------------------------

def test_refused_resume_changes_nothing_on_disk(env, tmp_path, capsys):
    from app.jobs.job import TrainJob
    from app.jobs.resume import JOB_FILE, save_job

    storage = tmp_path / "rr"
    save_job(TrainJob(preset="tiny-gpt", seq_len=32, storage_path=str(storage), name="base", tracking_uri="none",
                      data_dir=str(env["data"])))
    before = {p: (storage / p).read_bytes() for p in _listing(storage) if (storage / p).is_file()}
    for flags, said in ((["--preset", "tiny-bert"], "--preset tiny-bert (the run has tiny-gpt)"),
                        (["--seq-len", "48"], "--seq-len 48 (the run has 32)")):
        status, line, _, seconds = _cli(["train", "--resume", "base", "--storage-path", str(storage), *flags], capsys)
        assert status == 1 and seconds < 20
        assert line == (f"mpipemoe train: error: run base cannot continue with {said}: its checkpoints hold that "
                        f"model split over its workers; drop those options (`mpipemoe train --resume base "
                        f"--storage-path {storage}`), or start a new run with another --name. Nothing was changed "
                        f"(--debug shows the traceback)")
        after = {p: (storage / p).read_bytes() for p in _listing(storage) if (storage / p).is_file()}
        assert after == before  # the recorded settings are intact: the printed command still works
    # another worker count continues the run where each keeps whole experts (workers/reshard.py)
    status, line, _, _ = _cli(["train", "--resume", "base", "--storage-path", str(storage), "--num-workers", "3"],
                              capsys)
    assert status == 1
    assert line == ("mpipemoe train: error: run base (trained on 2 workers) cannot continue on 3 workers: its 4 "
                    "experts per MoE layer do not split into whole experts per worker; use --num-workers 1, 2, 4 "
                    "(each keeps whole experts and an equal share of the batch) (--debug shows the traceback)")
    assert {p: (storage / p).read_bytes() for p in _listing(storage) if (storage / p).is_file()} == before
    recorded = json.loads((storage / "base" / JOB_FILE).read_text())
    assert recorded["preset"] == "tiny-gpt" and recorded["seq_len"] == 32


# ---- sizes checked against the preset and the machine before Ray starts ---------------------

def test_absurd_sizes_are_refused_before_ray_starts(env, tmp_path, capsys):
    storage = tmp_path / "rr"
    status, line, _, seconds = _cli(_train(env, "--name", "long", "--seq-len", "100000", storage=storage), capsys)
    assert status == 1 and seconds < 30
    assert re.match(r"mpipemoe train: error: TrainJob\.seq_len=100000 is invalid: one step of tiny-gpt with batch 4 "
                    r"x seq_len 100000 is about 1\.2e\+14 FLOPs per worker \(attention grows with seq_len squared\), "
                    rf"over [\d,]+ min per step on this machine's {os.cpu_count()} core\(s\); --seq-len 100000 also "
                    r"grows tiny-gpt's 64 learned positions: lower --seq-len \(the preset's is 64\) or --batch-size",
                    line), line
    # memory: 64 layers of 65536 experts (about 2 TiB of parameters and optimizer state per worker)
    status, line, _, _ = _cli(_train(env, "--name", "wide", "--num-experts", "65536", "--num-layers", "64",
                                     storage=storage), capsys)
    assert status == 1
    assert re.match(r"mpipemoe train: error: TrainJob\.num_experts=65536 is invalid: 2 worker\(s\) of tiny-gpt with "
                    r"batch 4 x seq_len 32 need about [\d.]+ GiB .* more than this machine's free [\d.]+ GiB: "
                    r"use fewer --num-experts or --num-layers, or a smaller --preset", line), line
    cores = os.cpu_count()
    workers = str(max(64, 2 * cores + 2))  # the 64 on 2 cores; more than any machine's cores can run
    status, line, _, seconds = _cli(_train(env, "--name", "wide", "--num-workers", workers, "--num-experts", workers,
                                           storage=storage), capsys)
    assert status == 1 and seconds < 30
    assert line.startswith(f"mpipemoe train: error: TrainJob.num_workers={workers} is invalid: this machine has "
                           f"{cores} CPU core(s) and embedded Ray runs at most {2 * cores} workers on them")
    assert _listing(storage) == []


def test_lr_message_names_the_rule(capsys, tmp_path):
    status, line, _, _ = _cli(["train", "--lr", "-1", "--storage-path", str(tmp_path)], capsys)
    assert status == 1
    assert line == ("mpipemoe train: error: TrainJob.lr=-1.0 is invalid: give a finite number > 0, e.g. 1e-3 "
                    "(--debug shows the traceback)")


# ---- data: corrupt pages, binary files, a full disk --------------------------------------------

def test_corrupt_shard_pages_are_named_with_the_fix(env, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(env["data"], broken)
    shard = broken / "shard-00000.parquet"
    data = bytearray(shard.read_bytes())
    for i in range(len(data) // 4, len(data) // 4 + 2000):  # pages only: header and footer intact
        data[i] = (data[i] * 7 + 13) % 256
    shard.write_bytes(bytes(data))
    argv = _train(env, "--name", "corrupt", storage=tmp_path / "rr", uri="none")
    argv[argv.index(str(env["data"]))] = str(broken)
    status, line, _, seconds = _cli(argv, capsys)
    assert status == 1 and seconds < 20
    assert re.match(rf"mpipemoe train: error: data shard {re.escape(str(shard))} is damaged \(.+\): prepare the "
                    rf"data again with `mpipemoe data prepare --out {re.escape(str(broken))}`", line), line
    assert _listing(tmp_path / "rr") == []


def test_binary_files_are_skipped_and_counted(tmp_path, capsys):
    source = tmp_path / "src"
    source.mkdir()
    for i in range(3):
        (source / f"notes{i}.txt").write_text(f"plain text number {i}\n" * 200)
    (source / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 8)
    (source / "lib.so").write_bytes(b"\x7fELF\x02\x01\x01\x00" + b"\x00" * 3000)
    status = cli.main(["data", "prepare", "--source", str(source), "--out", str(tmp_path / "out"),
                       "--row-len", "500"])
    out = capsys.readouterr().out
    assert status == 0
    assert re.search(r"^skipped 2 binary file\(s\), not text \(e\.g\. (lib\.so|logo\.png), (lib\.so|logo\.png)\)$",
                     out, flags=re.M), out
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert manifest["skipped_binary_files"] == 2 and manifest["num_files"] == 3
    import pyarrow.parquet as pq

    tokens = pq.read_table(tmp_path / "out" / "shard-00000.parquet").column("tokens").combine_chunks().flatten()
    assert 0 not in set(tokens.to_numpy().tolist())  # no byte of the binary files (they hold NULs)
    only_binary = tmp_path / "bin"
    only_binary.mkdir()
    shutil.copy(source / "logo.png", only_binary)
    status, line, _, _ = _cli(["data", "prepare", "--source", str(only_binary), "--out", str(tmp_path / "o2")],
                              capsys)
    assert status == 1 and "all 1 file(s) are binary (e.g. logo.png)" in line


@contextlib.contextmanager
def _full_disk(tmp_path: Path):
    """A folder whose disk is full: a 256 KiB tmpfs, filled, where mounting is permitted;
    else None (the caller uses a quota-like stand-in, RLIMIT_FSIZE, instead)."""
    with _mounted_tmpfs(tmp_path / "disk", "256k") as mounted:
        if mounted is not None:
            fd = os.open(mounted / "filler", os.O_WRONLY | os.O_CREAT)
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * 4096)
            os.close(fd)
        yield mounted


def _run_limited(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``mpipemoe ARGV`` in a subprocess that may write no byte to any file (RLIMIT_FSIZE 0,
    SIGXFSZ ignored, so a write fails with EFBIG as a quota's would)."""
    import resource

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))

    return subprocess.run([sys.executable, "-m", "app.cli", *argv], cwd=cwd, capture_output=True, text=True,
                          preexec_fn=limit, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)


def test_full_disk(env, tmp_path, capsys):
    source = tmp_path / "book.txt"
    source.write_text("".join(f"line {i} of a book that does not fit on a full disk\n" for i in range(20000)))
    with _full_disk(tmp_path) as disk:
        where = disk if disk is not None else tmp_path / "quota"
        prepare = ["data", "prepare", "--source", str(source), "--out", str(where / "data"), "--row-len", "1000"]
        train = _train(env, "--name", "full", storage=where / "rr", uri="none")
        if disk is not None:
            results = [_cli(argv, capsys)[:2] for argv in (prepare, train)]
        else:
            results = []
            for argv in (prepare, train):
                done = _run_limited(argv, tmp_path)
                lines = done.stderr.strip().splitlines()
                assert len(lines) == 1, done.stderr
                results.append((done.returncode, lines[0]))
        (status, line), (train_status, train_line) = results
        assert status == 1
        assert re.match(rf"mpipemoe data: error: cannot write {re.escape(str(where / 'data'))}"
                        r"/(shard-00000|val)\.parquet \((No space left on device|File too large)\): free space there or "
                        r"choose another --out; the data already there was left as it was", line), line
        assert _listing(where / "data") == []  # no shard, no manifest: nothing looks prepared
        assert train_status == 1
        assert re.match(rf"mpipemoe train: error: cannot write the run lock "
                        rf"{re.escape(str(where / 'rr'))}/\.mpipemoe-locks/full\.lock \((No space left on device|"
                        r"File too large)\): free space there or choose another --storage-path", train_line), train_line
        assert _listing(where / "rr") == []  # no run folder, no lock left


# ---- report with only failed runs; a sweep trial whose run had already finished -------------

def test_report_names_the_runs_it_leaves_out(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for status in ("FAILED", "FAILED", "KILLED"):
        run = RunLogger.start(uri, "faults", tags={"mpipemoe.kind": "train"})
        run.log_params({"engine": "mpipemoe", "preset": "tiny-gpt", "batch_size": 4, "seq_len": 32})
        run.finish(status)
    capsys.readouterr()  # MLflow's own notes on creating the store
    status, line, out, _ = _cli(["report", "--tracking-uri", uri, "--out", str(tmp_path / "rep")], capsys)
    assert status == 0 and "(0 run(s)" in out
    assert line == ("note: 3 run(s) did not finish and are left out (FAILED 2, KILLED 1); `mpipemoe ui` shows them "
                    "with their error tags")


def test_sweep_trial_metrics_are_never_nan():
    from app.jobs.trial import trial_metrics

    assert trial_metrics({"name": "t", "tokens_per_s": 12.5, "steps": 3, "status": "FINISHED"}) == \
        {"tokens_per_s": 12.5, "steps": 3, "step": 3}  # step: the schedulers' time axis
    with pytest.raises(RuntimeError, match="training run t reported no tokens_per_s: see its MLflow run r1"):
        trial_metrics({"name": "t", "mlflow_run_id": "r1"})


# ---- real Ray runs: two runs with one name, Ctrl-C, SIGKILL of the driver ---------------------

class _Driver:
    """``mpipemoe train ...`` in a subprocess and session of its own, output in files."""

    def __init__(self, argv: list[str], root: Path, tag: str):
        self.out, self.err = root / f"{tag}.out", root / f"{tag}.err"
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "MLFLOW_DISABLE_TELEMETRY": "true",
               "RAY_TMPDIR": tempfile.mkdtemp(prefix="rf", dir="/tmp")}
        cwd = root / "cwd"  # not the storage's parent: the printed resume command names --storage-path
        cwd.mkdir(exist_ok=True)
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "app.cli", *argv], cwd=cwd, stdout=out,
                                         stderr=err, env=env, start_new_session=True)

    def steps(self) -> list[int]:
        return [int(m) for m in re.findall(r"step +(\d+)/", self.out.read_text())]

    def wait_for_step(self, step: int, timeout: float = 150) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            seen = self.steps()
            if seen and max(seen) >= step:
                return max(seen)
            if self.proc.poll() is not None:
                pytest.fail(f"the driver ended early ({self.proc.returncode}): {self.err.read_text()[-3000:]}")
            time.sleep(0.2)
        self.proc.kill()
        pytest.fail(f"no step {step} within {timeout} s: {self.out.read_text()[-2000:]}")

    def wait(self, timeout: float = 150) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            pytest.fail(f"the driver did not end within {timeout} s: {self.out.read_text()[-2000:]}")

    def live_in_group(self) -> list[str]:
        """Commands of the live (not zombie) processes of the driver's session."""
        listed = subprocess.run(["ps", "-o", "stat=,cmd=", "-g", str(self.proc.pid)], capture_output=True,
                                text=True).stdout
        return [line.split(None, 1)[1] for line in listed.splitlines() if line.split() and line.split()[0][0] != "Z"]

    def training_gone(self, timeout: float = 30) -> bool:
        """After the driver was SIGKILLed: whether its Ray (raylet, GCS) and everything that trains
        (Train controller, workers) has ended. Ray's dashboard and runtime-env agents can outlive
        their raylet by a minute; they train nothing and are ended here (they are ours)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            left = self.live_in_group()
            if all(cmd.startswith(("ray::DashboardAgent", "ray::RuntimeEnvAgent")) for cmd in left):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                return True
            time.sleep(0.5)
        return False

    def group_gone(self, timeout: float = 60) -> bool:
        """Whether every process of the driver's session (Ray's and the workers) has ended
        within ``timeout`` (seen: more than 20 s for Ray's processes on 2 cores beside another
        test process)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.5)
        return False


def _train_runs(uri: str, name: str) -> list:
    mlflow = client(uri)
    experiment = mlflow.get_experiment_by_name("faults")
    return mlflow.search_runs([experiment.experiment_id], filter_string=f"tags.ray_train_name = '{name}'")


@pytest.fixture(scope="module")
def interrupted(env):
    """Run A; a second run with its name meanwhile; then Ctrl-C."""
    a = _Driver(_train(env, "--name", "faulty", "--steps", str(LONG), "--checkpoint-every", "5",
                       "--log-every", "1"), env["root"], "a")
    a.wait_for_step(3)
    job_file = env["storage"] / "faulty" / "mpipemoe_job.json"
    before = job_file.read_bytes()
    started = time.perf_counter()
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        second = cli.main(_train(env, "--name", "faulty", "--steps", "10"))
    refused = {"status": second, "seconds": time.perf_counter() - started, "err": err.getvalue(),
               "job_file_kept": job_file.read_bytes() == before, "runs": len(_train_runs(env["uri"], "faulty"))}
    os.killpg(a.proc.pid, signal.SIGINT)  # Ctrl-C in a terminal signals the whole foreground group
    interrupted_at = time.perf_counter()
    status = a.wait(120)
    return {"a": a, "refused": refused, "status": status, "stop_seconds": time.perf_counter() - interrupted_at}


def test_second_run_with_the_same_name_is_refused_naming_the_live_run(interrupted):
    refused, a = interrupted["refused"], interrupted["a"]
    assert refused["status"] == 1 and refused["seconds"] < 30
    (line,) = refused["err"].strip().splitlines()
    assert re.fullmatch(rf"mpipemoe train: error: run name 'faulty' is in use by a live job \(pid {a.proc.pid}, "
                        r"host \S+, started [\d: -]+, mlflow_run_id [0-9a-f]+\): wait for it to end or stop it "
                        r"\(Ctrl-C\), or choose another --name \(--debug shows the traceback\)", line), line
    assert refused["job_file_kept"] and refused["runs"] == 1  # nothing attached to A's MLflow run


def test_ctrl_c_stops_the_workers_with_a_checkpoint_and_marks_the_run_killed(env, interrupted):
    a = interrupted["a"]
    assert interrupted["status"] == 130 and interrupted["stop_seconds"] < 60
    stopped = max(a.steps())
    lines = a.err.read_text().strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(
        rf"mpipemoe train: interrupted: faulty stopped after step {stopped} of {LONG}; checkpoint "
        rf"{re.escape(str(env['storage']))}/faulty/checkpoint_{stopped:06d}; MLflow run "
        rf"{_train_runs(env['uri'], 'faulty')[0].info.run_id} marked KILLED; resume with: \S+ -m app\.cli train "
        rf"--resume faulty --storage-path {re.escape(str(env['storage']))}", lines[-1]), lines[-3:]
    assert not any("Traceback" in line for line in lines)
    meta = json.loads((env["storage"] / "faulty" / f"checkpoint_{stopped:06d}" / "meta.json").read_text())
    assert meta["step"] == stopped
    assert a.group_gone()  # Ray and the workers ended with the driver
    checkpoints = _listing(env["storage"] / "faulty")
    time.sleep(2)
    assert _listing(env["storage"] / "faulty") == checkpoints  # nobody writes later checkpoints
    assert not (env["storage"] / ".mpipemoe-locks").exists()
    (run,) = _train_runs(env["uri"], "faulty")
    assert run.info.status == "KILLED"
    assert [s for s, _ in metric_history(env["uri"], run.info.run_id, "loss")] == list(range(1, stopped + 1))


@pytest.fixture(scope="module")
def killed_then_resumed(env, interrupted):
    """The printed resume command; its driver SIGKILLed mid-run; the resume again, to a finish."""
    stopped = max(interrupted["a"].steps())
    printed = interrupted["a"].err.read_text().strip().rsplit("resume with: ", 1)[1]
    resume = shlex.split(printed)[shlex.split(printed).index("train"):]  # the command as printed
    c = _Driver(resume, env["root"], "c")
    reached = c.wait_for_step(stopped + 4)
    os.kill(c.proc.pid, signal.SIGKILL)
    c.wait(30)
    lock = json.loads((env["storage"] / ".mpipemoe-locks" / "faulty.lock").read_text())
    last = max(c.steps())
    gone = c.training_gone(90)  # Ray's processes share the driver's fate; its workers end with them
    # The workers may have run (and checkpointed) a few steps past the driver's last logged one
    # before they died: the resume continues from the newest intact checkpoint, chosen here as the
    # resume chooses it (a folder whose copy into storage the kill cut short has meta.json but not
    # every shard whole: counting it made this test flaky).
    from workers import checkpoint as ckpt

    chosen, _ = ckpt.choose(env["storage"] / "faulty")
    newest = int(chosen.name.split("_")[1])
    target = max(last, newest) + 3
    # resumed with another strategy: a new segment of the run, recorded in MLflow (issue 28)
    e = _Driver(resume + ["--steps", str(target), "--strategy", "S2"], env["root"], "e")
    return {"stopped": stopped, "c": c, "reached": reached, "last": last, "lock": lock, "e": e, "gone": gone,
            "status": e.wait(180), "target": target, "newest": newest}


def test_sigkilled_driver_leaves_a_lock_that_the_resume_takes_over(env, killed_then_resumed):
    r = killed_then_resumed
    assert r["c"].proc.returncode == -signal.SIGKILL and r["lock"]["pid"] == r["c"].proc.pid
    assert r["gone"]  # nothing of the killed run kept training
    assert min(r["c"].steps()) == r["stopped"] + 1  # the resume began at the Ctrl-C checkpoint
    out = r["e"].out.read_text()
    assert r["status"] == 0, r["e"].err.read_text()[-3000:]
    assert f"taking over the lock left by pid {r['c'].proc.pid}" in out
    assert not (env["storage"] / ".mpipemoe-locks").exists()
    (run,) = _train_runs(env["uri"], "faulty")
    assert run.info.status == "FINISHED"
    steps = [s for s, _ in metric_history(env["uri"], run.info.run_id, "loss")]
    assert len(steps) == len(set(steps))  # no step logged twice
    # every step the drivers saw is logged; steps the killed run's workers ran after its driver
    # died (up to the checkpoint the resume continued from) were never reported to any driver
    assert set(range(1, r["last"] + 1)) | set(range(r["newest"] + 1, r["target"] + 1)) <= set(steps)
    assert max(steps) == r["target"]
    # the strategy switch: printed, a segment in the MLflow run, credited to S2 by the report
    # (its new --steps is part of the segment: the wsd decay plan follows the step target)
    assert re.search(rf"\[mpipemoe\] from step {r['newest'] + 1} faulty trains with strategy S1 -> S2, "
                     rf"steps \d+ -> {r['target']} \(segment 2, recorded in MLflow\)", out), out[-2000:]
    data = client(env["uri"]).get_run(run.info.run_id).data
    assert data.params["strategy"] == "S1" and data.params["segment.2.strategy"] == "S2"
    assert [(s["from_step"], s["strategy"]) for s in json.loads(data.tags["mpipemoe.segments"])] == \
        [(1, "S1"), (r["newest"] + 1, "S2")]
    from app.reports.report import load_records

    (record,) = [rec for rec in load_records(env["uri"], ["faults"]) if rec.run_id == run.info.run_id]
    assert record.strategy == "S2" and f"from step {r['newest'] + 1}: strategy S2" in record.segments


def test_resuming_a_finished_run_reports_its_numbers(env, killed_then_resumed, ray_local, capsys):
    """A sweep trial re-run on resume whose Train run had finished: recorded numbers, no NaN;
    with another strategy too, the finished run is left unchanged (no segment, its settings kept)."""
    from app.jobs.trial import trial_metrics
    from app.jobs.launch import run_job
    from app.commands.train import job_from_args, add_arguments
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    job = job_from_args(parser.parse_args(["--resume", "faulty", "--storage-path", str(env["storage"]),
                                           "--steps", str(killed_then_resumed["target"]), "--strategy", "S1"]))
    (run,) = _train_runs(env["uri"], "faulty")
    points = len(client(env["uri"]).get_metric_history(run.info.run_id, "loss"))
    segments = client(env["uri"]).get_run(run.info.run_id).data.tags["mpipemoe.segments"]
    job_file = env["storage"] / "faulty" / "mpipemoe_job.json"
    settings = job_file.read_bytes()
    summary = run_job(job, echo=lambda line: None)
    assert summary["steps_run"] == 0 and summary["steps"] == killed_then_resumed["target"]
    assert math.isfinite(trial_metrics(summary)["tokens_per_s"])
    assert len(client(env["uri"]).get_metric_history(run.info.run_id, "loss")) == points
    assert client(env["uri"]).get_run(run.info.run_id).info.status == "FINISHED"
    assert client(env["uri"]).get_run(run.info.run_id).data.tags["mpipemoe.segments"] == segments  # no segment
    assert job_file.read_bytes() == settings


@pytest.fixture(scope="module")
def terminated(env):
    """A run stopped by SIGTERM to its driver alone (``kill PID``, ``docker stop``)."""
    t = _Driver(_train(env, "--name", "term", "--steps", str(LONG), "--checkpoint-every", "5", "--log-every", "1"),
                env["root"], "t")
    t.wait_for_step(3)
    os.kill(t.proc.pid, signal.SIGTERM)
    sent = time.perf_counter()
    return {"t": t, "status": t.wait(120), "stop_seconds": time.perf_counter() - sent}


def test_sigterm_stops_the_workers_with_a_checkpoint_like_ctrl_c(env, terminated):
    t = terminated["t"]
    assert terminated["status"] == 143 and terminated["stop_seconds"] < 60, t.err.read_text()[-3000:]
    stopped = max(t.steps())
    lines = t.err.read_text().strip().splitlines()
    (run,) = _train_runs(env["uri"], "term")
    assert len(lines) == 1 and re.fullmatch(
        rf"mpipemoe train: terminated \(SIGTERM\): term stopped after step {stopped} of {LONG}; checkpoint "
        rf"{re.escape(str(env['storage']))}/term/checkpoint_{stopped:06d}; MLflow run {run.info.run_id} marked "
        rf"KILLED; resume with: \S+ -m app\.cli train --resume term --storage-path {re.escape(str(env['storage']))}",
        lines[0]), lines
    assert "SIGTERM: stopping the workers after their current step" in t.out.read_text()
    meta = json.loads((env["storage"] / "term" / f"checkpoint_{stopped:06d}" / "meta.json").read_text())
    assert meta["step"] == stopped
    assert run.info.status == "KILLED"
    assert t.group_gone()  # Ray and the workers ended with the driver



@pytest.mark.parametrize("flags, message", [
    (["--moe-memory-gib", "0"], "TrainJob.moe_memory_gib=0.0 is invalid: give a number of GiB > 0, e.g. 6 "
                                "(--moe-memory-gib)"),
    (["--moe-memory-gib", "4", "--engine", "fastmoe"],
     "TrainJob.moe_memory_gib=4.0 is invalid: only the mpipemoe engine trades time for memory; drop "
     "--moe-memory-gib or use --engine mpipemoe (not fastmoe)"),
    (["--moe-memory-gib", "4", "--partitions", "2", "--strategy", "S4"],
     "TrainJob.moe_memory_gib=4.0 is invalid: the budget steers the automatic choices: give --partitions auto "
     "or --strategy auto (or drop --moe-memory-gib)"),
    (["--moe-memory-gib", "0.0001"],  # tiny-gpt, 2 workers, batch 8 x 64: about 1.7 MiB at least
     "TrainJob.moe_memory_gib=0.0001 is invalid: the leanest MPipeMoE setting (n=16, S1) needs 0.00166 GiB for "
     "the 2 MoE layers of a 512-token micro-batch (tiny-gpt, --batch-size 8): give --moe-memory-gib 0.002 or "
     "more, or a smaller --batch-size, or --activation-checkpointing full (one MoE layer's activations live "
     "at a time)"),
    (["--split", "peers", "--engine", "fastmoe"],
     "TrainJob.split='peers' is invalid: only the mpipemoe engine splits its partitions; drop --split or use "
     "--engine mpipemoe (not fastmoe)"),
    (["--split", "peers", "--partitions", "3", "--no-gpu"],  # 2 workers: one expert group of 2
     "TrainJob.partitions=3 is invalid: with --split peers give a divisor of the expert-parallel degree 2 "
     "(1, 2): each partition is 2/n destination ranks"),
    (["--split", "auto", "--partitions", "2"],
     "TrainJob.split='auto' is invalid: the search chooses the split with --partitions auto; give --split "
     "tokens or peers with a fixed --partitions"),
])
def test_moe_memory_budget_and_split_are_checked_before_ray_starts(flags, message, capsys, tmp_path):
    status, line, _, _ = _cli(["train", *flags, "--storage-path", str(tmp_path)], capsys)
    assert status == 1
    assert line == f"mpipemoe train: error: {message} (--debug shows the traceback)"
    assert list(tmp_path.iterdir()) == []
