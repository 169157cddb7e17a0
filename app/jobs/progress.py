"""A running job's progress and outcome, on the driver: the metrics pump (``_MetricsPump``: the
per-step metrics that rank 0 puts on a small Ray queue become the history, the console's step
lines and the MLflow metrics; a restart of the workers is said and recorded), the summary of a
run (``summarize``; for a run that had nothing left to train, its last recorded step:
``_recorded_last_step``) and the line a failed job ends with (``failure_message``: the root
cause, a dead worker said as such, and the command that resumes the run), and what the train
command prints and writes of a finished run (``steps_done``, ``write_summary_json``).
"""
from __future__ import annotations

import dataclasses
import json
import queue as queue_lib
import statistics
import threading
import time
from pathlib import Path

from app.jobs.job import TrainJob
from app.jobs.resume import resume_command
from app.tracking.records import record_meta
from moe_engine.granularity import Setting
from workers import checkpoint as ckpt


def _format_step(m: dict, steps: int, elapsed_s: float, eta_s: float | None = None) -> str:
    """The console's step line: losses, rate, memory; then the MoE load imbalance (max / mean
    expert load of the worst layer, on the steps that read it), the tokens seen and the ETA."""
    line = (f"[{elapsed_s:5.0f}s] step {m['step']:>4}/{steps}  loss {m['loss']:.4f}  lm {m['lm_loss']:.4f}  "
            f"aux {m['aux_loss']:.3f}  lr {m['lr']:.2e}  gnorm {m['grad_norm']:.2f}  tok/s {m['tokens_per_s']:>9,.0f}  "
            f"step {m['step_time_s']:.3f}s  peak {m['peak_memory_bytes'] / 2**20:,.0f} MiB"
            + (f"  MFU {m['mfu']:.1%}" if "mfu" in m else "")
            + (f"  compile {m['compile_time_s']:.1f}s" if "compile_time_s" in m else "")
            + (f"  load {m['moe_load/imbalance_max']:.2f}" if "moe_load/imbalance_max" in m else "")
            + (f"  seen {_short_count(m['tokens_seen'])} tok" if "tokens_seen" in m else "")
            + (f"  ETA {_short_duration(eta_s)}" if eta_s is not None else ""))
    shown = {**m, "partitions": Setting(m["partitions"], m.get("split") or "tokens").label} if "partitions" in m else m
    choices = [f"{k}={shown[k]}" for k in ("partitions", "strategy") if k in shown]
    return line + (f"  [{' '.join(choices)}]" if choices else "")


