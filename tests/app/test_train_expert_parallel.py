"""``mpipemoe train --expert-parallel E`` (Ray local cluster, gloo): tiny-gpt (4 experts) on 4
CPU workers with E = 2 (two expert groups, each expert on 2 workers) trains the losses of
E = 4 (one group) from the same seed; the summary and the MLflow params record E.

One Ray job (E = 2); the E = 4 losses come from the same job's settings (``worker_config``) on 4
gloo ranks without Ray, which tests/app/test_cluster_jobs.py shows to be a Ray job's losses: a
4-worker Ray job costs minutes on 2 cores, 4 gloo ranks seconds.
tests/workers/test_expert_parallel.py checks the same below Ray, with checkpoints."""
from __future__ import annotations

import json

import pytest

from app import cli
from app.jobs.job import TrainJob, worker_config
from app.tracking.store import client
from lm.data import prepare_dataset
from tests.distributed import run_on_ranks, train_straight

pytestmark = pytest.mark.ray

STEPS = 3


def _job(root, degree: int) -> TrainJob:
    return TrainJob(preset="tiny-gpt", num_workers=4, expert_parallel=degree, use_gpu=False, cpus_per_worker=0.45,
                    steps=STEPS, batch_size=2, seq_len=64, partitions=2, strategy="S1", seed=3, aux_loss_weight=0,
                    dtype="float32", eval_every=0, checkpoint_every=0, data_dir=str(root / "data"),
                    storage_path=str(root / "ray_results"), name=f"e{degree}",
                    tracking_uri=f"sqlite:///{root / 'mlflow.db'}")


@pytest.fixture(scope="module")
def trained(ray_local, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("expert_parallel")
    prepare_dataset(root / "data", max_bytes=2**18)
    summary = root / "e2.json"
    status = cli.main(["train", "--preset", "tiny-gpt", "--num-workers", "4", "--expert-parallel", "2",
                       "--no-gpu", "--cpus-per-worker", "0.45", "--steps", str(STEPS), "--batch-size", "2",
                       "--seq-len", "64", "--partitions", "2", "--strategy", "S1", "--seed", "3",
                       "--aux-loss-weight", "0", "--dtype", "float32", "--eval-every", "0",
                       "--checkpoint-every", "0", "--data-dir", str(root / "data"),
                       "--storage-path", str(root / "ray_results"), "--name", "e2",
                       "--tracking-uri", f"sqlite:///{root / 'mlflow.db'}", "--summary-json", str(summary)])
    assert status == 0
    one_group = worker_config(_job(root, 4), use_gpu=False)
    return {2: json.loads(summary.read_text()), "one_group": one_group,
            "one_group_losses": run_on_ranks(4, train_straight, one_group)[0],
            "tracking_uri": f"sqlite:///{root / 'mlflow.db'}"}


def test_two_expert_groups_train_the_losses_of_one(trained):
    two, four = [m["loss"] for m in trained[2]["history"]], trained["one_group_losses"]
    assert len(two) == len(four) == STEPS
    assert two == pytest.approx(four, abs=1e-3)


def test_the_summary_and_the_mlflow_params_record_the_degree(trained):
    """The summary's degree is the one its workers were given (app/jobs/launch.py records
    ``config.expert_parallel``): 2 for the job, 4 for the one-group settings."""
    assert (trained[2]["expert_parallel"], trained["one_group"].expert_parallel) == (2, 4)
    params = client(trained["tracking_uri"]).get_run(trained[2]["mlflow_run_id"]).data.params
    assert params["expert_parallel"] == params["resolved.expert_parallel"] == "2"


def test_a_degree_that_does_not_divide_the_experts_is_refused_naming_the_valid_ones():
    with pytest.raises(ValueError, match=r"TrainJob.expert_parallel=3 is invalid: .* use --expert-parallel 1, 2, 4"):
        TrainJob(preset="tiny-gpt", num_workers=4, expert_parallel=3, tracking_uri="none")


def test_the_default_degree_is_checked_once_the_gpus_of_a_node_are_known(tmp_path, monkeypatch):
    """gpt-s (8 experts) on 64 GPUs without --expert-parallel (issue 38): accepted before Ray is
    up; on 8-GPU nodes the default expert groups are one node's 8 GPUs; on 3-GPU nodes (no
    divisor of the experts) the default is the world, refused naming the valid degrees; on CPU
    (--use-gpu off) it is refused at once."""
    from app.jobs import ray_start
    from lm.data import prepare_dataset

    data = tmp_path / "data"
    prepare_dataset(data, max_bytes=2**15)
    job = TrainJob(preset="gpt-s", num_workers=64, data_dir=str(data), tracking_uri="none",
                   storage_path=str(tmp_path / "runs"))
    monkeypatch.setattr(ray_start, "_resolve_gpu", lambda job: True)
    monkeypatch.setattr(ray_start, "_gpus_per_node", lambda: 8)
    trainer = ray_start.build_trainer(job)
    assert trainer.train_loop_config.expert_parallel == 8
    monkeypatch.setattr(ray_start, "_gpus_per_node", lambda: 3)
    with pytest.raises(ValueError, match=r"num_experts=8 is invalid: .*\(64, the number of workers\).*"
                                         r"use --expert-parallel 1, 2, 4, 8 "):
        ray_start.build_trainer(job)
    with pytest.raises(ValueError, match=r"use --expert-parallel 1, 2, 4, 8 "):
        TrainJob(preset="gpt-s", num_workers=64, use_gpu=False, data_dir=str(data), tracking_uri="none")
