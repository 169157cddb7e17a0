"""``mpipemoe sweep SPACE``: a Ray Tune study from ``tune_spaces/``, one Ray Train run per trial.

    mpipemoe sweep smoke                                   # embedded local Ray, CPU workers
    mpipemoe sweep lr --search optuna --scheduler asha --max-concurrent 2
    mpipemoe sweep engines --address auto --storage-path /mnt/efs/ray_results

Layers (Ray's Train-inside-Tune pattern under Train V2, where ``Tuner(TorchTrainer)``
is not allowed): the driver builds a ``Tuner`` around the function trainable
``train_trial``; each trial turns its config into an ``app.jobs.TrainJob`` and
calls ``app.jobs.run_job``, which builds and fits a ``TorchTrainer`` and logs the
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
  ``LOCAL_RAY_TRAIN_ENV`` (docs/sweeps.md, "Start-up per trial").
- **MLflow.** Each trial's run is logged by ``run_job`` in the experiment named
  after the study, nested under one parent run per study (tag ``kind=study``).
  There is deliberately no ``MLflowLoggerCallback``: it would log a second run
  per trial.
- **Resume.** The Tune experiment lives in ``<storage-path>/<study>``; running the
  same study again with the same storage path restores it (``Tuner.restore``):
  finished trials are kept, unfinished and errored ones run again.

Ray and Ray Tune (the ``ray`` extra) are imported inside the functions that use them, as
in app/jobs.py; so is app/jobs.py itself, which loads torch (about 2 s): only a trial runs a
job, and `mpipemoe sweep --help` stays fast.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tune_spaces
from app.run_kinds import STUDY, kind_tags
from app.tracking import RunLogger, check_store, find_run, resolve_tracking_uri
from lm.data import ensure_default_data
from lm.errors import invocation

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


@dataclass(frozen=True)
class TrialSettings:
    """What every trial of one study shares (passed with ``tune.with_parameters``)."""

    study: str
    tracking_uri: str
    train_storage_path: str         # where the trials' TorchTrainers keep checkpoints
    data_dir: str                   # prepared training data (absolute: trials run in their own cwd)
    parent_run_id: str | None
    use_gpu: bool
    cpus_per_worker: float | None
    metric: str = tune_spaces.METRIC  # what the trials report each step and Tune ranks by


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


def train_trial(config: dict, *, settings: TrialSettings) -> None:
    """One Tune trial: one ``app.jobs`` job with the trial's config; reports its summary."""
    from ray import tune

    from app.jobs import TrainJob, run_job

    trial_id = tune.get_context().get_trial_id()
    fields = {f.name for f in dataclasses.fields(TrainJob)}
    unknown = sorted(set(config) - fields)
    if unknown:
        raise ValueError(f"study {settings.study!r} sets {unknown}, which TrainJob does not have")
    extra = {"cpus_per_worker": settings.cpus_per_worker} if settings.cpus_per_worker else {}
    job = TrainJob(**{"use_gpu": settings.use_gpu, **extra, **config},
                   storage_path=settings.train_storage_path, name=f"{settings.study}-{trial_id}",
                   data_dir=settings.data_dir,
                   tracking_uri=settings.tracking_uri, experiment=settings.study,
                   parent_run_id=settings.parent_run_id)
    reporter = StepReporter(settings, job)
    summary = run_job(job, on_step=reporter)
    run_id = summary.get("mlflow_run_id") or summary.get("run_id")
    if run_id:
        RunLogger(settings.tracking_uri, run_id).set_tags({"study": settings.study, "trial_id": trial_id,
                                                           **reporter.pruned_tags()})
    if reporter.stopped is None:  # a stopped trial reports nothing more: Tune has ended it
        tune.report(trial_metrics(summary, settings.metric, reporter.last))


