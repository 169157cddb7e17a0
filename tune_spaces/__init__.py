"""Ray Tune studies, one module per study (docs/design.md §6).

    mpipemoe sweep smoke            # 3 tiny CPU trials, a few minutes on 2 cores
    mpipemoe sweep lr --search optuna --scheduler asha   # 12 tiny CPU trials, pruned by ASHA
    mpipemoe sweep granularity      # partitions n x strategy jointly, one model (GPU cluster)
    mpipemoe sweep granularity --preset tiny-gpt --num-workers 2 --steps 6   # the same, on CPU
    mpipemoe sweep strategy         # n x strategy x tokens per GPU (GPU cluster)
    mpipemoe sweep --space my_space.toml   # a study of your own (Python, TOML or YAML file)
    mpipemoe sweep engines          # engine x model x tokens: MPipeMoE against the baselines

Each study module gives:

- ``DESCRIPTION``: one line for ``--help`` and the MLflow parent run.
- ``param_space(search="grid") -> dict``: the Tune param space for that search algorithm
  (a grid for "grid", distributions for "random"/"optuna"). Keys are fields of
  ``app.jobs.job.TrainJob`` (preset, engine, steps, num_workers, batch_size,
  seq_len, partitions, strategy, lr, ...); every trial is one Ray Train run of the
  training application built from them. ``num_workers`` and ``steps`` are constants per
  study: ``app.jobs.sweep`` sizes the concurrency and ASHA's budget from them.
- ``SEARCHES`` (optional, default ``GRID_SEARCHES``): the search algorithms its space
  supports (a grid of categorical choices has nothing for Optuna to model).
- ``RANK_BY`` (optional): "throughput" (``tokens_per_s``, max; the default) or "loss"
  (``loss_metric``, min).
- ``NUM_SAMPLES`` (optional, default 1): trials drawn when ``--num-samples`` is not given
  (a grid: its repeats); a dict by search (``{"grid": 1, "optuna": 12}``) where a search
  that samples draws more than a grid repeats (``num_samples``).
- ``METRIC`` and ``MODE`` (optional): rank by any number the trials report (``METRICS``: a
  step metric or a summary's, e.g. ``final_val_loss``), instead of ``RANK_BY``.
- ``SEARCH``, ``SCHEDULER`` (optional): the defaults of ``--search`` and ``--scheduler``.

A study may also be a file outside the package (``load(path)``): a Python file with the
same names, or a TOML/YAML file (``load_data_file``, docs/sweeps.md "Your own space").

Tokens per GPU in a MoE layer are ``batch_size * seq_len`` (each worker's local
batch); the GPU studies cover the paper's 4k-32k tokens per GPU.
"""
from __future__ import annotations

import importlib
import importlib.util
import math
from pathlib import Path
from types import ModuleType, SimpleNamespace

STUDIES = ("smoke", "lr", "granularity", "strategy", "engines")
SEARCHES = ("grid", "random", "optuna")
GRID_SEARCHES = ("grid", "random")
SCHEDULERS = ("fifo", "asha")

# Throughput studies rank trials by training throughput (reported by app.jobs.launch.run_job).
METRIC = "tokens_per_s"
MODE = "max"
# Loss studies rank by the validation loss where the training job evaluates one (the step
# metrics then carry VAL_LOSS every EVAL_FIELD steps), else by the training loss of each step.
VAL_LOSS = "val_loss"
TRAIN_LOSS = "loss"
EVAL_FIELD = "eval_every"
# What a study may rank by (METRIC): the numbers every trial reports, each step (workers/loop.py)
# or in its final summary (app/jobs/progress.py summarize, app/jobs/launch.py run_job).
STEP_METRICS = ("loss", "lm_loss", "aux_loss", "lr", "grad_norm", "tokens_per_s", "step_time_s",
                "peak_memory_bytes", "model_tflops_per_s", "mfu", "tokens_seen", "val_loss", "val_ppl")
SUMMARY_METRICS = ("first_loss", "final_loss", "final_lm_loss", "final_aux_loss", "settled_peak_memory_bytes",
                   "final_val_loss", "final_val_ppl", "first_val_loss", "wall_time_s", "training_state_bytes")
METRICS = STEP_METRICS + SUMMARY_METRICS

# ASHA: a trial reaches rung r after GRACE_FRACTION * steps * REDUCTION**r steps; the top
# 1/REDUCTION of the trials at a rung go on.
GRACE_FRACTION = 0.25
REDUCTION = 3


DATA_SUFFIXES = (".toml", ".yaml", ".yml")
# A TOML/YAML space entry {kind: arguments} -> the Tune domain (``grid`` is a grid search).
DOMAINS = {"grid": "grid_search", "choice": "choice", "uniform": "uniform", "loguniform": "loguniform",
           "randint": "randint", "quniform": "quniform", "qloguniform": "qloguniform"}


