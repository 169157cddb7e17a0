"""Hardware profile, calibration and the performance model (docs/design.md §2, §7).

Calibration measures, on the actual device and process group:
  * the expert FFN's GEMM rate for the layer's shapes (FLOP/s),
  * All-to-All latency and bandwidth (two message sizes),
  * device→host and host→device copy bandwidth (pinned memory on CUDA),
  * the slowdown of compute, communication and copies when two of them run at
    the same time (they share SMs, memory bandwidth and links).
All ranks take the slowest rank's figures (one all-reduce), so every rank
holds the same profile and makes the same choices. Profiles are JSON, keyed by
device name, dtype and world size, and reused until refreshed. The dtype is the
one the experts run in (experts.compute_dtype: autocast's under autocast), not
the layer input's.

A profile read rather than measured (a rank-local file, a per-node `ProfileStore`,
a `HardwareProfile` each rank loaded itself) may differ between ranks, and a
strategy chosen from it decides which collectives backward runs (S2/S4 send the
inputs again). So ranks compare their profiles' `digest` before choosing (the
planner: in the count exchange) and, where they differ, all adopt rank 0's
figures (`adopt_rank0`, one agreement) with a warning.

The model predicts the pipelined forward+backward time of every
(partitions n, strategy): per partition, the communication stream carries the
All-to-Alls, the compute stream the GEMMs (plus recomputation), the copy stream
the offloads/restores. With n partitions a pass takes one partition's full
latency (fill) plus (n−1) times the slowest stream's per-partition time, each
stream slowed by what overlaps it, plus a fixed cost per partition. A partition's host
copies run beside its All-to-Alls in the fill (offloads trail its compute, restores lead it).

The formula is closed-form; its per-partition terms come from the operation counts of
one partition of the pipeline's schedule (schedule.py): the All-to-Alls, GEMM passes
and host copies that partition issues. It takes the several-ranks schedule whatever the
world size: calibration measured an All-to-All on every group, one rank included.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections import Counter
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .comm import ExpertGroup
from .config import MemoryBudget, MemoryBudgetError, MoEConfig
from .experts import Experts, ExpertSegments
from .memory import RestorePolicy, predict_memory
from .schedule import COMM, backward_schedule, forward_schedule
from .streams import StreamSet
from .timing import Stopwatch, synchronize, time_fn

SHARED_STRATEGIES = ("S1", "S2", "S3", "S4")
# Without a memory budget, `strategy="auto"` takes a restore strategy (S1-S4: shared buffers,
# less memory) only where it is predicted within this share of the fastest choice; otherwise
# the fastest, usually "none" (issue 26: on the emulated 8x8 H200 cluster S3 cost 10-14% at
# gpt-xl 8k-32k, so the memory-first rule left auto 5-20% behind the best setting). Give
# `memory_budget` to trade time for memory.
SAVING_SLACK = 0.03
# The rates and costs the model reads, and the concurrent pairs it reads slowdowns of.
FIGURES = ("gemm_flops", "a2a_latency_s", "a2a_bytes_per_s", "d2h_bytes_per_s", "h2d_bytes_per_s",
           "partition_overhead_s")
SLOWDOWN_PAIRS = (("compute", "comm"), ("comm", "compute"), ("compute", "copy"), ("copy", "compute"),
                  ("comm", "copy"), ("copy", "comm"))

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HardwareProfile:
    device: str
    dtype: str
    world_size: int
    gemm_flops: float            # FLOP/s of the expert FFN GEMMs
    a2a_latency_s: float         # fixed cost of one All-to-All
    a2a_bytes_per_s: float       # bytes per second per rank through an All-to-All
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    partition_overhead_s: float  # launch / bookkeeping cost per partition and pass
    slowdown: dict[str, float] = field(default_factory=dict)  # e.g. {"compute|comm": 1.1, "comm|compute": 1.2, ...}
    measured_at: str = ""
    torch_version: str = ""

    @property
    def key(self) -> str:
        return profile_key(self.device, self.dtype, self.world_size)

    def factor(self, victim: str, other: str) -> float:
        """How much slower `victim` runs while `other` runs beside it (≥ 1)."""
        return max(1.0, float(self.slowdown.get(f"{victim}|{other}", 1.0)))

    def figures(self) -> list[float]:
        """Local. Every number the model reads: the FIGURES, then the SLOWDOWN_PAIRS' factors."""
        return [float(getattr(self, name)) for name in FIGURES] + [self.factor(*pair) for pair in SLOWDOWN_PAIRS]

    def with_figures(self, figures: Sequence[float]) -> "HardwareProfile":
        """Local. This profile (device, dtype, ...) with the numbers of ``figures()`` replaced."""
        figures = [float(f) for f in figures]
        slowdown = {f"{victim}|{other}": f for (victim, other), f in zip(SLOWDOWN_PAIRS, figures[len(FIGURES):])}
        changes: dict[str, Any] = dict(zip(FIGURES, figures), slowdown=slowdown)
        return replace(self, **changes)

    def digest(self) -> int:
        """Local. A 63-bit hash of ``figures()``: equal digests, equal choices. Ranks compare
        it (an int64 that rides in the count exchange) to find whether they agree."""
        raw = np.asarray(self.figures(), dtype=np.float64).tobytes()
        return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 1

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "HardwareProfile":
        return cls(**data)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def profile_key(device: str, dtype: str, world_size: int) -> str:
    return f"{device}|{dtype}|ws{world_size}"


