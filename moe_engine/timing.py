"""One timing helper for calibration, the online search and the benchmark:
warm-up, then repeated runs timed with CUDA events (GPU) or perf_counter (CPU), with the
host's time beside each: how long the call took to return (perf_counter, unsynchronized)."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Timing:
    """mean_s, stdev_s: the device's time of the calls (wall time on CPU);
    host_s: the mean host time of a call, from its start until it returned without waiting
    for the device (on CUDA less than mean_s when the host runs ahead; equal to it when the
    call waits at a host read); counted_s: the mean seconds `host_counter` (time_fn) advanced
    in a call (0 without one)."""

    mean_s: float
    stdev_s: float
    repeats: int
    host_s: float = 0.0
    counted_s: float = 0.0

    @property
    def mean_ms(self) -> float:
        return self.mean_s * 1e3


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """Elapsed time of a region, ordered with the device's work."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.device.type == "cuda":
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self.device.type == "cuda":
            self._end.record()
        else:
            self._t1 = time.perf_counter()

    def elapsed_s(self) -> float:
        """Seconds between start and stop (waits for the device on CUDA)."""
        if self.device.type == "cuda":
            self._end.synchronize()
            return float(self._start.elapsed_time(self._end)) / 1e3
        return self._t1 - self._t0


def time_fn(fn: Callable[[], object], device: torch.device, warmup: int = 2, repeats: int = 5,
            host_counter: Callable[[], float] | None = None) -> Timing:
    """`warmup` calls, then `repeats` timed ones. `host_counter`: a running total of seconds
    (the emulator's own host work, moe_sim/emulation.py EmulatedTiming.host_s) whose advance
    over the timed calls is reported apart (`Timing.counted_s`)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples, host = [], []
    counted_before = host_counter() if host_counter is not None else 0.0
    for _ in range(repeats):
        watch = Stopwatch(device)
        watch.start()
        issued = time.perf_counter()
        fn()
        host.append(time.perf_counter() - issued)
        watch.stop()
        samples.append(watch.elapsed_s())
    counted = (host_counter() - counted_before) / repeats if host_counter is not None else 0.0
    return Timing(statistics.fmean(samples), statistics.stdev(samples) if len(samples) > 1 else 0.0, len(samples),
                  host_s=statistics.fmean(host), counted_s=counted)


@dataclass(frozen=True)
class RoundsTiming:
    """One function's time over interleaved rounds: `median_s` is the median of its
    per-round means, `spread_s` the standard deviation of those means; `host_median_s` and
    `counted_median_s` the medians of the rounds' `Timing.host_s` and `Timing.counted_s`."""

    median_s: float
    spread_s: float
    round_means_s: tuple[float, ...]
    host_median_s: float = 0.0
    counted_median_s: float = 0.0

    @property
    def host_ms(self) -> float:
        return self.host_median_s * 1e3

    @property
    def counted_ms(self) -> float:
        return self.counted_median_s * 1e3

    @property
    def median_ms(self) -> float:
        return self.median_s * 1e3

    @property
    def fastest_ms(self) -> float:
        """The fastest round's mean: what a floor of this function's time is built from."""
        return min(self.round_means_s) * 1e3


def time_interleaved(fns: list[Callable[[], object]], device: torch.device, rounds: int = 5, warmup: int = 1,
                     repeats: int = 3, host_counter: Callable[[], float] | None = None) -> list[RoundsTiming]:
    """Times every function in `fns` round after round — each round warms each one up
    and then times `repeats` calls of it — so a slow spell of the machine (another
    tenant, a CPU clock change) lands on all of them alike instead of on whichever ran
    during it. Returns one `RoundsTiming` per function, in order (`host_counter`: time_fn's)."""
    if rounds < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"time_interleaved needs rounds >= 1, repeats >= 1, warmup >= 0; "
                         f"got rounds={rounds}, repeats={repeats}, warmup={warmup}")
    timings: list[list[Timing]] = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            timings[i].append(time_fn(fn, device, warmup=warmup, repeats=repeats, host_counter=host_counter))
    results = []
    for per_round in timings:
        means = [t.mean_s for t in per_round]
        results.append(RoundsTiming(statistics.median(means), statistics.stdev(means) if len(means) > 1 else 0.0,
                                    tuple(means), host_median_s=statistics.median(t.host_s for t in per_round),
                                    counted_median_s=statistics.median(t.counted_s for t in per_round)))
    return results
