"""``mpipemoe routing``: the per-expert loads a training run logged, as a routing file the
benchmarks replay (``mpipemoe bench --routing replay:FILE``; app/bench/routing_replay.py).

    mpipemoe routing --run NAME --step 50 --out out/routing-NAME-50.json
    mpipemoe routing --run NAME --out out/routing-NAME-last.json     # its last log step

The run is a `mpipemoe train` run in the MLflow store (its name or id); the loads are those
it logged at a log step (``--log-every``): the (token, choice) pairs each expert of each MoE
layer received since the previous log step, over every rank.
"""
from __future__ import annotations

import argparse

from app.bench.routing_replay import extract_routing
from moe_sim.routing import save_routing
from app.tracking.records import check_out_path
from app.tracking.store import resolve_tracking_uri


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, metavar="NAME_OR_ID", help="a training run (mpipemoe train --name)")
    parser.add_argument("--step", type=int, default=None, help="a log step of the run (default: its last)")
    parser.add_argument("--out", required=True, metavar="FILE", help="routing JSON to write")
    parser.add_argument("--experiment", default=None, help="the run's MLflow experiment (default: any)")
    parser.add_argument("--tracking-uri", default=None, help="MLflow store (default MLFLOW_TRACKING_URI or ./mlflow.db)")


def run(args: argparse.Namespace) -> int:
    check_out_path(args.out)
    routing = extract_routing(resolve_tracking_uri(args.tracking_uri), args.run, args.step, args.experiment)
    save_routing(routing, args.out)
    worst = routing.most_imbalanced_layer()
    print(f"[mpipemoe] wrote {args.out}: {len(routing.layers)} MoE layers x {routing.num_experts} experts at step "
          f"{routing.step} of {args.run}; the most imbalanced is layer {worst} "
          f"(busiest expert {routing.imbalance(worst):.2f}x the mean)")
    return 0
