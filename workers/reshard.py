"""Resuming a run on another number of workers: the rules, and the data each rank reads.

A run's checkpoint holds every expert tensor and its AdamW moments as ``Shard(0)`` slices of
the global ``[E, ...]`` tensor (workers/checkpoint.py; written once however many expert groups
hold copies), so DCP can load it on W' ranks in expert groups of P' ranks as long as each rank
keeps whole experts: ``E % P' == 0`` (P' = W' without expert replicas). The model and optimizer
state are then the same tensors, cut differently.

The data must continue at the same global sample. A run that started on D workers reads its
data as D rank streams (lm/data.py: rank d of D reads rows d, d+D, ...), and step s's global
batch is the D streams' batch ``s`` side by side: ``G = D * b`` sequences (b per stream). A
run resumed on W' workers keeps D (``data_shards``, recorded in the job and the checkpoint)
and the global batch G, and rank r of W' takes the contiguous slice
``[r * G / W', (r + 1) * G / W')`` of it (``RankSlice``), so every step trains on the same
sequences as a run that never changed (``G % W' == 0``). With W' == D this is exactly the
plain layout (``BatchSampler`` of rank r's own stream).

Same sequences, same update: the language-model loss is a mean over the global batch and
the gradients are those of that mean whatever the split (dense: DDP's average over equal
rank batches; experts: summed over every rank's tokens, divided by W'). Two things are
per rank by definition and so change with the split: the load-balance (aux) loss, computed
over each rank's tokens (docs/engine.md, DESIGN §4.1), and a capacity factor's per-rank
capacity. tiny-bert's masks are drawn per rank as well. With ``aux_loss_weight`` 0 and
dropless routing a GPT run continues within float32 rounding of the run that never changed
(tests/workers/test_reshard.py).

Local throughout: no collectives here.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from lm.data import BatchSampler, open_rank_stream
from lm.errors import invocation


def divisors_fitting(num_experts: int, global_batch: int) -> list[int]:
    """Local. Worker counts that keep whole experts per rank and an equal share of the global batch."""
    return [w for w in range(1, num_experts + 1) if num_experts % w == 0 and global_batch % w == 0]


def check_worker_count(num_experts: int, global_batch: int, workers: int, where: str,
                       expert_parallel: int | None = None, *, default_degree_known: bool = True) -> None:
    """Local. Raise ValueError naming the fix unless ``workers`` ranks in expert groups of
    ``expert_parallel`` can each hold whole experts (``num_experts % degree == 0``, the
    degree dividing ``workers``) and an equal slice of the ``global_batch``. With
    ``expert_parallel`` None the degree is the default one: all the workers where
    ``default_degree_known`` (CPU workers), else (GPU workers: the GPUs of a node where they
    divide the experts, known once Ray is up) only the batch is checked here, and the
    experts by the trainer's builder (app/jobs/ray_start.py)."""
    degree = expert_parallel or workers
    experts_split = (num_experts % degree == 0 and workers % degree == 0) or \
        (expert_parallel is None and not default_degree_known)
    if experts_split and global_batch % workers == 0:
        return
    from lm.model import valid_expert_degrees

    valid = ", ".join(str(p) for p in valid_expert_degrees(num_experts, workers))
    counts = ", ".join(str(w) for w in divisors_fitting(num_experts, global_batch))
    if expert_parallel is not None and not experts_split:
        raise ValueError(f"{where} cannot continue on {workers} workers with --expert-parallel {expert_parallel}: "
                         f"the degree must divide both the {workers} workers and the {num_experts} experts per MoE "
                         f"layer; use --expert-parallel {valid}")
    if not experts_split and global_batch % workers == 0:  # the default degree (all the workers) is what fails
        raise ValueError(f"{where} cannot continue on {workers} workers in one expert group: its {num_experts} "
                         f"experts per MoE layer do not split into whole experts per worker; use --expert-parallel "
                         f"{valid} (expert groups of that many workers, each holding every expert) or "
                         f"--num-workers {counts} (each keeps whole experts and an equal share of the batch)")
    why = (f"its {num_experts} experts per MoE layer do not split into whole experts per worker"
           if not experts_split else
           f"its global batch of {global_batch} sequences does not split evenly over {workers} workers")
    raise ValueError(f"{where} cannot continue on {workers} workers: {why}; use --num-workers {counts} "
                     f"(each keeps whole experts and an equal share of the batch)")


def default_degree_known(use_gpu: bool | None) -> bool:
    """Local. Whether a job's default expert-parallel degree is known before Ray starts: on
    CPU workers (``use_gpu`` False, or None on a machine without CUDA) it is all the workers;
    on GPU workers it depends on the GPUs of a node (workers/distributed.py
    ``default_expert_degree``)."""
    if use_gpu is None:
        import torch

        return not torch.cuda.is_available()
    return not use_gpu