class ProfileStore:
    """Hardware profiles in one JSON file, keyed by device, dtype and world size."""

    def __init__(self, path: str):
        self.path = path

    def _read(self) -> dict[str, Any]:
        if not os.path.exists(self.path):
            return {}
        with open(self.path) as f:
            profiles: dict[str, Any] = json.load(f)
            return profiles

    def get(self, key: str) -> HardwareProfile | None:
        data = self._read().get(key)
        return HardwareProfile.from_json(data) if data else None

    def put(self, profile: HardwareProfile) -> None:
        data = self._read()
        data[profile.key] = profile.to_json()
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = f"{self.path}.{os.getpid()}.tmp"  # one per process: every rank of a node may write
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
        os.replace(tmp, self.path)


class ProfileCache:
    """Hardware profiles shared by the MoE layers of a model (and, with a `ProfileStore`,
    by later runs): the first layer that needs one measures it, the others reuse it.

    `get_or_measure` is a collective: all ranks call it together and either all read
    the stored profile or all calibrate (a rank missing the file makes every rank measure);
    where the ranks read different profiles (one store per node), all adopt rank 0's.
    A caller that agrees on "missing" and "different" itself (the planner, in its count
    exchange) asks `held` (local) on each rank and `agreed` with the agreed flags.

    The store is read once per key: `held` keeps what it read until `agreed` settles the
    key, so the profile a rank prices is the one whose digest it sent for the agreement
    (a second read could find the file rewritten by another run, and ranks that agreed
    on equal digests would price different profiles and issue different collectives).
    """

    def __init__(self, store: ProfileStore | None = None):
        self.store = store
        self.profiles: dict[str, HardwareProfile] = {}
        self.measurements = 0
        self._read: dict[str, HardwareProfile | None] = {}  # key -> what the store held, until agreed

    def get_or_measure(self, config: MoEConfig, tokens: int, group: ExpertGroup, device: torch.device,
                       dtype: torch.dtype) -> HardwareProfile:
        if self._key(group.size, device, dtype) in self.profiles:
            return self.profiles[self._key(group.size, device, dtype)]
        held = self.held(group.size, device, dtype)
        digest = held.digest() if held is not None else 0
        flags = torch.tensor([int(held is None), digest, -digest], dtype=torch.int64,
                             device=device if group.distributed and device.type == "cuda" else "cpu")
        missing, top, neg_bottom = group.all_reduce_max(flags).tolist()
        return self.agreed(config, tokens, group, device, dtype, bool(missing), top != -neg_bottom)

    @staticmethod
    def _key(world_size: int, device: torch.device, dtype: torch.dtype) -> str:
        return profile_key(device_name(device), str(dtype).replace("torch.", ""), world_size)

    def held(self, world_size: int, device: torch.device, dtype: torch.dtype) -> HardwareProfile | None:
        """Local. The profile for this key in memory or in the store; None when it must be measured."""
        key = self._key(world_size, device, dtype)
        if key in self.profiles:
            return self.profiles[key]
        if key not in self._read:
            self._read[key] = self.store.get(key) if self.store is not None else None
        return self._read[key]

    def agreed(self, config: MoEConfig, tokens: int, group: ExpertGroup, device: torch.device,
               dtype: torch.dtype, missing_on_some_rank: bool, differs_on_some_rank: bool = False
               ) -> HardwareProfile:
        """The profile for this key, the same on every rank, from flags all ranks agreed on:
        measured now when `missing_on_some_rank` (every rank calibrates, a collective);
        rank 0's when `differs_on_some_rank` (`adopt_rank0`, a collective; kept in memory
        for the other layers, not written to the store); else `held` (local)."""
        key = self._key(group.size, device, dtype)
        profile = None if missing_on_some_rank else self.held(group.size, device, dtype)
        if profile is None:
            profile = calibrate(config, tokens, group, device, dtype)
            self.measurements += 1
            if self.store is not None:
                self.store.put(profile)
        elif differs_on_some_rank:
            profile = adopt_rank0(profile, group, device)
        self.profiles[key] = profile
        self._read.pop(key, None)
        return profile


