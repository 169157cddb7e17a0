"""Strategy study: memory strategy x tokens per GPU, n chosen online (docs/design.md §2, §5, §7).

    mpipemoe sweep strategy --address auto --storage-path /mnt/shared/ray_results

"none" (keep everything), S1-S4 and "auto" (the performance model's choice) at 4k-32k
tokens per GPU on one model, partitions "auto": how the fastest strategy and its memory
move with the tokens. Each trial records the n the online search settled on (the
ranking's ``chosen`` column); ``granularity`` sweeps n and strategy jointly.
"""
from __future__ import annotations

from ray import tune

from moe_engine.config import STRATEGIES

DESCRIPTION = "strategy {none,S1..S4,auto} x tokens/GPU {4k..32k} on one model, n chosen online"
NUM_SAMPLES = 2


def param_space(search: str = "grid") -> dict:
    return {
        "engine": "mpipemoe",
        "preset": "gpt-xl",
        "batch_size": tune.grid_search([8, 16, 32, 64]),  # x seq_len 512 = 4k..32k tokens per GPU
        "seq_len": 512,
        "partitions": "auto",
        "strategy": tune.grid_search([*STRATEGIES, "auto"]),
        "steps": 30,
        "num_workers": 8,
        "checkpoint_every": 0,
    }