def resumed_settings(recorded: dict[str, Any], given: dict[str, Any], name: str) -> dict[str, Any]:
    """Local. The job settings (``app.jobs.job.TrainJob`` fields) a resume of the run ``recorded``
    continues with, when the user asked for ``given`` (options set on the command line).

    Same worker count: ``{**recorded, **given}``. Another ``num_workers``: the data keeps the
    run's layout (``data_shards``: its first worker count) and the global batch; the
    per-worker ``batch_size`` becomes ``global / num_workers``. Raises ValueError naming the
    fix when the experts or the batch do not split, or ``given`` changes the global batch."""
    merged = {**recorded, **given}
    old_workers, new_workers = recorded["num_workers"], merged["num_workers"]
    if new_workers == old_workers:
        return merged
    global_batch = recorded["batch_size"] * old_workers
    experts = merged.get("num_experts") or _preset_experts(merged["preset"])
    where = f"run {name} (trained on {old_workers} workers)"
    check_worker_count(experts, global_batch, new_workers, where, merged.get("expert_parallel"),
                       default_degree_known=default_degree_known(merged.get("use_gpu")))
    per_worker = global_batch // new_workers
    if "batch_size" in given and given["batch_size"] != per_worker:
        raise ValueError(f"{where} cannot continue with --batch-size {given['batch_size']} on {new_workers} workers: "
                         f"its data continues at the same global sample only with the same global batch "
                         f"({global_batch} sequences, --batch-size {per_worker}); drop --batch-size "
                         f"(`{invocation()} train --resume {name} --num-workers {new_workers}`)")
    return {**merged, "batch_size": per_worker,
            "data_shards": recorded.get("data_shards") or old_workers}


def _preset_experts(preset: str) -> int:
    from lm.model import get_preset

    return get_preset(preset).num_experts


def check_checkpoint_layout(meta: dict[str, Any], world_size: int, data_shards: int | None,
                            directory: str | Path, expert_parallel: int | None = None) -> None:
    """Local. Raise ValueError naming the fix unless a checkpoint (its ``meta.json``) can
    load on ``world_size`` ranks in expert groups of ``expert_parallel`` (None: the world)
    reading the data as ``data_shards`` streams (None: one per rank): whole experts per rank,
    and the data layout the checkpoint's run reads."""
    written_by = meta["world_size"]
    layout = meta.get("data_shards", written_by)
    wanted = data_shards or world_size
    experts = meta.get("preset", {}).get("num_experts")
    degree = expert_parallel or world_size
    if experts and experts % degree:
        from lm.model import valid_expert_degrees

        valid = ", ".join(str(p) for p in valid_expert_degrees(experts, world_size))
        raise ValueError(f"checkpoint in {directory} holds {experts} experts per MoE layer, which do not split into "
                         f"whole experts over expert groups of {degree} workers: resume with --expert-parallel "
                         f"{valid} on {world_size} workers, or with --num-workers "
                         f"{' or '.join(str(w) for w in range(1, experts + 1) if experts % w == 0)}")
    if layout != wanted:
        raise ValueError(f"checkpoint in {directory} was written by a run reading its data as {layout} rank "
                         f"stream(s), this run reads {wanted}: resume it with `mpipemoe train --resume NAME "
                         f"--num-workers {world_size}` (which keeps the data layout), or set data_shards={layout}")


class RankSlice:
    """Rank ``rank`` of ``world_size``'s batches when the data is ``data_shards`` rank streams
    (see the module docstring): batch i is the slice ``[rank * b, (rank + 1) * b)`` of the
    ``data_shards`` streams' batches i side by side, b = ``batch_size`` (this rank's share).
    Same interface as ``BatchSampler`` (``batch``, ``epoch_of``)."""

    def __init__(self, data_dir: str, rank: int, world_size: int, data_shards: int, batch_size: int,
                 window: int, seed: int) -> None:
        global_batch = batch_size * world_size
        if global_batch % data_shards:
            raise ValueError(f"data_shards={data_shards} is invalid: the global batch ({batch_size} x "
                             f"{world_size} workers) must split evenly over the data's {data_shards} rank streams")
        self.stream_batch = global_batch // data_shards
        first, last = rank * batch_size, (rank + 1) * batch_size  # global rows [first, last)
        self.parts = []  # (stream's sampler, rows [lo, hi) of its batch)
        for stream in range(first // self.stream_batch, (last - 1) // self.stream_batch + 1):
            start = stream * self.stream_batch
            sampler = BatchSampler(open_rank_stream(data_dir, stream, data_shards), self.stream_batch, window,
                                   seed, stream)
            self.parts.append((sampler, max(first, start) - start, min(last, start + self.stream_batch) - start))

    def epoch_of(self, index: int) -> int:
        return self.parts[0][0].epoch_of(index)

    def batch(self, index: int) -> np.ndarray:
        """Batch ``index`` (0-based): int64 (batch_size, window)."""
        return np.concatenate([sampler.batch(index)[lo:hi] for sampler, lo, hi in self.parts])


def rank_batches(data_dir: str, rank: int, world_size: int, data_shards: int | None, batch_size: int,
                 window: int, seed: int) -> BatchSampler | RankSlice:
    """Local. This rank's batch source: its own stream's ``BatchSampler`` when the data is
    split one stream per rank (``data_shards`` None or ``world_size``), else a ``RankSlice``."""
    if data_shards in (None, world_size):
        return BatchSampler(open_rank_stream(data_dir, rank, world_size), batch_size, window, seed, rank)
    return RankSlice(data_dir, rank, world_size, data_shards, batch_size, window, seed)
