"""Measured activation peak of each engine against the memory model, on a GPU, for
uniform and hot-expert routing (one rank: every routing computes k·T rows).

    python3 tools/memory_check.py --model gpt-s --tokens 8192 [--activation swiglu --no-bias]

Prints one line per engine setting: predicted MiB, measured MiB, predicted / measured.
"""
from __future__ import annotations

import argparse

import torch

from app.bench.measure import layer_pass as _step
from app.bench.parts import layer_inputs, peak_memory_bytes
from app.bench.shapes import LAYER_SHAPES
from moe_engine import FastMoE, FasterMoE, MoEConfig, MPipeMoE
from moe_engine.memory import predict_memory


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt-s")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--activation", default="gelu")
    parser.add_argument("--no-bias", action="store_true")
    parser.add_argument("--routing", default="uniform,hot-expert")
    args = parser.parse_args()
    D, H = LAYER_SHAPES[args.model]
    config = MoEConfig(D, H, 8, top_k=2, activation=args.activation, bias=not args.no_bias)
    dtype, cuda = torch.bfloat16, torch.device("cuda")
    torch.manual_seed(0)
    source = FastMoE(config, device=cuda, dtype=dtype)
    settings = [("fastmoe", 1, "none"), ("fastermoe", 1, "none")] + [
        ("mpipemoe", n, s) for n in (1, 2, 4, 8) for s in ("none", "S1", "S2", "S3", "S4")]
    for routing in args.routing.split(","):
        x = layer_inputs(args.tokens, source.router.weight.detach(), routing)
        grad_y = torch.randn_like(x)
        for engine, n, strategy in settings:
            layer = {"fastmoe": lambda: FastMoE(config, device=cuda, dtype=dtype),
                     "fastermoe": lambda: FasterMoE(config, device=cuda, dtype=dtype),
                     "mpipemoe": lambda: MPipeMoE(config, partitions=n, strategy=strategy, device=cuda,
                                                  dtype=dtype)}[engine]()
            layer.load_state_dict(source.state_dict())
            peak_memory_bytes(lambda: _step(layer, x, grad_y), cuda)  # warm-up: host pool, allocator
            measured = peak_memory_bytes(lambda: _step(layer, x, grad_y), cuda)
            predicted = predict_memory(config, args.tokens, 1, n, strategy, engine=engine, dtype=dtype).peak_bytes
            print(f"{args.model} {args.activation} bias={config.bias} {args.tokens} {routing:8s} {engine:9s} n={n} "
                  f"{strategy:4s} predicted {predicted / 2**20:8.1f} MiB  measured {measured / 2**20:8.1f} MiB  "
                  f"ratio {predicted / measured:.3f}", flush=True)
            layer = None
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
