"""A/B of the CPU threads of gloo rank processes (workers/distributed.py cpu_threads_per_process):
the first three scenarios of the engine reference matrix (float64, every engine) on 4 ranks,
with torch's default threads in each rank and with the rank's share of the cores, twice each,
interleaved (a slow spell of the machine falls on both).

    python3 tools/rank_threads_ab.py          # prints each run's wall time

On the 2-core CI machine (2026-12-06, commit cce253a), alone: default 21.9 and 22.6 s, the
share (1 thread) 9.3 and 10.1 s; with a test suite running beside it: 31.8 and 34.5 s against
15.6 and 13.9 s (the figures in cpu_threads_per_process's docstring).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tests/ and workers/

from tests.distributed import run_on_ranks  # noqa: E402
from tests.engine_cases import ENGINES, SCENARIOS, check_layouts  # noqa: E402
from workers.distributed import cpu_threads_per_process  # noqa: E402

RANKS = 4


def _with_threads(rank: int, world_size: int, threads: int | None, *args):
    """check_layouts with ``threads`` intra-op threads (None: torch's default, every core;
    run_on_ranks set the share before this runs)."""
    torch.set_num_threads(threads if threads is not None else cpu_threads_per_process(1))  # 1 process: every core
    return check_layouts(rank, world_size, *args)


def main() -> None:
    scenarios = [s.name for s in SCENARIOS][:3]
    for threads in (None, cpu_threads_per_process(RANKS)) * 2:
        started = time.monotonic()
        run_on_ranks(RANKS, _with_threads, threads, scenarios, ENGINES, [(torch.float64, None)], timeout=1200)
        label = "default (every core)" if threads is None else f"{threads} thread(s), the share"
        print(f"{RANKS} ranks, {label}: {time.monotonic() - started:.1f} s", flush=True)


if __name__ == "__main__":
    main()
