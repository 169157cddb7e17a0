"""Tier 1: the interleaved timing the benchmark uses (moe_engine/timing.py)."""
import time

import pytest
import torch

from moe_engine.timing import time_interleaved

CPU = torch.device("cpu")


def test_every_function_runs_once_per_round_in_turn():
    calls = []
    fns = [lambda name=name: calls.append(name) for name in "abc"]
    timings = time_interleaved(fns, CPU, rounds=3, warmup=1, repeats=2)  # type: ignore[arg-type]  # (default-bound lambdas)
    # each round: a warm-up and two timed calls of a, then of b, then of c
    assert calls == (["a"] * 3 + ["b"] * 3 + ["c"] * 3) * 3
    assert [len(t.round_means_s) for t in timings] == [3, 3, 3]


def test_a_slow_spell_lands_on_every_function_and_the_median_ignores_it(monkeypatch):
    """The machine is 20x slower during round 2: both functions see it in the same round,
    and their medians stay at the normal cost with the right ratio. The clock is the test's
    own (each call advances it by its cost): a real sleep overslept on a loaded machine."""
    state = {"round_calls": 0, "now": 0.0}
    per_round_calls = 2 * (1 + 2)  # two functions x (warm-up + repeats)
    monkeypatch.setattr(time, "perf_counter", lambda: state["now"])

    def work(seconds):
        def run():
            slow = state["round_calls"] // per_round_calls == 1
            state["round_calls"] += 1
            state["now"] += seconds * (20 if slow else 1)
        return run

    fast, slow = time_interleaved([work(0.002), work(0.004)], CPU, rounds=3, warmup=1, repeats=2)
    assert fast.round_means_s == pytest.approx([0.002, 0.04, 0.002])
    assert slow.round_means_s == pytest.approx([0.004, 0.08, 0.004])
    assert fast.median_s == pytest.approx(0.002) and slow.median_s == pytest.approx(0.004)
    assert fast.spread_s > fast.median_s  # the slow round shows in the spread


@pytest.mark.parametrize("kwargs", [dict(rounds=0), dict(repeats=0), dict(warmup=-1)])
def test_nonsense_counts_are_refused_naming_them(kwargs):
    with pytest.raises(ValueError, match="time_interleaved needs rounds >= 1"):
        time_interleaved([lambda: None], CPU, **kwargs)


def test_the_host_time_of_each_call_and_the_counters_advance_are_reported_beside_the_device_time(monkeypatch):
    """host_s: from a call's start until it returned (here the test's own clock, advanced by
    each call); counted_s: how far `host_counter` advanced per timed call (warm-ups excluded)."""
    state = {"now": 0.0, "counted": 0.0}
    monkeypatch.setattr(time, "perf_counter", lambda: state["now"])

    def call():
        state["now"] += 0.003
        state["counted"] += 0.001  # of which the emulator's own work

    (timing,) = time_interleaved([call], CPU, rounds=3, warmup=2, repeats=4, host_counter=lambda: state["counted"])
    assert timing.host_median_s == pytest.approx(0.003) and timing.host_ms == pytest.approx(3.0)
    assert timing.counted_median_s == pytest.approx(0.001) and timing.counted_ms == pytest.approx(1.0)
    (plain,) = time_interleaved([call], CPU, rounds=1, warmup=0, repeats=1)
    assert plain.counted_median_s == 0.0 and plain.host_median_s == pytest.approx(0.003)

