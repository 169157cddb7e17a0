"""Run a function on P gloo ranks (spawned CPU processes) and collect what each returns."""
from __future__ import annotations

import os
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from workers.distributed import cpu_threads_per_process


def _worker(rank, world_size, init_file, fn, args, queue, collective_timeout_s):
    try:
        torch.set_num_threads(cpu_threads_per_process(world_size))  # the ranks share the cores
        if world_size > 1:
            dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                    world_size=world_size, timeout=timedelta(seconds=collective_timeout_s))
            # Every rank's mesh is complete before any rank goes on: a rank whose function
            # makes no collective could otherwise exit (closing its sockets) while a peer is
            # still connecting ("Gloo connectFullMesh failed ... Connection closed by peer").
            dist.barrier()
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # report every failure to the parent, then exit
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(world_size: int, fn, *args, timeout: float = 300.0, collective_timeout_s: float = 120.0):
    """fn(rank, world_size, *args) on each rank; returns the list of results by rank.
    With world_size 1 it runs in this process, without a process group. Each rank process
    uses its share of the cores (``cpu_threads_per_process``).
    ``collective_timeout_s``: the process group's timeout (a collective waiting longer fails)."""
    if world_size == 1:
        return [fn(0, 1, *args)]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_worker, args=(r, world_size, init_file, fn, args, queue, collective_timeout_s))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        results, errors = {}, []
        try:
            for _ in procs:
                rank, status, payload = queue.get(timeout=timeout)
                if status == "ok":
                    results[rank] = payload
                else:
                    errors.append(f"rank {rank}:\n{payload}")
        finally:
            for p in procs:
                p.join(timeout=30 if not errors else 5)
                if p.is_alive():
                    p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]


def train_straight(rank: int, world_size: int, config) -> list[float]:
    """Collective: ``config.steps`` steps of the Trainer (no Ray, no checkpoint); each step's
    loss as a Ray Train job's summary records it (the LM loss plus the weighted aux loss)."""
    from workers.loop import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(config, rank, world_size, torch.device("cpu"))
    losses = []
    for step in range(1, config.steps + 1):
        result = trainer.step(step)
        losses.append(result["lm_loss"] + config.aux_loss_weight * result["aux_loss"])
    return losses
