"""``mpipemoe train``: train a MoE transformer with Ray Train, tracked in MLflow.

    mpipemoe train                                   # tiny-gpt, 2 CPU workers (gloo), 50 steps
    mpipemoe train --engines mpipemoe,fastmoe,fastermoe   # same job per engine + comparison
    mpipemoe train --preset gpt-s --use-gpu --num-workers 8 --address auto
    mpipemoe train --resume tiny-gpt-mpipemoe-20260101-120000-ab12 --steps 60
    mpipemoe train --config run.toml --steps 300     # a TOML file's options, flags override
    mpipemoe train --compile                         # torch.compile of the blocks' local parts
    mpipemoe train --init-from checkpoints/mixtral --data-dir data/mixtral   # a Hugging Face Mixtral start

The job itself (``TrainJob``: app/jobs/job.py; ``run_job``: checks, Ray, the trainer, MLflow:
app/jobs/launch.py) is shared with the sweep and capacity commands; this module is the command
line, the ``--engines`` comparison and the summary it prints. MLflow is imported only to quiet its
logger (``_quiet_mlflow``): ``--tracking-uri none`` runs without it.
"""
from __future__ import annotations

import argparse
import logging
import shlex
import time
import uuid

from app.jobs.job import COMPUTE_DTYPES, PARAM_DTYPES, TrainJob
from app.jobs.launch import run_job
from app.jobs.compare import compare_engines
from app.jobs.progress import steps_done, write_summary_json
from app.jobs.resume import resume_command, resumed_job_fields
from app.jobs.train_config import read_train_config
from app.tracking.store import resolve_tracking_uri
from lm.errors import invocation
from lm.model import ACTIVATION_CHECKPOINTING, COMPILE_BACKENDS, PRESETS
from moe_engine.config import ACTIVATIONS, ENGINES, SPLITS, STRATEGY_CHOICES
from workers.config import LR_SCHEDULES, NONFINITE_POLICIES, OPTIMIZER_IMPLS, SCHEDULE_CHOICES

PRESET_NAMES = tuple(PRESETS)


# ---- command line -------------------------------------------------------------------------

