"""The driver's stop request to the workers (Ctrl-C, SIGTERM): a tiny async Ray actor.

    flag = new_stop_flag()           # driver; goes to the workers in their config
    flag.request.remote()            # driver, on Ctrl-C
    poller = StopPoller(flag)        # rank 0
    poller.requested()               # rank 0, once per step: a local, non-blocking check

Only rank 0 polls; the loop carries its answer in the step's max-reduction that every rank
already makes, so all ranks stop after the same step (no extra collective, no hang).
Ray is imported inside the functions that use it: tests drive the flag and the poller
without the ``ray`` extra.
"""
from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

# Exit status of a command stopped by SIGTERM (128 + 15, as shells report it); Ctrl-C gives 130.
SIGTERM_EXIT_CODE = 128 + signal.SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler, systemd, ``docker stop``), raised in the main thread so that it
    stops a job the way Ctrl-C does."""

    exit_code = SIGTERM_EXIT_CODE


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated("SIGTERM")


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises ``Terminated`` in the main thread (elsewhere: no
    change); the previous handler (Ray's ``ray.init`` installs one that exits at once,
    leaving the workers mid-step) is restored afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class StopFlag:
    """Set once by the driver; ``wait`` returns when it is set."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    async def request(self) -> None:
        self._event.set()

    async def wait(self) -> bool:
        await self._event.wait()
        return True


def new_stop_flag() -> Any:
    """A StopFlag actor that needs no CPU (it only waits)."""
    import ray

    return ray.remote(num_cpus=0)(StopFlag).remote()


class StopPoller:
    """Rank 0's view of a StopFlag: one pending ``wait`` call, checked without blocking."""

    def __init__(self, flag: Any) -> None:  # a StopFlag actor handle, or None
        self._pending = flag.wait.remote() if flag is not None else None

    def requested(self) -> bool:
        """Local (no collective): whether the driver has asked to stop."""
        if self._pending is None:
            return False
        import ray

        ready, _ = ray.wait([self._pending], timeout=0)
        return bool(ready)
