"""Metrics kept in a local file while the MLflow tracking server is unreachable.

On a cluster, drivers log to the head's tracking server over HTTP. If it stops answering
mid-run, training goes on: ``RunLogger`` (app/tracking/store.py) appends the metrics, tags and
final status it could not send to ``<run dir>/mlflow_pending.jsonl``, says so once, and
sends them (in order, then renames the file ``*.sent``) as soon as the server answers
again; if the run ends first, ``mpipemoe tracking import FILE`` (app/commands/tracking.py)
sends them later.

File format: JSON lines; the first is ``{"run_id", "tracking_uri"}``, then
``{"metrics": [[key, value, timestamp_ms, step], ...]}``, ``{"tags": {...}}`` and
``{"status": "FINISHED"}`` records in the order they happened.
"""
from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

PENDING_FILE = "mlflow_pending.jsonl"
_BATCH = 500


def is_remote(tracking_uri: str) -> bool:
    return tracking_uri.startswith(("http://", "https://"))


def reachable(tracking_uri: str, timeout_s: float = 3.0) -> bool:
    """Whether a tracking server answers its health check (non-HTTP stores: always True)."""
    if not is_remote(tracking_uri):
        return True
    try:
        with urllib.request.urlopen(tracking_uri.rstrip("/") + "/health", timeout=timeout_s):
            return True
    except urllib.error.HTTPError as error:  # it answers (e.g. 401 behind basic auth)
        return error.code < 500
    except OSError:
        return False


class MetricSpool:
    """The pending file of one run; ``waiting`` while it holds records not yet sent."""

    def __init__(self, path: str | Path, run_id: str, tracking_uri: str, echo=None,
                 retry_every_s: float = 30.0):
        self.path = Path(path)
        self.run_id, self.tracking_uri = run_id, tracking_uri
        self.echo = echo or (lambda line: print(line, file=sys.stderr))
        self.retry_every_s = retry_every_s
        self.waiting = self.path.exists()
        self._warned = False
        self._last_try = time.monotonic()

    def due(self) -> bool:
        """Time to try the server again (at most every ``retry_every_s``)."""
        return time.monotonic() - self._last_try >= self.retry_every_s

    def keep(self, metrics=(), tags: dict | None = None, status: str | None = None, reason: str = "") -> None:
        """Append records to the file; the first time, print one warning saying where they are."""
        self._last_try = time.monotonic()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as out:
            if out.tell() == 0:
                out.write(json.dumps({"run_id": self.run_id, "tracking_uri": self.tracking_uri}) + "\n")
            if metrics:
                out.write(json.dumps({"metrics": [[m.key, m.value, m.timestamp, m.step] for m in metrics]}) + "\n")
            if tags:
                out.write(json.dumps({"tags": tags}) + "\n")
            if status:
                out.write(json.dumps({"status": status}) + "\n")
        self.waiting = True
        if not self._warned:
            self._warned = True
            self.echo(f"[mpipemoe] warning: the MLflow tracking server {self.tracking_uri} is unreachable"
                      f"{f' ({reason})' if reason else ''}; training goes on and its metrics are kept in "
                      f"{self.path}, to be sent when the server answers again (or with "
                      f"`mpipemoe tracking import {self.path}`)")

    def replay(self, mlflow_client) -> int:
        """Send every kept record in order; rename the file ``*.sent``. Returns metrics sent."""
        self._last_try = time.monotonic()
        sent = replay_file(self.path, mlflow_client, self.run_id)
        self.waiting = False
        self._warned = False
        self.echo(f"[mpipemoe] the MLflow tracking server {self.tracking_uri} answers again: sent the "
                  f"{sent} metric values kept in {self.path}")
        return sent


def replay_file(path: Path, mlflow_client, run_id: str | None = None) -> int:
    from mlflow.entities import Metric, RunTag  # MLflow (the ``ray`` extra) only when there is something to send

    lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not lines or "run_id" not in lines[0]:
        raise ValueError(f"{path} is not a file of kept MLflow metrics (its first line names no run_id)")
    run_id = run_id or lines[0]["run_id"]
    sent = 0
    for record in lines[1:]:
        if "metrics" in record:
            metrics = [Metric(k, v, t, s) for k, v, t, s in record["metrics"]]
            for start in range(0, len(metrics), _BATCH):
                mlflow_client.log_batch(run_id, metrics=metrics[start:start + _BATCH])
            sent += len(metrics)
        if "tags" in record:
            mlflow_client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in record["tags"].items()])
        if "status" in record:
            mlflow_client.set_terminated(run_id, status=record["status"])
    Path(path).rename(Path(path).with_name(Path(path).name + ".sent"))
    return sent
