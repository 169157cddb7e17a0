"""Which host code the device waits for: the step bench's traces recorded with Python stacks,
then each trace's idle gaps summed by the innermost repository frame running when each began.

    python3 tools/trace_stacks.py bench --step --emulate 8x8 --experts 64 --network dgx-h200 \\
        --model gpt-s --layers 4 --tokens 16384 --micro-batches 1 --partitions 1 --strategies none \\
        --no-grid --tracking-uri none --trace traces

Runs `mpipemoe` with the arguments given (they must hold `--trace DIR`) with every
torch.profiler profile taking `with_stack=True` (slower: the host times grow, the attribution
holds), then prints per trace the pass, its idle total and gaps, and the frames that cover the
most idle time (tools/trace_gaps.py accounts the same traces without stacks). CUDA only.
"""
from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import torch.profiler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's app/ and tools/

from tools.trace_gaps import DEVICE_WORK, HOST_RANGES, PASS_MARK, load  # noqa: E402

REPO_FOLDERS = ("moe_engine/", "moe_sim/", "lm/", "app/", "workers/")


def _profile_with_stacks() -> None:
    """Every torch.profiler.profile made from here on records Python stacks."""
    plain_init = torch.profiler.profile.__init__

    def init(self, *args, **kwargs):
        plain_init(self, *args, **{**kwargs, "with_stack": True})

    torch.profiler.profile.__init__ = init  # type: ignore[method-assign]


def idle_by_frame(events: list[dict]) -> tuple[float, float, int, list[tuple[str, float, int]]]:
    """(pass ms, idle ms, gaps, [(frame, idle ms, gaps)] most idle first) of the last pass."""
    start, end = max((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                     if e.get("name") == PASS_MARK and e.get("cat") in HOST_RANGES)
    work = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                  if e.get("cat") in DEVICE_WORK and float(e["ts"]) >= start)
    frames = [e for e in events if e.get("cat") == "python_function" and start <= float(e["ts"]) <= end]
    by_frame: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    last = work[0][1]
    for begin, finish in work[1:]:
        if begin > last:
            covering = sorted((e for e in frames if float(e["ts"]) <= last <= float(e["ts"]) + float(e["dur"])),
                              key=lambda e: float(e["dur"]))
            ours = [e["name"] for e in covering if any(f in e["name"] for f in REPO_FOLDERS)]
            entry = by_frame[ours[0] if ours else "(no repository frame)"]
            entry[0] += begin - last
            entry[1] += 1
        last = max(last, finish)
    ranked = sorted(((name, us / 1e3, int(n)) for name, (us, n) in by_frame.items()), key=lambda r: -r[1])
    return (end - start) / 1e3, sum(r[1] for r in ranked), sum(r[2] for r in ranked), ranked


def main(argv: list[str]) -> int:
    if "--trace" not in argv:
        raise SystemExit("give the mpipemoe arguments with --trace DIR (see this file's docstring)")
    _profile_with_stacks()
    from app.cli import main as mpipemoe

    status = mpipemoe(argv)
    for path in sorted(Path(argv[argv.index("--trace") + 1]).glob("*.json*")):
        pass_ms, idle_ms, gaps, ranked = idle_by_frame(load(path))
        print(f"{path.name}: pass {pass_ms:.1f} ms, idle {idle_ms:.1f} ms in {gaps} gaps")
        for name, ms, n in ranked[:12]:
            print(f"  {ms:6.2f} ms in {n:4d} gaps: {name}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