class GivenOnce(argparse.Action):
    """An option that may be given once: a second one is refused (argparse would keep the last)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"{option_string} given twice ({getattr(namespace, self.dest)} and {values}): give one "
                         f"file (flags given beside it override its options)")
        setattr(namespace, self.dest, values)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options default to None, meaning "TrainJob's default" (or, with --resume, the run's)."""
    fields = TrainJob.__dataclass_fields__

    def add(flag, help_text, field=None, **kw):
        field = field or flag[2:].replace("-", "_")
        default = fields[field].default if field in fields else None
        suffix = f" (default {default})" if default is not None and "default" not in help_text else ""
        parser.add_argument(flag, default=None, help=help_text + suffix, **kw)

    parser.add_argument("--config", default=None, metavar="FILE.toml", action=GivenOnce,
                        help="options from a TOML file (keys: these options' names); flags given here override it; "
                             "one file")
    add("--preset", "model preset: " + ", ".join(PRESET_NAMES))
    add("--engine", "MoE engine", choices=ENGINES)
    parser.add_argument("--engines", default=None,
                        help="comma list: run each engine and compare, e.g. mpipemoe,fastmoe,fastermoe")
    add("--steps", "total steps (a resumed run continues up to this)", type=int)
    add("--num-workers", "Ray Train workers (one per GPU)", type=int)
    add("--expert-parallel", "expert-parallel degree E: expert groups of E consecutive workers (the MoE "
        "All-to-All stays inside a group), the experts replicated over the num-workers / E groups; E divides "
        "the workers and the experts (default: the GPUs of one node where they divide the experts, else all "
        "workers)", type=int)
    gpu = parser.add_mutually_exclusive_group()
    gpu.add_argument("--use-gpu", dest="use_gpu", action="store_true", default=None,
                     help="one worker per GPU, NCCL (default: when the cluster has GPUs)")
    gpu.add_argument("--no-gpu", dest="use_gpu", action="store_false", help="CPU workers, gloo")
    parser.add_argument("--address", default=None,
                        help="Ray cluster address (auto, ray://host:10001); default: embedded local Ray")
    add("--storage-path", "Ray Train storage path (default ./ray_results)")
    add("--batch-size", "sequences per worker per step", type=int)
    add("--seq-len", "tokens per sequence (default: the preset's)", type=int)
    add("--partitions", "mpipemoe partitions n: auto or an integer")
    add("--strategy", "mpipemoe memory strategy", choices=STRATEGY_CHOICES)
    add("--split", "mpipemoe: how the partitions split a step's tokens: tokens, peers (FasterMoE's groups of "
        "destination workers) or auto (the search times both; the default with --partitions auto)", choices=SPLITS)
    add("--sync-free-capacity", "the MoE layers' sync-free capacity mode: every partition sends each expert "
        "ceil(F x top-k x tokens / experts) rows, padded, so no layer reads its counts on the host; a step whose "
        "capacity overflows on any worker runs again dropless (counted: dropless_rerun). Needs a fixed "
        "--partitions and --strategy (mpipemoe) or --engine fastmoe. Off by default", type=float, metavar="F")
    add("--moe-memory-gib", "mpipemoe: GiB of activation memory for all MoE layers together (per worker and "
        "micro-batch); the automatic partitions and strategy choose the fastest setting that fits", type=float)
    add("--seed", "model init and data order", type=int)
    add("--lr", "AdamW peak learning rate", type=float)
    add("--lr-schedule", "learning rate after the warm-up: constant, or a decay to --min-lr at --steps "
        "(cosine, linear; wsd: stable, then linear over the last --decay-fraction)", choices=LR_SCHEDULES)
    add("--warmup-steps", "linear warm-up steps from 0 to --lr", type=int)
    add("--min-lr", "where cosine / linear / wsd end, at the last step", type=float)
    add("--decay-fraction", "wsd: the share of the steps after warm-up that decays (a resume with a larger "
        "--steps continues the decay from the rate reached)", type=float)
    add("--weight-decay", "AdamW weight decay of matrices (not biases or norms)", type=float)
    add("--grad-clip", "clip the global gradient norm to this; 0 = off", type=float)
    add("--aux-loss-weight", "loss = lm loss + this x the MoE load-balance loss", type=float)
    add("--expert-bias-rate", "auxiliary-loss-free balancing (DeepSeek-V3): each MoE layer's router adds a "
        "per-expert bias to the scores its top-k selects on (the gate weights stay unbiased), moved by R after "
        "every step toward the experts that got fewer tokens than the mean; 0 = off (default)", type=float,
        metavar="R")
    add("--router-z-loss", "loss += C x the router z-loss, mean(logsumexp(router logits)^2) (ST-MoE); "
        "0 = off (default)", type=float, metavar="C")
    add("--optimizer-impl", "AdamW kernels: auto = fused on CUDA, foreach on CPU", choices=OPTIMIZER_IMPLS)
    add("--eval-every", "validation loss every N steps and at the end; 0 = never", type=int)
    add("--eval-batches", "fixed validation batches (of --batch-size sequences) per worker", type=int)
    add("--checkpoint-every", "steps between checkpoints, also written at the last step; "
        "0 writes none (benchmarks of large models, where each checkpoint is gigabytes)", type=int)
    add("--name", "run name (default: generated; an existing name continues that run)")
    parser.add_argument("--resume", default=None, metavar="NAME",
                        help="continue run NAME from its last checkpoint, with its settings")
    add("--data-dir", "prepared data (default ./data/stdlib-bytes, prepared if missing)")
    add("--tracking-uri", "MLflow store (default MLFLOW_TRACKING_URI or ./mlflow.db); 'none' = no MLflow")
    add("--experiment", "MLflow experiment")
    add("--cpus-per-worker", "Ray CPUs per worker (default 0.9 on CPU, 1 on GPU)", type=float)
    add("--num-experts", "experts per MoE layer (default: the preset's)", type=int)
    add("--num-layers", "transformer blocks (default: the preset's)", type=int)
    add("--top-k", "experts per token (default: the preset's)", type=int)
    add("--capacity-factor", "each expert takes at most this x its even share of the (token, choice) pairs, "
        "the rest dropped (default: the preset's dropless routing)", type=float)
    add("--activation", "expert activation (default: the preset's)", choices=ACTIVATIONS)
    add("--dtype", "compute dtype under autocast (auto: bfloat16 on GPU, float32 on CPU); parameters, "
        "gradients and AdamW state are float32", choices=COMPUTE_DTYPES + ("float16",))
    add("--param-dtype", "parameters, gradients and AdamW state: float32 master weights, or bfloat16 "
        "(half the training state, but updates smaller than bf16's resolution round away; for comparison)",
        choices=PARAM_DTYPES)
    parser.add_argument("--shard-dense", dest="shard_dense", action="store_true", default=None,
                        help="FSDP2 for the dense part: shards its parameters, gradients and AdamW state "
                             "(default: DDP, replicated); expert parameters are sharded by the MoE layer either way")
    add("--grad-accum", "micro-batches of --batch-size per optimizer step", type=int)
    add("--micro-batch-schedule", "with --grad-accum >= 2: overlapped runs the forward of micro-batch k+1 "
        "beside the backward of k (two micro-batches' activations live; DDP only); auto picks it when two fit "
        "--moe-memory-gib", choices=SCHEDULE_CHOICES)
    add("--activation-checkpointing", "per transformer block, what runs again in backward instead of being "
        "kept: none; selective = the attention and its norm (cheap to recompute, no communication; the MoE "
        "layer keeps its activations); full = the whole block (each keeps only its input; the MoE layer's "
        "All-to-Alls run again; with several workers per expert group it takes the sequential schedule)",
        choices=ACTIVATION_CHECKPOINTING)
    parser.add_argument("--compile", dest="compile", action="store_true", default=None,
                        help="torch.compile each block's norms, attention and router (the MoE dispatch stays "
                             "eager); compiled at the first step, its time shown on the progress line and logged "
                             "as compile_time_s")
    add("--compile-backend", "torch.compile backend with --compile: inductor (fused kernels) or aot_eager "
        "(the same graphs with eager kernels; compiles in seconds)", choices=COMPILE_BACKENDS)
    add("--init-from", "start from a Hugging Face Mixtral-style checkpoint folder (config.json, safetensors, "
        "tokenizer.json): the model comes from its config.json (not --preset), its weights start the run, and "
        "the data must be prepared with its tokenizer (mpipemoe data prepare --tokenizer DIR)", metavar="DIR")
    add("--keep-checkpoints", "complete checkpoints to keep (older ones are deleted); 0 keeps all", type=int)
    parser.add_argument("--async-checkpoint", dest="async_checkpoint", action="store_true", default=None,
                        help="copy each checkpoint to host memory and write its shards while the next step trains")
    add("--max-failures", "let Ray Train restart failed workers N times", type=int)
    add("--collective-timeout-s", "a dead or stalled worker ends the job after this many seconds", type=int)
    add("--on-nonfinite-loss", "NaN/Inf loss: halt the job, or skip that step's update",
        choices=NONFINITE_POLICIES)
    add("--log-every", "progress line, and per-expert load metrics to MLflow, every N steps", type=int)
    parser.add_argument("--summary-json", default=None, metavar="PATH",
                        help="also write the summary (with per-step history) as JSON")
    parser.add_argument("--verbose", action="store_true",
                        help="show the Ray actors' logs (Ray Train, worker tracebacks)")



