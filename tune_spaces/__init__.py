"""Ray Tune studies, one module per study (docs/design.md §6).

    mpipemoe sweep smoke            # 3 tiny CPU trials, a few minutes on 2 cores
    mpipemoe sweep lr --search optuna --scheduler asha   # 12 tiny CPU trials, pruned by ASHA
    mpipemoe sweep granularity      # partitions x tokens per GPU x model (GPU cluster)
    mpipemoe sweep strategy         # memory-reuse strategy x model x tokens (GPU cluster)
    mpipemoe sweep engines          # engine x model x tokens: MPipeMoE against the baselines

Each study module gives:

- ``DESCRIPTION``: one line for ``--help`` and the MLflow parent run.
- ``param_space(search="grid") -> dict``: the Tune param space for that search algorithm
  (a grid for "grid", distributions for "random"/"optuna"). Keys are fields of
  ``app.jobs.TrainJob`` (preset, engine, steps, num_workers, batch_size,
  seq_len, partitions, strategy, lr, ...); every trial is one Ray Train run of the
  training application built from them. ``num_workers`` and ``steps`` are constants per
  study: ``app.sweep`` sizes the concurrency and ASHA's budget from them.
- ``SEARCHES`` (optional, default ``GRID_SEARCHES``): the search algorithms its space
  supports (a grid of categorical choices has nothing for Optuna to model).
- ``RANK_BY`` (optional): "throughput" (``tokens_per_s``, max; the default) or "loss"
  (``loss_metric``, min).
- ``NUM_SAMPLES`` (optional, default 1): trials drawn when ``--num-samples`` is not given
  (a grid: its repeats).

Tokens per GPU in a MoE layer are ``batch_size * seq_len`` (each worker's local
batch); the GPU studies cover the paper's 4k-32k tokens per GPU.
"""
from __future__ import annotations

import importlib
from types import ModuleType

STUDIES = ("smoke", "lr", "granularity", "strategy", "engines")
SEARCHES = ("grid", "random", "optuna")
GRID_SEARCHES = ("grid", "random")
SCHEDULERS = ("fifo", "asha")

# Throughput studies rank trials by training throughput (reported by app.jobs.run_job).
METRIC = "tokens_per_s"
MODE = "max"
# Loss studies rank by the validation loss where the training job evaluates one (the step
# metrics then carry VAL_LOSS every EVAL_FIELD steps), else by the training loss of each step.
VAL_LOSS = "val_loss"
TRAIN_LOSS = "loss"
EVAL_FIELD = "eval_every"
# ASHA: a trial reaches rung r after GRACE_FRACTION * steps * REDUCTION**r steps; the top
# 1/REDUCTION of the trials at a rung go on.
GRACE_FRACTION = 0.25
REDUCTION = 3


def load(name: str) -> ModuleType:
    """The study module ``tune_spaces.<name>``; raises with the valid names otherwise."""
    if name not in STUDIES:
        raise ValueError(f"unknown study {name!r}: choose one of {', '.join(STUDIES)}")
    return importlib.import_module(f"{__name__}.{name}")


def loss_metric(job_fields: dict) -> str:
    """The loss a study ranks by: VAL_LOSS when its training jobs evaluate (EVAL_FIELD above
    0, or not set: ``app.jobs.TrainJob`` evaluates by default), else TRAIN_LOSS."""
    every = job_fields.get(EVAL_FIELD, 1)
    return VAL_LOSS if isinstance(every, int) and every > 0 else TRAIN_LOSS


def ranking(module: ModuleType, space: dict) -> tuple[str, str]:
    """(metric, mode) of a study module."""
    if getattr(module, "RANK_BY", "throughput") == "loss":
        return loss_metric(space), "min"
    return METRIC, MODE


def tune_config(*, num_samples: int = 1, max_concurrent_trials: int | None = None, metric: str = METRIC,
                mode: str = MODE, search: str = "grid", scheduler: str = "fifo", steps: int | None = None,
                seed: int = 0):
    """The TuneConfig of a study: ``search`` (grid and random: Tune's variant generator over
    the param space; optuna: ``OptunaSearch``, TPE seeded by ``seed``), ``scheduler`` (fifo:
    every trial runs to the end; asha: ``ASHAScheduler`` on ``metric`` over the trials' step
    reports, budget ``steps``), ranked by ``metric``/``mode``.

    Trials reuse their Tune actors (``reuse_actors``): a trial process that has finished one
    trial runs the next, with torch, MLflow and ``app.jobs`` already imported (a new trial
    process costs seconds of CPU before its Train job starts; app.sweep.stopping_trainable
    waits for the previous trial's job to stop first)."""
    from ray import tune

    if num_samples < 1:
        raise ValueError(f"num_samples={num_samples!r} is invalid: give an integer >= 1")
    if search not in SEARCHES:
        raise ValueError(f"search={search!r} is invalid: choose one of {', '.join(SEARCHES)}")
    if scheduler not in SCHEDULERS:
        raise ValueError(f"scheduler={scheduler!r} is invalid: choose one of {', '.join(SCHEDULERS)}")
    search_alg = None
    if search == "optuna":
        try:
            from ray.tune.search.optuna import OptunaSearch
            import optuna
        except ImportError as error:
            raise ValueError("--search optuna needs optuna: pip install 'mpipemoe[ray]' (it pins optuna)") from error
        search_alg = OptunaSearch(sampler=optuna.samplers.TPESampler(seed=seed))
    trial_scheduler = None
    if scheduler == "asha":
        if not steps:
            raise ValueError("--scheduler asha needs the study's steps (a constant of its param space)")
        from ray.tune.schedulers import ASHAScheduler

        # max_t one past the last step: a trial reaching max_t is stopped at that report, and
        # the trial's end-of-run summary (step = steps) must still be reported after it
        trial_scheduler = ASHAScheduler(time_attr="step", max_t=steps + 1, reduction_factor=REDUCTION,
                                        grace_period=max(1, int(steps * GRACE_FRACTION)))
    return tune.TuneConfig(metric=metric, mode=mode, num_samples=num_samples,
                           max_concurrent_trials=max_concurrent_trials, search_alg=search_alg,
                           scheduler=trial_scheduler, reuse_actors=True)
