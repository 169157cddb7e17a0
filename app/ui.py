"""``mpipemoe ui``: the MLflow UI over the training runs' store, on 127.0.0.1 by default.

    mpipemoe ui                      # http://127.0.0.1:5000, store: MLFLOW_TRACKING_URI or ./mlflow.db
    mpipemoe ui --port 5050 --tracking-uri sqlite:////abs/path/mlflow.db

Runs ``mlflow server`` as a child process and stops it (by its pid) on Ctrl-C.
To reach it from another machine, forward the port over SSH
(``ssh -L 5000:127.0.0.1:5000 host``) rather than listening on other interfaces.
``--host`` listens elsewhere, with a warning: the UI has no login of its own
(docs/security.md).
"""
from __future__ import annotations

import argparse
import ipaddress
import signal
import subprocess
import sys

from app.tracking import TRAINING_VIEW, resolve_tracking_uri

LOCAL_HOST = "127.0.0.1"


def server_command(tracking_uri: str, port: int, host: str = LOCAL_HOST) -> list[str]:
    """The ``mlflow server`` command line for ``tracking_uri`` on ``host:port``."""
    return [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", tracking_uri,
            "--host", host, "--port", str(port), "--workers", "1"]


def exposure_warning(host: str) -> str | None:
    """A warning when ``host`` is reachable from other machines (None for loopback)."""
    if host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:  # a host name
        pass
    return (f"warning: the MLflow UI will listen on {host}, reachable from other machines, and has no "
            f"login of its own: anyone who reaches the port can read and delete runs. Prefer the default "
            f"{LOCAL_HOST} with an SSH tunnel (ssh -L PORT:127.0.0.1:PORT host); see docs/security.md")


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=5000, help="port (default %(default)s)")
    parser.add_argument("--host", default=LOCAL_HOST,
                        help="interface to listen on (default %(default)s: this machine only; "
                             "anything else warns, see docs/security.md)")
    parser.add_argument("--tracking-uri", default=None,
                        help="MLflow store (default MLFLOW_TRACKING_URI or ./mlflow.db)")


def run(args: argparse.Namespace) -> int:
    uri = resolve_tracking_uri(args.tracking_uri)
    if uri.startswith(("http://", "https://")):
        print(f"the tracking store is already a server: open {uri}")
        return 0
    warning = exposure_warning(args.host)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    process = subprocess.Popen(server_command(uri, args.port, args.host))
    signal.signal(signal.SIGTERM, _interrupt)  # a terminated `mpipemoe ui` stops its server too
    print(f"MLflow UI for {uri}\n  open http://{args.host}:{args.port}/{TRAINING_VIEW}  (the model-training view; "
          f"Ctrl-C stops it)", flush=True)
    try:
        return process.wait()
    except KeyboardInterrupt:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
        return 0
