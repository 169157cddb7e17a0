"""``mpipemoe ui``: the MLflow UI over the training runs' store, on 127.0.0.1 by default.

    mpipemoe ui                      # http://127.0.0.1:5000, store: MLFLOW_TRACKING_URI or ./mlflow.db
    mpipemoe ui --port 5050 --tracking-uri sqlite:////abs/path/mlflow.db
    mpipemoe ui --host 10.0.1.5 --workers 4 --tracking-uri postgresql://mlflow:PASSWORD@db-host:5432/mlflow \
        --artifacts-destination s3://my-bucket/mlflow       # a cluster's store (docs/cluster.md)

Runs ``mlflow server`` as a child process and stops it (by its pid) on Ctrl-C.
To reach it from another machine, forward the port over SSH
(``ssh -L 5000:127.0.0.1:5000 host``) rather than listening on other interfaces.
``--host`` listens elsewhere, with a warning: the UI has no login of its own
(docs/security.md).
"""
from __future__ import annotations

import argparse
import errno
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time

from app.tracking.server import check_server_stores, mlflow_server_command, redact_password
from app.tracking.store import TRAINING_VIEW, resolve_tracking_uri

LOCAL_HOST = "127.0.0.1"


def server_command(tracking_uri: str, port: int, host: str = LOCAL_HOST, *,
                   artifacts_destination: str | None = None, workers: int = 1) -> list[str]:
    """The ``mlflow server`` command line for ``tracking_uri`` on ``host:port`` (app/tracking/server.py)."""
    return mlflow_server_command(tracking_uri, port, host, artifacts_destination=artifacts_destination,
                                 workers=workers)


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
                        help="MLflow store (default MLFLOW_TRACKING_URI or ./mlflow.db); a cluster's: "
                             "postgresql://USER:PASSWORD@HOST:5432/DB (docs/cluster.md)")
    parser.add_argument("--artifacts-destination", default=None,
                        help="where the server keeps the runs' artifacts, e.g. s3://BUCKET/PREFIX (default: "
                             "MLflow's, ./mlartifacts); clients upload them through the server")
    parser.add_argument("--workers", type=int, default=1,
                        help="server processes (default %(default)s; more only with a database store such as "
                             "PostgreSQL: a SQLite store has one writer)")


def check_port(host: str, port: int) -> None:
    """Raise ValueError naming the fix unless ``port`` is a TCP port that ``host`` can listen on
    now (in range, not taken by another server): checked by binding it, then letting it go."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"--port {port} is not a TCP port: give one in 1-65535, e.g. 5050")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds it
            probe.bind((host, port))
    except OSError as error:
        why = os.strerror(error.errno) if error.errno else str(error)
        taken = error.errno == errno.EADDRINUSE
        raise ValueError(f"--port {port}: cannot listen on {host}:{port} ({why}): "
                         + ("another server has it; stop it or choose another --port (e.g. --port 5050)" if taken
                            else "choose another --port or --host")) from None


# mlflow server imports its app and opens the store before it listens: seconds on a loaded machine.
READY_TIMEOUT_S = 120


def wait_until_listening(process: subprocess.Popen, host: str, port: int, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Return once ``host:port`` accepts a connection; raise RuntimeError naming the cause when the
    server ``process`` ends first (or does not listen within ``timeout_s``; it is then stopped)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the MLflow server ended (status {process.returncode}) before it listened on "
                               f"{host}:{port}: its lines above say why; check --tracking-uri and --port")
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    _stop(process)
    raise RuntimeError(f"the MLflow server did not listen on {host}:{port} within {timeout_s:.0f} s: stopped it; "
                       f"try again, or run `{' '.join(server_command('STORE', port, host)[1:])}` to see why")


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()


def run(args: argparse.Namespace) -> int:
    uri = resolve_tracking_uri(args.tracking_uri)
    if uri.startswith(("http://", "https://")):
        print(f"the tracking store is already a server: open {uri}")
        return 0
    check_server_stores(uri, args.artifacts_destination, args.workers)
    check_port(args.host, args.port)  # before the server starts: a taken port is one line
    warning = exposure_warning(args.host)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    process = subprocess.Popen(server_command(uri, args.port, args.host, artifacts_destination=args.artifacts_destination,
                                              workers=args.workers))
    signal.signal(signal.SIGTERM, _interrupt)  # a terminated `mpipemoe ui` stops its server too
    try:
        wait_until_listening(process, args.host, args.port)
        print(f"MLflow UI for {redact_password(uri)}\n  open http://{args.host}:{args.port}/{TRAINING_VIEW}  (the model-training "
              f"view; Ctrl-C stops it)", flush=True)
        status = process.wait()
    except KeyboardInterrupt:
        _stop(process)
        return 0
    if status != 0:
        raise RuntimeError(f"the MLflow server on {args.host}:{args.port} ended with status {status}: its lines "
                           f"above say why")
    return 0
