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


def ray_client_port_flag(port: int) -> list[str]:
    """``--ray-client-server-port``: our own port where Ray Client is installed (else the head
    would take the shared default 10001); nothing where it is not (Ray refuses the flag then)."""
    from ray._private.utils import get_ray_client_dependency_error
    return [f"--ray-client-server-port={port}"] if get_ray_client_dependency_error() is None else []


def start_ray_node(log: Path, env: dict, *, head_address: str | None = None, num_cpus: int,
                   temp_dir: str | None = None, resources: dict | None = None,
                   dashboard_port: int | None = None) -> subprocess.Popen:
    """``ray start --block`` on 127.0.0.1 with every port of its own (none of Ray's shared
    defaults, so it never meets another Ray on the machine): a head (``head_address`` None;
    its GCS on the first of its ports, returned as ``process.gcs_port``, its dashboard and job
    server on ``dashboard_port``) or a worker node joining ``head_address``. ``env`` carries
    the token authentication (``RAY_AUTH_MODE``, ``RAY_AUTH_TOKEN``) and a private HOME.
    Returns at once; stop it with ``stop`` (SIGTERM stops the node's own processes)."""
    import json
    import sys

    gcs, client, agent_http, agent_grpc, metrics, runtime_env = free_ports(6)
    flags = [f"--num-cpus={num_cpus}", "--node-ip-address=127.0.0.1",
             f"--dashboard-agent-listen-port={agent_http}", f"--dashboard-agent-grpc-port={agent_grpc}",
             f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={runtime_env}",
             "--object-store-memory=100000000", "--disable-usage-stats"]
    if resources:
        flags.append(f"--resources={json.dumps(resources)}")
    if head_address is None:
        flags += ["--head", f"--port={gcs}", "--dashboard-host=127.0.0.1", *ray_client_port_flag(client),
                  *([f"--dashboard-port={dashboard_port}"] if dashboard_port else []),
                  *([f"--temp-dir={temp_dir}"] if temp_dir else [])]
    else:
        flags.append(f"--address={head_address}")
    process = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--block", *flags],
                               env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    process.gcs_port = gcs  # type: ignore[attr-defined]  # (the head's GCS: worker nodes join 127.0.0.1:gcs_port)
    return process



def _children() -> dict[int, list[tuple[int, str]]]:
    """{parent pid: [(pid, command name)]} of every process now, read from /proc."""
    tree: dict[int, list[tuple[int, str]]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the process ended while we looked
            continue
        # "pid (comm) state ppid ...": comm may hold spaces, so split after its last ")"
        comm, rest = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
        tree.setdefault(int(rest[1]), []).append((int(text.split()[0]), comm))
    return tree


def descendants(pid: int) -> list[int]:
    """The pids of every process below ``pid`` (children, their children, ...)."""
    tree, found, todo = _children(), [], [pid]
    while todo:
        for child, _ in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def descendants_running(process: subprocess.Popen, text: str) -> list[int]:
    """The pids below ``process`` whose command line holds ``text`` (e.g. ``RayTrainWorker``,
    the title Ray gives a Ray Train worker's process)."""
    found = []
    for pid in descendants(process.pid):
        try:
            if text in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                found.append(pid)
        except OSError:  # the process ended while we looked
            continue
    return found


def child_pid(process: subprocess.Popen, name: str) -> int:
    """The pid of ``process``'s child whose command name is ``name`` (e.g. the ``raylet`` of a
    node started by ``ray start --block``); fails naming the children it found."""
    children = _children().get(process.pid, [])
    pids = [pid for pid, comm in children if comm == name]
    assert len(pids) == 1, f"{name!r} among the children of {process.pid}: {children}"
    return pids[0]


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL ``process`` and everything it started, at once (no grace: for processes whose
    state nobody keeps, such as a test's Ray nodes); a pid reused since is left alone."""
    import os

    below = {pid: _started_at(pid) for pid in descendants(process.pid)}
    process.kill()
    process.wait()
    for pid, started_at in below.items():
        if started_at is not None and _started_at(pid) == started_at:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended just now
                pass


def _started_at(pid: int) -> int | None:
    """The process's start time (clock ticks since boot, /proc/PID/stat), None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(text[text.rindex(")") + 2:].split()[19])
