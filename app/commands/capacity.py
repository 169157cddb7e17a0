"""``mpipemoe capacity``: the largest batch each engine trains with under one memory cap.

    mpipemoe capacity --preset gpt-s --engines mpipemoe,fastmoe --memory-cap-gib 32 --use-gpu

Each engine runs as its own Ray Train job (one worker per GPU, as in ``mpipemoe train``)
whose workers cap their GPU memory and search the batch size with real training steps
(``workers/capacity.py``). Prints a line per trial and a table: the largest batch, its
tokens/s and peak memory, and the ratios to the first engine; writes a JSON record (with
the command, the hardware and the date) and, unless ``--tracking-uri none``, one MLflow
run per engine. On CPU there is no memory cap: the search stops at ``--max-batch``.
`mpipemoe report`'s section on these runs is app/reports/capacity.py.

Ray (the ``ray`` extra) is imported where the search starts, as in app/jobs/launch.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from app.jobs.launch import TrainJob, build_trainer, ensure_data, init_ray
from app.tracking.records import DEFAULT_OUT_DIR, CapacityResult, EngineCapacity, RecordMeta, record_meta
from app.tracking.run_kinds import CAPACITY, kind_tags
from app.tracking.store import NO_TRACKING, RunLogger, resolve_tracking_uri
from lm.model import PRESETS
from moe_engine.config import ENGINES
from workers.capacity import capacity_fn_per_worker


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
    queue = Queue(actor_options={"num_cpus": 0})
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


# ---- command line -------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny-gpt", help=f"model preset: {', '.join(PRESETS)} (default tiny-gpt)")
    parser.add_argument("--engines", default="mpipemoe,fastmoe,fastermoe",
                        help="comma list of engines, the first is the reference (default %(default)s)")
    parser.add_argument("--memory-cap-gib", type=float, default=None,
                        help="GPU memory per worker in GiB (default: the whole GPU; no cap on CPU)")
    parser.add_argument("--start-batch", type=int, default=CapacitySearch.start_batch,
                        help="first batch size (sequences per worker) tried (default %(default)s)")
    parser.add_argument("--max-batch", type=int, default=CapacitySearch.max_batch,
                        help="largest batch size tried (default %(default)s)")
    parser.add_argument("--steps-per-trial", type=int, default=CapacitySearch.steps_per_trial,
                        help="training steps per batch size (default %(default)s)")
    parser.add_argument("--num-workers", type=int, default=1, help="workers (GPUs) per engine (default 1)")
    gpu = parser.add_mutually_exclusive_group()
    gpu.add_argument("--use-gpu", dest="use_gpu", action="store_true", default=None,
                     help="one worker per GPU, NCCL (default: when there are GPUs)")
    gpu.add_argument("--no-gpu", dest="use_gpu", action="store_false", help="CPU workers, gloo")
    parser.add_argument("--partitions", default="auto", help="mpipemoe partitions n: auto or an integer")
    parser.add_argument("--strategy", default="auto", help="mpipemoe memory strategy: auto, none, S1..S4")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the preset's)")
    parser.add_argument("--num-experts", type=int, default=None, help="experts per MoE layer (default: the preset's)")
    parser.add_argument("--num-layers", type=int, default=None, help="transformer blocks (default: the preset's)")
    parser.add_argument("--data-dir", default=None, help="prepared data (default ./data/stdlib-bytes)")
    parser.add_argument("--address", default=None, help="Ray cluster address; default: embedded local Ray")
    parser.add_argument("--tracking-uri", default=None,
                        help="MLflow store (default MLFLOW_TRACKING_URI or ./mlflow.db); 'none' = no MLflow")
    parser.add_argument("--experiment", default="mpipemoe-capacity", help="MLflow experiment (default %(default)s)")
    parser.add_argument("--out", default=None,
                        help="JSON record to write (default out/capacity-<preset>-<date>.json)")
    parser.add_argument("--import", dest="import_json", default=None, metavar="JSON",
                        help="log the runs of an existing capacity record (e.g. made on a GPU machine "
                             "without MLflow) to MLflow and exit")


def run(args: argparse.Namespace) -> int:
    if args.import_json:
        uri = resolve_tracking_uri(args.tracking_uri)
        record = CapacityResult.from_json(json.loads(Path(args.import_json).read_text()))
        log_to_mlflow(record, uri, args.experiment)
        print(f"[capacity] logged {len(record.results)} run(s) of {args.import_json} to {uri}")
        return 0
    search = CapacitySearch(memory_cap_gib=args.memory_cap_gib, start_batch=args.start_batch,
                            max_batch=args.max_batch, steps_per_trial=args.steps_per_trial)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for engine in engines:
        if engine not in ENGINES:
            raise ValueError(f"--engines: {engine!r} is unknown: choose from {', '.join(ENGINES)}")
    base = TrainJob(preset=args.preset, num_workers=args.num_workers, use_gpu=args.use_gpu,
                    partitions=args.partitions, strategy=args.strategy, seq_len=args.seq_len,
                    num_experts=args.num_experts, num_layers=args.num_layers, data_dir=args.data_dir,
                    tracking_uri=args.tracking_uri, batch_size=search.start_batch,
                    name=f"capacity-{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}")
    use_gpu = base.use_gpu if base.use_gpu is not None else _gpu_available()
    base = dataclasses.replace(base, use_gpu=use_gpu)
    cap = f"{search.memory_cap_gib:g} GiB" if search.memory_cap_gib and use_gpu else "no cap"
    print(f"[capacity] {args.preset}: largest batch per engine ({', '.join(engines)}), {cap}, "
          f"{args.num_workers} worker(s) on {'GPU' if use_gpu else 'CPU'}, batch {search.start_batch}.."
          f"{search.max_batch}, {search.steps_per_trial} steps per size", flush=True)
    results = [find_capacity(dataclasses.replace(base, engine=engine, name=f"{base.name}-{engine}"), search,
                             echo=lambda line: print(line, flush=True), address=args.address)
               for engine in engines]
    seq_len = base.model_preset().seq_len
    meta = RecordMeta.from_json({**record_meta("capacity", use_gpu), "preset": args.preset, "seq_len": seq_len,
                                 "num_workers": args.num_workers, "partitions": args.partitions,
                                 "strategy": args.strategy, "search": dataclasses.asdict(search)})
    record = CapacityResult(meta=meta, results=results)
    print(comparison_table(results, seq_len))
    out = Path(args.out or f"{DEFAULT_OUT_DIR}/capacity-{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record.to_json(), indent=1) + "\n")
    print(f"[capacity] wrote {out}")
    log_to_mlflow(record, base.tracking_uri, args.experiment)
    return 0


def _gpu_available() -> bool:
    return torch.cuda.is_available()
