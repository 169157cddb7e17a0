"""Private by default (docs/design.md §8, issue 7 item 6): the MLflow UI and the embedded Ray
instance listen on 127.0.0.1 only unless the user asks otherwise (then with a warning);
cluster.yaml's bindings are checked in tests/app/test_cluster_config.py; docs/security.md
says how to run safely. No server is started here: the commands and calls are captured.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from app.commands import ui

ROOT = Path(__file__).resolve().parents[2]


class _FakeServer:
    def __init__(self, command):
        self.command = command

    def wait(self):
        return 0


def _run_ui(monkeypatch, argv: list[str]) -> list[str]:
    started = []
    monkeypatch.setattr(ui.subprocess, "Popen", lambda command: started.append(command) or _FakeServer(command))
    monkeypatch.setattr(ui.signal, "signal", lambda *a: None)
    monkeypatch.setattr(ui, "check_port", lambda host, port: None)  # (tests/app/test_faults_cli.py checks them)
    monkeypatch.setattr(ui, "wait_until_listening", lambda process, host, port: None)
    parser = argparse.ArgumentParser()
    ui.add_arguments(parser)
    assert ui.run(parser.parse_args(argv + ["--tracking-uri", "sqlite:////tmp/x.db"])) == 0
    (command,) = started
    return command


def _host_of(command: list[str]) -> str:
    return command[command.index("--host") + 1]


def test_ui_listens_on_loopback_by_default(monkeypatch, capsys):
    command = _run_ui(monkeypatch, [])
    assert _host_of(command) == "127.0.0.1"
    assert "warning" not in capsys.readouterr().err
    assert _host_of(ui.server_command("sqlite:////tmp/x.db", 5000)) == "127.0.0.1"


def test_ui_on_another_interface_warns(monkeypatch, capsys):
    command = _run_ui(monkeypatch, ["--host", "0.0.0.0"])
    assert _host_of(command) == "0.0.0.0"
    err = capsys.readouterr().err
    assert "warning: the MLflow UI will listen on 0.0.0.0" in err and "docs/security.md" in err


@pytest.mark.parametrize("host, warns", [("127.0.0.1", False), ("localhost", False), ("::1", False),
                                         ("0.0.0.0", True), ("10.0.0.5", True), ("myhost.example", True)])
def test_exposure_warning(host, warns):
    assert (ui.exposure_warning(host) is not None) == warns


def test_embedded_ray_has_no_dashboard(monkeypatch):
    ray = pytest.importorskip("ray")
    from app.jobs.job import TrainJob
    from app.jobs.ray_start import init_ray

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    assert init_ray(TrainJob(), address=None) is True
    (kwargs,) = calls
    assert kwargs["address"] == "local" and kwargs["include_dashboard"] is False
    assert kwargs["dashboard_host"] == "127.0.0.1"


def test_every_embedded_ray_init_turns_the_dashboard_off():
    """Static guard for new commands: each ``ray.init(address="local", ...)`` in app/ says
    include_dashboard=False."""
    calls = [(path.name, call) for path in sorted((ROOT / "app").rglob("*.py"))
             for call in re.findall(r"ray\.init\((.*?)\)\n", path.read_text(), flags=re.S)
             if 'address="local"' in call]
    assert calls, "no embedded ray.init found"
    for name, call in calls:
        assert "include_dashboard=False" in call, f"{name}: ray.init({call})"


def test_security_doc_covers_the_safe_setup():
    doc = (ROOT / "docs" / "security.md").read_text()
    for needle in ("127.0.0.1", "ssh -L 5000:127.0.0.1:5000", "RAY_AUTH_MODE", "--dashboard-host=127.0.0.1",
                   "basic-auth", "MLFLOW_TRACKING_USERNAME", "mpipemoe ui --host", "use_internal_ips"):
        assert needle in doc, needle


def test_the_auth_extra_brings_mlflows_auth_app_at_the_pinned_mlflow():
    """`mlflow server --app-name basic-auth` needs Flask-WTF: pip install 'mpipemoe[auth]' brings
    it with the same mlflow the ray extra pins."""
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (pinned,) = [r for r in extras["ray"] if r.startswith("mlflow==")]
    assert extras["auth"] == [f"mlflow[auth]=={pinned.split('==')[1]}"]