def load(name: str) -> ModuleType | SimpleNamespace:
    """The study named ``name`` (module ``tune_spaces.<name>``), or the study in the file ``name``
    (``.py``: a module with the names above; ``.toml``/``.yaml``: ``load_data_file``); raises
    ValueError naming the valid names otherwise."""
    path = Path(name).expanduser()
    if path.suffix == ".py" or path.suffix in DATA_SUFFIXES:
        if not path.is_file():
            raise ValueError(f"--space {name}: no such file: give the path of a .py, .toml or .yaml study file")
        if path.suffix in DATA_SUFFIXES:
            return load_data_file(path)
        spec = importlib.util.spec_from_file_location(f"mpipemoe_space_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as error:  # the user's file: one line naming it, its line and the error
            raise ValueError(f"--space {name}: the study file failed to import{_where(error, path)}: "
                             f"{type(error).__name__}: {error}: fix the file (python {name} shows the "
                             f"traceback)") from error
        for needed in ("DESCRIPTION", "param_space"):
            if not hasattr(module, needed):
                raise ValueError(f"--space {name}: the file defines no {needed}: see docs/sweeps.md "
                                 f"\"Your own space\" (DESCRIPTION and param_space(search))")
        return module
    if name not in STUDIES:
        raise ValueError(f"unknown study {name!r}: choose one of {', '.join(STUDIES)}, or give a study file "
                         f"(--space my_space.toml)")
    return importlib.import_module(f"{__name__}.{name}")


def _where(error: BaseException, path: Path) -> str:
    """" (line N)" of the innermost frame of ``error`` in the file ``path`` (a syntax error's own
    line), or ""."""
    line = getattr(error, "lineno", None) if isinstance(error, SyntaxError) else None
    frame = error.__traceback__
    while frame is not None:
        if Path(frame.tb_frame.f_code.co_filename).resolve() == path.resolve():
            line = frame.tb_lineno
        frame = frame.tb_next
    return f" (line {line})" if line else ""


def num_samples(module, search: str) -> int:
    """A study's trials when ``--num-samples`` is not given: its ``NUM_SAMPLES`` (a number, or a
    dict by search; a search it does not name gets 1)."""
    samples = getattr(module, "NUM_SAMPLES", 1)
    return samples.get(search, 1) if isinstance(samples, dict) else samples


def study_name(name: str) -> str:
    """The default name of a study: a built-in study's name, a file's stem."""
    return Path(name).stem if name not in STUDIES else name


def _domain(key: str, value, where: str):
    """A TOML/YAML space entry as a Tune domain: a constant stays; ``{grid = [...]}``,
    ``{choice = [...]}``, ``{loguniform = [low, high]}``, ... become Tune's."""
    from ray import tune

    if not isinstance(value, dict):
        return value
    if len(value) != 1 or next(iter(value)) not in DOMAINS:
        raise ValueError(f"{where}: space.{key} = {value!r} is invalid: give a constant or one of "
                         f"{', '.join(f'{{{k} = [...]}}' for k in DOMAINS)}")
    kind, arguments = next(iter(value.items()))
    if not isinstance(arguments, list) or not arguments:
        raise ValueError(f"{where}: space.{key}.{kind} = {arguments!r} is invalid: give a non-empty list")
    if kind in ("grid", "choice"):
        return getattr(tune, DOMAINS[kind])(arguments)
    return getattr(tune, DOMAINS[kind])(*arguments)


def load_data_file(path: Path) -> SimpleNamespace:
    """A study from a TOML or YAML file: top-level ``description``, optional ``metric``/``mode``
    (or ``rank_by``), ``search``, ``scheduler``, ``num_samples``, and a ``space`` table whose
    keys are ``mpipemoe train`` options (TrainJob fields) with constants or domains."""
    import yaml  # type: ignore[import-untyped]  # the ray extra pins pyyaml

    try:
        if path.suffix == ".toml":
            try:  # the standard library's from Python 3.11
                toml = importlib.import_module("tomllib")
            except ImportError as error:
                raise ValueError(f"--space {path}: TOML study files need Python 3.11 or later (tomllib): "
                                 f"write the study as YAML (.yaml) instead") from error
            data = toml.loads(path.read_text())
        else:
            data = yaml.safe_load(path.read_text())
    except (ValueError, yaml.YAMLError) as error:  # tomllib.TOMLDecodeError is a ValueError
        if str(error).startswith("--space"):
            raise
        raise ValueError(f"--space {path}: not valid {path.suffix[1:].upper()}: {error}") from error
    if not isinstance(data, dict) or not isinstance(data.get("space"), dict) or not data["space"]:
        raise ValueError(f"--space {path}: the file has no [space] table: give one with train options as keys")
    known = {"description", "metric", "mode", "rank_by", "search", "scheduler", "num_samples", "space"}
    if unknown := sorted(set(data) - known):
        raise ValueError(f"--space {path}: unknown top-level key(s) {unknown}: use {', '.join(sorted(known))}")
    where = f"--space {path}"
    entries = dict(data["space"])
    for key, value in entries.items():  # checked now; param_space builds fresh domains per call
        _domain(key, value, where)
    searchable = any(isinstance(v, dict) and next(iter(v)) not in ("grid",) for v in entries.values())
    samples = data.get("num_samples", 1)
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"{where}: num_samples = {samples!r} is invalid: give an integer >= 1 (the trials drawn; "
                         f"a grid: its repeats)")
    for key in ("metric", "mode", "rank_by", "search", "scheduler", "description"):
        if key in data and not isinstance(data[key], str):
            raise ValueError(f"{where}: {key} = {data[key]!r} is invalid: give a string")
    study = SimpleNamespace(
        DESCRIPTION=str(data.get("description") or f"study file {path.name}"),
        param_space=lambda search="grid": {k: _domain(k, v, where) for k, v in entries.items()},
        SEARCHES=SEARCHES if searchable else GRID_SEARCHES,
        NUM_SAMPLES=samples,
        SEARCH=data.get("search"), SCHEDULER=data.get("scheduler"))
    if "rank_by" in data:
        study.RANK_BY = data["rank_by"]
    if "metric" in data:
        study.METRIC, study.MODE = data["metric"], data.get("mode", "min")
    return study


