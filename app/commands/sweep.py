"""``mpipemoe sweep SPACE``: a Ray Tune study from ``tune_spaces/``, one Ray Train run per trial.
Its flags, and one call into the jobs wing (app/jobs/sweep.py).

    mpipemoe sweep smoke                                   # embedded local Ray, CPU workers
    mpipemoe sweep lr --search optuna --scheduler asha --max-concurrent 2
    mpipemoe sweep engines --address auto --storage-path /mnt/efs/ray_results
"""
from __future__ import annotations

import argparse
import sys

import tune_spaces
from app.jobs.sweep import DEFAULT_STORAGE, run_sweep, study_overrides


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("space", nargs="?", default=None,
                        help=f"a built-in study ({', '.join(tune_spaces.STUDIES)}; tune_spaces/) or a study file "
                             f"(.py, .toml, .yaml)")
    parser.add_argument("--space", dest="space_file", default=None, metavar="FILE",
                        help="a study file of your own: train options as Tune domains, with metric, mode, search "
                             "and scheduler (docs/sweeps.md, \"Your own space\")")
    parser.add_argument("--name", default=None,
                        help="the study's name: its folder <storage-path>/<name> (the same name resumes it), MLflow "
                             "tag and default experiment; default the study's (a file's stem)")
    parser.add_argument("--experiment", default=None, help="MLflow experiment of the study's runs; default its name")
    shortcuts = parser.add_argument_group(
        "the model and hardware of every trial (override the study's; --set KEY=V1,V2 makes a grid)")
    shortcuts.add_argument("--preset", default=None, help="model preset (mpipemoe train --preset)")
    shortcuts.add_argument("--num-workers", type=int, default=None, help="Ray Train workers per trial")
    shortcuts.add_argument("--steps", type=int, default=None, help="training steps per trial")
    shortcuts.add_argument("--batch-size", type=int, default=None, help="sequences per worker per step")
    shortcuts.add_argument("--seq-len", type=int, default=None, help="tokens per sequence")
    shortcuts.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE[,VALUE...]",
                           help="any train option (TrainJob field, e.g. partitions=1,2,auto or lr_schedule=wsd): "
                                "one value is a constant, several a grid; repeatable")
    parser.add_argument("--memory-cap-gib", type=float, default=None,
                        help="also name the fastest setting whose settled peak memory fits this many GiB "
                             "(throughput studies)")
    parser.add_argument("--address", default=None,
                        help="Ray cluster address (e.g. 'auto' on the head node); default: embedded local Ray")
    parser.add_argument("--storage-path", default=DEFAULT_STORAGE,
                        help="Tune/Train results root, shared by all nodes on a cluster "
                             "(e.g. /mnt/shared/ray_results); the study resumes from <storage-path>/<name>")
    parser.add_argument("--num-samples", type=int, default=None,
                        help="trials drawn from the param space (a grid: its repeats), 1 or more; default: the "
                             "study's (lr: its grid of 7 once, 12 draws with --search random or optuna; granularity "
                             "and strategy: 2; the others: 1)")
    parser.add_argument("--search", choices=tune_spaces.SEARCHES, default=None,
                        help="grid: the study's grid; random: draws from its distributions; optuna: "
                             "Optuna's TPE; default the study's, else grid")
    parser.add_argument("--scheduler", choices=tune_spaces.SCHEDULERS, default=None,
                        help="fifo: every trial runs to its end; asha: stops trials whose metric lags "
                             "(ASHA over the trials' per-step reports); default the study's, else fifo")
    parser.add_argument("--max-failures", type=int, default=0,
                        help="retries of a trial that fails (default 0: a failed trial stays failed)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the optuna search")
    parser.add_argument("--max-concurrent", type=int, default=None,
                        help="trials at once; default: as many as the cluster's GPUs/CPUs can serve")
    parser.add_argument("--data-dir", default=None,
                        help="prepared training data, on shared storage for a cluster "
                             "(default ./data/stdlib-bytes, prepared if missing)")
    parser.add_argument("--verbose", action="store_true",
                        help="forward the trials' own output (training steps, Ray Train) to this terminal")
    parser.add_argument("--tracking-uri", default=None,
                        help="MLflow store; default MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlflow.db")


SHORTCUTS = ("preset", "num_workers", "steps", "batch_size", "seq_len")


def overrides_of(args: argparse.Namespace) -> dict:
    """The param-space entries the command line sets: ``--set`` items, then the shortcut flags."""
    return study_overrides(args.overrides, {k: getattr(args, k) for k in SHORTCUTS})


def run(args: argparse.Namespace) -> int:
    spec = args.space_file or args.space
    if spec is None or (args.space_file and args.space):
        print("mpipemoe sweep: give one study: a built-in name (mpipemoe sweep smoke) or a file "
              "(mpipemoe sweep --space my_space.toml)", file=sys.stderr)
        return 2
    return run_sweep(spec, args.overrides, {k: getattr(args, k) for k in SHORTCUTS}, name=args.name,
                     experiment=args.experiment, address=args.address, verbose=args.verbose,
                     storage_path=args.storage_path, num_samples=args.num_samples,
                     max_concurrent=args.max_concurrent, data_dir=args.data_dir, search=args.search,
                     scheduler=args.scheduler, max_failures=args.max_failures, seed=args.seed,
                     tracking_uri=args.tracking_uri, memory_cap_gib=args.memory_cap_gib)
