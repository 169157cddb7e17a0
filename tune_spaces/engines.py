"""Engines study: MPipeMoE against the FastMoE- and FasterMoE-style baselines (docs/design.md §1, §7).

    mpipemoe sweep engines --address auto --storage-path /mnt/shared/ray_results

Each engine at its own automatic settings, for each paper model and 4k-32k
tokens per GPU. The report computes speedup and memory ratios per (model, tokens).
"""
from __future__ import annotations

from ray import tune

DESCRIPTION = "engine {mpipemoe, fastmoe, fastermoe} x tokens/GPU {4k..32k} x {gpt-s, gpt-xl, bert-l}, 8 workers per trial"


def param_space(search: str = "grid") -> dict:
    return {
        "engine": tune.grid_search(["mpipemoe", "fastmoe", "fastermoe"]),
        "preset": tune.grid_search(["gpt-s", "gpt-xl", "bert-l"]),
        "batch_size": tune.grid_search([8, 16, 32, 64]),  # x seq_len 512 = 4k..32k tokens per GPU
        "seq_len": 512,          # bert-l's maximum; the same for every model
        "partitions": "auto",
        "strategy": "auto",
        "steps": 30,
        "num_workers": 8,
        "checkpoint_every": 0,
    }

