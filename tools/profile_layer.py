"""Kernel-time breakdown of one MoE layer's forward+backward on a GPU (torch.profiler):
where the device time goes, and how much of the pass the host takes to issue.

    python3 tools/profile_layer.py --model gpt-s --tokens 16384 --activation swiglu --no-bias \
        --engine mpipemoe:1:none [--engine torchtitan] [--rows 25]
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from app.bench.shapes import LAYER_SHAPES
from moe_engine import FastMoE, MoEConfig, build_layer


def build(spec: str, config: MoEConfig, source):
    if spec == "torchtitan":
        from app.bench.peers import build_peer
        return build_peer("torchtitan", config, source, torch.device("cuda"), torch.bfloat16)
    layer = build_layer(spec, config, device="cuda", dtype=torch.bfloat16)
    layer.load_state_dict(source.state_dict())
    return layer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt-s")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--activation", default="swiglu")
    parser.add_argument("--no-bias", action="store_true")
    parser.add_argument("--engine", action="append", default=[])
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args()
    D, H = LAYER_SHAPES[args.model]
    config = MoEConfig(D, H, 8, top_k=2, activation=args.activation, bias=not args.no_bias)
    torch.manual_seed(0)
    source = FastMoE(config, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(args.tokens, D, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    for spec in args.engine or ["mpipemoe:1:none"]:
        layer = build(spec, config, source)

        def step():
            xi = x.detach().requires_grad_(True)
            y, aux = layer(xi)
            torch.autograd.backward([y, aux], [dy, torch.ones_like(aux)])
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        host_s = time.perf_counter() - t0
        torch.cuda.synchronize()
        wall_s = time.perf_counter() - t0
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        print(f"\n=== {spec}: {args.model} {args.tokens} tokens: wall {wall_s * 1e3:.2f} ms, host issue "
              f"{host_s * 1e3:.2f} ms")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))



if __name__ == "__main__":
    main()
