"""One timing helper for calibration, the online search and the benchmark:
warm-up, then repeated runs timed with CUDA events (GPU) or perf_counter (CPU)."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Timing:
    mean_s: float
    stdev_s: float
    repeats: int

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


def time_fn(fn: Callable[[], object], device: torch.device, warmup: int = 2, repeats: int = 5) -> Timing:
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples = []
    for _ in range(repeats):
        watch = Stopwatch(device)
        watch.start()
        fn()
        watch.stop()
        samples.append(watch.elapsed_s())
    return Timing(statistics.fmean(samples), statistics.stdev(samples) if len(samples) > 1 else 0.0, len(samples))


@dataclass(frozen=True)
class RoundsTiming:
    """One function's time over interleaved rounds: `median_s` is the median of its
    per-round means, `spread_s` the standard deviation of those means."""

    median_s: float
    spread_s: float
    round_means_s: tuple[float, ...]

    @property
    def median_ms(self) -> float:
        return self.median_s * 1e3

    @property
    def fastest_ms(self) -> float:
        """The fastest round's mean: what a floor of this function's time is built from."""
        return min(self.round_means_s) * 1e3


def time_interleaved(fns: list[Callable[[], object]], device: torch.device, rounds: int = 5, warmup: int = 1,
                     repeats: int = 3) -> list[RoundsTiming]:
    """Times every function in `fns` round after round — each round warms each one up
    and then times `repeats` calls of it — so a slow spell of the machine (another
    tenant, a CPU clock change) lands on all of them alike instead of on whichever ran
    during it. Returns one `RoundsTiming` per function, in order."""
    if rounds < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"time_interleaved needs rounds >= 1, repeats >= 1, warmup >= 0; "
                         f"got rounds={rounds}, repeats={repeats}, warmup={warmup}")
    means: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            means[i].append(time_fn(fn, device, warmup=warmup, repeats=repeats).mean_s)
    return [RoundsTiming(statistics.median(m), statistics.stdev(m) if len(m) > 1 else 0.0, tuple(m)) for m in means]
