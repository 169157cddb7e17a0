"""The capacity search of ``mpipemoe capacity`` (app/commands/capacity.py): each engine's largest
batch under one memory cap, as a Ray Train job whose workers search it with real training
steps (``workers/capacity.py``), its table and its MLflow runs.

Ray (the ``ray`` extra) is imported where the search starts, as in app/jobs/launch.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from app.jobs.job import TrainJob
from app.jobs.preflight import ensure_data
from app.jobs.ray_start import build_trainer, init_ray
from app.tracking.records import CapacityResult, EngineCapacity
from app.tracking.run_kinds import CAPACITY, kind_tags
from app.tracking.store import NO_TRACKING, RunLogger
from workers.capacity import capacity_fn_per_worker
from workers.control import on_this_node


@dataclass(frozen=True)
class CapacitySearch:
    """How the batch size is searched.

    memory_cap_gib:  GPU memory each worker may use (None: the whole GPU); ignored on CPU.
    start_batch:     first batch size tried (sequences per worker); doubled until one fails.
    max_batch:       the search never tries more than this.
    steps_per_trial: training steps per size (the fastest step after the first is timed).
    """

    memory_cap_gib: float | None = None
    start_batch: int = 8
    max_batch: int = 256
    steps_per_trial: int = 3

    def __post_init__(self) -> None:
        if self.memory_cap_gib is not None and not self.memory_cap_gib > 0:
            raise ValueError(f"CapacitySearch.memory_cap_gib={self.memory_cap_gib!r} is invalid: "
                             f"give a size in GiB > 0, e.g. --memory-cap-gib 32")
        for name in ("start_batch", "max_batch", "steps_per_trial"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"CapacitySearch.{name}={value!r} is invalid: give an integer >= 1")
        if self.start_batch > self.max_batch:
            raise ValueError(f"CapacitySearch.start_batch={self.start_batch} is invalid: "
                             f"it must not exceed max_batch={self.max_batch}")

    def worker_settings(self) -> dict:
        cap = None if self.memory_cap_gib is None else int(self.memory_cap_gib * 2**30)
        return {"memory_cap_bytes": cap, "start_batch": self.start_batch, "max_batch": self.max_batch,
                "steps_per_trial": self.steps_per_trial}


def find_capacity(job: TrainJob, search: CapacitySearch, echo=print, address: str | None = None) -> EngineCapacity:
    """Run the search for ``job.engine``: the largest batch that fit, the trial at it, every trial."""
    import ray
    from ray.util.queue import Empty, Queue

    ensure_data(job, echo)
    started_ray = init_ray(job, address)
    queue = Queue(actor_options=on_this_node())
    try:
        trainer = build_trainer(job, queue, train_fn=capacity_fn_per_worker,
                                extra_config=search.worker_settings())
        result = trainer.fit()
        if getattr(result, "error", None) is not None:
            raise RuntimeError(f"capacity search for {job.engine} failed: {result.error}")
        trials, largest = [], None
        while True:
            try:
                item = queue.get(timeout=5)
            except Empty:
                break
            if "largest_batch_size" in item:
                largest = item["largest_batch_size"]
                break
            trials.append(item)
            choices = " ".join(f"{k}={item[k]}" for k in ("partitions", "strategy") if k in item)
            echo(f"[capacity] {job.engine:<9} batch {item['batch_size']:>4}: "
                 + (f"fits, peak {item['peak_memory_bytes'] / 2**30:6.2f} GiB, "
                    f"{item['tokens_per_s']:>9,.0f} tok/s "
                    + (f"MFU {item['mfu']:.1%} " if "mfu" in item else "") + choices
                    if item["fits"] else "out of memory"))
        if largest is None:
            raise RuntimeError(f"capacity search for {job.engine} ended without a result")
    finally:
        queue.shutdown()
        if started_ray:
            ray.shutdown()
    at_largest = next((t for t in trials if t["fits"] and t["batch_size"] == largest), None)
    return EngineCapacity(engine=job.engine, largest_batch_size=largest, at_largest=at_largest, trials=trials)


def comparison_table(results: list[EngineCapacity], seq_len: int) -> str:
    """Largest batch, tokens/s and peak per engine, with ratios to the first engine."""
    first = results[0]
    lines = [f"{'engine':<10} {'batch':>6} {'tokens':>8} {'tokens/s':>10} {'peak GiB':>9} "
             f"{'batch x':>8} {'speed x':>8}  (x = engine / {first.engine})"]
    for r in results:
        best = r.at_largest or {"tokens_per_s": 0.0, "peak_memory_bytes": 0}
        ref = first.at_largest or {"tokens_per_s": float("nan")}
        lines.append(f"{r.engine:<10} {r.largest_batch_size:>6} {r.largest_batch_size * seq_len:>8} "
                     f"{best['tokens_per_s']:>10,.0f} {best['peak_memory_bytes'] / 2**30:>9.2f} "
                     f"{r.largest_batch_size / max(first.largest_batch_size, 1):>8.2f} "
                     f"{best['tokens_per_s'] / ref['tokens_per_s']:>8.2f}")
    return "\n".join(lines)


def log_to_mlflow(record: CapacityResult, tracking_uri: str, experiment: str) -> None:
    """One MLflow run per engine: the search settings as params; the result as metrics."""
    if tracking_uri == NO_TRACKING:
        return
    meta = record.meta
    for result in record.results:
        run = RunLogger.start(tracking_uri, experiment, run_name=f"capacity-{result.engine}",
                              tags={**kind_tags(CAPACITY), "engine": result.engine,
                                    "preset": meta.extra["preset"], "device": meta.hardware})
        run.log_params({**meta.extra["search"], "command": meta.command[:250],
                        "num_workers": meta.extra["num_workers"]})
        best = result.at_largest or {}
        run.log_metrics({"largest_batch_size": result.largest_batch_size,
                         "tokens_per_s": best.get("tokens_per_s", 0.0),
                         "peak_memory_bytes": best.get("peak_memory_bytes", 0),
                         **{k: best[k] for k in ("model_tflops_per_s", "mfu") if k in best}})
        run.finish()
