"""The studies of ``mpipemoe sweep SPACE`` (app/commands/sweep.py): a Ray Tune study from
``tune_spaces/``, one Ray Train run per trial.

Layers (Ray's Train-inside-Tune pattern under Train V2, where ``Tuner(TorchTrainer)``
is not allowed): the driver builds a ``Tuner`` around the function trainable
``train_trial`` (app/jobs/trial.py, with the rest of a trial's side); each trial turns its config into an ``app.jobs.job.TrainJob`` and
calls ``app.jobs.launch.run_job``, which builds and fits a ``TorchTrainer`` and logs the
job as one MLflow run. The trial reports every step to Tune (``StepReporter``, the
job's ``on_step``), so a scheduler such as ASHA can stop it early, then the job's summary.

- **Search and ranking.** ``tune_spaces.tune_config`` builds the search algorithm (grid,
  random, Optuna's TPE) and the scheduler (FIFO or ASHA); a study ranks by throughput or
  by loss (``tune_spaces.ranking``: the validation loss where its jobs evaluate one).

- **Resources.** A trial itself holds ``TRIAL_CPUS`` and a sliver of the head node
  (so drivers, and the MLflow store they write to, stay on the head); its Train
  workers ask for their own resources. Tune cannot see those, so the driver caps
  ``max_concurrent_trials`` at what the cluster can serve (``plan_resources``).
- **Start-up.** A trial's Train job costs seconds of process starts for ~1.5 s of steps
  on a tiny model, so Tune reuses trial processes (``reuse_actors``; ``StoppingTrial``
  waits for a pruned trial's function first) and embedded Ray's Train jobs get
  ``ray_start.LOCAL_RAY_TRAIN_ENV`` (docs/sweeps.md, "Start-up per trial").
- **MLflow.** Each trial's run is logged by ``run_job`` in the experiment named
  after the study, nested under one parent run per study (tag ``kind=study``).
  There is deliberately no ``MLflowLoggerCallback``: it would log a second run
  per trial.
- **Resume.** The Tune experiment lives in ``<storage-path>/<study>``; running the
  same study again with the same storage path restores it (``Tuner.restore``):
  finished trials are kept, unfinished and errored ones run again.

Ray and Ray Tune (the ``ray`` extra) are imported inside the functions that use them, as
in app/jobs/launch.py; so are app/jobs/job.py and app/jobs/launch.py themselves, which load torch
(about 2 s): only a trial runs a job, and `mpipemoe sweep --help` stays fast. A finished study's
results are counted and tabled in app/jobs/study_results.py.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tune_spaces
from app.jobs.study_results import Tally, _cell, _varying, best_trial, first_reason, format_results, tally
from app.jobs.study_checks import (StudyRecord, check_resumable, check_space_values, check_study_name,
                                   write_study_record)
from app.jobs.trial import (STOP_GRACE_S, TrialGate, TrialSettings, gated, stopping_trainable,
                            study_parent_run, train_trial)
from app.tracking import sweep_rank
from app.tracking.store import RunLogger, check_store, resolve_tracking_uri
from lm.data import ensure_default_data
from lm.errors import invocation
from workers.control import on_this_node

# Defaults, in one place.
DEFAULT_STORAGE = "ray_results"      # relative to the current directory; made absolute
TRIAL_CPUS = 0.01                    # the trial only waits on its TorchTrainer
HEAD_RESOURCE = "node:__internal_head__"  # every Ray head node carries 1 of it
HEAD_SHARE = 0.001                   # up to 1000 trial drivers fit on the head


@dataclass(frozen=True)
class Plan:
    """How a study uses the cluster: per-trial resources, worker sizing, concurrency."""

    trial_resources: dict
    use_gpu: bool
    cpus_per_worker: float | None   # None: TrainJob's default (GPU runs)
    max_concurrent_trials: int


def _floor2(value: float) -> float:
    return math.floor(value * 100) / 100


def plan_resources(cluster: dict, *, num_workers: int, use_gpu: bool | None = None,
                   max_concurrent: int | None = None) -> Plan:
    """Size a study for ``cluster`` (``ray.cluster_resources()``).

    GPU: one GPU per worker, as many trials at once as ``GPU // num_workers``.
    CPU: trials at once ``CPU // (num_workers + TRIAL_CPUS)`` (at least 1), and each
    worker gets the CPU share that lets that many trials fit (at most 1 CPU): on a
    2-core machine, 1 trial of 2 workers at 0.99 CPU each. ``max_concurrent``
    overrides the derived concurrency (CPU workers then get a smaller share).
    """
    if num_workers < 1:
        raise ValueError(f"num_workers={num_workers!r} is invalid: give an integer >= 1")
    if max_concurrent is not None and max_concurrent < 1:
        raise ValueError(f"max_concurrent={max_concurrent!r} is invalid: give an integer >= 1")
    gpus = float(cluster.get("GPU", 0))
    cpus = float(cluster.get("CPU", 0))
    trial_resources = {"CPU": TRIAL_CPUS, HEAD_RESOURCE: HEAD_SHARE}
    if use_gpu is None:
        use_gpu = gpus >= num_workers
    if use_gpu:
        if gpus < num_workers:
            raise ValueError(f"num_workers={num_workers} needs {num_workers} GPUs but the cluster has "
                             f"{gpus:g}: run it on a GPU cluster (docs/cluster.md) or pick a CPU-sized study (smoke)")
        concurrency = max_concurrent or int(gpus // num_workers)
        return Plan(trial_resources, True, None, concurrency)
    concurrency = max_concurrent or max(1, int(cpus // (num_workers + TRIAL_CPUS)))
    share = min(1.0, _floor2((cpus - concurrency * TRIAL_CPUS) / (concurrency * num_workers)))
    if share < 0.01:
        raise ValueError(f"{concurrency} trial(s) of {num_workers} workers do not fit in {cpus:g} CPUs: "
                         f"lower --max-concurrent or num_workers")
    return Plan(trial_resources, False, share, concurrency)


def _constant(space: dict, key: str, default):
    """A study's constant setting (a grid over it would defeat the resource plan)."""
    value = space.get(key, default)
    if isinstance(value, dict):
        raise ValueError(f"study param {key!r} must be a constant, not a search space ({value!r})")
    return value


