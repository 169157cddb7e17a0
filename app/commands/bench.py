"""`mpipemoe bench`: its flags as settings, and one call into the bench wing (app/bench/layer.py
measures and writes; app/bench/step.py with --step; app/bench/stack.py with --layers).

    mpipemoe bench                                   # tiny layer on CPU, quick
    mpipemoe bench --model gpt-xl --tokens 4096,8192,16384,32768      # on a GPU (bf16)
    mpipemoe bench --model gpt-s --world-size 2      # 2 processes (NCCL on 2 GPUs, gloo on CPU)
    mpipemoe bench --import results/bench-h200.json  # log records made elsewhere to MLflow
    mpipemoe bench --model gpt-s --activation swiglu --no-bias --peers torchtitan  # beside torchtitan's layer
    mpipemoe bench --model gpt-xl --emulate 8x8 --network dgx-a100 --experts 64  # rank 0 of an emulated cluster
"""
from __future__ import annotations

import argparse
import json

import torch

from app.bench.layer import bench_and_write, log_to_mlflow
from app.bench.layer_settings import BenchSettings
from app.bench.peers import PEERS
from app.bench.shapes import LAYER_SHAPES
from app.bench.stack import CHECKPOINTING, DEFAULT_BUDGET_SHARE
from app.bench.step import run_and_write
from app.bench.step_settings import StepSettings
from app.tracking.records import check_out_path
from moe_sim.routing import CHOICES as ROUTING_CHOICES, renamed
from moe_engine.comm import DEFAULT_COMM_SMS


