"""Learning-rate study: AdamW's peak lr on tiny-gpt, ranked by loss, CPU-sized.

    mpipemoe sweep lr --search optuna --scheduler asha    # 12 trials, ASHA prunes the bad ones

One worker per trial (it holds all 4 experts): two trials run at once on 2 cores
(``--max-concurrent 2``). Every trial reports each step's loss to Tune (the validation loss
where the training jobs evaluate one, tune_spaces.loss_metric); ASHA stops trials whose loss
lags at 10 and 30 of the 40 steps. ``--search grid`` (the default) runs the fixed grid of 7 lrs
once instead.
"""
from __future__ import annotations

from ray import tune

import tune_spaces

DESCRIPTION = "tiny-gpt, 1 worker, 40 steps: AdamW peak lr in [1e-4, 1e-1] (log scale), ranked by loss"
SEARCHES = ("grid", "random", "optuna")
RANK_BY = "loss"
NUM_SAMPLES = {"grid": 1, "random": 12, "optuna": 12}  # the grid's 7 points once; 12 draws otherwise
LR_RANGE = (1e-4, 1e-1)
LR_GRID = [1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1]


def param_space(search: str = "grid") -> dict:
    return {
        "lr": tune.grid_search(LR_GRID) if search == "grid" else tune.loguniform(*LR_RANGE),
        "preset": "tiny-gpt",
        "engine": "mpipemoe",
        "steps": 40,           # ASHA rungs at 10 and 30 steps
        "warmup_steps": 2,
        "num_workers": 1,
        "batch_size": 4,
        "seq_len": 64,
        "partitions": 1,
        "strategy": "none",
        "checkpoint_every": 0,  # a trial is short; no checkpoints to write
        "eval_every": 10,       # a validation loss at each ASHA rung (10, 30) and the end
        "eval_batches": 16,     # 16 x 4 x 64 = 4,096 validation tokens per rung (docs/sweeps.md: at 512 the rank flipped)
    }

