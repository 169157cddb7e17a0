"""Smoke study: the three engines on a tiny model, a few steps each, CPU-sized.

    mpipemoe sweep smoke && mpipemoe report

Three trials of 2 gloo workers; on a 2-core machine the sweep runs them one at a
time and finishes in a few minutes. The report then has a baseline comparison.
"""
from __future__ import annotations

from ray import tune

DESCRIPTION = "tiny-gpt, 2 workers, 4 steps: mpipemoe vs fastmoe vs fastermoe (CPU-sized)"


def param_space(search: str = "grid") -> dict:
    return {
        "engine": tune.grid_search(["mpipemoe", "fastmoe", "fastermoe"]),
        "preset": "tiny-gpt",
        "steps": 4,           # enough for a loss and a throughput, not a curve
        "num_workers": 2,     # two ranks: the All-to-All is real
        "batch_size": 4,
        "seq_len": 64,        # 256 tokens per worker
        "partitions": 2,
        "strategy": "auto",
    }

