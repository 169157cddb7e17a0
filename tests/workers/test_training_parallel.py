"""Tier 2 (2 gloo ranks, no Ray): the worker's ``Trainer`` under DDP and FSDP2, bf16
autocast over float32 master weights, gradient accumulation, sharded checkpoints.

One spawn of 2 ranks (``runs`` fixture) trains the same tiny-gpt job several ways; the tests
compare the per-step losses:
- DDP and FSDP2 (``shard_dense``) give the same losses (float32);
- bf16 compute stays within tolerance of float32 (and differs from it: autocast is on);
- pure bf16 (``param_dtype``: parameters and AdamW state in bf16) trains, near both;
- K=2 micro-batches of b sequences equal one batch of 2b (``aux_loss_weight=0``: the
  load-balance loss of a batch is not the mean of its halves'), and so do they under the
  overlapped micro-batch schedule;
- k steps, a sharded checkpoint (each rank writes its own folder, merged as Ray Train
  does), a fresh Trainer loading it, and N-k more steps equal N steps straight, for DDP
  (saved asynchronously while step k+1 trains: the checkpoint is step k's state) and
  FSDP2 (saved synchronously); the expert shards in the checkpoint are slices of the
  global expert tensors.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from lm.data import MASK_ID, prepare_dataset
from lm.model import MoETransformer, get_preset, init_parameters, lm_batch, lm_loss
from tests.distributed import run_on_ranks
from workers.config import WorkerConfig

N, K = 4, 2


def _config(data_dir: str, **change) -> WorkerConfig:
    preset = get_preset("tiny-gpt").replace(vocab_size=259)
    import dataclasses

    config: dict[str, Any] = {"preset": dataclasses.asdict(preset), "engine": "mpipemoe", "partitions": 2, "strategy": "S1",
              "seed": 3, "lr": 3e-3, "weight_decay": 0.1, "warmup_steps": 1, "grad_clip": 1.0,
              "aux_loss_weight": 0.01, "steps": N, "batch_size": 4, "seq_len": preset.seq_len,
              "data_dir": data_dir, "dtype": "float32", "shard_dense": False, "grad_accum": 1}
    config.update(change)
    return WorkerConfig(**config)


def _losses(trainer, steps) -> list[float]:
    return [trainer.step(step)["lm_loss"] for step in steps]


def _train_ways(rank: int, world_size: int, data_dir: str, out: str) -> dict:
    import torch.distributed as dist

    from workers import checkpoint as ckpt
    from workers.loop import Trainer

    torch.set_num_threads(1)
    device = torch.device("cpu")
    results = {}
    for name, change in (("ddp", {}), ("fsdp2", {"shard_dense": True}), ("bf16", {"dtype": "bfloat16"}),
                         ("accum", {"grad_accum": 2, "batch_size": 2, "aux_loss_weight": 0.0}),
                         ("whole", {"batch_size": 4, "aux_loss_weight": 0.0}),
                         ("overlapped", {"grad_accum": 2, "batch_size": 2, "aux_loss_weight": 0.0,
                                         "micro_batch_schedule": "overlapped"}),
                         ("fused", {"optimizer_impl": "fused"}),
                         ("selective", {"activation_checkpointing": "selective"}),
                         ("full", {"activation_checkpointing": "full"}),
                         ("s4", {"strategy": "S4"}),
                         ("full_s4", {"strategy": "S4", "activation_checkpointing": "full"}),
                         ("full_fsdp2", {"shard_dense": True, "activation_checkpointing": "full"}),
                         ("full_accum", {"grad_accum": 2, "batch_size": 2, "aux_loss_weight": 0.0,
                                         "activation_checkpointing": "full"}),
                         ("full_auto", {"grad_accum": 2, "batch_size": 2, "aux_loss_weight": 0.0,
                                        "activation_checkpointing": "full", "micro_batch_schedule": "auto"}),
                         ("selective_overlapped", {"grad_accum": 2, "batch_size": 2, "aux_loss_weight": 0.0,
                                                   "activation_checkpointing": "selective",
                                                   "micro_batch_schedule": "overlapped"})):
        torch.manual_seed(rank)
        trainer = Trainer(_config(data_dir, **change), rank, world_size, device)
        results[name] = _losses(trainer, range(1, N + 1))
        results[f"{name}_schedule"] = trainer.schedule
        results[f"{name}_schedule_reason"] = trainer.schedule_reason
    torch.manual_seed(rank)
    pure = Trainer(_config(data_dir, dtype="bfloat16", param_dtype="bfloat16"), rank, world_size, device)
    results["pure_bf16"] = _losses(pure, range(1, N + 1))
    state = [t for s in pure.optimizer.state.values() for t in s.values() if t.dim()]  # moments, not the step count
    results["pure_bf16_dtypes"] = sorted({str(t.dtype) for t in [*pure.model.parameters(), *state]})
    for name, change in (("ddp", {}), ("fsdp2", {"shard_dense": True})):
        torch.manual_seed(rank)
        first = Trainer(_config(data_dir, **change), rank, world_size, device)
        losses = _losses(first, range(1, K + 1))
        own = Path(out) / name / f"rank{rank}"  # what each worker reports to Ray Train ...
        own.mkdir(parents=True)
        meta = {"step": K, "world_size": world_size, "preset": first.config.preset_dict()}
        if name == "ddp":  # async: the next step trains while the shards are written
            future = ckpt.save_async(own, rank, world_size, first.parallel, first.optimizer,
                                     dist.new_group(backend="gloo"))
            losses += _losses(first, [K + 1])
            future.result()
            ckpt.write_meta(own, rank, world_size, meta)
        else:
            ckpt.save(own, rank, world_size, first.parallel, first.optimizer, meta)
        dist.barrier()
        merged = Path(out) / name / "merged"  # ... and what Ray Train makes of it
        if rank == 0:
            for r in range(world_size):
                shutil.copytree(Path(out) / name / f"rank{r}", merged, dirs_exist_ok=True)
        dist.barrier()
        results[f"{name}_continued"] = losses + _losses(first, range(len(losses) + 1, N + 1))  # saving changed nothing
        torch.manual_seed(100 + rank)  # the checkpoint's RNG state must win
        second = Trainer(_config(data_dir, **change), rank, world_size, device)
        meta = ckpt.load(merged, rank, world_size, second.parallel, second.optimizer, second.config.preset_dict())
        results[f"{name}_resumed"] = losses[:K] + _losses(second, range(meta["step"] + 1, N + 1))
        embed = second.model.tok_embed.weight
        local = embed.to_local() if hasattr(embed, "to_local") else embed
        results[f"{name}_dense_shard"] = (type(embed).__name__, local.shape[0])
        results[f"{name}_experts"] = {n: p.detach().clone() for n, p in second.model.named_parameters()
                                      if "experts." in n}
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel")
    prepare_dataset(root / "data", max_bytes=2**18, row_len=1024)
    results = run_on_ranks(2, _train_ways, str(root / "data"), str(root / "out"))
    return results, root / "out"


@pytest.mark.gloo
def test_ddp_and_fsdp2_give_the_same_losses(runs):
    results, _ = runs
    assert results[0]["ddp"] == results[1]["ddp"]  # every rank reports the global mean
    assert results[0]["fsdp2"] == pytest.approx(results[0]["ddp"], rel=1e-5, abs=1e-6)
    assert results[0]["ddp"][-1] < results[0]["ddp"][0]


@pytest.mark.gloo
def test_fused_adamw_clipping_inside_the_update_matches_foreach(runs):
    """The fused AdamW takes the global clip as its grad_scale (workers/loop.py step 6): the
    same losses as clipping first and the foreach AdamW, up to float32 rounding."""
    results, _ = runs
    for rank in range(2):
        assert results[rank]["fused"] == pytest.approx(results[rank]["ddp"], rel=1e-5)


@pytest.mark.gloo
def test_bf16_compute_stays_near_float32(runs):
    results, _ = runs
    fp32, bf16 = results[0]["ddp"], results[0]["bf16"]
    assert bf16 == pytest.approx(fp32, rel=2e-2)
    assert bf16 != fp32  # autocast really ran in bf16


@pytest.mark.gloo
def test_pure_bf16_parameters_train_in_bf16_near_mixed_precision(runs):
    results, _ = runs
    assert results[0]["pure_bf16_dtypes"] == ["torch.bfloat16"]  # parameters and AdamW moments
    assert results[0]["pure_bf16"] == pytest.approx(results[0]["ddp"], rel=5e-2)
    assert results[0]["pure_bf16"] != results[0]["bf16"]  # the master weights made a difference


@pytest.mark.gloo
def test_accumulating_k_micro_batches_equals_one_batch_k_times_larger(runs):
    results, _ = runs
    assert results[0]["accum"] == pytest.approx(results[0]["whole"], rel=1e-5, abs=1e-6)


@pytest.mark.gloo
def test_overlapped_micro_batch_schedule_equals_the_sequential_one(runs):
    """The forward of micro-batch 2 beside the backward of micro-batch 1 (workers/schedules.py),
    the dense gradients reduced after the last backward instead of by DDP: the same losses."""
    results, _ = runs
    for rank in range(2):
        assert results[rank]["overlapped"] == pytest.approx(results[rank]["accum"], rel=1e-5, abs=1e-6)
    assert results[0]["overlapped"] == results[1]["overlapped"]
    assert (results[0]["overlapped_schedule"], results[0]["accum_schedule"]) == ("overlapped", "sequential")


@pytest.mark.gloo
@pytest.mark.parametrize("checkpointed, plain", [
    ("selective", "ddp"), ("full", "ddp"), ("full_s4", "s4"), ("full_fsdp2", "fsdp2"), ("full_accum", "accum"),
    ("full_auto", "accum"), ("selective_overlapped", "overlapped")])
def test_activation_checkpointing_gives_the_plain_runs_losses(runs, checkpointed, plain):
    """Blocks run again in backward (the attention, or the whole block with its MoE layer, whose
    engine replays the plan its forward ran): the same losses as keeping the activations, under
    the strategies, FSDP2 and several micro-batches."""
    results, _ = runs
    for rank in range(2):
        assert results[rank][checkpointed] == pytest.approx(results[rank][plain], rel=1e-6, abs=1e-7)
    assert results[0]["full_auto_schedule"] == "sequential"  # full recomputes the MoE layers: not beside a forward
    assert "activation checkpointing" in results[0]["full_auto_schedule_reason"]
    assert results[0]["selective_overlapped_schedule"] == "overlapped"


@pytest.mark.gloo
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_sharded_checkpoint_resumes_exactly(runs, mode):
    results, out = runs
    for rank in range(2):
        assert results[rank][f"{mode}_resumed"] == results[rank][mode]  # exactly
        assert results[rank][f"{mode}_continued"] == results[rank][mode]
    files = json.loads((out / mode / "merged" / "meta.json").read_text())["files"]
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(files)
    # the checkpoint holds the global expert tensors [E, ...], each rank's slice from its shard
    from torch.distributed.checkpoint import FileSystemReader

    w1 = "blocks.0.moe.experts.w1"
    metadata = FileSystemReader(str(out / mode / "merged")).read_metadata().state_dict_metadata
    assert tuple(metadata[f"model.{w1}"].size) == (4, 128, 256)
    assert tuple(metadata[f"optim.state.{w1}.exp_avg"].size) == (4, 128, 256)
    assert not torch.equal(results[0][f"{mode}_experts"][w1], results[1][f"{mode}_experts"][w1])


@pytest.mark.gloo
def test_fsdp2_shards_the_dense_part(runs):
    results, _ = runs
    assert results[0]["fsdp2_dense_shard"] == ("DTensor", 259 // 2 + 1)  # tok_embed rows on rank 0
    assert results[0]["ddp_dense_shard"] == ("Parameter", 259)


# ---- tier 1: choosing and pruning checkpoints (plain files) --------------------------------

def _fake_checkpoint(run_dir: Path, step: int, complete: bool = True) -> Path:
    from workers import checkpoint as ckpt

    folder = run_dir / ckpt.checkpoint_name(step)
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"x" * 10)
    if complete:
        (folder / "meta.json").write_text(json.dumps({"step": step, "files": {"__0_0.distcp": 10}}))
    return folder


def test_choose_skips_newer_incomplete_checkpoints_and_prune_keeps_the_newest_complete(tmp_path):
    from workers import checkpoint as ckpt

    for step in (1, 2, 3):
        _fake_checkpoint(tmp_path, step)
    _fake_checkpoint(tmp_path, 4, complete=False)
    (tmp_path / ckpt.RAY_SNAPSHOT).write_text('{"x": "checkpoint_000005", "y": "checkpoint_000001"}')
    chosen, skipped = ckpt.choose(tmp_path)
    assert chosen == tmp_path / "checkpoint_000003"
    assert skipped == [("checkpoint_000005", "its folder is missing"),
                       ("checkpoint_000004", "meta.json (the completeness marker, written last) is missing: "
                                             "the save did not finish")]
    assert ckpt.prune(tmp_path, 2) == [tmp_path / "checkpoint_000001"]
    assert [p.name for _, p in ckpt.listed(tmp_path)] == ["checkpoint_000004", "checkpoint_000003",
                                                          "checkpoint_000002"]  # incomplete ones stay
    assert ckpt.prune(tmp_path, 0) == []
    (tmp_path / "checkpoint_000003" / "__0_0.distcp").write_bytes(b"x" * 11)
    assert ckpt.validate(tmp_path / "checkpoint_000003") == "__0_0.distcp is damaged (11 of 10 bytes)"
    assert ckpt.set_aside(tmp_path, "checkpoint_000003") == tmp_path / "damaged" / "checkpoint_000003"
    assert ckpt.choose(tmp_path)[0] == tmp_path / "checkpoint_000002"
