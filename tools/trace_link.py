"""What the emulated link waited for in a traced step: the link busy with no compute beside it
(and whether that compute was already launched, waiting on a dependency, or not yet launched by
the host), and how long the link sat idle while a transfer of the other host thread (the other
micro-batch's lane) queued behind it was ready — the head-of-line blocking of the one link
stream that every transfer shares (docs/emulation.md, "The training step on the H200").

Reads the traces `mpipemoe bench --step --trace DIR` writes and accounts the last
`mpipemoe.pass` range of each:

    python3 tools/trace_link.py results/traces/step-gpt_xl-4-32768-k2-uniform-*.json.gz

The link stream is the one whose kernels are the emulator's waits (`spin_*`). A transfer's
readiness is the end of the last compute kernel its host thread launched before it (its data);
a link gap counts as head-of-line blocking when one of the next five transfers in the link's
order, from the other thread, was launched and ready before the gap ended. An approximation:
the host and device clocks of a trace are one timeline, and a transfer's data may come from
earlier kernels than its thread's last.
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tools/

from tools.trace_gaps import DEVICE_WORK, LAUNCHES, PASS_MARK, load  # noqa: E402

LOOK_AHEAD = 5  # transfers after a gap checked for a ready one of the other thread


def link_account(events: list[dict]) -> dict:
    """The last pass of one trace: link_ms, exposed_ms (link busy, no compute), of it
    dependency_ms (compute launched, waiting) and host_ms (nothing launched), link_idle_ms
    (between transfers) and head_of_line_ms (of it, another thread's transfer was ready)."""
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCHES and "correlation" in e.get("args", {})}
    passes = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                    if e.get("name") == PASS_MARK and e.get("cat") == "user_annotation")
    if not passes:
        raise ValueError(f"no {PASS_MARK} range: not a trace of `mpipemoe bench --trace`")
    start, end = passes[-1]
    device = [e for e in events if e.get("cat") in DEVICE_WORK and e.get("args", {}).get("correlation") in launches
              and start <= float(launches[e["args"]["correlation"]]["ts"]) <= end]
    waits = Counter(e["args"]["stream"] for e in device if "spin" in e["name"])
    if not waits:
        raise ValueError("no emulated link waits (spin kernels) in the last pass")
    link_stream = waits.most_common(1)[0][0]
    link = sorted((e for e in device if e["args"]["stream"] == link_stream), key=lambda e: float(e["ts"]))
    compute = [e for e in device if e["args"]["stream"] != link_stream]

    def launched(e: dict) -> float:
        return float(launches[e["args"]["correlation"]]["ts"])

    def thread(e: dict):
        return launches[e["args"]["correlation"]].get("tid")

    def finish(e: dict) -> float:
        return float(e["ts"]) + float(e["dur"])

    exposed = _link_without_compute(link, compute)
    dependency = sum(b - a for a, b in exposed
                     if any(launched(e) <= (a + b) / 2 <= float(e["ts"]) for e in compute))
    idle = blocked = 0.0
    for index in range(1, len(link)):
        gap_start, gap_end = finish(link[index - 1]), float(link[index]["ts"])
        if gap_end <= gap_start:
            continue
        idle += gap_end - gap_start
        for later in link[index + 1:index + 1 + LOOK_AHEAD]:
            if thread(later) == thread(link[index]) or launched(later) >= gap_end:
                continue
            ready = max((finish(e) for e in compute if thread(e) == thread(later) and launched(e) < launched(later)),
                        default=gap_start)
            if ready < gap_end:
                blocked += gap_end - max(gap_start, ready, launched(later))
                break
    total = sum(b - a for a, b in exposed)
    return {"pass_ms": (end - start) / 1e3, "link_ms": sum(float(e["dur"]) for e in link) / 1e3,
            "exposed_ms": total / 1e3, "dependency_ms": dependency / 1e3, "host_ms": (total - dependency) / 1e3,
            "link_idle_ms": idle / 1e3, "head_of_line_ms": blocked / 1e3}


def _link_without_compute(link: list[dict], compute: list[dict]) -> list[tuple[float, float]]:
    """Intervals (µs) where a link wait runs and no compute kernel, copy or memset does."""
    edges = [(float(e["ts"]), 1, "compute") for e in compute] + \
            [(float(e["ts"]) + float(e["dur"]), -1, "compute") for e in compute] + \
            [(float(e["ts"]), 1, "link") for e in link] + [(float(e["ts"]) + float(e["dur"]), -1, "link") for e in link]
    busy = {"compute": 0, "link": 0}
    intervals, last = [], None
    for at, step, kind in sorted(edges):
        if last is not None and at > last and busy["link"] > 0 and busy["compute"] == 0:
            intervals.append((last, at))
        busy[kind] += step
        last = at
    return intervals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", type=Path, help="trace files (.json or .json.gz)")
    args = parser.parse_args(argv)
    print("| trace | pass ms | link ms | link, no compute ms | of it waiting on a dependency | of it the host | "
          "link idle ms | of it head-of-line ms |")
    print("|---|---|---|---|---|---|---|---|")
    for path in args.traces:
        a = link_account(load(path))
        print(f"| {path.name} | {a['pass_ms']:.1f} | {a['link_ms']:.1f} | {a['exposed_ms']:.1f} | "
              f"{a['dependency_ms']:.1f} | {a['host_ms']:.1f} | {a['link_idle_ms']:.1f} | {a['head_of_line_ms']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
