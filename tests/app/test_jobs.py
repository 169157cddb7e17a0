"""``ray job submit`` end to end (tier 3, marked ``ray``): a local Ray head with its dashboard
and token authentication on, an MLflow tracking server over HTTP, a short training job on
BPE-tokenized data submitted through Ray's job SDK, and the MLflow run it made read back.

Everything runs as processes this test starts and stops by pid: the head (``ray start
--head --block``, every port its own, a private temp dir and HOME, so nothing touches
another Ray on the machine) and ``mlflow server`` on 127.0.0.1. Never skipped: without
``ray[default]`` (the job server) it fails naming the install (`make test` brings it).
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.processes import free_ports, ray_client_port_flag, start_mlflow_server, stop, wait_http

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.ray


def _dashboard_missing() -> str | None:
    try:
        import ray.dashboard.optional_deps  # noqa: F401  (what Ray itself checks before starting it)
    except ImportError as error:
        return (f"the Ray dashboard/job server cannot start here ({error}): it needs ray[default], "
                f"pip install -e '.[ray,test]' (what `make test` installs)")
    return None


CLIENT = """
import json, sys, time
from ray.job_submission import JobSubmissionClient, JobStatus
address, entrypoint, env = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
try:
    client = JobSubmissionClient(address)
except Exception as error:
    print(json.dumps({"refused": f"{type(error).__name__}: {error}"})); sys.exit(0)
job_id = client.submit_job(entrypoint=entrypoint, runtime_env={"env_vars": env})
deadline = time.monotonic() + 240
while client.get_job_status(job_id) not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
    if time.monotonic() > deadline:
        client.stop_job(job_id); break
    time.sleep(1)
print(json.dumps({"job_id": job_id, "status": str(client.get_job_status(job_id)),
                  "logs": client.get_job_logs(job_id)[-4000:]}))
"""


def test_submitted_training_job_logs_an_mlflow_run_over_http(tmp_path):
    missing = _dashboard_missing()
    if missing:
        pytest.fail(missing)  # a broken test install, not a reason to skip
    from lm.data import prepare_dataset
    from app.tracking.store import find_run, metric_history

    data_dir = tmp_path / "data"
    manifest = prepare_dataset(data_dir, max_bytes=60_000, row_len=1000, tokenizer="bpe:512")
    home = tmp_path / "home"
    home.mkdir()
    token = secrets.token_hex(32)
    gcs, dashboard, client_port, agent_http, agent_grpc, metrics, runtime_env, mlflow_port = free_ports(8)
    python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    base_env = {**os.environ, "HOME": str(home), "PYTHONPATH": python_path, "MLFLOW_DISABLE_TELEMETRY": "true",
                "RAY_USAGE_STATS_ENABLED": "0"}
    base_env.pop("RAY_ADDRESS", None)
    head_env = {**base_env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # short: socket paths have a length limit
    bin_dir = Path(sys.executable).parent
    head_log, mlflow_log = tmp_path / "head.log", tmp_path / "mlflow.log"
    head = subprocess.Popen(
        [str(bin_dir / "ray"), "start", "--head", "--block", "--num-cpus=2", f"--port={gcs}",
         "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
         *ray_client_port_flag(client_port), f"--dashboard-agent-listen-port={agent_http}",
         f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
         f"--runtime-env-agent-port={runtime_env}", f"--temp-dir={temp_dir}",
         "--object-store-memory=200000000", "--disable-usage-stats"],
        env=head_env, stdout=head_log.open("w"), stderr=subprocess.STDOUT)
    tracking_uri = f"http://127.0.0.1:{mlflow_port}"
    server = start_mlflow_server(mlflow_port, tmp_path / "server.db", mlflow_log, base_env)
    try:
        wait_http(f"{tracking_uri}/health", server, mlflow_log)
        wait_http(f"http://127.0.0.1:{dashboard}/api/version", head, head_log)
        address = f"http://127.0.0.1:{dashboard}"
        entrypoint = (f"{sys.executable} -m app.cli train --address auto --steps 3 --num-workers 2 "
                      f"--cpus-per-worker 0.45 --batch-size 2 --seq-len 32 --checkpoint-every 0 --log-every 1 "
                      f"--data-dir {data_dir} --storage-path {tmp_path / 'results'} --name submitted-job "
                      f"--tracking-uri {tracking_uri} --experiment jobs")
        job_env = {"PYTHONPATH": python_path, "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "30",
                   "MLFLOW_DISABLE_TELEMETRY": "true"}

        def submit(env: dict) -> dict:
            done = subprocess.run([sys.executable, "-c", CLIENT, address, entrypoint, json.dumps(job_env)],
                                  env=env, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr[-3000:]
            return json.loads(done.stdout.strip().splitlines()[-1])

        # token authentication is on: a client without the token is refused
        refused = submit({**base_env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)})
        assert "refused" in refused and "auth" in refused["refused"].lower(), refused
        result = submit(head_env)
        assert result["status"] == "SUCCEEDED", result
        assert "[mpipemoe] done: 3 steps" in result["logs"]
        run_id = find_run(tracking_uri, "jobs", "ray_train_name", "submitted-job")
        assert run_id is not None
        from app.tracking.store import client
        run = client(tracking_uri).get_run(run_id)
        assert run.info.status == "FINISHED"
        assert run.data.params["model.vocab_size"] == str(manifest.vocab_size) == "512"  # the BPE's
        assert [step for step, _ in metric_history(tracking_uri, run_id, "loss")] == [1, 2, 3]
    finally:
        stop(server)
        stop(head)