def adopt_rank0(profile: HardwareProfile, group: ExpertGroup, device: torch.device) -> HardwareProfile:
    """Collective (one agreement, `ExpertGroup.agree`, on the data's ``device``). ``profile``
    with rank 0's figures, on every rank: rank 0 sends its figures' float64 bits, the others
    the smallest int64, so the max over ranks is rank 0's. Call it when the ranks' digests
    differ (they agreed so); it logs a warning naming the key."""
    bits = np.asarray(profile.figures(), dtype=np.float64).view(np.int64)
    mine = bits.tolist() if group.rank == 0 else [int(np.iinfo(np.int64).min)] * bits.size
    figures = np.asarray(group.agree(mine, device), dtype=np.int64).view(np.float64)
    log.warning("MPipeMoE: the ranks hold different hardware profiles for %s (read from per-rank or per-node "
                "files?); every rank now uses rank 0's, so that all choose the same strategies and run the "
                "same collectives. To choose from each rank's own measurements, let the layers calibrate "
                "together (ProfileCache without a stored profile) or give every node the same profiles file.",
                profile.key)
    return profile.with_figures(figures.tolist())


# -- calibration (collectives: every rank of the group must call it together) -----------

def calibrate(config: MoEConfig, tokens: int, group: ExpertGroup, device: torch.device,
              dtype: torch.dtype, repeats: int = 5) -> HardwareProfile:
    """Measure the profile for this layer shape on this device and group, in ``dtype``
    (give the dtype the experts run in, experts.compute_dtype). Autocast is off while it
    measures, so what is timed is ``dtype`` whatever the caller's context."""
    with torch.autocast(device.type, enabled=False):
        return _measure(config, tokens, group, device, dtype, repeats)