def ui_command(tracking_uri: str) -> str:
    """``mpipemoe ui`` as the user can type it, naming the store unless it is the default one."""
    store = "" if tracking_uri == resolve_tracking_uri(None) else f" --tracking-uri {shlex.quote(tracking_uri)}"
    return f"{invocation()} ui{store}"


def job_from_args(args: argparse.Namespace) -> TrainJob:
    """The job the options describe; ``--resume NAME`` starts from NAME's recorded settings."""
    given = {f: getattr(args, f) for f in TrainJob.__dataclass_fields__ if getattr(args, f, None) is not None}
    if getattr(args, "config", None):
        given = {**read_train_config(args.config), **given}
    if args.resume and getattr(args, "engines", None):
        raise ValueError(f"--resume {args.resume} and --engines cannot be combined: a run has one engine; "
                         f"resume each engine's run by its name (<name>-<engine>)")
    if args.resume:
        given = resumed_job_fields(args.resume, given)
    elif getattr(args, "engines", None) and not args.name:  # siblings get "<name>-<engine>"
        preset = given.get("preset", TrainJob.preset)
        given["name"] = f"{preset}-compare-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
    return TrainJob(**given)


def _quiet_mlflow() -> None:
    """No store-migration INFO lines on the console (MLflow sets its level when imported)."""
    try:
        import mlflow  # noqa: F401
    except ImportError:  # --tracking-uri none on a machine without MLflow
        return
    logging.getLogger("mlflow").setLevel(logging.WARNING)


def run(args: argparse.Namespace) -> int:
    """Errors (bad options, data, resources; a failed job) propagate to ``app.cli.main``,
    which prints them as one line (the traceback with ``--debug``)."""
    started = time.perf_counter()
    _quiet_mlflow()
    job = job_from_args(args)
    if args.engines:
        result = compare_engines(job, [e.strip() for e in args.engines.split(",") if e.strip()],
                                 args.address, verbose=args.verbose)
        if args.summary_json:
            write_summary_json(args.summary_json, result, job)
    else:
        summary = run_job(job, args.address, verbose=args.verbose)
        if args.summary_json:
            write_summary_json(args.summary_json, summary, job)
        if not summary.get("steps_run"):
            print(f"[mpipemoe] {job.name} had already reached step {summary.get('steps', job.steps)} of "
                  f"--steps {job.steps}: nothing to train, the run is left unchanged; to continue it: "
                  f"{resume_command(job, job.steps * 2)}")
            return 0
        val = f", val loss {summary['final_val_loss']:.3f} (ppl {summary['final_val_ppl']:.2f})" \
            if "final_val_loss" in summary else ""
        print(f"[mpipemoe] done: {steps_done(summary)}, loss {summary['first_loss']:.3f} -> "
              f"{summary['final_loss']:.3f}{val}, {summary['tokens_per_s']:,.0f} tokens/s, peak "
              f"{summary['peak_memory_bytes'] / 2**20:,.0f} MiB"
              + (f", MFU {summary['mfu']:.1%}" if "mfu" in summary else ""))
        if summary["checkpoint_path"] is None:
            print("[mpipemoe] no checkpoint written (--checkpoint-every 0); this run cannot be resumed")
        else:
            print(f"[mpipemoe] checkpoint: {summary['checkpoint_path']}")
            print(f"[mpipemoe] resume with: {resume_command(job, job.steps * 2)}")
    browse = "" if job.tracking_uri == "none" else f"; browse runs with: {ui_command(job.tracking_uri)}"
    print(f"[mpipemoe] total wall time {time.perf_counter() - started:.0f} s{browse}")
    return 0
