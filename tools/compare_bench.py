"""Per-point time and memory ratios of two `mpipemoe bench` records of the same grid
(B over A), matched by (engine, model, tokens, routing, n, strategy, chosen_by):

    python3 tools/compare_bench.py results/bench-h200.json results/bench-h200-refactor-ab/bench-h200-after-refactor.json
"""
from __future__ import annotations

import json
import statistics
import sys


def _points(path: str) -> dict:
    return {(r["engine"], r["model"], r["tokens"], r["routing"], r["partitions"], r["strategy"], r.get("chosen_by")): r
            for r in json.load(open(path))["records"]}


def main(before: str, after: str) -> None:
    a, b = _points(before), _points(after)
    shared = [k for k in b if k in a]
    times = [b[k]["fwd_bwd_ms"] / a[k]["fwd_bwd_ms"] for k in shared]
    memory = [b[k]["peak_memory_bytes"] / a[k]["peak_memory_bytes"] for k in shared if a[k]["peak_memory_bytes"]]
    print(f"{len(shared)} points in both; time B/A median {statistics.median(times):.3f} "
          f"({min(times):.2f}-{max(times):.2f}), {sum(abs(t - 1) <= 0.05 for t in times)} within 5%")
    if memory:
        print(f"peak memory B/A median {statistics.median(memory):.4f} ({min(memory):.3f}-{max(memory):.3f})")


if __name__ == "__main__":
    main(*sys.argv[1:3])
