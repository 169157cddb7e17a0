"""Where a traced step waits for its host: the device's busy time against the host's pass, and
the longest idle gaps with the host operation that was running in each.

Reads the traces `mpipemoe bench --step --trace DIR` (or the layer bench's) writes, one per
setting, and accounts the last `mpipemoe.pass` range of each:

    mpipemoe bench --step --emulate 8x8 --experts 64 --network dgx-h200 --model gpt-s --layers 4 \\
        --tokens 16384 --micro-batches 1 --partitions 1 --strategies none --no-grid --tracking-uri none \\
        --trace traces
    python3 tools/trace_gaps.py traces --gaps 8

Per trace it prints the host pass (ms), the union of the device's kernels, copies and memsets
launched in it (busy ms), the idle gaps' total, the launches, and the longest gaps, each with
the innermost host operations that covered its start. A step whose device is idle for much of
its pass is host-bound: a faster engine will not show in it until the host is.
"""
from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

PASS_MARK = "mpipemoe.pass"
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_RANGES = ("cpu_op", "user_annotation")
LAUNCHES = ("cuda_runtime", "cuda_driver")


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X"]


def account(events: list[dict], gaps: int = 8) -> dict:
    """The last pass of one trace: host_ms, busy_ms, idle_ms, launches and the longest gaps
    (ms, the device work after it, the host operations covering its start)."""
    passes = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                    if e.get("name") == PASS_MARK and e.get("cat") in HOST_RANGES)
    if not passes:
        raise ValueError(f"no {PASS_MARK!r} host range in the trace: was it written by `mpipemoe bench --trace`?")
    start, end = passes[-1]
    work = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"]) for e in events
                  if e.get("cat") in DEVICE_WORK and float(e["ts"]) >= start)
    if not work:
        raise ValueError("no device work after the last pass began: a CPU trace has none")
    busy_us, idle = 0.0, []
    first, last = work[0][0], work[0][1]
    for begin, finish, name in work[1:]:
        if begin > last:
            busy_us += last - first
            idle.append((begin - last, last, name))
            first = begin
        last = max(last, finish)
    busy_us += last - first
    host = [e for e in events if e.get("cat") in HOST_RANGES and start <= float(e["ts"]) <= last]

    def covering(at: float) -> list[str]:
        inside = [e for e in host if float(e["ts"]) <= at <= float(e["ts"]) + float(e["dur"])]
        return [e["name"] for e in sorted(inside, key=lambda e: float(e["dur"]))[:3]]

    return {"host_ms": (end - start) / 1e3, "busy_ms": busy_us / 1e3, "idle_ms": sum(g for g, _, _ in idle) / 1e3,
            "launches": sum(1 for e in events if e.get("cat") in LAUNCHES and "Launch" in e["name"]
                            and start <= float(e["ts"]) <= end),
            "gaps": [{"ms": g / 1e3, "before": name, "host": covering(at)}
                     for g, at, name in sorted(idle, reverse=True)[:gaps]]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", type=Path, help="a trace file, or a folder of them (*.json, *.json.gz)")
    parser.add_argument("--gaps", type=int, default=8, help="longest idle gaps to list per trace (default 8)")
    args = parser.parse_args(argv)
    paths = sorted(args.traces.glob("*.json*")) if args.traces.is_dir() else [args.traces]
    if not paths:
        parser.error(f"no traces (*.json, *.json.gz) in {args.traces}")
    for path in paths:
        found = account(load(path), args.gaps)
        print(f"{path.name}: host pass {found['host_ms']:.2f} ms, device busy {found['busy_ms']:.2f} ms, "
              f"idle {found['idle_ms']:.2f} ms, {found['launches']} launches")
        for gap in found["gaps"]:
            print(f"  {gap['ms']:.3f} ms idle before {gap['before'][:48]}; host in {' < '.join(gap['host'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
