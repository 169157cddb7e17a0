"""Running a training job: the driver side of ``mpipemoe train``, shared by the commands that
run training jobs (train, sweep, capacity).

    job = TrainJob(preset="tiny-gpt", steps=50)      # app/jobs/job.py: validated, paths made absolute
    summary = run_job(job)                           # checks, Ray, one MLflow run, the summary

Three layers (docs/design.md §3): ``workers.loop.train_fn_per_worker`` runs in every worker;
``build_trainer(job)`` (app/jobs/ray_start.py) makes the ``TorchTrainer``; ``run_job(job)``
starts/joins Ray, fits, and logs one MLflow run. The sweep calls ``run_job`` inside Ray Tune
trials; the capacity search calls ``build_trainer`` with its own worker function.

``run_job`` checks the job before Ray starts (app/jobs/preflight.py; a recorded run's settings:
app/jobs/resume.py), holds the run name's lock, fits so that Ctrl-C and SIGTERM stop the
workers after their current step with a checkpoint (``TrainingInterrupted``), and ends the
MLflow run with the summary (app/jobs/progress.py).

MLflow is written by the *driver* only, from per-step metrics that rank 0 puts on a
small Ray queue actor: workers on a cluster may not reach the tracking store, the
driver always can, and the driver also prints live progress from the same stream.

Ray (the ``ray`` extra) is imported inside the functions that start or inspect a job:
``TrainJob``, its checks and ``mpipemoe train --help`` work without it, and importing it
costs seconds.
"""
from __future__ import annotations

import dataclasses
import threading
import time

import torch

from app.jobs.job import TrainJob, model_memory
from app.jobs.preflight import check_sizes, ensure_data
from app.jobs.progress import _MetricsPump, _recorded_last_step, _root_cause, failure_message, summarize
from app.jobs.ray_start import _only_this_machine, build_trainer, check_resources, init_ray
from app.jobs.resume import (RUN_DATA, _checkpoint_step, _read_job, check_continues, choose_checkpoint, record_segment,
                             resume_command, save_job)
from app.tracking.offline import PENDING_FILE, is_remote
from app.tracking.run_kinds import TRAIN, kind_tags
from app.tracking.runlock import RunLock
from app.tracking.store import NO_TRACKING, NullRun, RunLogger, check_store, client, find_run, metric_history
from lm import data as data_lib
from lm.errors import os_error
from workers import checkpoint as ckpt
from workers.control import Terminated, new_stop_flag, on_this_node, sigterm_as_interrupt
from workers.config import WorkerConfig


def _run_params(job: TrainJob, config: WorkerConfig) -> dict:
    params = {k: v for k, v in dataclasses.asdict(job).items() if v is not None}
    params["resolved"] = config.settings()
    params["model"] = config.preset_dict()
    try:
        params["model"].update(model_memory(job, config))
    except Exception as error:  # the count is informative only
        params["model"]["params_error"] = repr(error)[:200]
    return params


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped a job; the message says where it stopped and how to continue;
    ``exit_code`` is the command's status (130 after Ctrl-C, ``SIGTERM_EXIT_CODE`` after SIGTERM)."""

    def __init__(self, message: str, exit_code: int = 130):
        super().__init__(message)
        self.exit_code = exit_code


# After Ctrl-C the workers finish their step and write a checkpoint; a step plus a checkpoint
# of the largest presets takes well under this. A second Ctrl-C abandons the wait.
STOP_GRACE_S = 60


