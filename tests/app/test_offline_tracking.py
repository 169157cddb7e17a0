"""A tracking server that is unreachable mid-run loses nothing (tier 1, a real ``mlflow server``
on 127.0.0.1 started and stopped by pid, no Ray): metrics, tags and the final status go to
the run's pending file with one warning, and are sent when the server answers again, by
the next flush or by ``mpipemoe tracking import``."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("mlflow")

from app import cli  # noqa: E402
from app.tracking.offline import reachable  # noqa: E402
from app.tracking.store import RunLogger, client, metric_history  # noqa: E402
from tests.processes import free_ports, start_mlflow_server, stop, wait_http  # noqa: E402


def _start_server(port: int, db: Path, log: Path):
    server = start_mlflow_server(port, db, log, dict(os.environ))
    wait_http(f"http://127.0.0.1:{port}/health", server, log)
    return server


def test_metrics_survive_a_tracking_server_outage(tmp_path):
    db, (port,) = tmp_path / "mlflow.db", free_ports(1)
    uri = f"http://127.0.0.1:{port}"
    local = client(f"sqlite:///{db}")  # the server's own store, read without the server
    run_id = local.create_run(local.create_experiment("outage")).info.run_id
    assert not reachable(uri)

    # 1. server down from the start of logging: nothing raises, one warning, a local file
    lines = []
    run = RunLogger(uri, run_id)
    run.keep_offline(tmp_path / "run" / "mlflow_pending.jsonl", echo=lines.append, retry_every_s=0)
    for step in (1, 2):
        run.log_metrics({"loss": 3.0 - step}, step=step, flush=True)
    run.set_tags({"partitions": 2})
    assert len(lines) == 1 and "is unreachable" in lines[0] and "mpipemoe tracking import" in lines[0]
    pending = tmp_path / "run" / "mlflow_pending.jsonl"
    records = [json.loads(line) for line in pending.read_text().splitlines()]
    assert records[0] == {"run_id": run_id, "tracking_uri": uri}
    assert [r["metrics"][0][3] for r in records if "metrics" in r] == [1, 2]

    # 2. server back: the next flush sends what was kept, in order, then the new step
    server = _start_server(port, db, tmp_path / "server.log")
    try:
        run.log_metrics({"loss": 0.5}, step=3, flush=True)
        assert "answers again: sent the 2 metric values" in lines[-1]
        assert metric_history(uri, run_id, "loss") == [(1, 2.0), (2, 1.0), (3, 0.5)]
        assert local.get_run(run_id).data.tags["partitions"] == "2"
        assert not pending.exists() and pending.with_name("mlflow_pending.jsonl.sent").exists()
    finally:
        stop(server)

    # 3. down again at the end of the run: the last steps and the status wait for the import
    run.log_metrics({"loss": 0.25}, step=4)
    run.finish("FINISHED")
    assert local.get_run(run_id).info.status == "RUNNING"
    assert "is unreachable" in lines[-1]
    assert cli.main(["tracking", "import", str(pending), "--tracking-uri", f"sqlite:///{db}"]) == 0
    assert local.get_run(run_id).info.status == "FINISHED"
    assert metric_history(f"sqlite:///{db}", run_id, "loss")[-1] == (4, 0.25)
    assert cli.main(["tracking", "import", str(pending)]) == 1  # sent already: says so, names the fix
