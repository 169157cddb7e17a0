"""Multi-node on one machine: a head and two worker nodes (``ray.cluster_utils.Cluster``),
each worker node carrying one unit of a GPU-like custom resource ``fake_gpu``. A 2-worker
Ray Train job asking one ``fake_gpu`` per worker must put one worker on each node, and the
two train the tiny model together (gloo, expert parallel over both) to the last step.

The cluster needs its own Ray instance, so the test runs this file as a subprocess
(``python tests/app/test_cluster_multinode.py OUT_DIR``), away from the session's ``ray_local``.

    python tests/app/test_cluster_multinode.py /tmp/mn   # prints the placement as JSON
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

STEPS = 3


def placed_train_fn(config: dict) -> None:
    """Each worker records where it runs, then runs the real per-worker training loop."""
    import ray
    import ray.train

    from workers.loop import train_fn_per_worker

    context = ray.train.get_context()
    record = {"rank": context.get_world_rank(), "world_size": context.get_world_size(),
              "node_id": ray.get_runtime_context().get_node_id()}
    Path(config["placement_dir"], f"rank{record['rank']}.json").write_text(json.dumps(record))
    train_fn_per_worker(config["worker"])


def main(out_dir: str) -> dict:
    """Start the 3-node cluster, train on it, return the placement and the result."""
    import ray
    import ray.train
    from ray.cluster_utils import Cluster
    from ray.train.torch import TorchConfig, TorchTrainer

    from lm.data import ensure_default_data
    from app.jobs.launch import TrainJob, worker_config

    out = Path(out_dir)
    (out / "placement").mkdir(parents=True, exist_ok=True)
    temp_dir = tempfile.mkdtemp(prefix="rc", dir="/tmp")  # short: socket paths have a length limit
    # Cluster writes the head's address under $TMPDIR/ray, which a fresh TMPDIR lacks.
    os.makedirs(os.path.join(tempfile.gettempdir(), "ray"), exist_ok=True)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "object_store_memory": 100 * 2**20, "temp_dir": temp_dir})
    for _ in range(2):
        cluster.add_node(num_cpus=1, resources={"fake_gpu": 1}, object_store_memory=100 * 2**20)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        job = TrainJob(preset="tiny-gpt", engine="mpipemoe", steps=STEPS, num_workers=2, use_gpu=False,
                       batch_size=2, partitions=2, checkpoint_every=STEPS,
                       data_dir=str(ensure_default_data(out / "data", echo=lambda *_: None)),
                       storage_path=str(out / "results"), name="multinode",
                       tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
        config = {"worker": worker_config(job, use_gpu=False), "placement_dir": str(out / "placement")}
        trainer = TorchTrainer(
            placed_train_fn, train_loop_config=config, torch_config=TorchConfig(backend="gloo"),
            # one fake GPU per worker, like {"GPU": 1} on the real cluster
            scaling_config=ray.train.ScalingConfig(num_workers=2, use_gpu=False,
                                                   resources_per_worker={"CPU": 0.5, "fake_gpu": 1}),
            run_config=ray.train.RunConfig(name=job.name, storage_path=job.storage_path,
                                           failure_config=ray.train.FailureConfig(max_failures=0)))
        result = trainer.fit()
        ranks = [json.loads(p.read_text()) for p in sorted((out / "placement").glob("rank*.json"))]
        nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
        return {"nodes": len(nodes), "head": cluster.head_node.node_id,  # type: ignore[attr-defined]  # (Cluster(initialize_head=True) has a head)
                "fake_gpu_nodes": sorted(i for i, r in nodes.items() if r.get("fake_gpu") == 1),
                "ranks": ranks, "error": repr(result.error) if result.error else None,
                "metrics": {k: v for k, v in (result.metrics or {}).items() if isinstance(v, (int, float))}}
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.ray
def test_one_worker_per_fake_gpu_spread_over_nodes(tmp_path):
    env = {**os.environ, "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "30", "MLFLOW_DISABLE_TELEMETRY": "true"}
    proc = subprocess.run([sys.executable, __file__, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["error"] is None
    assert [r["rank"] for r in report["ranks"]] == [0, 1] and all(r["world_size"] == 2 for r in report["ranks"])
    assert report["nodes"] == 3 and len(report["fake_gpu_nodes"]) == 2
    nodes = [r["node_id"] for r in report["ranks"]]
    assert sorted(nodes) == report["fake_gpu_nodes"]  # one worker on each fake-GPU node
    assert report["head"] not in nodes
    assert report["metrics"]["step"] == STEPS and report["metrics"]["loss"] > 0  # trained together


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
