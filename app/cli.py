"""The ``mpipemoe`` command line: thin parsing, each subcommand lives in its own module.

    mpipemoe train            # short MoE training run on embedded local Ray (CPU workers, gloo)
    mpipemoe data prepare     # tokenize real text into Parquet shards
    mpipemoe bench            # MoE-layer benchmark, every engine side by side
    mpipemoe sweep smoke      # a Ray Tune study from tune_spaces/
    mpipemoe report           # Markdown report with plots, generated from MLflow runs
    mpipemoe ui               # MLflow UI on 127.0.0.1 over the same store
    mpipemoe check            # the engine on 2 gloo processes against the reference
    mpipemoe capacity         # the largest batch each engine trains with under a memory cap
    mpipemoe simulate         # predict a cluster's MoE layer and training step from measured parts
    mpipemoe generate         # continue a prompt with a trained run (greedy or top-k sampling)
    mpipemoe export           # a trained run as model.safetensors + config.json + tokenizer.json
    mpipemoe routing          # a training run's per-expert loads as a routing file the benches replay
    mpipemoe tracking import  # send metrics kept while the MLflow tracking server was unreachable

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``.
Modules are imported only when their subcommand runs, so ``mpipemoe --help`` is fast.
A user error (see USER_ERRORS) prints one line and exits 1; ``--debug`` (anywhere on
the line) prints the traceback too. Ctrl-C exits 130 and SIGTERM 143, both after an orderly
stop (a training job checkpoints its step and prints the resume command).
"""
from __future__ import annotations

import argparse
import importlib
import sys
import traceback

from workers.control import SIGTERM_EXIT_CODE, sigterm_as_interrupt

SUBCOMMANDS = {
    "train": ("app.commands.train", "train a MoE transformer with Ray Train (default: short CPU run)"),
    "data": ("app.commands.data", "prepare tokenized Parquet shards from real text"),
    "bench": ("app.commands.bench", "benchmark the MoE layer engines side by side"),
    "sweep": ("app.commands.sweep", "run a Ray Tune study from tune_spaces/"),
    "report": ("app.commands.report", "generate a Markdown report with plots from MLflow runs"),
    "ui": ("app.commands.ui", "start the MLflow UI on 127.0.0.1"),
    "check": ("app.commands.check", "run the engine on gloo processes and compare with the reference"),
    "calibrate": ("app.commands.calibrate", "measure the hardware profile used by the performance model"),
    "capacity": ("app.commands.capacity", "find the largest batch each engine trains with under a memory cap"),
    "simulate": ("app.commands.simulate", "predict a cluster's MoE layer and training step from calibrated parts"),
    "generate": ("app.commands.generate", "continue a prompt with a trained run's newest checkpoint"),
    "export": ("app.commands.export", "write a trained run as model.safetensors, config.json and tokenizer.json"),
    "routing": ("app.commands.routing", "save the per-expert loads a training run logged, for the benches to replay"),
    "tracking": ("app.commands.tracking", "send metrics a run kept while its MLflow tracking server was unreachable"),
}


# Errors a user can act on: a bad option, file or data (ValueError, OSError) and a job
# that failed for the cause its message names (RuntimeError). Anything else is a bug in
# mpipemoe and keeps its traceback.
USER_ERRORS = (ValueError, OSError, RuntimeError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpipemoe", description="Train Mixture-of-Experts models with MPipeMoE on Ray; benchmark, "
        "sweep, simulate and report. Start with `mpipemoe train` (a short run on CPU workers).",
        epilog="`mpipemoe COMMAND --help` lists a command's options; docs/ explains each command.")
    parser.add_argument("--debug", action="store_true",
                        help="on an error, also print the traceback (allowed anywhere on the line)")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(module_name=module_name)
        # Arguments are added lazily in main() for the chosen subcommand only.
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [arg for arg in argv if arg != "--debug"]
    parser = build_parser()
    # Find the subcommand first, then let its module add its own arguments.
    known, _ = parser.parse_known_args(argv[:1] if argv and not argv[0].startswith("-") else argv)
    module = importlib.import_module(known.module_name)
    sub = argparse.ArgumentParser(prog=f"mpipemoe {known.command}",
                                  description=SUBCOMMANDS[known.command][1])
    module.add_arguments(sub)
    args = sub.parse_args(argv[1:])
    try:
        with sigterm_as_interrupt():  # a job stops on SIGTERM as on Ctrl-C (app/jobs/launch.py)
            return int(module.run(args) or 0)
    except USER_ERRORS as error:
        if debug:
            traceback.print_exc()
        hint = "" if debug else " (--debug shows the traceback)"
        print(f"mpipemoe {known.command}: error: {_one_line(error)}{hint}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as interrupt:  # Ctrl-C: 130; SIGTERM: SIGTERM_EXIT_CODE (143)
        detail = _one_line(interrupt) if str(interrupt) != "SIGTERM" else ""
        code = getattr(interrupt, "exit_code", 130)
        how = "terminated (SIGTERM)" if code == SIGTERM_EXIT_CODE else "interrupted"
        print(f"mpipemoe {known.command}: {how}{': ' + detail if detail else ''}", file=sys.stderr)
        return code


def _one_line(error: BaseException) -> str:
    """The message's first line: a store's or a library's error can carry pages (SQL, stacks);
    the rest is what --debug is for."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return lines[0] + (" [...]" if len(lines) > 1 else "") if lines else type(error).__name__


if __name__ == "__main__":
    raise SystemExit(main())
