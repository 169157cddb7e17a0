"""``mpipemoe report``: its flags, and one call into the reports wing (app/reports/report.py).

    mpipemoe report                                  # every experiment in the default store
    mpipemoe report --experiment smoke --out out/report-smoke
"""
from __future__ import annotations

import argparse

from app.reports.report import DEFAULT_OUT, report_from_store


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("--experiment", action="append", default=None,
                        help="MLflow experiment to read (repeat for several); default: all")
    parser.add_argument("--tracking-uri", default=None,
                        help="MLflow store; default MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlflow.db")


def run(args: argparse.Namespace) -> int:
    return report_from_store(args.out, args.experiment, args.tracking_uri)
