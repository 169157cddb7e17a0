"""``mpipemoe tracking import FILE``: send the metrics a run kept while its MLflow tracking
server was unreachable (app/tracking/offline.py keeps them).

    mpipemoe tracking import ray_results/RUN/mlflow_pending.jsonl   # send what a run kept
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from app.tracking.offline import PENDING_FILE, reachable, replay_file
from app.tracking.store import client


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    imp = sub.add_parser("import", help="send the metrics a run kept while its tracking server was unreachable")
    imp.add_argument("path", help=f"the run's {PENDING_FILE} (in its run directory)")
    imp.add_argument("--tracking-uri", default=None,
                     help="send them to this store instead of the one the file names")


def run(args: argparse.Namespace) -> int:
    path = Path(args.path)
    if not path.is_file():
        raise ValueError(f"no kept metrics at {path}: give the {PENDING_FILE} of a run directory "
                         f"(already sent ones are renamed {PENDING_FILE}.sent)")
    header = json.loads(path.read_text().splitlines()[0])
    uri = args.tracking_uri or header["tracking_uri"]
    if not reachable(uri):
        raise ValueError(f"the tracking server {uri} does not answer: start it, or give --tracking-uri")
    sent = replay_file(path, client(uri))
    print(f"sent {sent} metric values of run {header['run_id']} to {uri}")
    return 0
