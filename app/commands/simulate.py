"""`mpipemoe simulate`: predict a cluster's MoE layer (and training step) from calibrated parts.
Its flags, and one call into the bench wing (app/bench/simulate.py).

    mpipemoe simulate --nodes 8 --gpus-per-node 8 --model gpt-xl --tokens 16384
    mpipemoe simulate --model gpt-xl --tokens 16384 --sweep-nodes 1,2,4,8,16,32,64
    mpipemoe simulate --model gpt-xl --tokens 4096,8192,16384,32768 --nodes 8 --step
    mpipemoe simulate --model gpt-s --tokens 8192 --nodes 8 --expert-parallel 8,64 --network dgx-h200
    mpipemoe simulate --model gpt-xl --tokens 16384 --nodes 8 --experts 64 --routing zipf:1.2   # or replay:early
    mpipemoe simulate --validate results/bench-h200.json --validate results/bench-h200-lean.json --out out/validation.json
    mpipemoe simulate --measure-parts results/sim-parts-h200.json     # on a GPU: the parts
"""
from __future__ import annotations

import argparse

from app.bench.simulate import DEFAULT_PARTS, EXPERIMENT, measure, simulate_and_write, validate_and_write
from app.bench.simulate_settings import DEFAULT_PARTITIONS, SimulateSettings
from app.tracking.records import check_out_path
from moe_sim.routing import CHOICES as ROUTING_CHOICES, renamed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="gpt-xl", help="model preset (default gpt-xl)")
    parser.add_argument("--tokens", default="16384", help="tokens per GPU, comma list (default 16384)")
    parser.add_argument("--nodes", type=int, default=8, help="nodes (default 8)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    parser.add_argument("--sweep-nodes", default=None, help="comma list of node counts to sweep, e.g. 1,2,4,8,16,32,64")
    parser.add_argument("--experts", type=int, default=None,
                        help="experts per MoE layer (default: the preset's 8, or one per GPU when there are more GPUs)")
    parser.add_argument("--network", default="dgx-a100",
                        help="dgx-a100, dgx-h200, or a JSON file of measured figures (default dgx-a100)")
    parser.add_argument("--routing", default="uniform",
                        help=f"the token routing (default uniform): {ROUTING_CHOICES}; docs/simulate.md")
    parser.add_argument("--seed", type=int, default=0,
                        help="the routing's seed, as the bench's: zipf's ranking of the experts (default 0)")
    parser.add_argument("--partitions", default=",".join(map(str, DEFAULT_PARTITIONS)),
                        help="MPipeMoE partition counts to consider (default 1,2,4,8,16)")
    parser.add_argument("--hierarchical", action="store_true", help="two-level All-to-All instead of the flat one")
    parser.add_argument("--step", action="store_true", help="also simulate a training step of the whole preset")
    parser.add_argument("--expert-parallel", default=None,
                        help="expert-parallel degrees E, comma list (e.g. 8,64): MPipeMoE's training step with "
                             "expert groups of E GPUs, side by side (default: one group of all GPUs, every engine)")
    parser.add_argument("--parts", default=DEFAULT_PARTS, help=f"measured GPU parts (default {DEFAULT_PARTS})")
    parser.add_argument("--host-scale", type=float, default=1.0,
                        help="multiply the measured host issue costs (another CPU; 0: device-only bound)")
    parser.add_argument("--out", default=None, help="JSON file to write (default: none; --validate: "
                        "out/simulate-validation.json)")
    parser.add_argument("--tracking-uri", default=None,
                        help="MLflow store (default MLFLOW_TRACKING_URI or ./mlflow.db; 'none' to skip)")
    parser.add_argument("--experiment", default=EXPERIMENT)
    parser.add_argument("--validate", action="append", default=None, metavar="BENCH_JSON",
                        help="compare the simulator with every record of a `mpipemoe bench` JSON (repeatable)")
    parser.add_argument("--measure-parts", default=None, metavar="PATH",
                        help="measure the GPU parts on this machine's CUDA device and write them to PATH")


def _split(text: str, cast=str) -> tuple:
    try:
        return tuple(cast(v.strip()) for v in str(text).split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not a comma list of {cast.__name__} values") from None


def run(args) -> int:
    for flag, path in (("--out", args.out), ("--measure-parts", args.measure_parts)):
        if path is not None:
            check_out_path(path, flag)
    if args.measure_parts:
        return measure(args.measure_parts)
    if args.validate:
        return validate_and_write(args.validate, args.parts, args.host_scale, args.out)
    routing, note = renamed(args.routing)
    if note:
        print(f"[mpipemoe] {note}", flush=True)
    settings = SimulateSettings(
        model=args.model, tokens=_split(args.tokens, int),
        nodes=_split(args.sweep_nodes, int) if args.sweep_nodes else (args.nodes,),
        gpus_per_node=args.gpus_per_node, experts=args.experts, network=args.network, routing=routing, seed=args.seed,
        partitions=_split(args.partitions, int), hierarchical=args.hierarchical, step=args.step,
        expert_parallel=_split(args.expert_parallel, int) if args.expert_parallel else ())
    return simulate_and_write(settings, args.parts, args.host_scale, args.out, args.tracking_uri, args.experiment)
