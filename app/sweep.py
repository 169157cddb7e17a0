"""``mpipemoe sweep SPACE``: a Ray Tune study from ``tune_spaces/``, one Ray Train run per trial.

    mpipemoe sweep smoke                                   # embedded local Ray, CPU workers
    mpipemoe sweep engines --address auto --storage-path /mnt/efs/ray_results

Layers (Ray's Train-inside-Tune pattern under Train V2, where ``Tuner(TorchTrainer)``
is not allowed): the driver builds a ``Tuner`` around the function trainable
``train_trial``; each trial turns its config into an ``app.jobs.TrainJob`` and
calls ``app.jobs.run_job``, which builds and fits a ``TorchTrainer`` and logs the
job as one MLflow run. The trial then reports the job's summary back to Tune.

- **Resources.** A trial itself holds ``TRIAL_CPUS`` and a sliver of the head node
  (so drivers, and the MLflow store they write to, stay on the head); its Train
  workers ask for their own resources. Tune cannot see those, so the driver caps
  ``max_concurrent_trials`` at what the cluster can serve (``plan_resources``).
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
    summary = run_job(job)
    run_id = summary.get("mlflow_run_id") or summary.get("run_id")
    if run_id:
        RunLogger(settings.tracking_uri, run_id).set_tags({"study": settings.study, "trial_id": trial_id})
    tune.report(trial_metrics(summary))


def trial_metrics(summary: dict) -> dict:
    """What a trial reports to Tune: the summary's numbers. A trial re-run on resume whose
    Train run had already finished reports that run's recorded numbers (run_job's summary),
    never NaN; a summary without the study's metric raises, naming the trial's run."""
    metrics = {k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if not math.isfinite(metrics.get(tune_spaces.METRIC, math.nan)):
        raise RuntimeError(f"training run {summary.get('name')} reported no {tune_spaces.METRIC}: "
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


def run_study(study: str, *, storage_path: str, tracking_uri: str, num_samples: int = 1,
              max_concurrent: int | None = None, data_dir: str | None = None, trainable=train_trial):
    """Run (or resume) study ``study`` on the connected Ray cluster; returns the ResultGrid.

    ``data_dir``: prepared training data; default ``./data/stdlib-bytes``, prepared here
    once if missing. ``trainable(config, *, settings)`` runs one trial; tests may pass a
    lighter one.
    """
    import ray
    from ray import tune

    module = tune_spaces.load(study)
    space = module.param_space()
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
                             cpus_per_worker=plan.cpus_per_worker)
    fn = tune.with_resources(tune.with_parameters(trainable, settings=settings), plan.trial_resources)
    if tune.Tuner.can_restore(experiment_path):
        print(f"Restoring study {study!r} from {experiment_path}: finished trials are kept, "
              f"unfinished and errored ones run (again)")
        tuner = tune.Tuner.restore(experiment_path, trainable=fn, resume_errored=True)
    else:
        print(f"Study {study!r}: {module.DESCRIPTION}\n"
              f"  up to {plan.max_concurrent_trials} trial(s) at once, "
              f"{'1 GPU' if plan.use_gpu else f'{plan.cpus_per_worker} CPU'} per worker; "
              f"results in {experiment_path}")
        tuner = tune.Tuner(
            fn, param_space=space,
            tune_config=module.tune_config(num_samples=num_samples,
                                           max_concurrent_trials=plan.max_concurrent_trials),
            run_config=tune.RunConfig(name=study, storage_path=storage_path,
                                      failure_config=tune.FailureConfig(max_failures=0)))
    parent = RunLogger(tracking_uri, parent_run_id)
    try:
        results = tuner.fit()
    except BaseException:
        parent.finish("FAILED")
        raise
    failed, finished = count_trials(results)
    parent.log_metrics({"trials": len(results), "trials_failed": failed, "trials_finished": finished},
                       flush=True)
    # KILLED: interrupted; running the study again resumes it (and reopens this run)
    parent.finish("FAILED" if failed else "FINISHED" if finished == len(results) else "KILLED")
    return results


def count_trials(results) -> tuple[int, int]:
    """(errored, finished) trials of a ResultGrid; the rest were interrupted or never started."""
    failed = sum(1 for r in results if r.error)
    finished = sum(1 for r in results if not r.error and tune_spaces.METRIC in (r.metrics or {}))
    return failed, finished


def format_results(results) -> str:
    """A plain-text table: one line per trial, the varying config and the key metrics."""
    rows = [(r.config or {}, r.metrics or {}, r.error) for r in results]
    varying = sorted({k for c, _, _ in rows for k in c if len({str(cc.get(k)) for cc, _, _ in rows}) > 1})
    header = varying + ["tokens/s", "loss", "peak MiB", "status"]
    lines = [header]
    for config, metrics, error in rows:
        peak = metrics.get("peak_memory_bytes")
        loss = metrics.get(tune_spaces.VAL_METRIC, metrics.get("final_loss", metrics.get("loss")))  # val where present
        lines.append([str(config.get(k)) for k in varying] + [
            f"{metrics.get(tune_spaces.METRIC, float('nan')):.0f}",
            f"{loss:.4f}" if isinstance(loss, (int, float)) else "-",
            f"{peak / 2**20:.1f}" if isinstance(peak, (int, float)) else "-",
            "ERROR" if error else "ok" if tune_spaces.METRIC in metrics else "unfinished"])
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("space", choices=tune_spaces.STUDIES, help="the study (a module of tune_spaces/)")
    parser.add_argument("--address", default=None,
                        help="Ray cluster address (e.g. 'auto' on the head node); default: embedded local Ray")
    parser.add_argument("--storage-path", default=DEFAULT_STORAGE,
                        help="Tune/Train results root, shared by all nodes on a cluster "
                             "(e.g. /mnt/shared/ray_results); the study resumes from <storage-path>/<space>")
    parser.add_argument("--num-samples", type=int, default=1, help="samples of the param space (grid repeats)")
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
                 logging_level="WARNING" if args.verbose else "ERROR", log_to_driver=args.verbose)
    try:
        results = run_study(args.space, storage_path=args.storage_path, tracking_uri=tracking_uri,
                            num_samples=args.num_samples, max_concurrent=args.max_concurrent,
                            data_dir=args.data_dir)
    except ValueError as error:  # a study that does not fit the cluster, a bad option
        print(f"mpipemoe sweep {args.space}: {error}", file=sys.stderr)
        return 2
    finally:
        if started:
            ray.shutdown()
    print(format_results(results))
    print(f"MLflow experiment {args.space!r} in {tracking_uri}; next: {invocation()} report --experiment "
          f"{args.space}" + ("" if tracking_uri == resolve_tracking_uri(None) else f" --tracking-uri {tracking_uri}"))
    failed, finished = count_trials(results)
    if failed + finished < len(results):
        print(f"Study interrupted ({finished}/{len(results)} trials finished): run the same command "
              f"again to resume it.")
    return 0 if finished == len(results) else 1
