"""One live job per run name: a lock file under ``<storage-path>/.mpipemoe-locks/``.

    with RunLock(storage_path, name, echo=print) as lock:   # raises RunInUseError if live
        lock.update(mlflow_run_id=run_id)                    # named in a second job's error

The lock is an ``flock`` on ``<name>.lock``; the kernel drops it when its process ends,
however it ends (Ctrl-C, SIGKILL, a crash), so a lock left by a dead process is simply
free: the next job takes it over (and says whose it was). The file's JSON (pid, host,
start time, command, MLflow run) only serves to name the live job in the error.
The file is removed when the lock is released; ``acquire`` re-checks that the file it
locked is still the one at the path, so a release racing an acquire cannot leave two holders.
The lock sits beside the run directories, not in them, so a refused job creates no run directory.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from lm.errors import os_error

LOCK_DIR = ".mpipemoe-locks"


class RunInUseError(ValueError):
    """Another live job holds the run name."""


class RunLock:
    def __init__(self, storage_path: str | os.PathLike, name: str, echo=print):
        self.path = Path(storage_path) / LOCK_DIR / f"{name}.lock"
        self.name = name
        self.echo = echo
        self._fd: int | None = None
        self._info: dict = {}

    def _read(self, fd: int) -> dict:
        try:
            return json.loads(os.pread(fd, 65536, 0).decode() or "{}")
        except (OSError, ValueError):
            return {}

    def acquire(self) -> "RunLock":
        """Take the lock or raise RunInUseError naming the live job and the fix (OSError
        naming the file and the fix when the storage cannot take it: full, read-only)."""
        try:
            return self._acquire()
        except OSError as error:
            self.release()
            raise os_error(error, f"cannot write the run lock {self.path}",
                           "free space there or choose another --storage-path") from error

    def _acquire(self) -> "RunLock":
        while True:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:  # another job's release removed the empty folder: again
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = self._read(fd)
                os.close(fd)
                who = ", ".join(f"{k} {holder[k]}" for k in ("pid", "host", "started", "mlflow_run_id")
                                if holder.get(k)) or "a process that has not written its details yet"
                raise RunInUseError(
                    f"run name {self.name!r} is in use by a live job ({who}): wait for it to end or stop "
                    f"it (Ctrl-C), or choose another --name") from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # released and removed between our open and our lock: try again
        stale = self._read(fd)
        if stale.get("pid"):
            self.echo(f"[mpipemoe] run {self.name}: taking over the lock left by pid {stale['pid']} on "
                      f"{stale.get('host', '?')} (started {stale.get('started', '?')}), which is no longer running")
        self._fd = fd  # from here on, release() removes the file on any failure
        self._info = {"pid": os.getpid(), "host": socket.gethostname(),
                      "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)[:500]}
        self._write()
        return self

    def _write(self) -> None:
        data = json.dumps(self._info).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def update(self, **info) -> None:
        """Add details (e.g. the MLflow run id) that a refused second job will be told."""
        if self._fd is not None:
            self._info.update({k: v for k, v in info.items() if v})
            self._write()

    def release(self) -> None:
        if self._fd is not None:
            try:
                self.path.unlink(missing_ok=True)  # still locked: nobody can take a removed file
            finally:
                os.close(self._fd)
                self._fd = None
        try:
            self.path.parent.rmdir()
        except OSError:  # other locks in it, or already gone
            pass

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
