"""DRAFT, not collected by pytest (issue 42, unfinished): on this 2-core machine under load a
worker node's raylet aborted at start ("Timed out waiting for file ...dashboard_agent_listen_port":
its dashboard agent came up after the raylet's wait), so the fixture never had both worker
nodes; the assertions below never ran. Rename to test_*.py once the nodes start reliably.

The cluster path on one machine, the local rehearsal of a cluster launch (docs/cluster.md):
a Ray head and two worker nodes started as ``ray start --block`` processes (token
authentication on, everything on 127.0.0.1, every port their own, a private HOME and temp
dir), an MLflow tracking server over HTTP, and jobs submitted through Ray's job server as
``ray job submit`` does; the test stops every process by its pid.

- ``mpipemoe train`` as a job: one worker on each worker node (none on the head, which has
  too little CPU for one), its run logged to the tracking server, checkpoints on the shared
  storage path; one worker node removed mid-run (its ``ray start`` stopped) and another one
  added: Ray Train restarts the worker group from the last checkpoint on the new node, and
  the job finishes with the losses of the straight run (2 gloo ranks, no Ray).
- ``mpipemoe sweep smoke`` as a job: its trials run at once, one on each worker node, and
  log their runs to the tracking server; Tune's state on the shared storage path.

Each worker node carries 2 CPUs and a marker resource naming it (``mn_a`` ...), so that
the state API's node ids can be told apart; nothing asks for the markers. The nodes share
one IP, so Ray reports ``node_rank=0`` for all.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.processes import free_ports, start_mlflow_server, start_ray_node, stop, wait_http

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.ray

N, K = 30, 2     # steps of the training job; a checkpoint every K steps
WORKER_CPUS = 2  # per worker node; a training worker asks for 1.5, so one fits on each


def _dashboard_missing() -> str | None:
    try:
        import ray.dashboard.optional_deps  # noqa: F401  (what Ray itself checks before starting it)
    except ImportError as error:
        return f"the Ray job server needs ray[default] ({error}): `make test` installs it (pyproject's test extra)"
    return None


class LocalCluster:
    """A head, worker nodes by name, an MLflow server: processes this test started."""

    def __init__(self, root: Path):
        self.root = root
        self.shared = root / "shared"  # what /mnt/shared is on the real cluster: every node sees it
        home = root / "home"
        home.mkdir()
        python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        self.env = {**os.environ, "HOME": str(home), "PYTHONPATH": python_path, "MLFLOW_DISABLE_TELEMETRY": "true",
                    "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        self.env.pop("RAY_ADDRESS", None)
        # A raylet waits 10 s for its node's dashboard agent to start, then aborts; on 2 loaded
        # cores the agent took longer (seen: "Timed out waiting for file ...dashboard_agent_listen_port").
        self.env.update(RAY_raylet_start_wait_time_s="120", RAY_agent_register_timeout_ms="120000")
        # what every job's driver, Ray Train controller and workers get (runtime_env)
        self.job_env = {"PYTHONPATH": python_path, "MLFLOW_DISABLE_TELEMETRY": "true",
                        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "90", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
                        "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}
        self.processes: dict[str, subprocess.Popen] = {}
        dashboard_port, mlflow_port = free_ports(2)
        self.address = f"http://127.0.0.1:{dashboard_port}"
        self.tracking_uri = f"http://127.0.0.1:{mlflow_port}"
        temp_dir = tempfile.mkdtemp(prefix="rm", dir="/tmp")  # short: socket paths have a length limit
        # 1 CPU: the drivers (and the Tune trials, pinned to the head) fit, no training worker does
        head = start_ray_node(root / "head.log", self.env, num_cpus=1, temp_dir=temp_dir,
                              resources={"mn_head": 1}, dashboard_port=dashboard_port)
        self.processes["head"] = head
        self.gcs = f"127.0.0.1:{head.gcs_port}"  # type: ignore[attr-defined]
        self.processes["mlflow"] = start_mlflow_server(mlflow_port, root / "server.db", root / "mlflow.log", self.env)

    def add_node(self, name: str) -> None:
        self.processes[name] = start_ray_node(self.root / f"{name}.log", self.env, head_address=self.gcs,
                                              num_cpus=WORKER_CPUS, resources={f"mn_{name}": 1})

    def remove_node(self, name: str) -> None:
        stop(self.processes.pop(name))

    def client(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "tests.job_client", args[0], self.address, *args[1:]],
                                cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def answer(self, process: subprocess.Popen, timeout_s: float = 300) -> dict:
        out, err = process.communicate(timeout=timeout_s)
        assert process.returncode == 0, err[-3000:]
        return json.loads(out.strip().splitlines()[-1])

    def submit(self, entrypoint: str, timeout_s: float = 240) -> subprocess.Popen:
        return self.client("submit", entrypoint, json.dumps(self.job_env), str(timeout_s))

    def wait_nodes(self, count: int) -> None:
        alive = self.answer(self.client("nodes", str(count), "120"))["alive"]
        assert alive == count, f"{alive} of {count} Ray nodes alive: {self.logs()}"

    def placement(self) -> dict:
        """{"names": {node_id: name}, "groups": [[node name of each worker] per worker group]}."""
        seen = self.answer(self.client("placement"))
        names = {node_id: next(k[3:] for k in node["resources"] if k.startswith("mn_"))
                 for node_id, node in seen["nodes"].items()}
        groups: dict[str, list[str]] = {}
        for worker in seen["train_workers"]:
            groups.setdefault(worker["placement_group_id"], []).append(names[worker["node_id"]])
        return {"names": names, "groups": [sorted(g) for g in groups.values()]}

    def logs(self) -> str:
        return "".join(f"\n--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(self.root.glob("*.log")))

    def shutdown(self) -> None:
        for name in list(self.processes):
            if name != "head":
                stop(self.processes.pop(name))
        stop(self.processes.pop("head"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    missing = _dashboard_missing()
    if missing:
        pytest.fail(missing)  # a missing package is a broken install here, not a reason to skip
    from lm.data import prepare_dataset
    from tests.processes import wait_http

    root = tmp_path_factory.mktemp("mn")
    cluster = LocalCluster(root)
    try:
        prepare_dataset(cluster.shared / "data", max_bytes=2**17)
        wait_http(f"{cluster.address}/api/version", cluster.processes["head"], root / "head.log")
        for count, name in enumerate(("a", "b"), start=2):  # one at a time: two joining at once timed out
            cluster.add_node(name)
            cluster.wait_nodes(count)
        wait_http(f"{cluster.tracking_uri}/health", cluster.processes["mlflow"], root / "mlflow.log")
        yield cluster
    finally:
        cluster.shutdown()


def _straight_losses(job) -> list[float]:
    """The job's N steps on 2 gloo ranks without Ray (no checkpoint, no restart)."""
    from app.jobs.launch import worker_config
    from tests.distributed import run_on_ranks

    return run_on_ranks(2, _train_straight, worker_config(job, use_gpu=False))[0]


