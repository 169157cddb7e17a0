"""The cluster path on one machine, the local rehearsal of a cluster launch (docs/cluster.md):
a Ray head and two worker nodes started as ``ray start --block`` processes (token
authentication on, everything on 127.0.0.1, every port their own, a private HOME and temp
dir), an MLflow tracking server over HTTP, and jobs submitted through Ray's job server as
``ray job submit`` does; the module's tests share it (one start: about 25 s on an idle
2-core machine) and it stops every process it started by its pid.

- a job submitted by a client without the cluster's token is refused.
- ``mpipemoe train`` on BPE-tokenized data as a job: one worker on each worker node (none on
  the head, which has too little CPU for one), its run logged to the tracking server and read
  back over HTTP, checkpoints on the shared storage path; then one worker node is lost mid-run
  (every process of it killed) and another one joins: Ray Train restarts the worker group from
  the last checkpoint on the new node, and the job finishes with the losses of the straight
  run (2 gloo ranks, no Ray).
- ``mpipemoe sweep smoke`` as a job (two of its trials): both run at once, one on each
  worker node, and log their runs to the tracking server; Tune's state on the shared path.
- a 2-worker Ray Train job asking one ``fake_gpu`` per worker and no CPU
  (tests/app/cluster_placement.py, as ``{"GPU": 1}`` on the real cluster), submitted beside
  the sweep: one worker on each worker node, trained together.

The machine's 2 cores are the limit (6% idle while the module ran): jobs submitted side by
side share them, so the module's time is the work of its processes (the nodes' and the
MLflow server's starts, two training jobs, a sweep of two trials).

Each worker node carries 2 CPUs, one ``fake_gpu`` and a marker resource naming it (``mn_a``
...), so that the state API's node ids can be told apart; nothing asks for the markers. The nodes share
one IP, so Ray reports ``node_rank=0`` for all. Where Ray is installed but a node cannot
start here (the machine, not the install), the tests skip saying why; a missing package
fails them.

    pytest -m ray tests/app/test_cluster_jobs.py -s   # prints each job's wall time
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.processes import (child_pid, descendants_running, free_ports, kill_tree, start_mlflow_server,
                             start_ray_node, stop, wait_http)

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.ray

N, K = 12, 2     # steps of the training job; a checkpoint every K steps
WORKER_CPUS = 2  # per worker node; a training worker asks for 1.5, so one fits on each
NODE_START_S = 60  # a worker node's start, at most (about 10 s on an idle 2-core machine)


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
        self.temp_dir = tempfile.mkdtemp(prefix="rm", dir="/tmp")  # short: socket paths have a length limit
        # 1 CPU: the drivers (and the Tune trials, pinned to the head) fit, no training worker does
        head = start_ray_node(root / "head.log", self.env, num_cpus=1, temp_dir=self.temp_dir,
                              resources={"mn_head": 1}, dashboard_port=dashboard_port)
        self.processes["head"] = head
        self.gcs = f"127.0.0.1:{head.gcs_port}"  # type: ignore[attr-defined]
        self.processes["mlflow"] = start_mlflow_server(mlflow_port, root / "server.db", root / "mlflow.log", self.env)

    def add_node(self, name: str) -> None:
        """Start worker node ``name`` and wait until the cluster counts it alive; one more try
        where it is not (seen when two nodes joined at once, and when a raylet gave up waiting for
        its agents on a busy machine), then a skip naming its log: Ray cannot run here, the
        product is not at fault."""
        for attempt in (1, 2):
            node = start_ray_node(self.root / f"{name}.log", self.env, head_address=self.gcs,
                                  num_cpus=WORKER_CPUS, resources={f"mn_{name}": 1, "fake_gpu": 1})
            self.processes[name] = node
            if not self.answer(self.client("nodes", f"mn_{name}", str(NODE_START_S)))["missing"] \
                    and node.poll() is None:
                return
            log = (self.root / f"{name}.log").read_text()[-1500:]
            kill_tree(self.processes.pop(name))
            print(f"worker node {name} not alive after {NODE_START_S} s (try {attempt} of 2): {log}")
        pytest.skip(f"Ray could not start worker node {name} on this machine (not alive after {NODE_START_S} s, "
                    f"twice): {log}")

    def freeze_training(self, name: str) -> None:
        """SIGSTOP the Ray Train worker on node ``name``: the other ranks wait for it in their
        next collective, so the run can go no further until the node is lost."""
        workers = descendants_running(self.processes[name], "RayTrainWorker")
        assert len(workers) == 1, f"Ray Train workers on node {name}: {workers}"
        os.kill(workers[0], signal.SIGSTOP)

    def lose_node(self, name: str) -> None:
        """Kill node ``name`` (SIGKILL of its raylet and every process of the node at once, as a
        machine that dies): its workers end with it."""
        node = self.processes.pop(name)
        child_pid(node, "raylet")  # (it was running: the loss is the node's, not a node already gone)
        kill_tree(node)

    def client(self, *args: str, token: str | None = None) -> subprocess.Popen:
        """tests/job_client.py with the cluster's token (or ``token``) in its environment."""
        env = self.env if token is None else {**self.env, "RAY_AUTH_TOKEN": token}
        return subprocess.Popen([sys.executable, "-m", "tests.job_client", args[0], self.address, *args[1:]],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def answer(self, process: subprocess.Popen, timeout_s: float = 540) -> dict:
        out, err = process.communicate(timeout=timeout_s)
        assert process.returncode == 0, err[-3000:]
        return json.loads(out.strip().splitlines()[-1])

    def submit(self, entrypoint: str, timeout_s: float = 480, token: str | None = None) -> subprocess.Popen:
        """Submit a job; the client waits up to ``timeout_s`` for it to end, then stops it. (The
        sweep job took 215 s in CI and was once still running at 240 s on a loaded machine.)"""
        return self.client("submit", entrypoint, json.dumps(self.job_env), str(timeout_s), token=token)

    def placement(self, ray_job_id: str) -> dict:
        """{"names": {node_id: name}, "groups": [[node name of each worker] per worker group]} of
        the Ray Train workers the job started, as Ray's state API reports them."""
        seen = self.answer(self.client("placement", ray_job_id))
        names = {node_id: next(k[3:] for k in node["resources"] if k.startswith("mn_"))
                 for node_id, node in seen["nodes"].items()}
        groups: dict[str, list[str]] = {}
        for worker in seen["train_workers"]:
            groups.setdefault(worker["placement_group_id"], []).append(names[worker["node_id"]])
        return {"names": names, "groups": [sorted(g) for g in groups.values()]}

    @staticmethod
    def said(result: dict) -> str:
        """What a job's own lines said (mpipemoe's, errors), without Ray's and MLflow's chatter."""
        lines = result.get("logs", "").splitlines()
        return "\n".join(line for line in lines if "mpipemoe" in line or "Error" in line or "error" in line)[-4000:]

    def logs(self) -> str:
        return "".join(f"\n--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(self.root.glob("*.log")))

    def shutdown(self) -> None:
        """Every process the test started, gone: nothing of this cluster is kept, so no grace."""
        stop(self.processes.pop("mlflow"))
        for name in list(self.processes):
            kill_tree(self.processes.pop(name))
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    missing = _dashboard_missing()
    if missing:
        pytest.fail(missing)  # a missing package is a broken install here, not a reason to skip
    from lm.data import prepare_dataset

    root = tmp_path_factory.mktemp("mn")
    started = time.monotonic()
    cluster = LocalCluster(root)
    try:
        prepare_dataset(cluster.shared / "data", max_bytes=2**17)
        print(f"data: {time.monotonic() - started:.0f} s")
        try:
            wait_http(f"{cluster.address}/api/version", cluster.processes["head"], root / "head.log")
        except AssertionError as error:  # the install is complete (checked above): the machine is at fault
            pytest.skip(f"Ray could not start a head node on this machine: {error}")
        print(f"head: {time.monotonic() - started:.0f} s")
        for name in ("a", "b"):  # one at a time: two joining at once missed the 90 s (twice in a row)
            cluster.add_node(name)
        wait_http(f"{cluster.tracking_uri}/health", cluster.processes["mlflow"], root / "mlflow.log")
        print(f"head, worker nodes a and b, MLflow server: {time.monotonic() - started:.0f} s")
        yield cluster
    finally:
        stopping = time.monotonic()
        cluster.shutdown()
        print(f"cluster stopped: {time.monotonic() - stopping:.0f} s")


@pytest.fixture(scope="module")
def placement_job(cluster):
    """tests/app/cluster_placement.py submitted as a job; the first test that asks for it starts it
    (the sweep's, whose trials take every CPU of the worker nodes: its workers ask for none)."""
    out = cluster.root / "placement-job"
    return out, cluster.submit(f"{sys.executable} -m tests.app.cluster_placement {out} {cluster.shared / 'data'}")


def test_a_job_submitted_without_the_clusters_token_is_refused(cluster):
    """Ray's job server refuses a client that holds another token; nothing runs."""
    entrypoint = f"{sys.executable} -m app.cli train --address auto --steps 1 --tracking-uri none"
    answer = cluster.answer(cluster.submit(entrypoint, token=secrets.token_hex(32)))
    assert "refused" in answer and "auth" in answer["refused"].lower(), answer


def _straight_losses(job) -> list[float]:
    """The job's N steps on 2 gloo ranks without Ray (no checkpoint, no restart)."""
    from app.jobs.job import worker_config
    from tests.distributed import run_on_ranks, train_straight

    return run_on_ranks(2, train_straight, worker_config(job, use_gpu=False))[0]


def _registered_checkpoints(run_dir: Path) -> int:
    """Checkpoints the Ray Train controller has registered (its snapshot on the storage path)."""
    snapshot = run_dir / "checkpoint_manager_snapshot.json"
    try:
        return len(json.loads(snapshot.read_text()).get("checkpoint_results", []))
    except (OSError, ValueError):
        return 0


def test_submitted_training_job_survives_the_loss_of_a_node(cluster):
    """``mpipemoe train`` on BPE-tokenized data through Ray's job server, one worker per worker
    node; a node lost after the first checkpoint, another one joining (module docstring)."""
    from app.jobs.job import TrainJob
    from app.tracking.store import client, find_run, metric_history
    from lm.data import prepare_dataset

    manifest = prepare_dataset(cluster.shared / "bpe-data", max_bytes=60_000, row_len=1000, tokenizer="bpe:512")
    storage = cluster.shared / "ray_results"
    summary_json = cluster.root / "train-summary.json"
    flags = dict(preset="tiny-gpt", steps=N, num_workers=2, use_gpu=False, cpus_per_worker=1.5, batch_size=2,
                 seq_len=32, checkpoint_every=K, max_failures=1, eval_every=0, partitions=2, strategy="S1",
                 seed=7, data_dir=str(cluster.shared / "bpe-data"), storage_path=str(storage), name="mn-train",
                 tracking_uri=cluster.tracking_uri, experiment="multinode")
    options = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in flags.items() if k != "use_gpu")
    started = time.monotonic()
    job = cluster.submit(f"{sys.executable} -m app.cli train --address auto --no-gpu --log-every 1 {options} "
                         f"--summary-json {summary_json}")
    # 1. worker node b dies once Ray Train has a checkpoint of the run; its worker is frozen the
    # moment the checkpoint is seen, so the run advances no further while the node is killed
    # (10 steps of margin for this test's polling); node c joins
    run_dir = storage / "mn-train"
    while _registered_checkpoints(run_dir) == 0:
        assert job.poll() is None, f"the job ended before its first checkpoint: {job.communicate()}"
        assert time.monotonic() - started < 300, f"no checkpoint registered in 300 s: {cluster.logs()}"
        time.sleep(0.05)
    cluster.freeze_training("b")
    cluster.lose_node("b")
    lost_at = time.monotonic()
    cluster.add_node("c")
    result = cluster.answer(job)
    print(f"training job: b lost after {lost_at - started:.0f} s, done after {time.monotonic() - started:.0f} s")
    assert result["status"] == "SUCCEEDED", cluster.said(result) + cluster.logs()
    logs = result["logs"]

    # 2. one worker on each worker node; after the loss, on the node left and the new one
    placement = cluster.placement(result["ray_job_id"])
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
    straight_started = time.monotonic()
    straight = _straight_losses(TrainJob(**flags))
    print(f"straight run: {time.monotonic() - straight_started:.0f} s")
    assert [m["loss"] for m in summary["history"]] == pytest.approx(straight, rel=1e-5)

    # 4. the run, over HTTP: finished, the restart recorded, steps after the checkpoint ran twice
    run_id = find_run(cluster.tracking_uri, "multinode", "ray_train_name", "mn-train")
    assert run_id is not None
    run = client(cluster.tracking_uri).get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["restarts"] == "1"
    assert run.data.params["model.vocab_size"] == str(manifest.vocab_size) == "512"  # the BPE's
    steps = [s for s, _ in metric_history(cluster.tracking_uri, run_id, "loss")]
    assert sorted(set(steps)) == list(range(1, N + 1))
    assert all(steps.count(step) == 1 for step in range(1, resumed_at))  # only steps after it re-ran
    print(f"training job with a lost node, checked: {time.monotonic() - started:.0f} s")


def test_submitted_sweep_runs_a_trial_on_each_worker_node(cluster, placement_job):
    """``mpipemoe sweep smoke`` (two of its engines) as a job: the resource plan lets two trials
    run at once (5 CPUs: 1 on the head, 2 on each worker node), each trial's 2 workers fit on
    one worker node only (1 CPU each; the head keeps less than 1 free), so one trial per node."""
    from app.tracking.run_kinds import run_kind
    from app.tracking.store import client

    storage = cluster.shared / "ray_results"
    started = time.monotonic()
    result = cluster.answer(cluster.submit(
        f"{sys.executable} -m app.cli sweep smoke --address auto --set engine=mpipemoe,fastmoe --name mn-sweep "
        f"--storage-path {storage} --data-dir {cluster.shared / 'data'} --tracking-uri {cluster.tracking_uri}"))
    print(f"sweep job: {time.monotonic() - started:.0f} s")
    assert result["status"] == "SUCCEEDED", cluster.said(result) + cluster.logs()
    logs = result["logs"]
    assert "up to 2 trial(s) at once, 1.0 CPU per worker" in logs, logs
    for engine in ("mpipemoe", "fastmoe"):
        assert re.search(rf"^{engine} .* ok *$", logs, flags=re.M), logs

    # each trial's two workers on one worker node, the two trials on different ones
    placement = cluster.placement(result["ray_job_id"])
    groups = placement["groups"]
    assert len(groups) == 2 and all(len(set(g)) == 1 and len(g) == 2 for g in groups), placement
    assert groups[0][0] != groups[1][0] and "head" not in groups[0] + groups[1], placement

    # Tune's state on the shared path; the study and its trials' runs over HTTP
    assert (storage / "mn-sweep").is_dir() and list((storage / "mn-sweep").glob("experiment_state*.json"))
    mlflow = client(cluster.tracking_uri)
    runs = mlflow.search_runs([mlflow.get_experiment_by_name("mn-sweep").experiment_id])
    trials = [r for r in runs if run_kind(r.data.tags) == "train"]
    assert [run_kind(r.data.tags) for r in runs].count("study") == 1
    assert sorted(r.data.params["engine"] for r in trials) == ["fastmoe", "mpipemoe"]
    assert all(r.info.status == "FINISHED" for r in trials)


def test_one_worker_per_fake_gpu_spread_over_nodes(cluster, placement_job):
    """tests/app/cluster_placement.py as a job (submitted beside the sweep): 2 workers
    asking one ``fake_gpu`` each and no CPU (as ``{"GPU": 1}`` on the real cluster) land one on each worker
    node, and train together."""
    from tests.app.cluster_placement import STEPS

    _, submission = placement_job
    result = cluster.answer(submission)
    assert result["status"] == "SUCCEEDED", cluster.said(result) + cluster.logs()
    report = json.loads([line for line in result["logs"].splitlines() if line.startswith("{")][-1])
    assert report["error"] is None
    assert [r["rank"] for r in report["ranks"]] == [0, 1] and all(r["world_size"] == 2 for r in report["ranks"])
    assert report["nodes"] == 3 and len(report["fake_gpu_nodes"]) == 2
    nodes = [r["node_id"] for r in report["ranks"]]
    assert sorted(nodes) == report["fake_gpu_nodes"]  # one worker on each fake-GPU node
    assert report["head"] not in nodes
    assert report["metrics"]["step"] == STEPS and report["metrics"]["loss"] > 0  # trained together
