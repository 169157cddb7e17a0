"""`mpipemoe check`: run every engine on gloo processes (CPU) on random inputs and compare
outputs and gradients with the brute-force reference, printing one line per engine.

    mpipemoe check                      # 2 ranks, the default engines
    mpipemoe check --world-size 4 --partitions 3 --strategy S2
"""
from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from moe_engine import FastMoE, FasterMoE, MoEConfig, MPipeMoE
from moe_engine.config import STRATEGIES
from moe_engine.reference import reference_moe
from workers.distributed import cpu_threads_per_process


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=2, help="gloo processes (default 2)")
    parser.add_argument("--tokens", type=int, default=24, help="tokens per rank (default 24)")
    parser.add_argument("--partitions", type=int, default=3, help="MPipeMoE partitions (default 3)")
    parser.add_argument("--strategy", default="all", choices=["all", *STRATEGIES],
                        help="MPipeMoE restore strategy to check (default: all)")
    parser.add_argument("--seed", type=int, default=0)


def _engines(args: argparse.Namespace) -> list[tuple[str, Callable[[MoEConfig], nn.Module]]]:
    strategies = STRATEGIES if args.strategy == "all" else (args.strategy,)

    def mpipemoe(strategy: str) -> Callable[[MoEConfig], nn.Module]:
        return lambda c: MPipeMoE(c, partitions=args.partitions, strategy=strategy, dtype=torch.float64)

    engines: list[tuple[str, Callable[[MoEConfig], nn.Module]]] = [("FastMoE", lambda c: FastMoE(c, dtype=torch.float64))]
    engines += [(f"MPipeMoE(n={args.partitions}, {s})", mpipemoe(s)) for s in strategies]
    engines.append(("FasterMoE", lambda c: FasterMoE(c, dtype=torch.float64)))
    return engines


def _rank_main(rank: int, world_size: int, init_file: str, args, queue) -> None:
    torch.set_num_threads(cpu_threads_per_process(world_size))  # the ranks share the cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=120))
    try:
        config = MoEConfig(d_model=16, d_hidden=32, num_experts=2 * world_size, top_k=2, capacity_factor=1.25)
        g = torch.Generator().manual_seed(args.seed)
        E, D, H = config.num_experts, config.d_model, config.d_hidden
        full = {"router.weight": torch.randn(E, D, generator=g, dtype=torch.float64) * D ** -0.5,
                "experts.w1": torch.randn(E, D, H, generator=g, dtype=torch.float64) * D ** -0.5,
                "experts.b1": torch.randn(E, H, generator=g, dtype=torch.float64) * 0.1,
                "experts.w2": torch.randn(E, H, D, generator=g, dtype=torch.float64) * H ** -0.5,
                "experts.b2": torch.randn(E, D, generator=g, dtype=torch.float64) * 0.1}
        xs = [torch.randn(args.tokens + r, D, generator=g, dtype=torch.float64) for r in range(world_size)]
        # The reference sees every rank's tokens, so expert gradients sum over ranks.
        leaves = {k: v.clone().requires_grad_(True) for k, v in full.items()}
        ref_y = None
        for r, x in enumerate(xs):
            y, aux = reference_moe(x, leaves["router.weight"] if r == rank else full["router.weight"],
                                   leaves["experts.w1"], leaves["experts.b1"], leaves["experts.w2"],
                                   leaves["experts.b2"], None, config)
            (y.square().sum() + aux).backward()
            if r == rank:
                ref_y = y.detach()
        L = config.experts_per_rank(world_size)
        for name, build in _engines(args):
            layer = build(config)
            with torch.no_grad():
                for pname, p in layer.named_parameters():
                    p.copy_(full[pname] if pname == "router.weight" else full[pname][rank * L:(rank + 1) * L])
            y, aux = layer(xs[rank])
            (y.square().sum() + aux).backward()
            errors = [float((y.detach() - ref_y).abs().max())]
            for pname, p in layer.named_parameters():
                want = leaves[pname].grad if pname == "router.weight" else leaves[pname].grad[rank * L:(rank + 1) * L]
                errors.append(float((p.grad - want).abs().max()))
            worst = torch.tensor([max(errors)], dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            if rank == 0:
                queue.put((name, float(worst)))
    finally:
        dist.destroy_process_group()


def run(args) -> int:
    print(f"Checking the MoE engines on {args.world_size} gloo processes, {args.tokens}+ tokens per rank, "
          f"float64, against the brute-force reference (outputs and every gradient)...", flush=True)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_rank_main, args=(r, args.world_size, init_file, args, queue))
                 for r in range(args.world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
    failed = any(p.exitcode != 0 for p in procs)
    worst_ok = 1e-9
    while not queue.empty():
        name, error = queue.get()
        verdict = "ok" if error <= worst_ok else "MISMATCH"
        failed |= error > worst_ok
        print(f"  {name:<24} max |error| {error:.2e}  {verdict}")
    print("all engines match the reference" if not failed else "some engines do NOT match the reference")
    return 1 if failed else 0