def parse_value(text: str):
    """A ``--set`` value: an int, a float, true/false, else the string ("auto", "none", "S1")."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def parse_overrides(items: list[str]) -> dict:
    """``--set KEY=VALUE`` (a constant) or ``KEY=V1,V2,...`` (a grid over the values) -> {key: value}."""
    from app.jobs.job import RESUME_OWNED, TrainJob

    fields = {f.name for f in dataclasses.fields(TrainJob)}
    overrides = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not text.strip():
            raise ValueError(f"--set {item!r} is invalid: give KEY=VALUE or KEY=V1,V2 (e.g. --set partitions=1,2,auto)")
        if key not in fields:
            raise ValueError(f"--set {item!r}: {key!r} is not a train option: use one of "
                             f"{', '.join(sorted(fields - SWEEP_OWNED - set(RESUME_OWNED)))}")
        if key in SWEEP_OWNED:
            raise ValueError(f"--set {item!r}: the sweep sets {key} itself ({', '.join(sorted(SWEEP_OWNED))})")
        if key in RESUME_OWNED:
            raise ValueError(f"--set {item!r}: {key} is set by a resume from a recorded run, not an option: drop it")
        values = [parse_value(v) for v in text.split(",")]
        overrides[key] = values[0] if len(values) == 1 else {"grid_search": values}
    return overrides


# TrainJob fields a sweep sets for every trial (a space or --set may not)
SWEEP_OWNED = frozenset({"storage_path", "name", "data_dir", "tracking_uri", "experiment", "parent_run_id"})
ONE_PER_STUDY = ("num_workers", "steps", "use_gpu")  # the resource plan and ASHA are sized from them


def study_space(module, search: str, overrides: dict | None = None) -> dict:
    """The study's param space for ``search`` with ``overrides`` (``--set`` and the shortcut
    flags) applied; a trial writes no checkpoints unless the space or an override asks."""
    try:
        base = module.param_space(search)
    except Exception as error:  # a study file's own code: one line naming it
        where = getattr(module, "__file__", None) or "the study"
        raise ValueError(f"{where}: param_space({search!r}) failed: {type(error).__name__}: {error}: fix the "
                         f"study file") from error
    space = {**base, **(overrides or {})}
    space.setdefault("checkpoint_every", 0)
    for key in ONE_PER_STUDY:
        _constant(space, key, None)
    from app.jobs.job import RESUME_OWNED, TrainJob

    fields = {f.name for f in dataclasses.fields(TrainJob)}
    if unknown := sorted(set(space) - fields):
        raise ValueError(f"the study sets {unknown}, which are not train options: use TrainJob's fields "
                         f"(mpipemoe train --help)")
    if owned := sorted(set(space) & SWEEP_OWNED):
        raise ValueError(f"the study sets {owned}: the sweep sets those itself (--name, --experiment, --data-dir)")
    if internal := sorted(set(space) & set(RESUME_OWNED)):
        raise ValueError(f"the study sets {internal}: a resume sets those from a recorded run, not a study: drop them")
    return space


def run_study(study: str, *, storage_path: str, tracking_uri: str, num_samples: int | None = None,
              max_concurrent: int | None = None, data_dir: str | None = None, trainable=train_trial,
              search: str | None = None, scheduler: str | None = None, max_failures: int = 0, seed: int = 0,
              stop_grace_s: float = STOP_GRACE_S, name: str | None = None, experiment: str | None = None,
              overrides: dict | None = None):
    """Run (or resume) a study on the connected Ray cluster; returns the ResultGrid.

    ``study``: a built-in study's name or a study file (``tune_spaces.load``); ``name``: the
    study's name (its Tune folder ``<storage_path>/<name>``, tag and MLflow experiment; default
    the study's name or the file's stem); ``experiment``: the MLflow experiment (default the
    name); ``overrides``: param-space entries that replace the study's (``parse_overrides``).
    ``data_dir``: prepared training data; default ``./data/stdlib-bytes``, prepared here
    once if missing. ``trainable(config, *, settings)`` runs one trial; tests may pass a
    lighter one. ``num_samples`` None: the study's (``tune_spaces.num_samples``, by search).
    ``search``, ``scheduler`` (None: the study's ``SEARCH``/``SCHEDULER``, else grid and fifo): see
    ``tune_spaces.tune_config``; ``max_failures``: Tune retries an errored trial that often.
    ``stop_grace_s``: how long a stopped trial may take to stop its Train job (``stopping_trainable``).
    """
    import ray
    from ray import tune

    prepared = prepare_study(study, storage_path=storage_path, name=name, search=search, scheduler=scheduler,
                             overrides=overrides, num_samples=num_samples)
    module, name, search, scheduler = prepared.module, prepared.name, prepared.search, prepared.scheduler
    space, metric, mode = dict(prepared.space), prepared.metric, prepared.mode
    if max_failures < 0:
        raise ValueError(f"--max-failures {max_failures} is invalid: give an integer >= 0")
    if data_dir is not None and not Path(data_dir).is_dir():
        raise ValueError(f"--data-dir {data_dir}: no such directory: prepare it (mpipemoe data prepare) or leave "
                         f"--data-dir out for the default data")
    storage_path = os.path.abspath(storage_path)  # Ray Train needs absolute paths
    experiment_path = prepared.experiment_path
    plan = plan_resources(ray.cluster_resources(), num_workers=_constant(space, "num_workers", 2),
                          use_gpu=_constant(space, "use_gpu", None), max_concurrent=max_concurrent)
    space.pop("use_gpu", None)  # decided by the plan
    if data_dir is None:
        data_dir = ensure_default_data()
    parent_run_id = study_parent_run(tracking_uri, experiment or name, experiment_path, module.DESCRIPTION, name)
    gate: Any = ray.remote(TrialGate).options(**on_this_node()).remote(plan.max_concurrent_trials)
    settings = TrialSettings(study=name, tracking_uri=tracking_uri,
                             train_storage_path=os.path.join(storage_path, f"{name}-train"),
                             data_dir=str(Path(data_dir).resolve()),
                             parent_run_id=parent_run_id, use_gpu=plan.use_gpu,
                             cpus_per_worker=plan.cpus_per_worker, metric=metric, experiment=experiment,
                             gate=gate, rungs=tuple(tune_spaces.asha_rungs(_constant(space, "steps", 50)))
                             if scheduler == "asha" else ())
    fn = tune.with_resources(stopping_trainable(tune.with_parameters(gated(trainable), settings=settings),
                                                stop_grace_s), plan.trial_resources)
    if prepared.resumes:
        print(f"Restoring study {name!r} from {experiment_path}: finished trials are kept, "
              f"unfinished and errored ones run (again), up to {plan.max_concurrent_trials} at once")
        tuner = tune.Tuner.restore(experiment_path, trainable=fn, resume_errored=True)
    else:
        print(f"Study {name!r}: {module.DESCRIPTION}\n"
              f"  up to {plan.max_concurrent_trials} trial(s) at once, "
              f"{'1 GPU' if plan.use_gpu else f'{plan.cpus_per_worker} CPU'} per worker; "
              f"results in {experiment_path}")
        print(f"  search {search}, scheduler {scheduler}, ranked by {metric} ({mode}), "
              f"{prepared.record.num_samples} sample(s)")
        write_study_record(experiment_path, prepared.record)
        tuner = tune.Tuner(
            fn, param_space=space,
            tune_config=tune_spaces.tune_config(
                num_samples=prepared.record.num_samples,
                max_concurrent_trials=plan.max_concurrent_trials, metric=metric, mode=mode, search=search,
                scheduler=scheduler, steps=_constant(space, "steps", None), seed=seed),
            run_config=tune.RunConfig(name=name, storage_path=storage_path, failure_config=tune.FailureConfig(max_failures=max_failures)))
    parent = RunLogger(tracking_uri, parent_run_id)
    try:
        results = tuner.fit()
    except BaseException:
        parent.finish("FAILED")
        raise
    finally:
        try:
            results_busiest = ray.get(gate.busiest.remote())
        finally:
            ray.kill(gate)
    counts = tally(results, metric, space)
    parent.log_metrics({"trials": counts.trials, "trials_failed": counts.failed + counts.errored,
                        "trials_refused": counts.refused, "trials_finished": counts.finished,
                        "trials_pruned": counts.pruned, "trials_at_once": results_busiest}, flush=True)
    best = best_trial(results, metric, mode)
    if best is not None:
        parent.set_tags({f"best_{k}": v for k, v in best.config.items() if k in _varying(results)})  # a resume may change it
        parent.log_metrics({f"best_{metric}": best.metrics[metric]}, flush=True)
    parent.finish(study_status(counts))
    return results


def study_status(counts: Tally) -> str:
    """The study's MLflow status: FAILED when a trial errored or none ran (every trial failed
    or was refused); KILLED when interrupted (running the study again resumes it and reopens
    the run); else FINISHED (some settings refused or failed beside measured ones: results)."""
    if counts.errored or counts.none_ran:
        return "FAILED"
    return "KILLED" if counts.unfinished else "FINISHED"


@dataclass(frozen=True)
class PreparedStudy:
    """A study checked and resolved before Ray starts (``prepare_study``)."""

    module: Any
    name: str
    search: str
    scheduler: str
    space: dict
    metric: str
    mode: str
    experiment_path: str
    record: StudyRecord   # what it is started with (a resume must ask for the same)
    resumes: bool         # <storage-path>/<name> holds a study that Tune can restore


def prepare_study(study: str, *, storage_path: str, name: str | None = None, search: str | None = None,
                  scheduler: str | None = None, overrides: dict | None = None,
                  num_samples: int | None = None) -> PreparedStudy:
    """Local (no Ray cluster needed). Load ``study``, resolve its name, search, scheduler, param
    space, ranking and number of samples, and check them: raises ValueError, naming the option
    and the fix, for a name that is not one folder (or is a training run's), a search or
    scheduler the study does not support, a bad key, metric, mode or number of samples, and for a
    resume whose space or ranking differs from the study's recorded one."""
    from ray import tune

    module = tune_spaces.load(study)
    name = name or tune_spaces.study_name(study)
    check_study_name(name, storage_path)
    search = search or getattr(module, "SEARCH", None) or "grid"
    scheduler = scheduler or getattr(module, "SCHEDULER", None) or "fifo"
    searches = getattr(module, "SEARCHES", tune_spaces.GRID_SEARCHES)
    if search not in searches:
        raise ValueError(f"--search {search}: study {name!r} supports {', '.join(searches)} (its space is "
                         f"{'a grid of categorical choices' if 'optuna' not in searches else 'not searchable so'})")
    if scheduler not in tune_spaces.SCHEDULERS:
        raise ValueError(f"scheduler={scheduler!r} is invalid: choose one of {', '.join(tune_spaces.SCHEDULERS)}")
    if num_samples is not None and num_samples < 1:
        raise ValueError(f"--num-samples {num_samples} is invalid: give an integer >= 1 (the trials drawn; a grid: "
                         f"its repeats), or leave it out for the study's "
                         f"({tune_spaces.num_samples(module, search)} with --search {search})")
    samples = num_samples if num_samples is not None else tune_spaces.num_samples(module, search)
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"study {name!r}: NUM_SAMPLES={samples!r} is invalid: give an integer >= 1")
    space = study_space(module, search, overrides)
    metric, mode = tune_spaces.ranking(module, space)
    experiment_path = os.path.join(os.path.abspath(storage_path), name)
    record = StudyRecord.of(space, search=search, scheduler=scheduler, metric=metric, mode=mode,
                            num_samples=samples)
    resumes = tune.Tuner.can_restore(experiment_path)
    if resumes:
        check_resumable(experiment_path, record, name)
    return PreparedStudy(module, name, search, scheduler, space, metric, mode, experiment_path, record, resumes)