def _measure(config: MoEConfig, tokens: int, group: ExpertGroup, device: torch.device,
             dtype: torch.dtype, repeats: int) -> HardwareProfile:
    torch.manual_seed(1234)
    L = config.experts_per_rank(group.size)
    rows = max(group.size * L, config.top_k * tokens)
    experts = Experts(config, L, device=device, dtype=dtype)
    counts = [rows // L + (1 if l < rows % L else 0) for l in range(L)]
    segments = ExpertSegments.from_counts(counts, device)
    x_ND = torch.randn(rows, config.d_model, device=device, dtype=dtype)
    A_NA = torch.empty(rows, experts.pre_activation_width, device=device, dtype=dtype)
    streams = StreamSet(device)

    def ffn() -> None:
        experts(x_ND, segments)

    flops = 2 * rows * config.d_model * (experts.pre_activation_width + config.d_hidden)
    gemm_s = time_fn(ffn, device, warmup=2, repeats=repeats).mean_s

    def a2a_fn(n_rows: int) -> tuple[Callable[[], object], int]:
        per_rank = max(1, n_rows // group.size)
        send = torch.randn(per_rank * group.size, config.d_model, device=device, dtype=dtype)
        recv = torch.empty_like(send)
        splits = [per_rank] * group.size
        return lambda: group.all_to_all(recv, send, splits, splits), send.numel() * send.element_size()

    small_fn, small_bytes = a2a_fn(group.size)
    large_fn, large_bytes = a2a_fn(rows)
    small_s = time_fn(small_fn, device, repeats=repeats).mean_s
    large_s = time_fn(large_fn, device, repeats=repeats).mean_s

    host = torch.empty(A_NA.shape, dtype=dtype, pin_memory=device.type == "cuda")
    copy_bytes = A_NA.numel() * A_NA.element_size()
    d2h_s = time_fn(lambda: host.copy_(A_NA, non_blocking=True), device, repeats=repeats).mean_s
    h2d_s = time_fn(lambda: A_NA.copy_(host, non_blocking=True), device, repeats=repeats).mean_s
    overhead_s = _partition_overhead(experts, config, device, dtype, repeats)

    slowdown = _slowdowns(ffn, large_fn, lambda: host.copy_(A_NA, non_blocking=True), streams, group,
                          {"compute": gemm_s, "comm": large_s, "copy": d2h_s}, reserved_sms=group.comm_sms)
    # Every rank adopts the slowest rank's figures (times: max; so rates: min).
    times = torch.tensor([gemm_s, small_s, large_s, d2h_s, h2d_s, overhead_s, *slowdown.values()],
                         dtype=torch.float64, device=device if group.distributed and device.type == "cuda" else "cpu")
    measured = group.all_reduce_max(times).cpu().tolist()
    gemm_s, small_s, large_s, d2h_s, h2d_s, overhead_s, *factors = measured
    return HardwareProfile(
        device=device_name(device), dtype=str(dtype).replace("torch.", ""), world_size=group.size,
        gemm_flops=flops / gemm_s,
        a2a_latency_s=small_s,
        a2a_bytes_per_s=max(large_bytes - small_bytes, 1) / max(large_s - small_s, 1e-9),
        d2h_bytes_per_s=copy_bytes / d2h_s, h2d_bytes_per_s=copy_bytes / h2d_s,
        partition_overhead_s=overhead_s,
        slowdown=dict(zip(slowdown.keys(), factors)),
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), torch_version=torch.__version__)


def _partition_overhead(experts: Experts, config: MoEConfig, device: torch.device, dtype: torch.dtype,
                        repeats: int) -> float:
    """Cost of one more partition: the FFN on a handful of rows (launches, bookkeeping)."""
    L = experts.local_experts
    x = torch.randn(L, config.d_model, device=device, dtype=dtype)
    segments = ExpertSegments.from_counts([1] * L, device)
    index = torch.arange(L, device=device)

    def tiny() -> None:
        experts(x.index_select(0, index), segments)

    return time_fn(tiny, device, repeats=repeats).mean_s


def _slowdowns(compute_fn: Callable[[], object], comm_fn: Callable[[], object], copy_fn: Callable[[], object],
               streams: StreamSet, group: ExpertGroup, alone: dict[str, float], reserved_sms: int = 0
               ) -> dict[str, float]:
    """Time each pair of activities side by side; slowdown = concurrent / alone. Beside
    communication the compute runs as a pipelined pass runs it there: with ``reserved_sms``
    SMs left to the communication kernels (`StreamSet.reserving_sms`), so the profile
    prices the carve-out's cost and what it saves; alone (the GEMM rate) on every SM."""
    def carved_compute() -> object:
        with streams.reserving_sms(reserved_sms):
            return compute_fn()

    activities = {"compute": (compute_fn, "compute"), "comm": (comm_fn, "comm"), "copy": (copy_fn, "copy")}
    result = {}
    for victim, other in SLOWDOWN_PAIRS:
        pair = dict(activities)
        if "comm" in (victim, other):
            pair["compute"] = (carved_compute, "compute")
        concurrent = _time_beside(pair[victim], pair[other], streams, group)
        result[f"{victim}|{other}"] = max(1.0, concurrent / max(alone[victim], 1e-9))
    return result


def _time_beside(victim: tuple[Callable[[], object], str], other: tuple[Callable[[], object], str], streams: StreamSet,
                 group: ExpertGroup, rounds: int = 3) -> float:
    """Mean time of `victim` while `other` runs continuously beside it."""
    victim_fn, victim_stream = victim
    other_fn, other_stream = other
    device = streams.device
    if streams.is_cuda:
        synchronize(device)
        enter: dict[str, Callable[[], AbstractContextManager[Any]]] = {
            "compute": streams.on_compute, "comm": streams.on_comm, "copy": streams.on_copy}
        with enter[other_stream]():
            for _ in range(rounds + 2):
                other_fn()
        with enter[victim_stream]():
            watch = Stopwatch(device)
            watch.start()
            for _ in range(rounds):
                victim_fn()
            watch.stop()
        seconds = watch.elapsed_s() / rounds
        synchronize(device)
        return seconds
    # CPU: only communication is asynchronous (gloo threads); run it on a helper thread.
    import threading

    stop = threading.Event()

    def background() -> None:
        while not stop.is_set():
            other_fn()

    uses_comm = "comm" in (victim_stream, other_stream) and group.distributed
    if uses_comm:
        # Collectives must be issued in the same order on every rank: run the pair in lock step.
        t0 = time.perf_counter()
        for _ in range(rounds):
            victim_fn()
            other_fn()
        both = (time.perf_counter() - t0) / rounds
        return both  # an upper bound on the victim's time beside the other
    thread = threading.Thread(target=background, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    for _ in range(rounds):
        victim_fn()
    seconds = (time.perf_counter() - t0) / rounds
    stop.set()
    thread.join()
    return seconds


# -- prediction ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Prediction:
    partitions: int
    strategy: str
    forward_s: float
    backward_s: float
    peak_bytes: int
    saved_bytes: int = 0  # of peak_bytes, what the layer keeps from forward to backward

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s

    def need(self, budget: MemoryBudget) -> int:
        """Bytes this choice needs under ``budget`` (its layers' saved tensors, one working set)."""
        return budget.need_of(self)


def _partition_counts(policy: RestorePolicy) -> tuple[Counter[str], Counter[str]]:
    """Operations of one partition of the forward and of the backward schedule, by name
    (absent names count 0), and under COMM its All-to-Alls."""
    counts = []
    for ops in (forward_schedule(1, policy, several=True), backward_schedule(1, policy, several=True)):
        by_name = Counter(op.name for op in ops)
        by_name[COMM] = sum(op.stream == COMM for op in ops)
        counts.append(by_name)
    return counts[0], counts[1]


class PerformanceModel:
    """Predicts forward+backward time of MPipeMoE for any (n, strategy) from a profile."""

    def __init__(self, profile: HardwareProfile):
        self.profile = profile

    def _pipelined(self, comm: float, compute: float, copy: float, n: int) -> float:
        p = self.profile
        if n == 1:
            return comm + compute + copy + p.partition_overhead_s
        c = compute * max(p.factor("compute", "comm") if comm else 1, p.factor("compute", "copy") if copy else 1)
        m = comm * max(p.factor("comm", "compute"), p.factor("comm", "copy") if copy else 1)
        h = copy * max(p.factor("copy", "compute"), p.factor("copy", "comm") if comm else 1)
        # The first partition's inputs arrive (All-to-All, or a restore from the host, side by
        # side), it computes, and its output leaves; after it the slowest stream sets the pace.
        # Host copies are never between two partitions' compute: offloads trail it, restores lead.
        fill = max(comm, copy) + compute
        return fill + (n - 1) * max(c, m, h) + n * p.partition_overhead_s

    def predict(self, config: MoEConfig, tokens: int, world_size: int, partitions: int, strategy: str,
                dtype: torch.dtype) -> Prediction:
        p = self.profile
        policy = RestorePolicy.of(strategy)
        s = torch.empty((), dtype=dtype).element_size()
        rows = config.top_k * tokens / partitions
        D, H = config.d_model, config.d_hidden
        A_width = 2 * H if config.gated else H
        remote = (world_size - 1) / world_size if world_size > 1 else 1.0
        a2a = p.a2a_latency_s + rows * D * s * remote / p.a2a_bytes_per_s
        gemm1 = 2 * rows * D * A_width / p.gemm_flops
        gemm2 = 2 * rows * H * D / p.gemm_flops
        fwd, bwd = _partition_counts(policy)
        offload = rows * s * (fwd["offload_input"] * D + fwd["offload_preactivation"] * A_width)
        restore = rows * s * (bwd["restore_input"] * D + bwd["restore_preactivation"] * A_width)
        forward = self._pipelined(fwd[COMM] * a2a, fwd["experts"] * (gemm1 + gemm2), offload / p.d2h_bytes_per_s,
                                  partitions)
        # dgrad and wgrad: the FFN's backward, twice its forward FLOPs; recompute: GEMM1 again.
        backward = self._pipelined(
            bwd[COMM] * a2a,
            (bwd["dgrad"] + bwd["wgrad"]) * (gemm1 + gemm2) + bwd["recompute"] * gemm1,
            restore / p.h2d_bytes_per_s, partitions)
        memory = predict_memory(config, tokens, world_size, partitions, strategy, dtype=dtype)
        return Prediction(partitions, strategy, forward, backward, memory.peak_bytes, memory.saved_bytes)

    def choose(self, config: MoEConfig, tokens: int, world_size: int, dtype: torch.dtype,
               partitions: list[int], strategies: Sequence[str] = SHARED_STRATEGIES,
               memory_budget: int | MemoryBudget | None = None, saving_slack: float = SAVING_SLACK) -> Prediction:
        """The (n, strategy) to run.

        Without a budget: the fastest predicted choice, "none" (keep everything) included,
        unless one of the given restore strategies lowers the predicted peak below "none"'s at
        the same n for at most ``saving_slack`` more time than the fastest: then the fastest
        such (memory saved for almost nothing). One partition has nothing to share: "none".
        With a budget (an int: the layer's peak; a MemoryBudget: its layers' saved
        tensors and one working set): the fastest predicted choice, "none" included, that
        fits; a ValueError names the smallest need when nothing fits.
        """
        options = [self.predict(config, tokens, world_size, n, s, dtype)
                   for n in partitions for s in ("none", *[s for s in strategies if s != "none"])]
        if memory_budget is None:
            fastest = min(options, key=lambda o: o.total_s)
            keep = {o.partitions: o.peak_bytes for o in options if o.strategy == "none"}
            saving = [o for o in options if o.strategy != "none" and o.peak_bytes < keep[o.partitions]
                      and o.total_s <= (1 + saving_slack) * fastest.total_s]
            return min(saving, key=lambda o: o.total_s) if saving else fastest
        budget = MemoryBudget.of(memory_budget)
        assert budget is not None
        fitting = [o for o in options if o.need(budget) <= budget.bytes]
        if not fitting:
            smallest = min(options, key=lambda o: o.need(budget))
            layers = f" for {budget.layers} layers" if budget.layers > 1 else ""
            raise MemoryBudgetError(
                f"memory_budget={budget.bytes} bytes{layers} is too small: the leanest choice "
                f"(n={smallest.partitions}, {smallest.strategy}) needs {smallest.need(budget)} bytes for "
                f"{tokens} tokens; raise the budget, use fewer tokens per step, or more partitions")
        return min(fitting, key=lambda o: o.total_s)
