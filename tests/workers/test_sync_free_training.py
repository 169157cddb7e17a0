"""Tier 2 (2 gloo ranks, no Ray): training with the MoE layers' sync-free capacity mode.

A step in the mode reads no counts per layer; the pairs a full capacity drops are counted on
the device and summed over ranks with the step's losses. A capacity with room for every
pair trains exactly as the dropless exchange does; a capacity that overflows makes every
rank run the step again dropless (its first gradients dropped), so the losses and the
parameters still equal the dropless run's, and the step says so (``dropless_rerun``).
Tier 1 below: the settings the mode refuses, named before anything starts.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from lm.data import prepare_dataset
from lm.model import get_preset
from tests.distributed import run_on_ranks
from workers.config import WorkerConfig, sync_free_capacity_refusal

STEPS = 3


def _config(data_dir: str, **change) -> WorkerConfig:
    return WorkerConfig(**{"preset": dataclasses.asdict(get_preset("tiny-gpt")), "engine": "mpipemoe",
                           "partitions": 2, "strategy": "S1", "seed": 3, "lr": 1e-3, "steps": STEPS,
                           "batch_size": 2, "seq_len": 32, "grad_accum": 2, "data_dir": data_dir,
                           "dtype": "float32", "collective_timeout_s": 30, **change})


def _train(rank: int, world_size: int, data_dir: str) -> dict:
    from workers.loop import Trainer

    torch.set_num_threads(1)
    runs = {}
    for label, factor in (("dropless", None), ("roomy", 8.0), ("tight", 0.05)):
        trainer = Trainer(_config(data_dir, sync_free_capacity=factor), rank, world_size, torch.device("cpu"))
        steps = [trainer.step(step) for step in range(1, STEPS + 1)]
        runs[label] = {"losses": [s["lm_loss"] for s in steps],
                       "overflowed": [s.get("capacity_overflow_pairs") for s in steps],
                       "reruns": [s.get("dropless_rerun") for s in steps],
                       # (numpy: a tensor sent back would live in the rank's shared memory, gone with it)
                       "params": torch.cat([p.detach().flatten() for p in trainer.model.parameters()]).numpy()}
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sync-free")
    prepare_dataset(root / "data", max_bytes=2**17, row_len=1024)
    return run_on_ranks(2, _train, str(root / "data"), timeout=300, collective_timeout_s=30)


@pytest.mark.gloo
def test_a_capacity_with_room_for_every_pair_trains_as_the_dropless_exchange(runs):
    for rank_runs in runs:
        dropless, roomy = rank_runs["dropless"], rank_runs["roomy"]
        assert dropless["overflowed"] == [None] * STEPS and dropless["reruns"] == [None] * STEPS
        assert roomy["overflowed"] == [0] * STEPS and roomy["reruns"] == [0] * STEPS
        torch.testing.assert_close(roomy["losses"], dropless["losses"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.from_numpy(roomy["params"]), torch.from_numpy(dropless["params"]),
                                   rtol=1e-4, atol=1e-5)  # (AdamW's first steps of lr 1e-3: rounding of the sums' order)


@pytest.mark.gloo
def test_a_step_whose_capacity_overflows_runs_again_dropless_on_every_rank(runs):
    tight = [rank_runs["tight"] for rank_runs in runs]
    assert tight[0]["overflowed"] == tight[1]["overflowed"]  # summed over the ranks: the same number on each
    assert all(pairs > 0 for pairs in tight[0]["overflowed"]) and tight[0]["reruns"] == [1] * STEPS
    for rank_runs in runs:
        torch.testing.assert_close(rank_runs["tight"]["losses"], rank_runs["dropless"]["losses"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.from_numpy(rank_runs["tight"]["params"]),
                                   torch.from_numpy(rank_runs["dropless"]["params"]), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("settings, named", [
    (dict(factor=0), "a capacity factor > 0"),
    (dict(factor=float("nan")), "a capacity factor > 0"),
    (dict(engine="fastermoe"), "fastmoe engine"),
    (dict(partitions="auto"), "fixed partitions count and strategy"),
    (dict(strategy="auto"), "fixed partitions count and strategy"),
    (dict(split="peers"), "drop split=peers"),
])
def test_the_settings_the_mode_cannot_run_are_refused_naming_the_fix(settings, named):
    given = {"factor": 1.5, "engine": "mpipemoe", "partitions": 2, "strategy": "S4", "split": None, **settings}
    assert named in sync_free_capacity_refusal(given["factor"], given["engine"], given["partitions"],
                                               given["strategy"], given["split"])
    with pytest.raises(ValueError, match="WorkerConfig.sync_free_capacity="):
        _config("data", sync_free_capacity=given["factor"], engine=given["engine"], partitions=given["partitions"],
                strategy=given["strategy"], split=given["split"])
    assert sync_free_capacity_refusal(1.5, "fastmoe", "auto", "auto", None) is None  # fastmoe: n = 1, keeps all


def test_train_refuses_the_mode_before_ray_starts():
    from app.jobs.job import TrainJob

    with pytest.raises(ValueError, match=r"TrainJob.sync_free_capacity=1.5 .*fixed partitions.*--sync-free-capacity"):
        TrainJob(preset="tiny-gpt", sync_free_capacity=1.5)
