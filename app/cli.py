"""The ``mpipemoe`` command line: thin parsing, each subcommand lives in its own module.

    mpipemoe train            # short MoE training run on embedded local Ray (CPU workers, gloo)
    mpipemoe data prepare     # tokenize real text into Parquet shards
    mpipemoe bench            # MoE-layer benchmark, every engine side by side
    mpipemoe sweep smoke      # a Ray Tune study from tune_spaces/
    mpipemoe report           # Markdown report with plots, generated from MLflow runs
    mpipemoe ui               # MLflow UI on 127.0.0.1 over the same store
    mpipemoe check            # the engine on 2 gloo processes against the reference
    mpipemoe capacity         # the largest batch each engine trains with under a memory cap

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``.
Modules are imported only when their subcommand runs, so ``mpipemoe --help`` is fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "train": ("app.train", "train a MoE transformer with Ray Train (default: short CPU run)"),
    "data": ("app.data", "prepare tokenized Parquet shards from real text"),
    "bench": ("app.bench", "benchmark the MoE layer engines side by side"),
    "sweep": ("app.sweep", "run a Ray Tune study from tune_spaces/"),
    "report": ("app.report", "generate a Markdown report with plots from MLflow runs"),
    "ui": ("app.ui", "start the MLflow UI on 127.0.0.1"),
    "check": ("app.check", "run the engine on gloo processes and compare with the reference"),
    "calibrate": ("app.calibrate", "measure the hardware profile used by the performance model"),
    "capacity": ("app.capacity", "find the largest batch each engine trains with under a memory cap"),
    "simulate": ("app.simulate", "predict a cluster's MoE layer and training step from calibrated parts"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mpipemoe", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(module_name=module_name)
        # Arguments are added lazily in main() for the chosen subcommand only.
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # Find the subcommand first, then let its module add its own arguments.
    known, _ = parser.parse_known_args(argv[:1] if argv and not argv[0].startswith("-") else argv)
    module = importlib.import_module(known.module_name)
    sub = argparse.ArgumentParser(prog=f"mpipemoe {known.command}",
                                  description=SUBCOMMANDS[known.command][1])
    module.add_arguments(sub)
    args = sub.parse_args(argv[1:])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