def loss_metric(job_fields: dict) -> str:
    """The loss a study ranks by: VAL_LOSS when its training jobs evaluate (EVAL_FIELD above
    0, or not set: ``app.jobs.job.TrainJob`` evaluates by default), else TRAIN_LOSS."""
    every = job_fields.get(EVAL_FIELD, 1)
    return VAL_LOSS if isinstance(every, int) and every > 0 else TRAIN_LOSS


def ranking(module, space: dict) -> tuple[str, str]:
    """(metric, mode) of a study: its ``METRIC``/``MODE`` when set, else by ``RANK_BY``; raises
    ValueError for a metric the trials do not report (``METRICS``), a mode other than min or
    max, a ``RANK_BY`` other than throughput or loss."""
    if getattr(module, "METRIC", None):
        mode = getattr(module, "MODE", "min")
        if mode not in ("min", "max"):
            raise ValueError(f"mode={mode!r} is invalid: choose min or max")
        if module.METRIC not in METRICS:
            raise ValueError(f"metric={module.METRIC!r} is not a number the trials report: choose one of "
                             f"{', '.join(METRICS)}")
        return module.METRIC, mode
    rank_by = getattr(module, "RANK_BY", "throughput")
    if rank_by not in ("throughput", "loss"):
        raise ValueError(f"rank_by={rank_by!r} is invalid: choose throughput or loss (or give metric and mode)")
    if rank_by == "loss":
        return loss_metric(space), "min"
    return METRIC, MODE


def asha_rungs(steps: int) -> list[int]:
    """The steps at which ASHA (``tune_config(scheduler="asha")``) may stop a trial of ``steps``
    steps: ``GRACE_FRACTION * steps`` times powers of ``REDUCTION``, as many as Ray Tune's
    ``ASHAScheduler`` makes for ``max_t = steps + 1``."""
    grace = max(1, int(steps * GRACE_FRACTION))
    count = int(math.log((steps + 1) / grace) / math.log(REDUCTION) + 1)
    return [grace * REDUCTION**k for k in range(count)]


def hold_steps(rungs: list[int], steps: int, metric: str, eval_every) -> tuple[int, ...]:
    """The steps after which a trial's workers wait for Tune's decision: for each rung, the
    first step at or after it that reports ``metric`` (every step, or every ``eval_every``-th
    for the validation loss), before the last step. A trial ASHA stops ends right there."""
    if metric == VAL_LOSS:
        if not isinstance(eval_every, int) or eval_every < 1:
            return ()
        held = {-(-rung // eval_every) * eval_every for rung in rungs}
    else:
        held = set(rungs)
    return tuple(sorted(step for step in held if step < steps))


def tune_config(*, num_samples: int = 1, max_concurrent_trials: int | None = None, metric: str = METRIC,
                mode: str = MODE, search: str = "grid", scheduler: str = "fifo", steps: int | None = None,
                seed: int = 0):
    """The TuneConfig of a study: ``search`` (grid and random: Tune's variant generator over
    the param space; optuna: ``OptunaSearch``, TPE seeded by ``seed``), ``scheduler`` (fifo:
    every trial runs to the end; asha: ``ASHAScheduler`` on ``metric`` over the trials' step
    reports, budget ``steps``), ranked by ``metric``/``mode``.

    Trials reuse their Tune actors (``reuse_actors``): a trial process that has finished one
    trial runs the next, with torch, MLflow and ``app.jobs.launch`` already imported (a new trial
    process costs seconds of CPU before its Train job starts; app.jobs.trial.stopping_trainable
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
