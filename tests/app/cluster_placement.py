"""A 2-worker Ray Train job asking one ``fake_gpu`` (a GPU-like custom resource) and no CPU per worker,
run as a job on a cluster whose worker nodes carry one ``fake_gpu`` each (the local cluster
of tests/app/test_cluster_jobs.py): it must put one worker on each worker node, none on the
head, and the two train the tiny model together (gloo, expert parallel over both) to the last
step. Prints the placement and the result as one JSON line:

    python -m tests.app.cluster_placement OUT_DIR DATA_DIR   # the entrypoint of a job on that cluster
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

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


def main(out_dir: str, data_dir: str) -> dict:
    """Train on the cluster this job runs on; return the placement and the result."""
    import ray
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    from app.jobs.job import TrainJob, worker_config

    out = Path(out_dir)
    (out / "placement").mkdir(parents=True, exist_ok=True)
    ray.init(address="auto", log_to_driver=False)
    try:
        job = TrainJob(preset="tiny-gpt", engine="mpipemoe", steps=STEPS, num_workers=2, use_gpu=False,
                       batch_size=2, partitions=2, checkpoint_every=STEPS,
                       data_dir=data_dir,
                       storage_path=str(out / "results"), name="multinode",
                       tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
        config = {"worker": worker_config(job, use_gpu=False), "placement_dir": str(out / "placement")}
        trainer = TorchTrainer(
            placed_train_fn, train_loop_config=config, torch_config=TorchConfig(backend="gloo"),
            # one fake GPU per worker, like {"GPU": 1} on the real cluster; no CPU: the job runs
            # beside a sweep whose trials hold every CPU of the worker nodes
            scaling_config=ray.train.ScalingConfig(num_workers=2, use_gpu=False,
                                                   resources_per_worker={"CPU": 0, "fake_gpu": 1}),
            run_config=ray.train.RunConfig(name=job.name, storage_path=job.storage_path,
                                           failure_config=ray.train.FailureConfig(max_failures=0)))
        result = trainer.fit()
        ranks = [json.loads(p.read_text()) for p in sorted((out / "placement").glob("rank*.json"))]
        nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
        return {"nodes": len(nodes), "head": ray.get_runtime_context().get_node_id(),  # a job's driver runs on the head
                "fake_gpu_nodes": sorted(i for i, r in nodes.items() if r.get("fake_gpu") == 1),
                "ranks": ranks, "error": repr(result.error) if result.error else None,
                "metrics": {k: v for k, v in (result.metrics or {}).items() if isinstance(v, (int, float))}}
    finally:
        ray.shutdown()


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