def _train_straight(rank: int, world_size: int, config) -> list[float]:
    import torch

    from workers.loop import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(config, rank, world_size, torch.device("cpu"))
    losses = []
    for step in range(1, config.steps + 1):
        result = trainer.step(step)
        losses.append(result["lm_loss"] + config.aux_loss_weight * result["aux_loss"])
    return losses


def _registered_checkpoints(run_dir: Path) -> int:
    """Checkpoints the Ray Train controller has registered (its snapshot on the storage path)."""
    snapshot = run_dir / "checkpoint_manager_snapshot.json"
    try:
        return len(json.loads(snapshot.read_text()).get("checkpoint_results", []))
    except (OSError, ValueError):
        return 0


def test_submitted_training_job_survives_the_loss_of_a_node(cluster):
    from app.jobs.launch import TrainJob
    from app.tracking.store import client, find_run, metric_history

    storage = cluster.shared / "ray_results"
    summary_json = cluster.root / "train-summary.json"
    flags = dict(preset="tiny-gpt", steps=N, num_workers=2, use_gpu=False, cpus_per_worker=1.5, batch_size=2,
                 seq_len=32, checkpoint_every=K, max_failures=1, eval_every=0, partitions=2, strategy="S1",
                 seed=7, data_dir=str(cluster.shared / "data"), storage_path=str(storage), name="mn-train",
                 tracking_uri=cluster.tracking_uri, experiment="multinode")
    options = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in flags.items() if k != "use_gpu")
    started = time.monotonic()
    job = cluster.submit(f"{sys.executable} -m app.cli train --address auto --no-gpu --log-every 1 {options} "
                         f"--summary-json {summary_json}")
    # 1. a node is lost once Ray Train has a checkpoint of the run; another one joins
    run_dir = storage / "mn-train"
    while _registered_checkpoints(run_dir) == 0:
        assert job.poll() is None and time.monotonic() - started < 180, (job.communicate(), cluster.logs())
        time.sleep(0.2)
    cluster.remove_node("b")
    cluster.add_node("c")
    cluster.wait_nodes(3)
    result = cluster.answer(job)
    assert result["status"] == "SUCCEEDED", (result, cluster.logs())
    logs = result["logs"]

    # 2. one worker on each worker node; after the loss, on the node left and the new one
    placement = cluster.placement()
    assert sorted(placement["names"].values()) == ["a", "b", "c", "head"]
    assert sorted(placement["groups"]) == [["a", "b"], ["a", "c"]], placement

    # 3. restarted from the last checkpoint on the shared storage path, nothing lost
    resumed_at = int(re.search(r"restarted from a checkpoint \(1 restart\(s\)\); continuing at step (\d+)",
                               logs).group(1))
    assert resumed_at > K and (resumed_at - 1) % K == 0, logs
    assert f"[mpipemoe] done: {N} steps" in logs
    assert sorted(p.name for p in run_dir.glob("checkpoint_*"))  # kept on the shared path
    summary = json.loads(summary_json.read_text())
    assert summary["restarts"] == 1 and [m["step"] for m in summary["history"]] == list(range(1, N + 1))
    straight = _straight_losses(TrainJob(**flags))
    assert [m["loss"] for m in summary["history"]] == pytest.approx(straight, rel=1e-5)

    # 4. the run, over HTTP: finished, the restart recorded, steps after the checkpoint ran twice
    run_id = find_run(cluster.tracking_uri, "multinode", "ray_train_name", "mn-train")
    assert run_id is not None
    run = client(cluster.tracking_uri).get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["restarts"] == "1"
    steps = [s for s, _ in metric_history(cluster.tracking_uri, run_id, "loss")]
    assert sorted(set(steps)) == list(range(1, N + 1))
    assert all(steps.count(step) == 1 for step in range(1, resumed_at))  # only steps after it re-ran
    print(f"training job with a lost node: {time.monotonic() - started:.0f} s")