def _numbers(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class StepReporter:
    """``run_job``'s ``on_step``: reports each step that carries the study's metric to Tune
    (every step for the training loss and throughput, every evaluation for the validation
    loss), so a scheduler (ASHA) can stop a trial early. Called on the job's metrics thread.

    When Tune stops the trial (ASHA pruned it, or the study was interrupted), its next
    report raises ``SystemExit`` (Ray Tune's function trainable ends a trial that way).
    The reporter then returns ``app.jobs.STOP_JOB``: the Train workers stop after their
    step and the job ends normally, releasing their resources (a trial process that
    simply exited would leave its workers' placement group reserved: Ray Train's cleaner
    needs the State API, which embedded Ray without a dashboard lacks; measured: the next
    trials waited for CPUs forever). ``StoppingTrial`` keeps the process alive meanwhile."""

    def __init__(self, settings: "TrialSettings", job):
        self.settings, self.job = settings, job
        self.last: dict = {}  # the newest step metrics that carried the study's metric
        self.stopped: int | None = None  # the step after which Tune stopped the trial

    def __call__(self, metrics: dict) -> str | None:
        from ray import tune

        from app.jobs import STOP_JOB

        numbers = _numbers(metrics)
        if self.stopped is not None or self.settings.metric not in numbers:
            return None
        try:
            tune.report(numbers)
        except SystemExit:
            self.stopped = int(numbers.get("step", 0))
            return STOP_JOB
        self.last = numbers
        return None

    def pruned_tags(self) -> dict:
        """MLflow tags of a trial Tune stopped before its last step: ``pruned_at_step``, the
        last step it reported."""
        if self.stopped is None or not self.last or self.last.get("step", 0) >= self.job.steps:
            return {}
        return {"pruned_at_step": self.last.get("step")}


# A stopped trial's process waits this long for its Train job to stop (after its current
# step) before it exits anyway (or, reused for the next trial, gives up being reused).
STOP_GRACE_S = 120
REUSE_POLL_S = 0.2  # how often a reused trial process checks that the previous trial's function ended


def stopping_trainable(trainable, stop_grace_s: float = STOP_GRACE_S):
    """``trainable`` (a function trainable) as a Tune Trainable class whose ``cleanup`` (run
    when Tune stops the trial) waits up to ``stop_grace_s`` for the trial function to return,
    instead of not at all: the function stops its Train job first (``StepReporter``).
    The rest is Ray Tune's ``FunctionTrainable.cleanup``.

    ``reset_config`` (Tune reuses the trial's process for the next trial, ``reuse_actors``)
    waits the same way before Ray Tune's own, which waits only ``TUNE_FUNCTION_THREAD_TIMEOUT_S``
    (2 s) and otherwise gives the process up: a pruned trial stopping its Train job takes
    a few seconds, and the next trial would pay for a new process."""
    from ray.train._internal.session import get_session, shutdown_session
    from ray.tune.trainable.function_trainable import wrap_function

    class StoppingTrial(wrap_function(trainable)):  # type: ignore[misc]  # (a class made at run time)
        def cleanup(self):
            session = get_session()
            assert session is not None  # Tune cleans up a trial inside its session
            try:
                session.finish(timeout=stop_grace_s)
            finally:
                session._report_thread_runner_error()
                shutdown_session()

        def reset_config(self, new_config):
            session = get_session()
            assert session is not None  # Tune resets a trial inside its session
            deadline = time.monotonic() + stop_grace_s
            # The previous trial's function stops its Train job, then Tune's wrapper of it
            # reports once more and waits for an answer that never comes (Tune has ended that
            # trial): each wait here lets such a report through and drops it.
            while session.training_thread.is_alive() and time.monotonic() < deadline:
                while not session.result_queue.empty():
                    session.result_queue.get_nowait()
                session.finish(timeout=REUSE_POLL_S)
            return super().reset_config(new_config)

    return StoppingTrial


# Standard Ray Train settings for the Train jobs of a study on embedded local Ray (one node,
# this machine), where the user has not set them. Every trial starts and ends a Train job, and
# each of the controller's state changes waits for its next check on the workers (default
# every 2 s); and each job starts a preemption watcher, one more process, while a local node
# is never drained. Measured on 2 shared cores, an lr-study trial's Train job (40 steps, ~1.5 s
# of training), start to end: 13-15 s with these, 13-20 s without (docs/sweeps.md).
LOCAL_RAY_TRAIN_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}


