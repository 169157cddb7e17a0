"""Host time of one MoE layer pass per partition count, on one GPU (or the CPU).

    python3 tools/host_per_partition.py --out host.json                      # this checkout's engine
    python3 tools/host_per_partition.py --engine-root /path/to/other/checkout --label before --out a.json

Times forward + backward of FastMoE and MPipeMoE at n = 1, 2, 4, 8 (strategies none and
S4) at a batch so small that the device work is negligible (256 tokens by default), so a
pass's wall time is the host's: Python, the dispatcher and the kernel launches. The
layers run in interleaved rounds (each round times every layer once, ``--passes`` passes
each, synchronised at the end) and each layer's figure is its fastest round, per pass.
Reports each setting's time and, for MPipeMoE, what each partition beyond the first
adds, as a share of n = 1's time (the target: at most 10%).

``--engine-root`` imports ``moe_engine`` from another checkout, so two versions of the
engine can be timed side by side on one machine (run the tool once per checkout,
alternately, and compare the JSON records).

``--emulate 8x8 --sync-free-capacity F`` times the layers as rank 0 of an emulated cluster
(moe_sim/emulation.py: the network modelled, one GPU) with the dropless exchange and with
the sync-free capacity mode side by side, and records each pass's issue time beside its
wall time: the host's time from the call to the return of backward, before waiting for the
device. A dropless pass reads its counts on the host once per layer, so its host waits for
the device there; the sync-free mode reads nothing and its host runs ahead.

    python3 tools/host_per_partition.py --emulate 8x8 --experts 64 --tokens 16384 \
        --d-model 2048 --d-hidden 8192 --activation gelu --sync-free-capacity 1.5 --out sync-free.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine-root", default=str(Path(__file__).resolve().parents[1]),
                        help="checkout whose moe_engine is timed (default: this one)")
    parser.add_argument("--label", default="this checkout", help="name of the engine version in the record")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--d-hidden", type=int, default=4096)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--activation", default="swiglu")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--passes", type=int, default=10, help="passes per layer per round")
    parser.add_argument("--emulate", help="NODESxGPUS: rank 0 of an emulated cluster (default: one rank)")
    parser.add_argument("--network", default="dgx-h200", help="the emulated cluster's network preset")
    parser.add_argument("--sync-free-capacity", type=float, help="also time each layer in the sync-free capacity mode")
    parser.add_argument("--graphs", action="store_true",
                        help="CUDA: also capture each capturable layer's forward+backward in a CUDA graph and time "
                             "its replay (the sync-free capacity layers; on one rank every layer)")
    parser.add_argument("--partitions", default="1,2,4,8", help="MPipeMoE's n, a comma list")
    parser.add_argument("--out", help="JSON record to write")
    args = parser.parse_args(argv)
    repo = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(repo))
    sys.path.insert(0, args.engine_root)  # (first: its moe_engine is the one timed)
    from app.tracking.records import git_commit

    import torch
    from moe_engine import FastMoE, MoEConfig, MPipeMoE

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    config = MoEConfig(d_model=args.d_model, d_hidden=args.d_hidden, num_experts=args.experts, top_k=2,
                       activation=args.activation)
    group = None
    if args.emulate:
        from moe_sim.emulation import EmulatedCluster
        group = EmulatedCluster.parse(args.emulate, args.network).build()
    capacities = [None] + ([args.sync_free_capacity] if args.sync_free_capacity else [])
    torch.manual_seed(0)
    layers = {}
    for factor in capacities:
        mode = "" if factor is None else f"+sync-free{factor:g}"
        layers[f"fastmoe{mode}"] = FastMoE(config, group, device=device, dtype=dtype, sync_free_capacity=factor)
        for strategy in ("none", "S4"):
            for n in (int(n) for n in args.partitions.split(",")):
                layers[f"mpipemoe:{n}:{strategy}{mode}"] = MPipeMoE(
                    config, group, partitions=n, strategy=strategy, device=device, dtype=dtype,
                    sync_free_capacity=factor)
    x = torch.randn(args.tokens, args.d_model, device=device, dtype=dtype)
    dy = torch.randn_like(x)

    def one_pass(layer) -> None:
        xi = x.detach().requires_grad_(True)
        y, aux = layer(xi)
        torch.autograd.backward([y, aux], [dy, torch.ones_like(aux)])

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for layer in layers.values():  # warm-up: allocator, kernels' first launches
        for _ in range(3):
            one_pass(layer)
    synchronize()
    best = {name: float("inf") for name in layers}
    issue = {name: float("inf") for name in layers}  # the round's host time before waiting for the device
    for _ in range(args.rounds):
        for name, layer in layers.items():
            start = time.perf_counter()
            for _ in range(args.passes):
                one_pass(layer)
            issued = time.perf_counter()
            synchronize()
            best[name] = min(best[name], (time.perf_counter() - start) / args.passes)
            issue[name] = min(issue[name], (issued - start) / args.passes)
    if args.graphs and device.type == "cuda":
        time_graph_replays(layers, x, dy, args, best, issue, one_rank=group is None)
    rows = []
    for name, seconds in best.items():
        if math.isnan(seconds):  # a capture that failed (printed above)
            rows.append({"setting": name, "pass_ms": None, "issue_ms": None})
            continue
        row = {"setting": name, "pass_ms": round(seconds * 1e3, 4), "issue_ms": round(issue[name] * 1e3, 4)}
        if name.startswith("mpipemoe"):
            _, n, rest = name.split(":", 2)
            first = best[f"mpipemoe:1:{rest}"] if f"mpipemoe:1:{rest}" in best else None
            if int(n) > 1 and first:
                row["per_extra_partition_of_n1"] = round((seconds - first) / (int(n) - 1) / first, 4)
        if name in layers and "overflowed" in dir(layers[name]) and layers[name].sync_free_capacity is not None:
            row["overflowed_pairs"] = int(layers[name].overflowed)
        rows.append(row)
    record = {
        "meta": {"tool": "tools/host_per_partition.py", "command": " ".join(["python3", "tools/host_per_partition.py",
                                                                            *(argv or sys.argv[1:])]),
                 "engine": args.label, "git_commit": git_commit(args.engine_root), "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                 else platform.processor() or "cpu", "torch": torch.__version__,
                 "date": datetime.date.today().isoformat(), "tokens": args.tokens, "d_model": args.d_model,
                 "d_hidden": args.d_hidden, "experts": args.experts, "top_k": 2, "activation": args.activation,
                 "dtype": "bfloat16", "rounds": args.rounds, "passes": args.passes,
                 "emulated_cluster": args.emulate, "network": args.network if args.emulate else None,
                 "graphs": "'+graph' rows: forward+backward captured in one CUDA graph, issue_ms = the replay call"
                 if args.graphs else None},
        "results": rows,
    }
    for row in rows:
        extra = row.get("per_extra_partition_of_n1")
        if row["pass_ms"] is None:
            continue
        print(f"{args.label:>14} {row['setting']:>26} {row['pass_ms']:8.3f} ms (issue {row['issue_ms']:7.3f} ms)"
              + (f"   +{extra:.1%} of n=1 per extra partition" if extra is not None else ""))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0


def time_graph_replays(layers: dict, x, dy, args, best: dict, issue: dict, *, one_rank: bool) -> None:
    """In place: for each capturable layer (the sync-free capacity mode's; on one rank, without
    an emulated cluster, every one but the offloading strategies'), its forward+backward (input
    and parameter gradients by autograd.grad into the graph's own outputs) captured in one CUDA
    graph after a warm-up on a side stream, and its replay timed as the eager passes were:
    `best` and `issue` get a row named '<setting>+graph' (a capture that fails: '+graph failed')."""
    import torch

    for name, layer in list(layers.items()):
        if not (getattr(layer, "sync_free_capacity", None) is not None or one_rank):
            continue
        params = [p for p in layer.parameters() if p.requires_grad]
        static_x = x.detach().clone().requires_grad_(True)

        def step(layer=layer, params=params, static_x=static_x):
            y, aux = layer(static_x)
            return (y, *torch.autograd.grad([y, aux], [static_x, *params], [dy, torch.ones_like(aux)]))

        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
        except Exception as error:  # noqa: BLE001 - recorded, and the others go on
            print(f"{name}: capture failed: {str(error).splitlines()[0][:200]}")
            best[f"{name}+graph failed"] = float("nan")
            issue[f"{name}+graph failed"] = float("nan")
            torch.cuda.synchronize()
            continue
        graph.replay()
        torch.cuda.synchronize()
        key = f"{name}+graph"
        best[key] = issue[key] = float("inf")
        for _ in range(args.rounds):
            start = time.perf_counter()
            for _ in range(args.passes):
                graph.replay()
            issued = time.perf_counter()
            torch.cuda.synchronize()
            best[key] = min(best[key], (time.perf_counter() - start) / args.passes)
            issue[key] = min(issue[key], (issued - start) / args.passes)
        del graph


if __name__ == "__main__":
    sys.exit(main())
