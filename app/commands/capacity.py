"""``mpipemoe capacity``: the largest batch each engine trains with under one memory cap.

    mpipemoe capacity --preset gpt-s --engines mpipemoe,fastmoe --memory-cap-gib 32 --use-gpu

Each engine runs as its own Ray Train job (one worker per GPU, as in ``mpipemoe train``)
whose workers cap their GPU memory and search the batch size with real training steps
(``workers/capacity.py``). Prints a line per trial and a table: the largest batch, its
tokens/s and peak memory, and the ratios to the first engine; writes a JSON record (with
the command, the hardware and the date) and, unless ``--tracking-uri none``, one MLflow
run per engine. On CPU there is no memory cap: the search stops at ``--max-batch``.
`mpipemoe report`'s section on these runs is app/reports/capacity.py.

The search is app/jobs/capacity.py; Ray (the ``ray`` extra) is imported where it starts.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from app.jobs.capacity import CapacitySearch, comparison_table, find_capacity, log_to_mlflow
from app.jobs.job import TrainJob
from app.tracking.records import DEFAULT_OUT_DIR, CapacityResult, RecordMeta, check_out_path, record_meta
from app.tracking.store import resolve_tracking_uri
from lm.model import PRESETS
from moe_engine.config import ENGINES


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
    if args.out is not None:
        check_out_path(args.out)  # before the search trains
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