def local_train_env(environ=None) -> dict[str, str]:
    """``LOCAL_RAY_TRAIN_ENV`` less the variables set in ``environ`` (default ``os.environ``):
    the user's own values win. ``run`` gives them to embedded Ray's job (``runtime_env``); Ray
    Train passes them on from each trial to its controller and workers."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in LOCAL_RAY_TRAIN_ENV.items() if k not in environ}


def trial_metrics(summary: dict, metric: str = tune_spaces.METRIC, last_step: dict | None = None) -> dict:
    """What a trial reports to Tune at its end: the summary's numbers, and the newest step
    value of ``metric`` where the summary has none of that name (a loss). ``step`` is the
    steps trained (ASHA's time axis). A trial re-run on resume whose Train run had already
    finished reports that run's recorded numbers (run_job's summary), never NaN; without the
    study's metric it raises, naming the trial's run."""
    metrics = {**{k: v for k, v in (last_step or {}).items() if k == metric}, **_numbers(summary)}
    if "steps" in metrics:
        metrics["step"] = metrics["steps"]
    if metric == tune_spaces.TRAIN_LOSS and "final_loss" in metrics:
        metrics.setdefault(metric, metrics["final_loss"])
    if not math.isfinite(metrics.get(metric, math.nan)):
        raise RuntimeError(f"training run {summary.get('name')} reported no {metric}: "
                           f"see its MLflow run {summary.get('mlflow_run_id')}")
    return metrics


def study_parent_run(tracking_uri: str, study: str, experiment_path: str, description: str) -> str:
    """The MLflow parent run of this study's experiment directory, reused on resume."""
    run_id = find_run(tracking_uri, study, "study_path", experiment_path)
    if run_id:
        return RunLogger.resume(tracking_uri, run_id).run_id
    run = RunLogger.start(tracking_uri, study, run_name=f"study-{study}",
                          tags={**kind_tags(STUDY), "study": study, "study_path": experiment_path})
    run.log_params({"study": study, "description": description})
    return run.run_id


def run_study(study: str, *, storage_path: str, tracking_uri: str, num_samples: int | None = None,
              max_concurrent: int | None = None, data_dir: str | None = None, trainable=train_trial,
              search: str = "grid", scheduler: str = "fifo", max_failures: int = 0, seed: int = 0,
              stop_grace_s: float = STOP_GRACE_S):
    """Run (or resume) study ``study`` on the connected Ray cluster; returns the ResultGrid.

    ``data_dir``: prepared training data; default ``./data/stdlib-bytes``, prepared here
    once if missing. ``trainable(config, *, settings)`` runs one trial; tests may pass a
    lighter one. ``num_samples`` None: the study's ``NUM_SAMPLES``. ``search``, ``scheduler``:
    see ``tune_spaces.tune_config``; ``max_failures``: Tune retries an errored trial that often.
    ``stop_grace_s``: how long a stopped trial may take to stop its Train job (``stopping_trainable``).
    """
    import ray
    from ray import tune

    module = tune_spaces.load(study)
    searches = getattr(module, "SEARCHES", tune_spaces.GRID_SEARCHES)
    if search not in searches:
        raise ValueError(f"--search {search}: study {study!r} supports {', '.join(searches)} (its space is "
                         f"{'a grid of categorical choices' if 'optuna' not in searches else 'not searchable so'})")
    if max_failures < 0:
        raise ValueError(f"--max-failures {max_failures} is invalid: give an integer >= 0")
    space = module.param_space(search)
    metric, mode = tune_spaces.ranking(module, space)
    storage_path = os.path.abspath(storage_path)  # Ray Train needs absolute paths
    experiment_path = os.path.join(storage_path, study)
    plan = plan_resources(ray.cluster_resources(), num_workers=_constant(space, "num_workers", 2),
                          use_gpu=_constant(space, "use_gpu", None), max_concurrent=max_concurrent)
    space.pop("use_gpu", None)  # decided by the plan
    if data_dir is None:
        data_dir = ensure_default_data()
    parent_run_id = study_parent_run(tracking_uri, study, experiment_path, module.DESCRIPTION)
    settings = TrialSettings(study=study, tracking_uri=tracking_uri,
                             train_storage_path=os.path.join(storage_path, f"{study}-train"),
                             data_dir=str(Path(data_dir).resolve()),
                             parent_run_id=parent_run_id, use_gpu=plan.use_gpu,
                             cpus_per_worker=plan.cpus_per_worker, metric=metric)
    fn = tune.with_resources(stopping_trainable(tune.with_parameters(trainable, settings=settings), stop_grace_s),
                             plan.trial_resources)
    if tune.Tuner.can_restore(experiment_path):
        print(f"Restoring study {study!r} from {experiment_path}: finished trials are kept, "
              f"unfinished and errored ones run (again)")
        tuner = tune.Tuner.restore(experiment_path, trainable=fn, resume_errored=True)
    else:
        print(f"Study {study!r}: {module.DESCRIPTION}\n"
              f"  up to {plan.max_concurrent_trials} trial(s) at once, "
              f"{'1 GPU' if plan.use_gpu else f'{plan.cpus_per_worker} CPU'} per worker; "
              f"results in {experiment_path}")
        print(f"  search {search}, scheduler {scheduler}, ranked by {metric} ({mode})")
        tuner = tune.Tuner(
            fn, param_space=space,
            tune_config=tune_spaces.tune_config(
                num_samples=num_samples or getattr(module, "NUM_SAMPLES", 1),
                max_concurrent_trials=plan.max_concurrent_trials, metric=metric, mode=mode, search=search,
                scheduler=scheduler, steps=_constant(space, "steps", None), seed=seed),
            run_config=tune.RunConfig(name=study, storage_path=storage_path,
                                      failure_config=tune.FailureConfig(max_failures=max_failures)))
    parent = RunLogger(tracking_uri, parent_run_id)
    try:
        results = tuner.fit()
    except BaseException:
        parent.finish("FAILED")
        raise
    failed, finished = count_trials(results, metric)
    pruned = count_pruned(results, space)
    parent.log_metrics({"trials": len(results), "trials_failed": failed, "trials_finished": finished,
                        "trials_pruned": pruned}, flush=True)
    best = best_trial(results, metric, mode)
    if best is not None:
        parent.set_tags({f"best_{k}": v for k, v in best.config.items() if k in _varying(results)})  # a resume may change it
        parent.log_metrics({f"best_{metric}": best.metrics[metric]}, flush=True)
    # KILLED: interrupted; running the study again resumes it (and reopens this run)
    parent.finish("FAILED" if failed else "FINISHED" if finished == len(results) else "KILLED")
    return results