# Without a GPU, `mpipemoe bench` is a smoke of the harness (about 20 s on 2 cores, as `make bench`):
# one point, a 2 x 2 grid, one timed step per round. A GPU gets the full study.
CPU_DEFAULTS = {"tokens": "256", "partitions": "1,2", "strategies": "none,S3", "repeats": 1, "rounds": 1}
GPU_DEFAULTS = {"tokens": "4096,8192,16384,32768", "partitions": "1,2,4,8", "strategies": "none,S1,S2,S3,S4",
                "repeats": 3, "rounds": 5}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help=f"comma list of {', '.join(LAYER_SHAPES)} "
                        "(default: tiny on CPU, gpt-s,gpt-xl,bert-l on GPU)")
    parser.add_argument("--tokens", default=None, help="comma list of tokens per rank "
                        f"(default: {CPU_DEFAULTS['tokens']} on CPU, {GPU_DEFAULTS['tokens']} on GPU)")
    parser.add_argument("--experts", type=int, default=None,
                        help="experts per MoE layer (default 8; with --step the emulated ranks)")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--activation", default="gelu", choices=["relu", "gelu", "swiglu"])
    parser.add_argument("--no-bias", action="store_true", help="expert FFNs without biases b1, b2")
    parser.add_argument("--peers", default="", help=f"comma list of other layers to time beside ours: "
                        f"{', '.join(PEERS)} (needs --world-size 1, --activation swiglu, --no-bias; default none)")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), bf16, fp16, fp32")
    parser.add_argument("--partitions", default=None,
                        help=f"grid of MPipeMoE partitions (default {GPU_DEFAULTS['partitions']}, on CPU "
                             f"{CPU_DEFAULTS['partitions']}; with --step 1,2,4)")
    parser.add_argument("--strategies", default=None,
                        help=f"grid of MPipeMoE strategies (default {GPU_DEFAULTS['strategies']}, on CPU "
                             f"{CPU_DEFAULTS['strategies']}; with --step none,S4)")
    parser.add_argument("--splits", default="tokens",
                        help="how the grid's MPipeMoE partitions split a pass: tokens, peers (FasterMoE's groups of "
                             "W/n ranks, n dividing W) or both, tokens,peers (default tokens; auto times both)")
    parser.add_argument("--no-grid", action="store_true", help="skip the exhaustive n × strategy grid")
    parser.add_argument("--routing", default="uniform",
                        help=f"comma list of routings (default uniform): {ROUTING_CHOICES}; docs/emulation.md")
    parser.add_argument("--seed", type=int, default=0,
                        help="the routing's seed: zipf's ranking of the experts, the order of the imposed tokens "
                             "(default 0; with --step also the model's weights)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before each timed round (default 1)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per round (default 3, on CPU 1; with --step 2)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds; every engine of a point runs once per round, interleaved, and its time is "
                             "the median over rounds (default 5, on CPU 1; with --step 3)")
    parser.add_argument("--world-size", type=int, default=1,
                        help="processes (one per GPU with NCCL when enough GPUs, else gloo on CPU)")
    parser.add_argument("--emulate", default=None, metavar="NODESxGPUS",
                        help="run one process as rank 0 of an emulated cluster, e.g. 8x8: the real engine, the "
                             "network's delays modelled (docs/emulation.md); records say measured_as=emulated")
    parser.add_argument("--network", default="dgx-a100",
                        help="the emulated cluster's network: dgx-a100, dgx-h200 or a JSON file (default dgx-a100)")
    parser.add_argument("--expert-parallel", type=int, default=None,
                        help="with --step: the expert-parallel degree E, rank 0's MoE layers over an expert group of "
                             "E ranks and the experts' gradients reduced over the W / E groups (default: one group "
                             "of every emulated rank)")
    parser.add_argument("--transfer-ctas", type=int, default=1,
                        help="with --emulate: thread blocks each emulated transfer holds while it waits, as NCCL's "
                             "kernels hold SMs (default 1: the least contention)")
    parser.add_argument("--comm-sms", type=int, default=None,
                        help="with --emulate: SMs the pipelined expert GEMMs leave free for the transfers, as "
                             f"they do for NCCL on real ranks (default {DEFAULT_COMM_SMS}; stated in each record)")
    parser.add_argument("--trace", default=None, metavar="DIR",
                        help="write a torch.profiler timeline (Chrome/Perfetto JSON, gzip) of one forward+backward "
                             "of every engine and setting into DIR, and add its stream account to the records "
                             "(emulated points carry the account without it)")
    parser.add_argument("--layers", type=int, default=None,
                        help="time stacks of L residual layers, h = h + layer(h), setting by setting, with memory "
                             "against time (app/bench/stack.py; default 1: single layers in interleaved rounds)")
    parser.add_argument("--checkpointing", default=None, choices=CHECKPOINTING,
                        help="with --layers: each setting without (off), with (on) or both (the default) "
                             "torch.utils.checkpoint around each layer")
    parser.add_argument("--memory-budget-share", type=float, default=None,
                        help="with --layers: also time auto@budget, MPipeMoE auto under this share of the reference "
                             f"setting's activation memory (first peer, else FastMoE; default {DEFAULT_BUDGET_SHARE} "
                             "when a peer runs)")
    parser.add_argument("--memory-budget-gib", type=float, default=None,
                        help="with --layers: auto@budget under this many GiB for the stack's activations instead")
    parser.add_argument("--step", action="store_true",
                        help="time the whole training step of --model (an lm preset: gpt-s, gpt-xl, bert-l, "
                             "tiny-gpt, ...; --layers of them) on one device as rank 0 of --emulate "
                             "(app/bench/step.py; docs/emulation.md, \"The training step\")")
    parser.add_argument("--micro-batches", default="1",
                        help="with --step: comma list of micro-batches per step (--tokens is per GPU per step)")
    parser.add_argument("--schedule", default="sequential",
                        help="with --step: comma list of micro-batch schedules, each timed: sequential, overlapped "
                             "(the forward of micro-batch k+1 beside the backward of k), auto (overlapped with >= 2 "
                             "micro-batches a step)")
    parser.add_argument("--out", default=None, help="JSON file to write (default out/bench-<device>-<date>.json; "
                        "with --layers out/stacked-<device>-<date>.json)")
    parser.add_argument("--tracking-uri", default=None,
                        help="MLflow store (default MLFLOW_TRACKING_URI or ./mlflow.db; 'none' to skip)")
    parser.add_argument("--experiment", default="mpipemoe-bench")
    parser.add_argument("--import", dest="import_json", default=None,
                        help="log the records of an existing bench JSON to MLflow and exit")


def _split(text: str, cast=str) -> list:
    return [cast(v.strip()) for v in text.split(",") if v.strip()]


def routings(text: str) -> tuple:
    """--routing's names, an old name replaced by its new one with a one-line note."""
    names = []
    for spec in _split(text):
        name, note = renamed(spec)
        if note:
            print(f"[mpipemoe] {note}", flush=True)
        names.append(name)
    return tuple(names)


