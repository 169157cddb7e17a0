"""Strategy study: memory-reuse strategy x model x tokens per GPU (docs/design.md §2, §5, §7).

    mpipemoe sweep strategy --address auto --storage-path /mnt/shared/ray_results

"none" (keep everything), S1-S4 and "auto" (the performance model's choice) for
each paper model and 4k-32k tokens per GPU; partitions "auto". The report shows
time and peak memory per strategy and whether "auto" picked the fastest.
"""
from __future__ import annotations

from ray import tune

DESCRIPTION = "strategy {none,S1..S4,auto} x tokens/GPU {4k..32k} x {gpt-s, gpt-xl, bert-l}, 8 GPUs per trial"


def param_space(search: str = "grid") -> dict:
    return {
        "engine": "mpipemoe",
        "preset": tune.grid_search(["gpt-s", "gpt-xl", "bert-l"]),
        "batch_size": tune.grid_search([8, 16, 32, 64]),  # x seq_len 512 = 4k..32k tokens per GPU
        "seq_len": 512,          # bert-l's maximum; the same for every model
        "partitions": "auto",
        "strategy": tune.grid_search(["none", "S1", "S2", "S3", "S4", "auto"]),
        "steps": 30,
        "num_workers": 8,
        "use_gpu": True,
    }