def _short_count(count: float) -> str:
    """1234 -> "1,234"; 10240 -> "10.2k"; 3.5e9 -> "3.5G" (three significant digits from 10,000)."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if count >= max(size * 0.9995, 1e4):  # 999,999 is "1M", not "1e+03k"
            return f"{count / size:.3g}{unit}"
    return f"{count:,.0f}"


def _short_duration(seconds: float) -> str:
    """42 -> "42s"; 125 -> "2m05s"; 7300 -> "2h01m"."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class _MetricsPump:
    """Driver side of the metrics stream: queue -> history, progress lines, MLflow.

    A restart of the workers by Ray Train shows as a new ``attempt`` id (or a step that
    goes back): it is printed and recorded in MLflow (tag and metric ``restarts``).
    Steps up to ``logged_through`` (a resumed run's last step already in MLflow, replayed
    from an earlier checkpoint with the same values: exact resume) are not logged again.

    What MLflow holds when the driver dies: every step the console has shown, because a step
    line is printed only after its metrics are sent (flushed). Steps logged since the last shown
    one (at most ``--log-every`` - 1) are buffered and a SIGKILL loses them; so are steps the
    workers ran after their driver died. A resume continues from the newest intact checkpoint,
    so those of them at or before it stay missing from the run's history.
    """

    def __init__(self, metrics_queue, run, job: TrainJob, echo, on_step, logged_through: int = 0):
        self.queue, self.run, self.job, self.echo, self.on_step = metrics_queue, run, job, echo, on_step
        self.logged_through = logged_through
        self.history: list[dict] = []
        self.restarts = 0
        self._attempt = None
        self._pace_from: tuple[int, float] | None = None  # (step, time) the ETA measures from
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mpipemoe-metrics", daemon=True)
        self._started = time.perf_counter()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        while not self.queue.empty():
            self._handle(self.queue.get_nowait())
        self.run.flush()

    def _loop(self):
        from ray.util.queue import Empty

        while not self._stop.is_set():
            try:
                self._handle(self.queue.get(timeout=0.5))
            except (Empty, queue_lib.Empty):
                continue

    def _eta_s(self, step: int) -> float | None:
        """Seconds to the last step at the wall-clock pace since the first step this attempt
        reported (checkpoints and validation included); None at that step and the last."""
        now = time.perf_counter()
        if self._pace_from is None:
            self._pace_from = (step, now)
        first, since = self._pace_from
        if step <= first or step >= self.job.steps:
            return None
        return (now - since) / (step - first) * (self.job.steps - step)

    def _handle(self, metrics: dict):
        step, attempt = metrics["step"], metrics.get("attempt")
        went_back = bool(self.history) and step <= self.history[-1]["step"]
        if went_back or (attempt is not None and self._attempt not in (None, attempt)):
            self.restarts += 1
            self.echo(f"[mpipemoe] workers restarted from a checkpoint ({self.restarts} restart(s)); "
                      f"continuing at step {step}")
            self.run.set_tags({"restarts": self.restarts})
            self.run.log_metrics({"restarts": self.restarts}, step=step)
            self.history = [m for m in self.history if m["step"] < step]
            self._pace_from = None
        self._attempt = attempt
        if metrics.get("skipped"):
            reason = metrics.get("skip_reason") or \
                f"non-finite loss (lm_loss={metrics['lm_loss']}, aux_loss={metrics['aux_loss']})"
            self.echo(f"[mpipemoe] step {step} skipped: {reason}; no update")
        self.history.append(metrics)
        if step > self.logged_through:
            self.run.log_metrics({k: v for k, v in metrics.items() if k != "step"}, step=step)
        if step == 1 or step % self.job.log_every == 0 or step == self.job.steps:
            self.run.flush()  # before the line: a step the console shows is in MLflow, even if a SIGKILL follows
            self.echo(_format_step(metrics, self.job.steps, time.perf_counter() - self._started, self._eta_s(step)))
        if "val_loss" in metrics:
            self.echo(f"[{time.perf_counter() - self._started:5.0f}s] step {step:>4}/{self.job.steps}  "
                      f"val loss {metrics['val_loss']:.4f} ppl {metrics['val_ppl']:.2f}")
        if self.on_step is not None:
            self.on_step(metrics)


