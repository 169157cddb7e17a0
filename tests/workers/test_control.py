"""The driver's stop flag as the workers see it (workers/control.py), on the session's local Ray."""
from __future__ import annotations

import time

import pytest


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