def _fit_interruptibly(trainer, stop_flag, echo) -> tuple:
    """``trainer.fit()`` in a thread, so that Ctrl-C reaches us (not Ray Train's own SIGINT
    handler, which aborts the workers mid-step and mid-checkpoint). Returns (result, error,
    interrupted, abandoned): on Ctrl-C or SIGTERM (``interrupted`` is that KeyboardInterrupt,
    ``workers.control.Terminated`` for SIGTERM, else None) the workers are asked to stop after
    their current step with a checkpoint; a second signal or STOP_GRACE_S without an answer
    abandons them (the caller then disconnects from Ray, which ends the job's actors)."""
    outcome, finished = {}, threading.Event()

    def target():
        try:
            outcome["result"] = trainer.fit()
        except BaseException as caught:  # noqa: BLE001 - handed to the caller
            outcome["error"] = caught
        finally:
            finished.set()

    # An Event, not Thread.join(timeout): a KeyboardInterrupt inside join() can leave the
    # thread marked as ended while it still runs (CPython bpo-45274).
    threading.Thread(target=target, name="mpipemoe-fit", daemon=True).start()
    interrupted, abandoned = None, False
    deadline = None
    with sigterm_as_interrupt():  # SIGTERM (schedulers, docker stop) stops the workers as Ctrl-C does
        while not finished.is_set():
            try:
                finished.wait(0.2)
                if deadline is not None and time.monotonic() > deadline and not finished.is_set():
                    echo(f"[mpipemoe] the workers did not stop within {STOP_GRACE_S} s: abandoning them")
                    abandoned = True
                    break
            except KeyboardInterrupt as caught:
                how = "SIGTERM" if isinstance(caught, Terminated) else "Ctrl-C"
                if interrupted:
                    echo(f"[mpipemoe] second {how}: abandoning the workers now")
                    abandoned = True
                    break
                interrupted = caught
                deadline = time.monotonic() + STOP_GRACE_S
                echo(f"[mpipemoe] {how}: stopping the workers after their current step, with a checkpoint "
                     f"({how} again to abandon them at once)")
                stop_flag.request.remote()
    result = outcome.get("result")
    return result, outcome.get("error") or getattr(result, "error", None), interrupted, abandoned


def run_job(job: TrainJob, address: str | None = None, echo=print, on_step=None,
            verbose: bool = False, extra_config: dict | None = None) -> dict:
    """Run ``job`` on Ray (embedded local Ray unless ``address`` or Ray is already up).

    Logs one MLflow run (reopened when ``job.name`` resumes an earlier run) and returns a
    summary: name, engine, status, steps, first/final loss, tokens_per_s (median),
    step_time_s (median), peak_memory_bytes (max over ranks and steps), partitions/strategy
    when the engine exposes them, restarts, skipped_steps, mlflow_run_id, checkpoint_path,
    run_dir, history (the per-step metrics). ``on_step(metrics)`` is called from a driver
    thread per step; when it returns STOP_JOB the workers stop after their current step;
    ``extra_config`` goes to the workers (see ``build_trainer``).

    Before Ray starts (within seconds, writing nothing): the data, the sizes against this
    machine, the MLflow store, the run name's lock (one live job per name) and, for an
    existing run, the settings its checkpoints are tied to. Raises ``ValueError`` for
    those and for a cluster that cannot hold the workers, ``RuntimeError`` naming the
    cause when training fails, and ``TrainingInterrupted`` after Ctrl-C (the workers stopped
    with a checkpoint, the MLflow run KILLED, the message has the resume command).
    """
    import ray

    ensure_data(job, echo)
    if address is None and (not ray.is_initialized() or _only_this_machine()):
        check_sizes(job, local=True, use_gpu=job.use_gpu if job.use_gpu is not None else torch.cuda.is_available())
    check_store(job.tracking_uri)
    with RunLock(job.storage_path, job.name, echo=echo) as lock:
        check_continues(job)
        return _run_locked(job, lock, address, echo, on_step, verbose, extra_config)