def study_overrides(set_items: list[str], shortcuts: dict) -> dict:
    """The param-space entries the command line sets: ``--set`` items, then the shortcut flags given."""
    overrides = parse_overrides(set_items)
    overrides.update({k: v for k, v in shortcuts.items() if v is not None})
    return overrides


def run_sweep(spec: str, set_items: list[str], shortcuts: dict, *, name: str | None, experiment: str | None,
              address: str | None, verbose: bool, storage_path: str, num_samples: int | None,
              max_concurrent: int | None, data_dir: str | None, search: str | None, scheduler: str | None,
              max_failures: int, seed: int, tracking_uri: str | None, memory_cap_gib: float | None) -> int:
    """`mpipemoe sweep`: check the study ``spec`` and the overrides before Ray starts (rc 2 on a bad
    one), run it on Ray (embedded unless ``address``), print its results and the next command."""
    import ray

    try:  # before Ray starts: a bad file, option or value costs nothing
        if memory_cap_gib is not None and not 0 < memory_cap_gib < math.inf:
            raise ValueError(f"--memory-cap-gib {memory_cap_gib} is invalid: give a number of GiB > 0, e.g. 40")
        overrides = study_overrides(set_items, shortcuts)
        prepared = prepare_study(spec, storage_path=storage_path, name=name, search=search, scheduler=scheduler,
                                 overrides=overrides, num_samples=num_samples)
        if not prepared.resumes:  # a resume runs what the study holds (checked the same above)
            check_space_values(prepared.space, storage_path)
    except ValueError as error:
        print(f"mpipemoe sweep {spec}: {error}", file=sys.stderr)
        return 2
    study = prepared.name
    tracking_uri = resolve_tracking_uri(tracking_uri)
    check_store(tracking_uri)  # before Ray starts: seconds, not minutes of MLflow retries
    started = not ray.is_initialized()
    if started and address:
        ray.init(address=address, logging_level="WARNING" if verbose else "ERROR", log_to_driver=verbose)
    elif started:  # a new embedded instance, never someone else's cluster found on this machine
        from app.jobs.ray_start import local_train_env

        ray.init(address="local", include_dashboard=False, object_store_memory=300 * 2**20,
                 logging_level="WARNING" if verbose else "ERROR", log_to_driver=verbose,
                 runtime_env={"env_vars": local_train_env()})
    try:
        results = run_study(spec, storage_path=storage_path, tracking_uri=tracking_uri,
                            num_samples=num_samples, max_concurrent=max_concurrent,
                            data_dir=data_dir, search=search, scheduler=scheduler,
                            max_failures=max_failures, seed=seed, name=name,
                            experiment=experiment, overrides=overrides)
    except ValueError as error:  # a study that does not fit the cluster, a bad option
        print(f"mpipemoe sweep {spec}: {error}", file=sys.stderr)
        return 2
    finally:
        if started:
            ray.shutdown()
    scheduler, space, metric, mode = prepared.scheduler, prepared.space, prepared.metric, prepared.mode
    print(format_results(results, metric, space.get("steps"), mode))
    if metric == tune_spaces.METRIC:  # a time study: settings over repeats, the time/memory front
        rows = [(r.config or {}, r.metrics or {}, r.error) for r in results]
        print(sweep_rank.format_ranking(sweep_rank.points(rows), memory_cap_gib))
    counts, best = tally(results, metric, space), best_trial(results, metric, mode)
    if best is not None:
        chosen = ", ".join(f"{k}={_cell(best.config.get(k))}" for k in _varying(results))
        print(f"Best trial ({'lowest' if mode == 'min' else 'highest'} {metric}): {chosen or best.path} "
              f"{metric} {best.metrics[metric]:.4g}" + (f"; {counts.pruned} of {len(results)} trials pruned by "
                                                        f"{scheduler}" if scheduler != "fifo" else ""))
    experiment = experiment or study
    print(f"MLflow experiment {experiment!r} in {tracking_uri}; next: {invocation()} report --experiment "
          f"{experiment}" + ("" if tracking_uri == resolve_tracking_uri(None) else f" --tracking-uri {tracking_uri}"))
    print(f"Study {study!r}: {counts.summary()}")
    if counts.none_ran:
        print(f"mpipemoe sweep {spec}: study {study!r} FAILED: none of its {counts.trials} trials ran "
              f"({counts.summary()}); first reason: {first_reason(results)}", file=sys.stderr)
        return 1
    if counts.errored:
        print(f"mpipemoe sweep {spec}: study {study!r} FAILED: {counts.errored} trial(s) errored "
              f"({first_reason(results)}); fix the cause and run the same command again to re-run them",
              file=sys.stderr)
        return 1
    if counts.unfinished:
        print(f"Study interrupted ({counts.finished}/{len(results)} trials finished): run the same command "
              f"again to resume it.")
        return 1
    return 0
