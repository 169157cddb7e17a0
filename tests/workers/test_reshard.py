"""Resuming on another number of workers (workers/reshard.py): 2 -> 1 and 1 -> 2 gloo ranks.

Tier 2 (no Ray). A run trains N steps straight on W ranks, writing a sharded checkpoint after
step K; a fresh ``Trainer`` on W' ranks loads it (DCP cuts the global expert tensors and their
AdamW moments for W' ranks) and trains steps K+1..N on its slice of the same global batch.
Its losses equal the straight run's within float32 rounding. ``aux_loss_weight`` is 0: the
load-balance loss is computed over each rank's tokens, so it depends on the split.

One in-process rank and one spawn of 2 ranks: the 1-rank run (straight, checkpoint A), the
2-rank run (straight, checkpoint B) and the 2-rank resume from A, then the 1-rank resume from B.
"""
from __future__ import annotations

import dataclasses
import shutil
from typing import Any
from pathlib import Path

import pytest
import torch

from lm.data import prepare_dataset
from lm.model import get_preset
from tests.distributed import run_on_ranks
from workers.config import WorkerConfig
from workers.reshard import RankSlice, check_worker_count, resumed_settings

N, K, GLOBAL_BATCH = 4, 2, 8


def _config(data_dir: str, world_size: int, **change) -> WorkerConfig:
    preset = get_preset("tiny-gpt").replace(vocab_size=259)
    return WorkerConfig(**{"preset": dataclasses.asdict(preset), "engine": "mpipemoe", "partitions": 2,
                           "strategy": "S1", "seed": 3, "lr": 3e-3, "warmup_steps": 1, "aux_loss_weight": 0.0,
                           "steps": N, "batch_size": GLOBAL_BATCH // world_size, "data_dir": data_dir,
                           "dtype": "float32", **change})


def _straight_then_resume(rank: int, world_size: int, data_dir: str, out: str, resume_from: str | None,
                          data_shards: int | None) -> dict:
    """N steps straight on ``world_size`` ranks with a checkpoint after step K (in
    ``out/w{world_size}``); then, given ``resume_from``, a fresh Trainer that loads it with
    the data read as ``data_shards`` streams and trains steps K+1..N."""
    import torch.distributed as dist

    from workers import checkpoint as ckpt
    from workers.loop import Trainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        device = torch.device("cpu")
        trainer = Trainer(_config(data_dir, world_size), rank, world_size, device)
        straight = []
        for step in range(1, N + 1):
            straight.append(trainer.step(step)["lm_loss"])
            if step == K:
                own = Path(out) / f"w{world_size}" / f"rank{rank}"  # merged as Ray Train does
                own.mkdir(parents=True)
                ckpt.save(own, rank, world_size, trainer.parallel, trainer.optimizer,
                          {"step": K, "world_size": world_size, "data_shards": world_size,
                           "preset": trainer.config.preset_dict()})
                if world_size > 1:
                    dist.barrier()
                if rank == 0:
                    for r in range(world_size):
                        shutil.copytree(own.parent / f"rank{r}", own.parent / "merged", dirs_exist_ok=True)
        result = {"straight": straight}
        if resume_from:
            config = _config(data_dir, world_size, data_shards=data_shards)
            second = Trainer(config, rank, world_size, device)
            meta = ckpt.load(resume_from, rank, world_size, second.parallel, second.optimizer,
                             config.preset_dict(), data_shards)
            result["resumed"] = [second.step(step)["lm_loss"] for step in range(meta["step"] + 1, N + 1)]
            result["w1_local_rows"] = second.model.blocks[0].moe.experts.w1.shape[0]
        return result
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    data, out = str(root / "data"), str(root / "out")
    prepare_dataset(data, max_bytes=2**18, row_len=1024)
    one = _straight_then_resume(0, 1, data, out, None, None)
    two = run_on_ranks(2, _straight_then_resume, data, out, str(Path(out) / "w1" / "merged"), 1)
    back = _straight_then_resume_from(data, out)
    return {"one": one, "two": two, "back": back}


def _straight_then_resume_from(data: str, out: str) -> dict:
    """The 1-rank resume from the 2-rank checkpoint (no straight run needed again)."""
    from workers import checkpoint as ckpt
    from workers.loop import Trainer

    config = _config(data, 1, data_shards=2)
    trainer = Trainer(config, 0, 1, torch.device("cpu"))
    meta = ckpt.load(Path(out) / "w2" / "merged", 0, 1, trainer.parallel, trainer.optimizer, config.preset_dict(), 2)
    return {"resumed": [trainer.step(step)["lm_loss"] for step in range(meta["step"] + 1, N + 1)],
            "w1_local_rows": trainer.model.blocks[0].moe.experts.w1.shape[0]}


@pytest.mark.gloo
def test_two_workers_resumed_on_one_continue_the_same_losses(runs):
    straight, resumed = runs["two"][0]["straight"], runs["back"]["resumed"]
    assert runs["back"]["w1_local_rows"] == 4  # one rank holds all 4 experts
    assert resumed == pytest.approx(straight[K:], rel=2e-5, abs=1e-6)
    assert straight[-1] < straight[0]


@pytest.mark.gloo
def test_one_worker_resumed_on_two_continues_the_same_losses(runs):
    straight = runs["one"]["straight"]
    for rank in range(2):
        assert runs["two"][rank]["w1_local_rows"] == 2  # each rank holds 2 of the 4 experts
        assert runs["two"][rank]["resumed"] == pytest.approx(straight[K:], rel=2e-5, abs=1e-6)


