"""L residual MoE layers on one GPU: fwd+bwd time and activation memory of every engine
setting side by side with torchtitan's layer, each with and without activation
checkpointing (torch.utils.checkpoint, non-reentrant, around each layer); issue 27.

    python3 tools/stacked_layers.py --model gpt-xl --tokens 32768 --layers 8 --out out/stacked-gpt-xl-32k.json

Each setting is built, measured and freed in turn (8 gpt-xl layers hold 6.4 GiB of bf16
weights each); "activation memory" is the peak of one forward+backward above what is
allocated before it (weights, their gradients, the input). `auto@budget` is MPipeMoE with
n and strategy "auto" under MemoryBudget(BUDGET_SHARE of torchtitan's activation memory,
layers=L): each layer's saved tensors count L times, one working set once. Writes JSON records and a Markdown table (memory against time).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.layer_shapes import DTYPES, LAYER_SHAPES  # noqa: E402
from app.peers import build_peer  # noqa: E402
from moe_engine import FastMoE, MemoryBudget, MoEConfig, build_layer  # noqa: E402
from moe_engine.granularity import GranularitySearch  # noqa: E402

BUDGET_SHARE = 0.15  # the target: <= 0.15x torchtitan's activation memory (issue 27)
DEFAULT_SETTINGS = ("torchtitan", "torchtitan+ckpt", "mpipemoe:1:none", "mpipemoe:1:none+ckpt",
                    "mpipemoe:2:S4", "mpipemoe:4:S4", "mpipemoe:8:S4", "mpipemoe:4:S3", "mpipemoe:8:S1",
                    "auto@budget")


class Stack(torch.nn.Module):
    """h = h + layer(h)[0] for each layer, each optionally under activation checkpointing."""

    def __init__(self, layers, checkpointed: bool):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        self.checkpointed = checkpointed

    def forward(self, h):
        for layer in self.layers:
            run = (lambda h, layer=layer: layer(h)[0])
            h = h + (checkpoint(run, h, use_reentrant=False) if self.checkpointed else run(h))
        return h


def build_stack(setting: str, config: MoEConfig, layers: int, source, device, dtype,
                budget: MemoryBudget | None) -> Stack:
    """The L layers of one setting (`engine spec[+ckpt]`, `torchtitan[+ckpt]` or
    `auto@budget`), every layer with `source`'s weights."""
    name, checkpointed = setting.removesuffix("+ckpt"), setting.endswith("+ckpt")

    def one():
        if name == "torchtitan":
            return build_peer("torchtitan", config, source, device, dtype)
        options = {}
        if name == "auto@budget":
            name_spec, options = "mpipemoe:auto:auto", {"memory_budget": budget,
                                                        "search": GranularitySearch(candidates=(1, 2, 4, 8))}
        else:
            name_spec = name
        layer = build_layer(name_spec, config, device=device, dtype=dtype, **options)
        layer.load_state_dict(source.state_dict())
        return layer
    return Stack([one() for _ in range(layers)], checkpointed)


def measure(stack: Stack, x, dy, device, warmup: int, repeats: int) -> dict:
    """Mean and spread of fwd+bwd ms over `repeats` (CUDA events), and the activation peak."""
    def step():
        stack(x).backward(dy)
    for _ in range(warmup):
        step()
    searches = [layer.search for layer in stack.layers if getattr(layer, "partitions", None) == "auto"]
    for _ in range(60):  # let automatic layers' searches settle on an n
        if all(search.active is None and search.cache for search in searches):
            break
        step()
    record = {"fwd_bwd_ms": None, "fwd_bwd_ms_std": None, "activation_bytes": None}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        record["activation_bytes"] = torch.cuda.max_memory_allocated(device) - baseline
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            import time
            began = time.perf_counter()
            step()
            times.append(1e3 * (time.perf_counter() - began))
    record.update(fwd_bwd_ms=statistics.mean(times), fwd_bwd_ms_std=statistics.pstdev(times))
    chosen = [(layer.last_partitions, layer.last_strategy) for layer in stack.layers
              if hasattr(layer, "last_partitions")]
    if chosen:
        record["chosen"] = sorted({f"{n}/{s}" for n, s in chosen})
    return record


def run(model: str, tokens: int, layers: int, settings, device, dtype, warmup: int = 3, repeats: int = 5) -> list:
    """Records of every setting, with ratios to torchtitan (time, memory) when it ran."""
    D, H = LAYER_SHAPES[model]
    config = MoEConfig(D, H, 8, top_k=2, activation="swiglu", bias=False)
    torch.manual_seed(0)
    source = FastMoE(config, device=device, dtype=dtype)
    x = torch.randn(tokens, D, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(tokens, D, device=device, dtype=dtype)
    records, budget = [], None
    for setting in settings:
        stack = build_stack(setting, config, layers, source, device, dtype, budget)
        record = {"setting": setting, "model": model, "tokens": tokens, "layers": layers,
                  "dtype": str(dtype).removeprefix("torch."), **measure(stack, x, dy, device, warmup, repeats)}
        if setting == "torchtitan" and record["activation_bytes"]:
            budget = MemoryBudget(int(BUDGET_SHARE * record["activation_bytes"]), layers)
            record["budget_bytes"] = budget.bytes
        records.append(record)
        del stack
        x.grad = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    titan = next((r for r in records if r["setting"] == "torchtitan"), None)
    for r in records:
        if titan:
            r["time_vs_torchtitan"] = r["fwd_bwd_ms"] / titan["fwd_bwd_ms"]
            if r["activation_bytes"] and titan["activation_bytes"]:
                r["memory_vs_torchtitan"] = r["activation_bytes"] / titan["activation_bytes"]
    return records


def markdown(records: list) -> str:
    """Memory against time, one row per setting, leanest first."""
    fmt = lambda v, f: "–" if v is None else format(v, f)  # noqa: E731
    lines = ["| model | tokens | layers | setting | chosen n/strategy | fwd+bwd ms | ± | activation GiB | "
             "time / torchtitan | memory / torchtitan |", "|" + "---|" * 10]
    for r in sorted(records, key=lambda r: (r["model"], r["tokens"], r["activation_bytes"] or 0)):
        lines.append(f"| {r['model']} | {r['tokens']} | {r['layers']} | {r['setting']} | "
                     f"{', '.join(r.get('chosen', [])) or '–'} | {fmt(r['fwd_bwd_ms'], '.1f')} | "
                     f"{fmt(r['fwd_bwd_ms_std'], '.1f')} | "
                     f"{fmt(r['activation_bytes'] and r['activation_bytes'] / 2**30, '.2f')} | "
                     f"{fmt(r.get('time_vs_torchtitan'), '.2f')} | {fmt(r.get('memory_vs_torchtitan'), '.2f')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-xl", choices=sorted(LAYER_SHAPES))
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--settings", default=",".join(DEFAULT_SETTINGS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    records = run(args.model, args.tokens, args.layers, args.settings.split(","), device, DTYPES[args.dtype],
                  args.warmup, args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"records": records}, indent=1))
    args.out.with_suffix(".md").write_text(markdown(records))
    print(markdown(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
