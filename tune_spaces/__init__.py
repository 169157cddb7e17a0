"""Ray Tune studies, one module per study (docs/design.md §6).

    mpipemoe sweep smoke            # 3 tiny CPU trials, a few minutes on 2 cores
    mpipemoe sweep granularity      # partitions x tokens per GPU x model (GPU cluster)
    mpipemoe sweep strategy         # memory-reuse strategy x model x tokens (GPU cluster)
    mpipemoe sweep engines          # engine x model x tokens: MPipeMoE against the baselines

Each study module gives:

- ``DESCRIPTION``: one line for ``--help`` and the MLflow parent run.
- ``param_space() -> dict``: the Tune param space. Keys are fields of
  ``app.jobs.TrainJob`` (preset, engine, steps, num_workers, batch_size,
  seq_len, partitions, strategy, ...); every trial is one Ray Train run of the
  training application built from them. ``num_workers`` is a constant per study:
  ``app.sweep`` sizes the concurrency from it and the cluster's resources.
- ``tune_config(*, num_samples, max_concurrent_trials) -> ray.tune.TuneConfig``.

Tokens per GPU in a MoE layer are ``batch_size * seq_len`` (each worker's local
batch); the GPU studies cover the paper's 4k-32k tokens per GPU.
"""
from __future__ import annotations

import importlib
from types import ModuleType

STUDIES = ("smoke", "granularity", "strategy", "engines")

# Every study ranks trials by training throughput (reported by app.jobs.run_job).
METRIC = "tokens_per_s"
MODE = "max"
# A study of model quality ranks them by the validation loss at the trial's last step
# (run_job's summary, when the data has a validation split: docs/training.md).
VAL_METRIC = "final_val_loss"
VAL_MODE = "min"


def load(name: str) -> ModuleType:
    """The study module ``tune_spaces.<name>``; raises with the valid names otherwise."""
    if name not in STUDIES:
        raise ValueError(f"unknown study {name!r}: choose one of {', '.join(STUDIES)}")
    return importlib.import_module(f"{__name__}.{name}")


def tune_config(*, num_samples: int = 1, max_concurrent_trials: int | None = None):
    """The TuneConfig shared by the studies: grid search, ranked by tokens/s."""
    from ray import tune

    if num_samples < 1:
        raise ValueError(f"num_samples={num_samples!r} is invalid: give an integer >= 1")
    return tune.TuneConfig(metric=METRIC, mode=MODE, num_samples=num_samples,
                           max_concurrent_trials=max_concurrent_trials)
