"""The driver's stop request to the workers (Ctrl-C, SIGTERM): a tiny async Ray actor.

    flag = new_stop_flag()           # driver; goes to the workers in their config
    flag.request.remote()            # driver, on Ctrl-C
    poller = StopPoller(flag)        # rank 0
    poller.requested()               # rank 0, once per step: a local, non-blocking check
    flag.decide.remote(step, stop)   # driver, at a hold step (a sweep's ASHA rung)
    poller.verdict(step, timeout_s)  # rank 0, at a hold step: waits a while for the driver's decision

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


# The ranks wait at most this long at a hold step for the driver's decision, then go on (a
# driver that never answers must not hang the job). Rank 0 asks in waits of at most
# HOLD_POLL_S (and a quarter of the collective timeout), between which every rank learns in a
# collective whether the driver has answered (workers/loop.py ``hold_verdict``), so no rank
# sits in a collective for long whatever the collective timeout.
HOLD_TIMEOUT_S = 300.0
HOLD_POLL_S = 30.0


class StopFlag:
    """Set once by the driver; ``wait`` returns when it is set. At a hold step the driver
    also ``decide``s whether the job stops there; ``verdict`` waits for that decision."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._decided: dict[int, bool] = {}
        self._changed = asyncio.Condition()

    async def request(self) -> None:
        self._event.set()
        async with self._changed:
            self._changed.notify_all()

    async def wait(self) -> bool:
        await self._event.wait()
        return True

    async def decide(self, step: int, stop: bool) -> None:
        async with self._changed:
            self._decided[step] = stop
            if stop:
                self._event.set()
            self._changed.notify_all()

    async def verdict(self, step: int, timeout_s: float = HOLD_POLL_S) -> bool | None:
        """True when the driver decided to stop after ``step`` or asked to stop (Ctrl-C);
        False when it decided to go on; None when it said nothing within ``timeout_s``."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(
                    lambda: step in self._decided or self._event.is_set()), timeout_s)
            except asyncio.TimeoutError:
                return None
            return self._event.is_set() or self._decided.get(step, False)


def on_this_node() -> dict[str, Any]:
    """Ray actor options for a helper actor of the driver's (stop flag, metrics queue, a sweep's
    trial gate): no CPU (it only waits) and the driver's own node. Anywhere else the loss of that
    node (a worker node that dies mid-run) would end the actor with it: a restarted worker group
    would stop after one step as if asked to, or lose its metrics (issue 42)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return {"num_cpus": 0, "scheduling_strategy": here}


def new_stop_flag() -> Any:
    """A StopFlag actor on the driver's node (``on_this_node``)."""
    import ray

    return ray.remote(StopFlag).options(**on_this_node()).remote()


class StopPoller:
    """Rank 0's view of a StopFlag: one pending ``wait`` call, checked without blocking."""

    def __init__(self, flag: Any) -> None:  # a StopFlag actor handle, or None
        self._flag = flag
        self._pending = flag.wait.remote() if flag is not None else None

    def requested(self) -> bool:
        """Local (no collective): whether the driver has asked to stop."""
        if self._pending is None:
            return False
        import ray

        ready, _ = ray.wait([self._pending], timeout=0)
        if not ready:
            return False
        try:
            return bool(ray.get(ready[0]))
        except ray.exceptions.RayActorError:  # the flag's node is gone: nobody asked to stop
            self._pending = None
            return False

    def verdict(self, step: int, timeout_s: float = HOLD_POLL_S) -> bool | None:
        """Local (no collective), blocking for up to ``timeout_s``: the driver's decision on
        stopping after ``step``, None while it has not decided (False without a flag)."""
        if self._flag is None:
            return False
        import ray

        answer = ray.get(self._flag.verdict.remote(step, timeout_s))
        return None if answer is None else bool(answer)
