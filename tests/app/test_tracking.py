"""MLflow helpers against a throw-away sqlite store (tier 1, no Ray)."""
from __future__ import annotations

import math
import time

import pytest

from app.tracking.store import RunLogger, client, find_run, flatten, metric_history, resolve_tracking_uri


def test_resolve_tracking_uri(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_tracking_uri(None) == f"sqlite:///{tmp_path}/mlflow.db"
    assert resolve_tracking_uri("sqlite:///sub/x.db") == f"sqlite:///{tmp_path}/sub/x.db"
    assert resolve_tracking_uri("sqlite:////abs/x.db") == "sqlite:////abs/x.db"
    assert resolve_tracking_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///env.db")
    assert resolve_tracking_uri(None) == f"sqlite:///{tmp_path}/env.db"


def test_flatten():
    assert flatten({"a": {"b": 1, "c": {"d": 2}}, "e": 3}) == {"a.b": 1, "a.c.d": 2, "e": 3}


def test_run_logger_params_metrics_nesting_and_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    parent = RunLogger.start(uri, "exp", run_name="parent")
    run = RunLogger.start(uri, "exp", run_name="child", parent_run_id=parent.run_id, tags={"key": "v"})
    run.log_params({"lr": 0.1, "model": {"d_model": 64}})
    for step in range(1, 4):
        run.log_metrics({"loss": 4.0 - step, "strategy": "S2", "bad": math.nan}, step=step)
    run.finish()
    info = client(uri).get_run(run.run_id)
    assert info.info.status == "FINISHED"
    assert info.data.params == {"lr": "0.1", "model.d_model": "64"}
    assert info.data.tags["mlflow.parentRunId"] == parent.run_id and info.data.tags["key"] == "v"
    assert metric_history(uri, run.run_id, "loss") == [(1, 3.0), (2, 2.0), (3, 1.0)]
    assert "strategy" not in info.data.metrics and "bad" not in info.data.metrics
    assert find_run(uri, "exp", "key", "v") == run.run_id
    assert find_run(uri, "exp", "key", "other") is None and find_run(uri, "nope", "key", "v") is None
    again = RunLogger.resume(uri, run.run_id)
    assert client(uri).get_run(run.run_id).info.status == "RUNNING"
    again.finish("FAILED")
    assert client(uri).get_run(run.run_id).info.status == "FAILED"


def test_runs_carry_the_git_commit_and_dirty_flag_of_a_checkout_and_nothing_elsewhere(tmp_path):
    import subprocess

    from app.tracking.store import CHECKOUT, git_tags

    assert git_tags(tmp_path) == {}  # not a checkout
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "sub").mkdir()
    assert git_tags(tmp_path / "sub") == {}  # inside one, but not its top (an installed copy)
    assert git_tags(tmp_path) == {}  # a checkout without a commit
    (tmp_path / "f.txt").write_text("a")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "add", "f.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert git_tags(tmp_path) == {"mlflow.source.git.commit": head, "git_commit": head, "git_dirty": "false"}
    (tmp_path / "f.txt").write_text("b")
    assert git_tags(tmp_path)["git_dirty"] == "true"
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run = RunLogger.start(uri, "exp", run_name="tagged")
    assert {k: v for k, v in client(uri).get_run(run.run_id).data.tags.items() if "git" in k} == git_tags(CHECKOUT)


def test_system_metrics_are_logged_where_psutil_is_and_off_cleanly_where_not(tmp_path, monkeypatch):
    import importlib.util

    from app.tracking import store as tracking

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    real = importlib.util.find_spec
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name, *a: None if name == "psutil" else real(name, *a))
    run = RunLogger.start(uri, "exp", run_name="bare", system_metrics=True)
    assert run.monitor is None
    run.finish()
    monkeypatch.undo()
    if real("psutil") is None:
        pytest.skip("psutil is not installed: system metrics are off (the case above)")
    monkeypatch.setattr(tracking, "SYSTEM_METRICS_INTERVAL_S", 0.2)
    run = RunLogger.start(uri, "exp", run_name="monitored", system_metrics=True)
    assert run.monitor is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(run.monitor.mlflow_logger.data) + \
            len(client(uri).get_run(run.run_id).data.metrics) == 0:
        time.sleep(0.2)
    run.finish()
    metrics = client(uri).get_run(run.run_id).data.metrics
    assert "system/cpu_utilization_percentage" in metrics and run.monitor is None


def test_ui_serves_the_store_on_localhost_only():
    from app.commands.ui import server_command

    command = server_command("sqlite:////x/mlflow.db", 5050)
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert command[command.index("--backend-store-uri") + 1] == "sqlite:////x/mlflow.db"
    assert command[command.index("--port") + 1] == "5050"
