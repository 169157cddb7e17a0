"""Helpers for tests that run servers as their own processes (``ray start --head --block``,
``mlflow server``): free ports, waiting for an HTTP answer, stopping by pid."""
from __future__ import annotations

import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 now."""
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def wait_http(url: str, process: subprocess.Popen, log: Path, timeout_s: float = 120) -> None:
    """Return once ``url`` answers (any HTTP status: 401 means token auth is on); fail naming
    the log's tail if ``process`` exits or ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"{process.args[:3]} exited: {log.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"{url} did not answer in {timeout_s} s: {log.read_text()[-2000:]}")


def stop(process: subprocess.Popen, timeout_s: float = 30) -> None:
    """SIGTERM (a Ray head started with --block stops its own processes), then SIGKILL."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def start_mlflow_server(port: int, db: Path, log: Path, env: dict) -> subprocess.Popen:
    """``mlflow server`` on 127.0.0.1:``port`` over the SQLite file ``db`` (artifacts beside
    it); returns at once: ``wait_http(.../health)`` waits for it."""
    import sys

    return subprocess.Popen(
        [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", f"sqlite:///{db}",
         "--artifacts-destination", str(db.parent / "artifacts")],
        env={**env, "MLFLOW_DISABLE_TELEMETRY": "true"}, stdout=log.open("w"), stderr=subprocess.STDOUT)
