"""How well the current memory model prices the committed GPU records.

Re-prices every record of the given bench JSONs that has a measured peak
(`peak_memory_bytes`) with today's `predict_memory`, from the record's own fields (the
layer's shape, tokens, world size, partitions, strategy, engine, dtype) and, where the
record has them, the rows its measured pass moved (`rows_sent`, `rows_received`,
`largest_partition_received`). Single-rank records (world_size 1) and emulated ones
(world_size 64, measured on rank 0) are priced alike. Prints, per file and per
(engine, n, strategy, routing), the ratio predicted / measured (min and max) and how
many records lie within ±10%; `--records` prints every record.

    python tools/memory_accuracy.py results/bench-h200*.json [--records] [--committed]

--committed compares the prediction stored in the record (`predicted_memory_bytes`)
instead of re-pricing it.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's engine, not an installed one

from moe_engine import MoEConfig
from moe_engine.memory import predict_memory

TOLERANCE = 0.10


def record_config(record: dict) -> MoEConfig:
    """The layer shape a bench record measured."""
    return MoEConfig(record["d_model"], record["d_hidden"], record["num_experts"], top_k=record["top_k"],
                     activation=record["activation"], bias=record.get("bias") is not False)


def reprice(record: dict) -> int:
    """Today's model's peak bytes for `record`, from its own fields and rows."""
    engine = record["engine"]
    n = record["partitions"] if engine != "fastmoe" else 1
    return predict_memory(record_config(record), record["tokens"], record["world_size"], n, record["strategy"],
                          engine=engine, dtype=getattr(torch, record["dtype"]),
                          rows_sent=record.get("rows_sent"), rows_received=record.get("rows_received"),
                          largest_partition_received=record.get("largest_partition_received")).peak_bytes


def priced_records(data: dict) -> list[dict]:
    """The records a model prices and a GPU measured (peers and the dense floor have no prediction)."""
    return [r for r in data["records"] if r.get("peak_memory_bytes") and r.get("predicted_memory_bytes")]


def ratios(data: dict, committed: bool = False) -> list[tuple[dict, float]]:
    """(record, predicted / measured) for every priced record of a bench JSON."""
    out = []
    for r in priced_records(data):
        predicted = r["predicted_memory_bytes"] if committed else reprice(r)
        out.append((r, predicted / r["peak_memory_bytes"]))
    return out


def within(ratio: float) -> bool:
    return abs(ratio - 1) <= TOLERANCE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--records", action="store_true", help="print every record")
    parser.add_argument("--committed", action="store_true", help="the records' stored predictions, not re-priced")
    args = parser.parse_args()
    total = [0, 0]
    for path in map(Path, args.paths):
        pairs = ratios(json.loads(path.read_text()), args.committed)
        if not pairs:
            continue
        ok = sum(within(q) for _, q in pairs)
        total[0] += ok
        total[1] += len(pairs)
        print(f"{path}: {ok}/{len(pairs)} within ±{TOLERANCE:.0%}")
        groups: dict = defaultdict(list)
        for r, q in pairs:
            groups[(r["engine"], r["partitions"], r["strategy"], r.get("routing", "uniform"), r["world_size"])].append(q)
            if args.records:
                print(f"    {r['engine']:9s} {r.get('model', ''):7s} {r['tokens']:6d} {r.get('routing', 'uniform'):8s} "
                      f"n={r['partitions']} {r['strategy']:4s} W={r['world_size']:2d} measured "
                      f"{r['peak_memory_bytes'] / 2**20:9.1f} MiB  ratio {q:.3f}{'' if within(q) else '  <-'}")
        for (engine, n, strategy, routing, world), qs in sorted(groups.items()):
            bad = sum(not within(q) for q in qs)
            print(f"  {engine:9s} n={n} {strategy:4s} {routing:8s} W={world:2d}: {len(qs) - bad}/{len(qs)} "
                  f"ratio {min(qs):.3f}..{max(qs):.3f}{'' if not bad else '  <- ' + str(bad) + ' outside'}")
    print(f"all: {total[0]}/{total[1]} within ±{TOLERANCE:.0%}")


if __name__ == "__main__":
    main()
