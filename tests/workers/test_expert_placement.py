"""Ray Train places the ranks of one expert group on one node (workers/distributed.py
``expert_groups_across_nodes``).

A head and two worker nodes on this machine (``ray.cluster_utils.Cluster``), each worker node
carrying 2 units of a GPU-like custom resource ``fake_gpu``; a 4-worker Ray Train job
(``DataParallelTrainer``, TorchTrainer's base) asking one ``fake_gpu`` per worker gets 2
workers on each node. Ray Train 2.60 numbers the workers
node by node, so with expert groups of P = 2 consecutive ranks each group sits on one node
(its All-to-All would stay on NVLink) and the two groups on different nodes. The workers
only record where they run (no training: the placement is the question).

The cluster needs its own Ray instance, so the test runs this file as a subprocess, away from
the session's ``ray_local``:

    python tests/workers/test_expert_placement.py   # prints each rank's node as JSON
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

WORKERS, PER_NODE, DEGREE = 4, 2, 2


def placed_fn(config: dict) -> None:
    """Each worker writes its world rank and node id."""
    import ray
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    Path(config["placement_dir"], f"rank{rank}.json").write_text(
        json.dumps({"rank": rank, "node_id": ray.get_runtime_context().get_node_id()}))


def main() -> dict:
    """Start the 3-node cluster, run the 4 workers, return each rank's node."""
    import ray
    import ray.train
    from ray.cluster_utils import Cluster
    # TorchTrainer's base: the same worker group and rank order without a torch process group,
    # so the workers need not import torch (47 s instead of 56 s on the 2-core machine, under load)
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    out = Path(tempfile.mkdtemp(prefix="ep"))
    (out / "placement").mkdir()
    temp_dir = tempfile.mkdtemp(prefix="rc", dir="/tmp")  # short: socket paths have a length limit
    os.makedirs(os.path.join(tempfile.gettempdir(), "ray"), exist_ok=True)  # Cluster writes the address there
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "object_store_memory": 80 * 2**20, "temp_dir": temp_dir})
    workers = [cluster.add_node(num_cpus=1, resources={"fake_gpu": PER_NODE}, object_store_memory=80 * 2**20)
               for _ in range(WORKERS // PER_NODE)]
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        trainer = DataParallelTrainer(
            placed_fn, train_loop_config={"placement_dir": str(out / "placement")},
            scaling_config=ray.train.ScalingConfig(num_workers=WORKERS, use_gpu=False,
                                                   resources_per_worker={"CPU": 0.25, "fake_gpu": 1}),
            run_config=ray.train.RunConfig(name="placement", storage_path=str(out / "results"),
                                           failure_config=ray.train.FailureConfig(max_failures=0)))
        result = trainer.fit()
        ranks = sorted((json.loads(p.read_text()) for p in (out / "placement").glob("rank*.json")),
                       key=lambda r: r["rank"])
        return {"error": repr(result.error) if result.error else None,
                "worker_nodes": sorted(node.node_id for node in workers),
                "node_of_rank": [r["node_id"] for r in ranks]}
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.ray
def test_each_expert_group_runs_on_one_node():
    from workers.distributed import expert_groups_across_nodes

    env = {**os.environ, "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "30"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["error"] is None
    nodes = report["node_of_rank"]
    assert len(nodes) == WORKERS and sorted(set(nodes)) == report["worker_nodes"]
    assert expert_groups_across_nodes(nodes, DEGREE) == []
    assert nodes[0] != nodes[DEGREE]  # the two expert groups (the two copies of each expert) on different nodes
    assert expert_groups_across_nodes(nodes, WORKERS) == [[0, 1, 2, 3]]  # one group of all 4 spans both


def test_groups_spanning_nodes_are_named():
    from workers.distributed import expert_groups_across_nodes

    assert expert_groups_across_nodes(["a", "a", "b", "b"], 2) == []
    assert expert_groups_across_nodes(["a", "b", "a", "b"], 2) == [[0, 1], [2, 3]]
    assert expert_groups_across_nodes(["a", "a", "a", "b"], 2) == [[2, 3]]
    assert expert_groups_across_nodes(["a"] * 8, 8) == []


if __name__ == "__main__":
    print(json.dumps(main()))