def _run_locked(job, lock, address, echo, on_step, verbose, extra_config) -> dict:
    import ray
    from ray.util.queue import Queue

    started_ray = init_ray(job, address, verbose)
    metrics_queue = Queue(actor_options=on_this_node())
    stop_flag = new_stop_flag()
    run = None
    abandoned = False
    try:
        trainer = build_trainer(job, metrics_queue, extra_config=extra_config, stop_flag=stop_flag)
        check_resources(trainer.scaling_config, [n["Resources"] for n in ray.nodes() if n["Alive"]])
        config = trainer.train_loop_config
        resuming = job.run_dir.exists()
        if resuming:  # before MLflow is touched: a run that cannot resume keeps its status
            # the workers read the trainer's config when it fits
            trainer.train_loop_config = config = config.replace(resume_from=choose_checkpoint(job, echo))
        recorded = _read_job(job)  # the previous segment's settings ({} for a new run)
        # A run that already reached --steps trains nothing: no segment, its settings file kept
        # (a finished run is left unchanged; train says so)
        nothing_left = bool(config.resume_from) and _checkpoint_step(config.resume_from) >= job.steps
        logged_through, previous_status = 0, None
        try:
            if job.tracking_uri == NO_TRACKING:
                run = NullRun()
            elif resuming and (previous := find_run(job.tracking_uri, job.experiment, "ray_train_name", job.name)):
                previous_status = client(job.tracking_uri).get_run(previous).info.status
                logged_through = max((s for s, _ in metric_history(job.tracking_uri, previous, "loss")), default=0)
                run = RunLogger.resume(job.tracking_uri, previous, system_metrics=True)
                echo(f"[mpipemoe] resuming {job.name} (MLflow run {previous})")
                if config.resume_from and not nothing_left:
                    record_segment(run, job, recorded, _checkpoint_step(config.resume_from) + 1, echo)
            else:
                run = RunLogger.start(job.tracking_uri, job.experiment, run_name=job.name,
                                      parent_run_id=job.parent_run_id,
                                      tags={"ray_train_name": job.name, "engine": job.engine,
                                            "preset": job.model_label, **kind_tags(TRAIN),
                                            "run_dir": str(job.run_dir)}, system_metrics=True)
                run.log_params(_run_params(job, config))
        except Exception as error:  # the store passed check_store, then failed (full disk, lock, server)
            lines = str(error).strip().splitlines()
            raise RuntimeError(f"MLflow store {job.tracking_uri} failed: {type(error).__name__}: "
                               f"{lines[0][:300] if lines else ''}: check it, or use --tracking-uri none") from error
        if not nothing_left:  # only now: a start refused or failed above leaves the run's settings as they were
            save_job(job)
        try:
            data_lib.keep_copy(job.data_dir, job.run_dir / RUN_DATA)
        except OSError as error:
            raise os_error(error, f"cannot write {job.run_dir / RUN_DATA}",
                           "free space there or choose another --storage-path") from error
        lock.update(mlflow_run_id=run.run_id)
        if run.run_id and is_remote(job.tracking_uri):  # a tracking server: survive it going away
            run.keep_offline(job.run_dir / PENDING_FILE, echo=echo)
        device = "GPU (nccl)" if config.use_gpu else "CPU (gloo)"
        accum = f" x {job.grad_accum} micro-batches" if job.grad_accum > 1 else ""
        echo(f"[mpipemoe] {job.name}: {job.model_label} / {job.engine}, {job.num_workers} workers (expert groups of "
             f"{config.expert_parallel}) on "
             f"{device}, {config.dtype} compute over {job.param_dtype} weights, dense part "
             f"{'FSDP2' if job.shard_dense else 'DDP'}, batch {job.batch_size}x{config.seq_len}{accum} "
             f"per worker, {job.steps} steps")
        memory = model_memory(job, config)
        mib = {k: v / 2**20 for k, v in memory.items() if k.endswith("_bytes")}
        echo(f"[mpipemoe] training state per worker {mib['training_state_bytes']:,.1f} MiB: {job.param_dtype} weights "
             f"{mib['master_params_bytes']:,.1f} + gradients {mib['grads_bytes']:,.1f} + AdamW moments "
             f"{mib['optimizer_state_bytes']:,.1f}"
             + (f" + {config.dtype} compute copy {mib['compute_copy_bytes']:,.1f}" if memory["compute_copy_bytes"]
                else "") + (" (dense part sharded)" if job.shard_dense else ""))
        if run.run_id:
            echo(f"[mpipemoe] MLflow run {run.run_id} in {job.tracking_uri} (experiment {job.experiment})")
        started = time.perf_counter()
        with _MetricsPump(metrics_queue, run, job, echo, _stopping_hook(on_step, stop_flag, config.hold_steps),
                          logged_through) as pump:
            result, error, interrupted, abandoned = _fit_interruptibly(trainer, stop_flag, echo)
        done = pump.history[-1]["step"] if pump.history else None
        if interrupted and (abandoned or error is not None or done != job.steps):
            checkpoint = result.checkpoint.path if (result is not None and not abandoned and result.checkpoint) \
                else None
            run.set_tags({"interrupted_at_step": done})
            run.finish("KILLED")
            where = f"after step {done} of {job.steps}" if done else "before its first step"
            saved = (f"checkpoint {checkpoint}" if checkpoint else
                     "no checkpoint written (--checkpoint-every 0)" if not job.checkpoint_every else
                     "the newest complete checkpoint is kept")
            killed = f"MLflow run {run.run_id} marked KILLED; " if run.run_id else ""
            raise TrainingInterrupted(f"{job.name} stopped {where}; {saved}; {killed}resume with: "
                                      f"{resume_command(job)}", getattr(interrupted, "exit_code", 130))
        if error is not None:
            run.set_tags({"error": _root_cause(error)})
            # A resume that failed before its first step leaves the run as it was (e.g. FINISHED).
            run.finish(previous_status if previous_status and not pump.history else "FAILED")
            raise RuntimeError(failure_message(job, error)) from error
        trained = bool(pump.history)
        if not trained and config.resume_from:  # nothing left: the chosen checkpoint's step
            reached = _checkpoint_step(config.resume_from)
        summary = summarize(pump.history or ([result.metrics] if result.metrics else _recorded_last_step(run)))
        summary.update(restarts=pump.restarts, name=job.name, engine=job.engine, preset=job.preset, status="FINISHED",
                       mlflow_run_id=run.run_id, run_dir=str(job.run_dir), steps_run=len(pump.history),
                       checkpoint_path=result.checkpoint.path if result.checkpoint else None,
                       wall_time_s=time.perf_counter() - started, expert_parallel=config.expert_parallel,
                       training_state_bytes=memory["training_state_bytes"])
        if not trained and config.resume_from and reached:
            summary["steps"] = reached
        if trained:  # a run that had already reached job.steps keeps its recorded summary
            run.log_metrics({f"summary_{k}": v for k, v in summary.items()
                             if k in ("final_loss", "tokens_per_s", "step_time_s", "peak_memory_bytes",
                                      "training_state_bytes", "model_tflops_per_s", "mfu", "final_val_loss",
                                      "final_val_ppl", "compile_time_s")},
                            step=summary.get("steps", 0))
        run.set_tags({k: summary[k] for k in ("partitions", "strategy", "split", "micro_batch_schedule",
                                              "checkpoint_path")
                      if summary.get(k) is not None})
        run.finish("FINISHED")
        for pruned in ckpt.prune(job.run_dir, job.keep_checkpoints):  # those of earlier fits too
            echo(f"[mpipemoe] deleted {pruned.name} (--keep-checkpoints {job.keep_checkpoints})")
        if getattr(run, "spool", None) is not None and run.spool.waiting:
            summary["mlflow_pending"] = str(run.spool.path)
        summary["history"] = pump.history
        return summary
    except BaseException:
        try:
            if run is not None and run.run_id and (run.spool is not None and run.spool.waiting
                                                   or run.client.get_run(run.run_id).info.status == "RUNNING"):
                run.finish("KILLED")
        except Exception:  # the store itself failed: the error being raised says so
            pass
        raise
    finally:
        if abandoned:
            ray.shutdown()  # ends this job's actors (controller, workers) at once
        else:
            metrics_queue.shutdown()
            if started_ray:
                ray.shutdown()


STOP_JOB = "stop"  # ``on_step`` returns it to stop the job after the current step (a pruned sweep trial)


def _stopping_hook(on_step, stop_flag, hold_steps=()):
    """``on_step`` for the metrics pump: a return of STOP_JOB asks the workers to stop after
    their current step (as Ctrl-C does: with a checkpoint where the job writes them), so the
    job ends and frees its workers' resources instead of being abandoned. At a hold step
    (``WorkerConfig.hold_steps``: rank 0 waits there) the hook always answers, go on or stop,
    so a pruned sweep trial trains no step past its rung."""
    if on_step is None and not hold_steps:
        return None

    def hook(metrics: dict) -> None:
        stop = False
        try:
            stop = on_step is not None and on_step(metrics) == STOP_JOB
        finally:
            if metrics["step"] in hold_steps:
                stop_flag.decide.remote(metrics["step"], stop)
            elif stop:
                stop_flag.request.remote()
    return hook