# ---- tier 1: the data slices and the rules ---------------------------------------------------

def test_rank_slices_are_the_global_batch_cut_evenly(tmp_path):
    prepare_dataset(tmp_path, max_bytes=2**16, row_len=512)
    window, seed = 65, 1
    streams = [RankSlice(str(tmp_path), r, 2, 2, 4, window, seed) for r in range(2)]  # the plain layout
    global_batch = torch.from_numpy(__import__("numpy").concatenate([s.batch(3) for s in streams]))
    one = RankSlice(str(tmp_path), 0, 1, 2, 8, window, seed)  # 2 -> 1
    assert torch.equal(torch.from_numpy(one.batch(3)), global_batch)
    quarters = [RankSlice(str(tmp_path), r, 4, 2, 2, window, seed).batch(3) for r in range(4)]  # 2 -> 4
    assert torch.equal(torch.from_numpy(__import__("numpy").concatenate(quarters)), global_batch)
    assert not torch.equal(global_batch[:4], global_batch[4:])


def test_whole_experts_per_rank_or_a_refusal_naming_the_counts():
    check_worker_count(4, 8, 1, "run r")
    check_worker_count(4, 8, 4, "run r")
    with pytest.raises(ValueError, match=r"^run r cannot continue on 3 workers: its 4 experts per MoE layer do not "
                                         r"split into whole experts per worker; use --num-workers 1, 2, 4 "):
        check_worker_count(4, 8, 3, "run r")
    with pytest.raises(ValueError, match=r"global batch of 6 sequences does not split evenly over 4 workers; "
                                         r"use --num-workers 1, 2 \("):
        check_worker_count(4, 6, 4, "run r")


def test_a_resume_without_expert_parallel_is_checked_against_the_default_degree():
    """--expert-parallel unset: on CPU workers the degree is all of them, and a refusal names the
    degrees that fit beside the worker counts; on GPU workers it may be a node's GPUs (known once
    Ray is up), so a worker count the experts do not split over is not refused here."""
    with pytest.raises(ValueError, match=r"^run r cannot continue on 8 workers in one expert group: its 4 experts per "
                                         r"MoE layer do not split into whole experts per worker; use --expert-parallel "
                                         r"1, 2, 4 \(expert groups of that many workers, each holding every expert\) or "
                                         r"--num-workers 1, 2, 4 "):
        check_worker_count(4, 16, 8, "run r")
    check_worker_count(4, 16, 8, "run r", default_degree_known=False)
    with pytest.raises(ValueError, match="global batch of 12 sequences does not split evenly over 8 workers"):
        check_worker_count(4, 12, 8, "run r", default_degree_known=False)
    recorded = {"preset": "tiny-gpt", "num_workers": 8, "batch_size": 2, "expert_parallel": None}
    on_gpus = resumed_settings({**recorded, "use_gpu": True}, {"num_workers": 16}, "r")  # 2 nodes of 8 GPUs: P = 8
    assert (on_gpus["num_workers"], on_gpus["batch_size"], on_gpus["data_shards"]) == (16, 1, 8)
    with pytest.raises(ValueError, match=r"use --expert-parallel 1, 2, 4 "):
        resumed_settings({**recorded, "use_gpu": False}, {"num_workers": 16}, "r")
    with pytest.raises(ValueError, match=r"with --expert-parallel 8: .* use --expert-parallel 1, 2, 4$"):
        resumed_settings({**recorded, "use_gpu": True}, {"num_workers": 16, "expert_parallel": 8}, "r")


def test_resumed_settings_keep_the_global_batch_and_the_data_layout():
    recorded = {"preset": "tiny-gpt", "num_workers": 2, "batch_size": 4, "steps": 10}
    assert resumed_settings(recorded, {"steps": 20}, "r") == {**recorded, "steps": 20}
    one = resumed_settings(recorded, {"num_workers": 1}, "r")
    assert (one["num_workers"], one["batch_size"], one["data_shards"]) == (1, 8, 2)
    four = resumed_settings({**one}, {"num_workers": 4}, "r")  # a second reshard keeps the first layout
    assert (four["batch_size"], four["data_shards"]) == (2, 2)
    with pytest.raises(ValueError, match=r"cannot continue with --batch-size 4 on 1 workers: .* same global batch "
                                         r"\(8 sequences, --batch-size 8\)"):
        resumed_settings(recorded, {"num_workers": 1, "batch_size": 4}, "r")


def test_a_recorded_run_under_another_worker_count_needs_its_layout(tmp_path):
    """``--name`` of a recorded run (not ``--resume``) with another --num-workers: the job
    keeps the per-worker batch, so the data would not continue; refused, naming --resume."""
    from app.jobs.job import TrainJob
    from app.jobs.resume import check_continues, save_job

    common: dict[str, Any] = dict(preset="tiny-gpt", name="base", storage_path=str(tmp_path), data_dir=str(tmp_path),
                  tracking_uri="none")
    save_job(TrainJob(**common, num_workers=2, batch_size=4))
    check_continues(TrainJob(**common, num_workers=1, batch_size=8, data_shards=2))  # what --resume derives
    with pytest.raises(ValueError, match=r"^run base cannot continue with --num-workers 1 and --batch-size 4: .* "
                                         r"global batch \(8 sequences\) read as 2 rank stream\(s\); continue it "
                                         r"with `mpipemoe train --resume base --storage-path .* --num-workers 1`"):
        check_continues(TrainJob(**common, num_workers=1, batch_size=4))