def run_step(args) -> int:
    """`mpipemoe bench --step`: the flags as app/bench/step_settings.py's settings."""
    layer_only = [flag for flag, given in (("--peers", args.peers), ("--world-size", args.world_size != 1),
                                           ("--checkpointing", args.checkpointing),
                                           ("--memory-budget-share", args.memory_budget_share is not None),
                                           ("--memory-budget-gib", args.memory_budget_gib is not None),
                                           ("--no-bias", args.no_bias), ("--activation", args.activation != "gelu"),
                                           ("--top-k", args.top_k != 2)) if given]
    if layer_only:
        raise ValueError(f"--step times a preset's whole training step: drop {', '.join(layer_only)} (layer-bench "
                         f"options; the preset fixes the model's shape)")
    on_gpu = torch.cuda.is_available()
    settings = StepSettings(
        model=args.model or ("gpt-xl" if on_gpu else "tiny-gpt"),
        tokens=_split(args.tokens, int) if args.tokens else ([8192, 16384, 32768] if on_gpu else [256]),
        micro_batches=tuple(_split(args.micro_batches, int)), layers=args.layers,
        emulate=args.emulate or ("8x8" if on_gpu else "2x2"), network=args.network,
        transfer_ctas=args.transfer_ctas, num_experts=args.experts, expert_parallel=args.expert_parallel,
        routings=routings(args.routing), seed=args.seed, grid=not args.no_grid, splits=tuple(_split(args.splits)),
        schedule=args.schedule, dtype=args.dtype, warmup=args.warmup, trace=args.trace,
        **{name: value for name, value in (("partitions", args.partitions and tuple(_split(args.partitions, int))),
                                           ("strategies", args.strategies and tuple(_split(args.strategies))),
                                           ("repeats", args.repeats), ("rounds", args.rounds)) if value is not None})
    return run_and_write(settings, args.out, args.tracking_uri, args.experiment,
                         lambda line: print(line, flush=True))


def run(args) -> int:
    if args.out is not None:
        check_out_path(args.out)  # before minutes of timing
    if args.import_json:
        with open(args.import_json) as f:
            log_to_mlflow(json.load(f), args.tracking_uri, args.experiment)
        return 0
    if args.step:
        return run_step(args)
    step_only = [flag for flag, given in (("--micro-batches", args.micro_batches != "1"),
                                          ("--schedule", args.schedule != "sequential")) if given]
    if step_only:
        raise ValueError(f"{' and '.join(step_only)} time a whole training step: add --step (or drop them)")
    if args.expert_parallel is not None:
        raise ValueError(f"--expert-parallel {args.expert_parallel} prices a training step's expert groups and their "
                         f"gradient reduction: add --step; the layer bench's All-to-All spans its whole --emulate "
                         f"cluster, so time one expert group's layer as that cluster (e.g. --emulate 1x8 for a group "
                         f"of a node's 8 GPUs)")
    on_gpu = torch.cuda.is_available()
    default = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
    settings = BenchSettings(
        models=_split(args.model) if args.model else (["gpt-s", "gpt-xl", "bert-l"] if on_gpu else ["tiny"]),
        tokens=_split(args.tokens or default["tokens"], int),
        num_experts=args.experts or 8, top_k=args.top_k, activation=args.activation, dtype=args.dtype,
        partitions=tuple(_split(args.partitions or default["partitions"], int)),
        strategies=tuple(_split(args.strategies or default["strategies"])), splits=tuple(_split(args.splits)),
        grid=not args.no_grid, warmup=args.warmup,
        repeats=default["repeats"] if args.repeats is None else args.repeats,
        rounds=default["rounds"] if args.rounds is None else args.rounds,
        world_size=args.world_size,
        routings=routings(args.routing), seed=args.seed, bias=not args.no_bias, peers=tuple(_split(args.peers)),
        emulate=args.emulate, network=args.network, transfer_ctas=args.transfer_ctas, comm_sms=args.comm_sms,
        trace=args.trace,
        layers=1 if args.layers is None else args.layers, checkpointing=args.checkpointing,
        memory_budget_share=args.memory_budget_share,
        memory_budget_gib=args.memory_budget_gib)
    return bench_and_write(settings, args.out, args.tracking_uri, args.experiment)
