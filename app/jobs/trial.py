"""One trial of a ``mpipemoe sweep`` study (app/jobs/sweep.py drives the study): the settings
every trial shares, the function trainable that turns a trial's config into a training job
(``train_trial``), the per-step report to Tune (``StepReporter``), the MLflow record of every
outcome (refused, failed, pruned), the trainable that stops a pruned trial's job
(``stopping_trainable``) and the gate that caps the jobs running at once (``TrialGate``).

Ray and Ray Tune are imported inside the functions that use them, and so are
app/jobs/job.py and app/jobs/launch.py (they load torch): `mpipemoe sweep --help` stays fast.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import tune_spaces
from app.tracking.run_kinds import STUDY, TRAIN, kind_tags
from app.tracking import sweep_rank
from app.tracking.store import RunLogger, find_run


@dataclass(frozen=True)
class TrialSettings:
    """What every trial of one study shares (passed with ``tune.with_parameters``)."""

    study: str                      # the study's name (--name): tag ``study``, trial run names
    tracking_uri: str
    train_storage_path: str         # where the trials' TorchTrainers keep checkpoints
    data_dir: str                   # prepared training data (absolute: trials run in their own cwd)
    parent_run_id: str | None
    use_gpu: bool
    cpus_per_worker: float | None
    metric: str = tune_spaces.METRIC  # what the trials report each step and Tune ranks by
    experiment: str | None = None   # MLflow experiment (--experiment); None: the study's name
    gate: Any = None                # a TrialGate actor: trials whose jobs may run at once
    rungs: tuple[int, ...] = ()     # steps where the scheduler (ASHA) may stop a trial

    @property
    def mlflow_experiment(self) -> str:
        return self.experiment or self.study


def train_trial(config: dict, *, settings: TrialSettings) -> None:
    """One Tune trial: one ``app.jobs.launch`` job with the trial's config; reports its summary.

    A setting the job refuses (``ValueError``: more partitions than tokens, a budget no
    setting meets, workers the cluster cannot hold) or whose training fails (``RuntimeError``:
    out of memory, a crashed worker) is a result, not an error of the study: its MLflow run
    (made here when the job made none) carries the study's tags, ``outcome`` (refused or
    failed) and ``reason``, and the trial reports ``outcome`` with a NaN metric, so a resume
    does not run it again. A trial the scheduler stopped (pruned) has its MLflow run tagged
    ``pruned_at_step`` and marked KILLED."""
    from ray import tune

    from app.jobs.job import TrainJob
    from app.jobs.launch import run_job

    trial_id = tune.get_context().get_trial_id()
    fields = {f.name for f in dataclasses.fields(TrainJob)}
    unknown = sorted(set(config) - fields)
    if unknown:
        raise ValueError(f"study {settings.study!r} sets {unknown}, which TrainJob does not have")
    extra = {"cpus_per_worker": settings.cpus_per_worker} if settings.cpus_per_worker else {}
    name = f"{settings.study}-{trial_id}"
    try:
        job = TrainJob(**{"use_gpu": settings.use_gpu, **extra, **config},
                       storage_path=settings.train_storage_path, name=name,
                       data_dir=settings.data_dir,
                       tracking_uri=settings.tracking_uri, experiment=settings.mlflow_experiment,
                       parent_run_id=settings.parent_run_id)
    except ValueError as error:
        tune.report(record_outcome(settings, trial_id, name, config, sweep_rank.REFUSED, error))
        return
    reporter = StepReporter(settings, job)
    held = tune_spaces.hold_steps(list(settings.rungs), job.steps, settings.metric, job.eval_every)
    try:
        summary = run_job(job, on_step=reporter, extra_config={"hold_steps": held} if held else None)
    except (ValueError, RuntimeError) as error:
        outcome = sweep_rank.REFUSED if isinstance(error, ValueError) else sweep_rank.FAILED
        tune.report(record_outcome(settings, trial_id, name, config, outcome, error))
        return
    run_id = summary.get("mlflow_run_id") or summary.get("run_id")
    if run_id:
        run = RunLogger(settings.tracking_uri, run_id)
        run.set_tags({"study": settings.study, "trial_id": trial_id, "outcome": sweep_rank.OK
                      if reporter.stopped is None else sweep_rank.PRUNED, **reporter.pruned_tags()})
        if summary.get("settled_peak_memory_bytes") is not None:
            run.log_metrics({"summary_settled_peak_memory_bytes": summary["settled_peak_memory_bytes"]},
                            step=summary.get("steps", 0), flush=True)
        if reporter.stopped is not None:  # Tune ended it early: MLflow says so too
            run.client.set_terminated(run_id, "KILLED")
    if reporter.stopped is None:  # a stopped trial reports nothing more: Tune has ended it
        tune.report(metric_first(trial_metrics(summary, settings.metric, reporter.last), settings.metric))


def record_outcome(settings: TrialSettings, trial_id: str, name: str, config: dict, outcome: str,
                   error: BaseException) -> dict:
    """A refused or failed setting as a result: its MLflow run (the job's, or a new FAILED one
    with the trial's config as params) tagged with the study, ``outcome`` and ``reason``;
    returns what the trial reports to Tune (``outcome``, ``reason``, a NaN metric)."""
    reason = " ".join(str(error).split())[:500] or type(error).__name__
    tags = {"study": settings.study, "trial_id": trial_id, "outcome": outcome, "reason": reason}
    if settings.tracking_uri != "none":
        run_id = find_run(settings.tracking_uri, settings.mlflow_experiment, "ray_train_name", name)
        if run_id:
            RunLogger(settings.tracking_uri, run_id).set_tags(tags)
        else:
            run = RunLogger.start(settings.tracking_uri, settings.mlflow_experiment, run_name=name,
                                  parent_run_id=settings.parent_run_id,
                                  tags={**kind_tags(TRAIN), "ray_train_name": name, **tags})
            run.log_params({k: v for k, v in config.items() if v is not None})
            run.finish("FAILED")
    print(f"[mpipemoe sweep] trial {trial_id} {outcome}: {reason}", file=sys.stderr)
    return {settings.metric: math.nan, "step": 0, "outcome": outcome, "reason": reason}


def metric_first(metrics: dict, metric: str) -> dict:
    """``metrics`` with the study's metric and the step first: Tune's live table shows the first
    four numbers a trial reports (ray.tune.experimental.output), and a step's report holds dozens."""
    first = [k for k in (metric, "step", tune_spaces.METRIC) if k in metrics]
    return {**{k: metrics[k] for k in first}, **metrics}


def _numbers(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class StepReporter:
    """``run_job``'s ``on_step``: reports each step that carries the study's metric to Tune
    (every step for the training loss and throughput, every evaluation for the validation
    loss), so a scheduler (ASHA) can stop a trial early. Called on the job's metrics thread.

    When Tune stops the trial (ASHA pruned it, or the study was interrupted), its next
    report raises ``SystemExit`` (Ray Tune's function trainable ends a trial that way).
    The reporter then returns ``app.jobs.launch.STOP_JOB``: the Train workers stop after their
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

        from app.jobs.launch import STOP_JOB

        numbers = _numbers(metrics)
        if self.stopped is not None or self.settings.metric not in numbers:
            return None
        try:
            tune.report(metric_first(numbers, self.settings.metric))
        except SystemExit:
            self.stopped = int(numbers.get("step", 0))
            return STOP_JOB
        self.last = numbers
        return None

    def pruned_tags(self) -> dict:
        """MLflow tags of a trial Tune stopped before its last step: ``pruned_at_step``, the step
        whose report Tune stopped it at (its rung; the workers held there and trained no more)."""
        if self.stopped is None or self.stopped >= self.job.steps:
            return {}
        return {"pruned_at_step": self.stopped}


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
    for key in ("partitions", "strategy", "split"):  # the settings an auto choice settled on
        if summary.get(key) is not None:
            metrics[key] = summary[key]
    if not math.isfinite(metrics.get(metric, math.nan)):
        raise RuntimeError(f"training run {summary.get('name')} reported no {metric}: "
                           f"see its MLflow run {summary.get('mlflow_run_id')}")
    return metrics


def study_parent_run(tracking_uri: str, experiment: str, experiment_path: str, description: str,
                     study: str | None = None) -> str:
    """The MLflow parent run of this study's experiment directory, reused on resume."""
    study = study or experiment
    run_id = find_run(tracking_uri, experiment, "study_path", experiment_path)
    if run_id:
        return RunLogger.resume(tracking_uri, run_id).run_id
    run = RunLogger.start(tracking_uri, experiment, run_name=f"study-{study}",
                          tags={**kind_tags(STUDY), "study": study, "study_path": experiment_path})
    run.log_params({"study": study, "description": description})
    return run.run_id


class TrialGate:
    """A Ray actor: at most ``limit`` trials run their Train jobs at once. Tune's own cap
    (``max_concurrent_trials``) does not hold for trials a restore starts again
    (``Tuner.restore(resume_errored=True)`` starts every errored trial at once; each holds a
    sliver of a CPU, their workers cannot all be placed and Ray Train retries forever):
    every trial passes this gate, so fresh and resumed studies keep the plan's cap.
    A trial id holds at most one place (a re-run of the same trial takes its own place)."""

    def __init__(self, limit: int) -> None:
        import asyncio

        self.limit = limit
        self.holders: set[str] = set()
        self.changed = asyncio.Condition()
        self.most = 0  # the most trials that held places at once

    async def enter(self, trial_id: str) -> int:
        async with self.changed:
            await self.changed.wait_for(lambda: trial_id in self.holders or len(self.holders) < self.limit)
            self.holders.add(trial_id)
            self.most = max(self.most, len(self.holders))
            return len(self.holders)

    async def leave(self, trial_id: str) -> None:
        async with self.changed:
            self.holders.discard(trial_id)
            self.changed.notify_all()

    async def busiest(self) -> int:
        return self.most


def gated(trainable):
    """``trainable(config, *, settings)`` that first takes a place at ``settings.gate`` (when set)
    and gives it back when it returns (a stopped trial returns: ``stopping_trainable``)."""

    def trial(config: dict, *, settings: TrialSettings) -> None:
        if settings.gate is None:
            return trainable(config, settings=settings)
        import ray
        from ray import tune

        trial_id = tune.get_context().get_trial_id()
        ray.get(settings.gate.enter.remote(trial_id))
        try:
            return trainable(config, settings=settings)
        finally:
            settings.gate.leave.remote(trial_id)

    return trial
