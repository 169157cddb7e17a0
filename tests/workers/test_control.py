"""The driver's stop flag as the workers see it (workers/control.py), on the session's local Ray."""
from __future__ import annotations

import time

import pytest
import torch


@pytest.mark.ray
def test_a_stop_flag_that_died_is_no_stop_request(ray_local):
    """A flag gone with its node (issue 42: a worker node lost mid-run) must not read as the
    driver's stop request: a restarted worker group stopped after one step when it did."""
    from workers.control import StopPoller, new_stop_flag

    asked, lost = new_stop_flag(), new_stop_flag()
    asked_poller, lost_poller = StopPoller(asked), StopPoller(lost)
    assert not asked_poller.requested() and not lost_poller.requested()

    ray_local.get(asked.request.remote())
    ray_local.kill(lost)
    with pytest.raises(ray_local.exceptions.RayActorError):
        ray_local.get(lost.wait.remote(), timeout=30)  # dead: the poller's pending call has failed too
    deadline = time.monotonic() + 30  # the request reaches the poller's pending call a moment later
    while not asked_poller.requested():
        assert time.monotonic() < deadline, "the stop request was not seen in 30 s"
        time.sleep(0.05)
    assert not lost_poller.requested() and not lost_poller.requested()  # and stays so


class _SlowDriver:
    """Rank 0's poller of a driver that answers ``answer`` ``after_s`` seconds after the first
    ask (None: never); ``asked``: the waits it was asked for."""

    def __init__(self, after_s: float, answer: bool | None):
        self.after_s, self.answer, self.asked, self.since = after_s, answer, [], None

    def verdict(self, step: int, timeout_s: float) -> bool | None:
        self.asked.append(timeout_s)
        self.since = self.since or time.monotonic()
        left = self.since + self.after_s - time.monotonic()
        if self.answer is None or left > timeout_s:
            time.sleep(timeout_s)
            return None
        time.sleep(max(0.0, left))
        return self.answer


def _hold(rank: int, world_size: int, timeout_s: float) -> list:
    from workers.loop import hold_verdict

    outcomes = []
    for after_s, answer in ((2 * timeout_s, True), (0.0, None)):
        driver = _SlowDriver(after_s, answer) if rank == 0 else None
        stop = hold_verdict(3, driver, torch.device("cpu"), world_size, timeout_s,  # type: ignore[arg-type]
                            hold_timeout_s=2.5 * timeout_s)
        outcomes.append((stop, max(driver.asked) if driver else None))
    return outcomes


@pytest.mark.gloo
def test_every_rank_waits_at_a_hold_step_however_short_the_collective_timeout():
    """The driver answers a hold step after 8 s, twice the 4 s collective timeout (long enough
    that a loaded machine's scheduling delays stay well inside it): rank 0 asks
    in waits of a quarter of it, every rank learns after each whether the answer has come, and
    all stop together (a rank 0 waiting for the answer alone left the others in a collective
    that timed out). A driver that never answers: every rank goes on after the hold's limit."""
    from tests.distributed import run_on_ranks

    rank0, rank1 = run_on_ranks(2, _hold, 4.0, collective_timeout_s=4.0, timeout=240)
    assert rank0 == [(True, 1.0), (False, 1.0)] and rank1 == [(True, None), (False, None)]