def count_trials(results, metric: str = tune_spaces.METRIC) -> tuple[int, int]:
    """(errored, finished) trials of a ResultGrid; the rest were interrupted or never started.
    A trial stopped early by the scheduler (pruned) counts as finished: it reported ``metric``."""
    failed = sum(1 for r in results if r.error)
    finished = sum(1 for r in results if not r.error and metric in (r.metrics or {}))
    return failed, finished


def _pruned(result, steps) -> bool:
    """Whether a trial stopped before the study's ``steps`` without an error (the scheduler's doing)."""
    metrics = result.metrics or {}
    return not result.error and steps is not None and "steps" not in metrics and metrics.get("step", steps) < steps


def count_pruned(results, space: dict) -> int:
    """Trials the scheduler stopped early: their last report is a step's, not the summary."""
    steps = space.get("steps") if not isinstance(space.get("steps"), dict) else None
    return sum(1 for r in results if _pruned(r, steps))


def best_trial(results, metric: str, mode: str):
    """The trial with the best last reported ``metric`` (lowest for mode "min"), None if none reported it."""
    scored = [r for r in results if not r.error and math.isfinite((r.metrics or {}).get(metric, math.nan))]
    if not scored:
        return None
    return (min if mode == "min" else max)(scored, key=lambda r: r.metrics[metric])


def _varying(results) -> list[str]:
    configs = [r.config or {} for r in results]
    return sorted({k for c in configs for k in c if len({str(cc.get(k)) for cc in configs}) > 1})


FINAL_VAL_LOSS = "final_val_loss"  # run_job's summary: the validation loss at the last step


def format_results(results, metric: str = tune_spaces.METRIC, steps: int | None = None) -> str:
    """A plain-text table: one line per trial, the varying config and the key metrics; a
    trial the scheduler stopped early shows "pruned@STEP"."""
    rows = [(r.config or {}, r.metrics or {}, r.error, _pruned(r, steps)) for r in results]
    varying = _varying(results)
    ranked = [metric] if metric not in (tune_spaces.METRIC, tune_spaces.TRAIN_LOSS) else []
    if metric != tune_spaces.VAL_LOSS and any(FINAL_VAL_LOSS in m for _, m, _, _ in rows):
        ranked.append(FINAL_VAL_LOSS)  # a throughput study on data with a validation split
    header = varying + ranked + ["tokens/s", "loss", "peak MiB", "status"]
    lines = [header]
    for config, metrics, error, pruned in rows:
        peak = metrics.get("peak_memory_bytes")
        loss = metrics.get("final_loss", metrics.get("loss"))
        status = "ERROR" if error else f"pruned@{metrics.get('step')}" if pruned else \
            "ok" if metric in metrics else "unfinished"
        lines.append([_cell(config.get(k)) for k in varying]
                     + [f"{metrics[m]:.4f}" if m in metrics else "-" for m in ranked] + [
            f"{metrics.get(tune_spaces.METRIC, float('nan')):.0f}",
            f"{loss:.4f}" if isinstance(loss, (int, float)) else "-",
            f"{peak / 2**20:.1f}" if isinstance(peak, (int, float)) else "-", status])
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in lines)


