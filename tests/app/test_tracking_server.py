"""A cluster's tracking store, on this machine: a real PostgreSQL server (the system's
``initdb``/``postgres`` in a folder of its own, on a free port) as MLflow's backend store, a
local S3-compatible server (``moto_server``) for the artifacts, and ``mpipemoe ui`` serving
both as the cluster's head does. A short ``mpipemoe train`` logs to it over HTTP; its run,
params and metrics are read back over HTTP, an artifact goes through the server into the
bucket and back, the rows are in PostgreSQL, the objects in S3, and nothing is written as a
store on the local disk. Every server is started here and stopped by its pid.

Skipped, with the reason, where PostgreSQL's binaries or moto (the ``test`` extra) are missing.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from app import cli
from app.tracking.node_metrics import start_node_monitors
from app.tracking.store import RunLogger, client
from lm.data import prepare_dataset

pytestmark = pytest.mark.ray

BUCKET = "mpipemoe-runs"
EXPERIMENT = "cluster-store"
READY_S = 150


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_listening(process: subprocess.Popen, port: int, what: str, log: Path) -> None:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} ended (status {process.returncode}): {log.read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{what} did not listen on port {port} within {READY_S} s: {log.read_text()[-2000:]}")


def _wait_healthy(process: subprocess.Popen, url: str, log: Path) -> None:
    """Until the server answers /health: it listens before it has created its schema."""
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the tracking server ended (status {process.returncode}): {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the tracking server did not answer {url}/health within {READY_S} s: {log.read_text()[-2000:]}")


def _stop(process: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _as_postgres_user() -> list[str]:
    """PostgreSQL refuses to run as root: as root, run its binaries as the `postgres` user."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: cannot start PostgreSQL as another user")
    try:
        import pwd
        pwd.getpwnam("postgres")
    except KeyError:
        pytest.skip("running as root and no `postgres` user to run PostgreSQL as")
    return ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups"]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """PostgreSQL, moto's S3 and `mpipemoe ui` between them: {'uri', 'pg', 'boto', 'cwd'}."""
    missing = [b for b in ("initdb", "postgres") if shutil.which(b) is None]
    if missing:
        pytest.skip(f"PostgreSQL's {', '.join(missing)} not on PATH (install postgresql to run this test)")
    psycopg = pytest.importorskip("psycopg", reason="psycopg is missing: pip install -e '.[test]'")
    boto3 = pytest.importorskip("boto3", reason="boto3 is missing: pip install -e '.[test]'")
    moto_server = Path(sys.executable).with_name("moto_server")
    if not moto_server.exists():
        pytest.skip("moto_server is missing: pip install -e '.[test]' (moto[server])")
    prefix = _as_postgres_user()
    started = time.monotonic()
    base = Path(tempfile.mkdtemp(prefix="mpg", dir="/tmp"))  # short: the server's socket lives here
    logs = tmp_path_factory.mktemp("server-logs")
    cwd = tmp_path_factory.mktemp("ui-cwd")
    processes: list[tuple[subprocess.Popen, int]] = []
    try:
        if prefix:
            shutil.chown(base, "postgres", "postgres")
        data = base / "data"
        subprocess.run(prefix + ["initdb", "-D", str(data), "-U", "mlflow", "-A", "trust", "--no-sync"],
                       check=True, capture_output=True)
        pg_port, s3_port, ui_port = _free_port(), _free_port(), _free_port()
        pg_log = logs / "postgres.log"
        with open(pg_log, "w") as out:
            postgres = subprocess.Popen(prefix + ["postgres", "-D", str(data), "-p", str(pg_port), "-k", str(base),
                                                  "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"],
                                        stdout=out, stderr=subprocess.STDOUT)
        processes.append((postgres, signal.SIGINT))  # SIGINT: PostgreSQL's fast shutdown
        _wait_listening(postgres, pg_port, "PostgreSQL", pg_log)
        for _ in range(50):  # listening comes a moment before it accepts sessions
            try:
                connection = psycopg.connect(host="127.0.0.1", port=pg_port, user="mlflow", dbname="postgres")
                break
            except psycopg.OperationalError:
                time.sleep(0.2)
        connection.autocommit = True
        connection.cursor().execute("CREATE DATABASE mlflow")
        connection.close()

        s3_log = logs / "moto.log"
        with open(s3_log, "w") as out:
            s3 = subprocess.Popen([str(moto_server), "-H", "127.0.0.1", "-p", str(s3_port)], stdout=out,
                                  stderr=subprocess.STDOUT)
        processes.append((s3, signal.SIGTERM))
        _wait_listening(s3, s3_port, "moto_server", s3_log)
        aws = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
               "MLFLOW_S3_ENDPOINT_URL": f"http://127.0.0.1:{s3_port}"}
        boto = boto3.client("s3", endpoint_url=aws["MLFLOW_S3_ENDPOINT_URL"], region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")
        boto.create_bucket(Bucket=BUCKET)

        backend = f"postgresql://mlflow@127.0.0.1:{pg_port}/mlflow"
        ui_log = logs / "ui.log"
        env = {**os.environ, **aws, "MLFLOW_DISABLE_TELEMETRY": "true",
               "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        with open(ui_log, "w") as out:
            ui = subprocess.Popen([sys.executable, "-m", "app.cli", "ui", "--port", str(ui_port), "--workers", "1",
                                   "--tracking-uri", backend, "--artifacts-destination", f"s3://{BUCKET}/mlflow"],
                                  cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        processes.append((ui, signal.SIGTERM))  # `mpipemoe ui` stops its mlflow server on SIGTERM
        _wait_listening(ui, ui_port, "mpipemoe ui", ui_log)
        _wait_healthy(ui, f"http://127.0.0.1:{ui_port}", ui_log)  # after MLflow's schema migrations
        print(f"PostgreSQL, S3 and the tracking server ready after {time.monotonic() - started:.0f} s")
        yield {"uri": f"http://127.0.0.1:{ui_port}", "pg": (psycopg, pg_port), "boto": boto, "cwd": cwd}
    finally:
        for process, sig in reversed(processes):
            _stop(process, sig)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def trained(stores, ray_local, tmp_path_factory):
    """`mpipemoe train` (tiny-gpt, 2 steps, CPU) logging to the server; its run id."""
    root = tmp_path_factory.mktemp("train")
    prepare_dataset(root / "data", max_bytes=2**16)
    status = cli.main(["train", "--preset", "tiny-gpt", "--num-workers", "1", "--no-gpu", "--cpus-per-worker", "0.45",
                       "--steps", "2", "--batch-size", "2", "--seq-len", "32", "--eval-every", "0",
                       "--checkpoint-every", "0", "--data-dir", str(root / "data"),
                       "--storage-path", str(root / "ray_results"), "--name", "on-postgres",
                       "--tracking-uri", stores["uri"], "--experiment", EXPERIMENT])
    assert status == 0
    runs = client(stores["uri"]).search_runs([client(stores["uri"]).get_experiment_by_name(EXPERIMENT).experiment_id])
    assert len(runs) == 1
    return runs[0].info.run_id


def test_a_training_run_logs_to_postgres_and_reads_back_over_http(stores, trained):
    mlflow = client(stores["uri"])
    run = mlflow.get_run(trained)
    assert run.info.status == "FINISHED" and run.info.run_name == "on-postgres"
    assert run.data.params["preset"] == "tiny-gpt"
    assert [m.step for m in mlflow.get_metric_history(trained, "loss")] == [1, 2]
    assert run.info.artifact_uri.startswith("mlflow-artifacts:/")  # served (and stored) by the server
    psycopg, port = stores["pg"]
    with psycopg.connect(host="127.0.0.1", port=port, user="mlflow", dbname="mlflow") as connection:
        cursor = connection.cursor()
        cursor.execute("SELECT status FROM runs WHERE run_uuid = %s", (trained,))
        assert cursor.fetchall() == [("FINISHED",)]
        cursor.execute("SELECT count(*) FROM metrics WHERE run_uuid = %s AND key = 'loss'", (trained,))
        assert cursor.fetchone()[0] == 2


def test_artifacts_go_through_the_server_into_s3_and_back(stores, trained, tmp_path):
    mlflow = client(stores["uri"])
    mlflow.log_text(trained, "loss went down\n", "notes/summary.txt")
    assert [a.path for a in mlflow.list_artifacts(trained, "notes")] == ["notes/summary.txt"]
    fetched = Path(mlflow.download_artifacts(trained, "notes/summary.txt", str(tmp_path)))
    assert fetched.read_text() == "loss went down\n"
    keys = [o["Key"] for o in stores["boto"].list_objects_v2(Bucket=BUCKET).get("Contents", [])]
    assert [k for k in keys if k.startswith("mlflow/") and k.endswith(f"{trained}/artifacts/notes/summary.txt")]
    assert sorted(p.name for p in stores["cwd"].iterdir()) == []  # no mlflow.db, mlruns or mlartifacts


def test_a_sweep_logs_its_study_and_trials_to_the_server(stores, ray_local, tmp_path):
    """`mpipemoe sweep` with --tracking-uri the server: the study's run and one run per trial,
    each a child of the study's, in PostgreSQL."""
    from app.tracking.run_kinds import run_kind

    space = tmp_path / "pair.yaml"
    space.write_text("description: two partition counts\nspace:\n  partitions: {grid: [1, 2]}\n"
                     "  eval_every: 0\n  checkpoint_every: 0\n")
    prepare_dataset(tmp_path / "data", max_bytes=2**16)
    status = cli.main(["sweep", "--space", str(space), "--name", "pair", "--preset", "tiny-gpt", "--num-workers", "1",
                       "--steps", "2", "--batch-size", "2", "--seq-len", "32", "--data-dir", str(tmp_path / "data"),
                       "--storage-path", str(tmp_path / "ray_results"), "--tracking-uri", stores["uri"],
                       "--experiment", "cluster-sweep"])
    assert status == 0
    mlflow = client(stores["uri"])
    experiment = mlflow.get_experiment_by_name("cluster-sweep")
    runs = mlflow.search_runs([experiment.experiment_id])
    (study,) = [r for r in runs if run_kind(r.data.tags) == "study"]
    trials = [r for r in runs if run_kind(r.data.tags) == "train"]
    assert study.info.status == "FINISHED" and sorted(r.data.params["partitions"] for r in trials) == ["1", "2"]
    assert all(r.data.tags["mlflow.parentRunId"] == study.info.run_id and r.info.status == "FINISHED"
               for r in trials)
    psycopg, port = stores["pg"]
    with psycopg.connect(host="127.0.0.1", port=port, user="mlflow", dbname="mlflow") as connection:
        cursor = connection.cursor()
        cursor.execute("SELECT count(*) FROM runs WHERE experiment_id = %s", (int(experiment.experiment_id),))
        assert cursor.fetchone()[0] == 3


def test_every_node_logs_its_system_metrics_to_the_run(stores, ray_local):
    """A node monitor (here on the one local node, the driver's, which a cluster's run leaves to
    the driver's own monitor) logs `system/node-<IP>/...` to the run through the server."""
    pytest.importorskip("psutil", reason="psutil is missing: system metrics are off (pip install -e '.[system-metrics]')")
    run = RunLogger.start(stores["uri"], EXPERIMENT, run_name="node-metrics")
    monitors = start_node_monitors(stores["uri"], run.run_id, interval_s=0.5, include_driver_node=True)
    assert monitors is not None and len(monitors.names) == 1 and monitors.names[0].startswith("node-")
    key = f"system/{monitors.names[0]}/cpu_utilization_percentage"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and key not in client(stores["uri"]).get_run(run.run_id).data.metrics:
        time.sleep(0.5)
    monitors.finish()
    run.finish()
    metrics = client(stores["uri"]).get_run(run.run_id).data.metrics
    assert key in metrics and f"system/{monitors.names[0]}/system_memory_usage_megabytes" in metrics


def test_the_server_command_and_its_store_checks():
    """Local: the command line carries both stores; a store the server could not serve is
    refused before it starts, naming the flag and the fix; a printed URI hides its password."""
    from app.tracking.server import check_server_stores, mlflow_server_command, redact_password

    command = mlflow_server_command("postgresql://u:pw@db:5432/mlflow", 5000, "10.0.1.5",
                                    artifacts_destination="s3://bucket/mlflow", workers=4)
    assert command[command.index("--artifacts-destination") + 1] == "s3://bucket/mlflow"
    assert command[command.index("--workers") + 1] == "4"
    assert "--artifacts-destination" not in mlflow_server_command("sqlite:////x.db", 5000, "127.0.0.1")
    assert redact_password("postgresql://u:pw@db:5432/mlflow") == "postgresql://u:***@db:5432/mlflow"
    check_server_stores("sqlite:////x.db", None, 1)
    for uri, destination, workers, words in (
            ("sqlite:////x.db", None, 2, "a SQLite store has one writer"),
            ("postgres://u:pw@db/mlflow", None, 1, "not postgres://"),
            ("postgresql+nosuchdriver://u@db/mlflow", None, 1, "needs the Python module nosuchdriver"),
            ("sqlite:////x.db", "s3:///mlflow", 1, "name the bucket"),
            ("sqlite:////x.db", None, 0, "--workers 0")):
        with pytest.raises(ValueError, match=words) as refused:
            check_server_stores(uri, destination, workers)
        assert "pw" not in str(refused.value)