def summarize(history: list[dict]) -> dict:
    """Final loss, median tokens/s, model TFLOP/s, MFU and step time (step 1 excluded when possible), max peak
    memory over the run and over its second half (``settled_peak_memory_bytes``: what the
    settings chosen online need, without the search's and calibration's peaks; on CUDA);
    losses from the steps that were not skipped (non-finite), listed in ``skipped_steps``."""
    if not history:
        return {}
    steady = history[1:] or history
    trained = [m for m in history if not m.get("skipped")] or history
    last = trained[-1]
    summary = {
        "steps": history[-1]["step"], "first_step": history[0]["step"],  # a resumed run starts past 1
        "first_loss": trained[0]["loss"], "final_loss": last["loss"],
        "final_lm_loss": last["lm_loss"], "final_aux_loss": last["aux_loss"],
        "skipped_steps": [m["step"] for m in history if m.get("skipped")],
        "tokens_per_s": statistics.median(m["tokens_per_s"] for m in steady),
        "step_time_s": statistics.median(m["step_time_s"] for m in steady),
        "peak_memory_bytes": max(m["peak_memory_bytes"] for m in history),
        # after the online choice of n and strategy has settled: the second half of the run
        "settled_peak_memory_bytes": max(m["peak_memory_bytes"] for m in history[len(history) // 2:]),
    }
    for key in ("model_tflops_per_s", "mfu"):  # model FLOPs (docs/training.md); MFU on known GPUs
        if all(key in m for m in steady):
            summary[key] = statistics.median(m[key] for m in steady)
    for key in ("partitions", "strategy", "split", "micro_batch_schedule", "compile_time_s"):
        if key in history[-1]:
            summary[key] = history[-1][key]
    evaluated = [m for m in history if "val_loss" in m]
    if evaluated:  # the last evaluation: at the last step (or the step a stopped run reached)
        summary.update(final_val_loss=evaluated[-1]["val_loss"], final_val_ppl=evaluated[-1]["val_ppl"],
                       first_val_loss=evaluated[0]["val_loss"])
    return summary


def _recorded_last_step(run) -> list[dict]:
    """The MLflow run's last logged step as one metrics dict (a run that had already reached
    its steps trains nothing; its summary comes from what it recorded), or []."""
    if not run.run_id:
        return []
    metrics = run.client.get_run(run.run_id).data.metrics
    if "loss" not in metrics:
        return []
    last = max(m.step for m in run.client.get_metric_history(run.run_id, "loss"))
    return [{"step": last, **metrics}]


# How gloo, NCCL and Ray word a worker that died (killed, out of memory, its node gone); Ray 2.60
# says "The actor is dead because its worker process has died" inside a WorkerGroupError.
_LOST_WORKER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "ActorDiedError",
                "ActorUnavailableError", "WorkerCrashedError", "NodeDiedError", "died unexpectedly",
                "exited unexpectedly", "NCCL communicator was aborted", "The actor is dead",
                "worker process has died", "worker process died", "A worker died or was killed")


def _lost_worker(error: BaseException) -> str | None:
    """``Type: line`` of the first line in ``error``'s chain (itself, its causes, Ray's ``cause``)
    that says a worker died, or None: Ray's paragraph and log lines are left out."""
    seen: set[int] = set()
    found: BaseException | None = error
    while found is not None and id(found) not in seen:
        seen.add(id(found))
        for line in str(found).splitlines():
            at = min((line.find(marker) for marker in _LOST_WORKER if marker in line), default=-1)
            if at >= 0:
                end = line.find(". ", at)  # the sentence that says it, not Ray's guesses after it
                return f"{type(found).__name__}: {(line if end < 0 else line[:end + 1]).strip()[:300]}"
        found = getattr(found, "cause", None) or found.__cause__ or found.__context__
    return None


def failure_message(job: TrainJob, error: BaseException) -> str:
    """The one line a failed job ends with: the root cause (a dead worker said as such, not in
    gloo's or Ray's words) and, when the run has a complete checkpoint, the command that resumes it."""
    lost = _lost_worker(error)
    cause = _root_cause(error) if lost is None else \
        f"a worker process ended or lost its connection (killed, out of memory, or its node went away): {lost}"
    try:
        chosen, _ = ckpt.choose(job.run_dir)
    except OSError:
        chosen = None
    hint = (f"; resume from {chosen.name} with: {resume_command(job)}" if chosen is not None
            else f" (no checkpoint was written yet; to train it again from step 1: {resume_command(job)})"
            if job.checkpoint_every else "")
    return f"training job {job.name} failed: {cause}{hint}"


def _root_cause(error: BaseException) -> str:
    """The innermost exception's type and message (Ray wraps worker errors several times)."""
    seen = error
    while True:
        nested = getattr(seen, "cause", None) or seen.__cause__
        if nested is None or nested is seen:
            break
        seen = nested
    text = str(seen).strip().splitlines()
    return f"{type(seen).__name__}: {text[-1] if text else ''}"


def write_summary_json(path: str, summary: dict, job: TrainJob) -> None:
    """The summary (or comparison) with the command, date, hardware and settings under ``meta``."""
    meta = {**record_meta("train", use_gpu=job.use_gpu is not False),
            "job": {k: v for k, v in dataclasses.asdict(job).items() if v is not None}}
    Path(path).write_text(json.dumps({"meta": meta, **summary}, indent=1, default=str) + "\n")


def steps_done(summary: dict) -> str:
    """``50 steps``, or for a resumed run ``steps 301-312 (12 in this run, 312 in all)``: the
    losses and speeds beside it are those of the steps this run trained."""
    first, last = summary.get("first_step", 1), summary["steps"]
    if first <= 1:
        return f"{last} steps"
    return f"steps {first}-{last} ({summary.get('steps_run', last - first + 1)} in this run, {last} in all)"