def _cell(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("space", choices=tune_spaces.STUDIES, help="the study (a module of tune_spaces/)")
    parser.add_argument("--address", default=None,
                        help="Ray cluster address (e.g. 'auto' on the head node); default: embedded local Ray")
    parser.add_argument("--storage-path", default=DEFAULT_STORAGE,
                        help="Tune/Train results root, shared by all nodes on a cluster "
                             "(e.g. /mnt/shared/ray_results); the study resumes from <storage-path>/<space>")
    parser.add_argument("--num-samples", type=int, default=None,
                        help="trials drawn from the param space (a grid: its repeats); default: the study's "
                             "(lr: 12, the others: 1)")
    parser.add_argument("--search", choices=tune_spaces.SEARCHES, default="grid",
                        help="grid: the study's grid; random: draws from its distributions; optuna: "
                             "Optuna's TPE (lr study)")
    parser.add_argument("--scheduler", choices=tune_spaces.SCHEDULERS, default="fifo",
                        help="fifo: every trial runs to its end; asha: stops trials whose metric lags "
                             "(ASHA over the trials' per-step reports)")
    parser.add_argument("--max-failures", type=int, default=0,
                        help="retries of a trial that fails (default 0: a failed trial stays failed)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the optuna search")
    parser.add_argument("--max-concurrent", type=int, default=None,
                        help="trials at once; default: as many as the cluster's GPUs/CPUs can serve")
    parser.add_argument("--data-dir", default=None,
                        help="prepared training data, on shared storage for a cluster "
                             "(default ./data/stdlib-bytes, prepared if missing)")
    parser.add_argument("--verbose", action="store_true",
                        help="forward the trials' own output (training steps, Ray Train) to this terminal")
    parser.add_argument("--tracking-uri", default=None,
                        help="MLflow store; default MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlflow.db")


def run(args: argparse.Namespace) -> int:
    import ray

    tracking_uri = resolve_tracking_uri(args.tracking_uri)
    check_store(tracking_uri)  # before Ray starts: seconds, not minutes of MLflow retries
    started = not ray.is_initialized()
    if started and args.address:
        ray.init(address=args.address, logging_level="WARNING" if args.verbose else "ERROR", log_to_driver=args.verbose)
    elif started:  # a new embedded instance, never someone else's cluster found on this machine
        ray.init(address="local", include_dashboard=False, object_store_memory=300 * 2**20,
                 logging_level="WARNING" if args.verbose else "ERROR", log_to_driver=args.verbose,
                 runtime_env={"env_vars": local_train_env()})
    try:
        results = run_study(args.space, storage_path=args.storage_path, tracking_uri=tracking_uri,
                            num_samples=args.num_samples, max_concurrent=args.max_concurrent,
                            data_dir=args.data_dir, search=args.search, scheduler=args.scheduler,
                            max_failures=args.max_failures, seed=args.seed)
    except ValueError as error:  # a study that does not fit the cluster, a bad option
        print(f"mpipemoe sweep {args.space}: {error}", file=sys.stderr)
        return 2
    finally:
        if started:
            ray.shutdown()
    module = tune_spaces.load(args.space)
    space = module.param_space(args.search)
    metric, mode = tune_spaces.ranking(module, space)
    print(format_results(results, metric, space.get("steps")))
    pruned, best = count_pruned(results, space), best_trial(results, metric, mode)
    if best is not None:
        chosen = ", ".join(f"{k}={_cell(best.config.get(k))}" for k in _varying(results))
        print(f"Best trial ({'lowest' if mode == 'min' else 'highest'} {metric}): {chosen or best.path} "
              f"{metric} {best.metrics[metric]:.4g}" + (f"; {pruned} of {len(results)} trials pruned by "
                                                        f"{args.scheduler}" if args.scheduler != "fifo" else ""))
    print(f"MLflow experiment {args.space!r} in {tracking_uri}; next: {invocation()} report --experiment "
          f"{args.space}" + ("" if tracking_uri == resolve_tracking_uri(None) else f" --tracking-uri {tracking_uri}"))
    failed, finished = count_trials(results, metric)
    if failed + finished < len(results):
        print(f"Study interrupted ({finished}/{len(results)} trials finished): run the same command "
              f"again to resume it.")
    return 0 if finished == len(results) else 1
