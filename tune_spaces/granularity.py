"""Granularity study: pipeline partitions n x tokens per GPU x model (docs/design.md §2, §7).

    mpipemoe sweep granularity --address auto --storage-path /mnt/shared/ray_results

Fixed n from 1 to 8 plus "auto" (the online search), for each paper model and
4k-32k tokens per GPU (batch 8-64 x 512). ``strategy`` is "none" so only the
pipelining varies; the report plots the best n against tokens, marks any
violation of the assumed monotonicity, and compares "auto" with the grid best.
One node (8 GPUs) per trial: eight trials at once on the 8-node cluster.
"""
from __future__ import annotations

from ray import tune

DESCRIPTION = "partitions {1,2,4,8,auto} x tokens/GPU {4k..32k} x {gpt-s, gpt-xl, bert-l}, 8 GPUs per trial"


def param_space(search: str = "grid") -> dict:
    return {
        "engine": "mpipemoe",
        "preset": tune.grid_search(["gpt-s", "gpt-xl", "bert-l"]),
        "batch_size": tune.grid_search([8, 16, 32, 64]),  # x seq_len 512 = 4k..32k tokens per GPU
        "seq_len": 512,          # bert-l's maximum; the same for every model
        "partitions": tune.grid_search([1, 2, 4, 8, "auto"]),
        "strategy": "none",
        "steps": 30,          # the first steps warm up and run the online search
        "num_workers": 8,
        "use_gpu": True,
    }

