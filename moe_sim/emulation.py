"""An emulated cluster: the real engine on one device as rank 0 of a balanced W-rank world.

Used by `mpipemoe bench --emulate` and by the simulator's validation against those
records, never by training: what it computes is not the layer's output (docs/emulation.md).

`EmulatedExpertGroup` stands in for `comm.ExpertGroup`. It assumes every rank holds the
same tokens and routes them as rank 0 does, so each collective rank 0 takes part in has
the shape it would have in that world, derived from rank 0's own tensors:

* count exchange: every rank sends rank 0 what rank 0 sends itself (row 0 of the send
  table: its counts for rank 0's experts, and the same pass statistics). FasterMoE's count
  chunks are peer steps, which depend on the sender: rank w sends rank 0 its rows in step
  ((−w) mod W) // g; a group built with `for_peer_steps(g)` answers so;
* All-to-All: its output is filled from rank 0's own block (the rows it sends itself):
  output row j is own row j mod |own| (the whole input when it sends itself nothing,
  zeros when it sends nothing). In a dispatch every source block is then exactly what
  that rank would send rank 0 (the same tokens); in a combine only rank 0's own block
  is; the other numbers are stand-ins of the right shape;
* agreements: the max over identical ranks is the value, the sum W times it.

Timing. An All-to-All occupies the stream it is issued on (`streams.comm` for the
asynchronous one, as comm.py issues NCCL) for the network's time for rank 0's actual
bytes: `network.rank_traffic` of its split sizes, priced by `network.flat_all_to_all_s`
(or `hierarchical_all_to_all_s`), the functions the simulator prices with. On CUDA that
is the local copy of the rows, then a wait of that much wall-clock time (`WallClockWait`:
a kernel spinning on the GPU's nanosecond timer, so the GPU clock falling under load
does not stretch it). The count exchange and the agreements cost
`network.small_collective_s` on the caller's stream, as NCCL's blocking calls do. On CPU
only the copies run. With ``keep_log=True`` every call is logged in `calls`
(`EmulatedCall`: kind, shapes, splits, modelled seconds).

Shapes: see moe_engine's legend (moe_engine/__init__.py). D is the row width.
"""
from __future__ import annotations

import contextlib
import copy
import math
import re
import statistics
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from moe_engine.comm import DEFAULT_COMM_SMS, ExpertGroup
from moe_engine.dispatcher import STATS
from moe_engine.streams import Pending, StreamSet

from .network import (EXPERT_PARALLEL_FLAG, ClusterLayout, NetworkProfile, all_reduce_s, expert_group_layouts,
                      flat_all_to_all_s, hierarchical_all_to_all_s, load_network, rank_traffic, small_collective_s)


@dataclass(frozen=True, kw_only=True)
class EmulatedCluster:
    """The cluster rank 0 is emulated in.

    layout:       nodes × GPUs per node; W = nodes · GPUs ranks, at least 2.
    network:      a network profile (network.PRESETS, or measured figures by load_network).
    hierarchical: price a full All-to-All as the two-level exchange; FasterMoE's peer
                  steps stay flat, as in the simulator.
    transfer_ctas: thread blocks each emulated transfer holds while it waits (WallClockWait):
                  1 (default) models the least SM contention; NCCL uses a few.
    comm_sms:     SMs the expert GEMMs leave free while a transfer runs beside them
                  (ExpertGroup.comm_sms): default what real runs leave NCCL (DEFAULT_COMM_SMS).
    expert_parallel: the expert-parallel degree P (None: W). Rank 0's expert group is ranks
                  0..P-1 (network.expert_group_layouts): the All-to-Alls, the count exchange
                  and the agreements run over them (with P = 8 on 8x8 inside one node, on
                  NVLink), each rank holding E / P experts; the expert gradients are reduced
                  over the W / P replicas (``expert_reduction_s``).
    """

    layout: ClusterLayout
    network: NetworkProfile
    hierarchical: bool = False
    transfer_ctas: int = 1
    comm_sms: int = DEFAULT_COMM_SMS
    expert_parallel: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.layout, ClusterLayout):
            raise TypeError(f"EmulatedCluster.layout must be a ClusterLayout, got {type(self.layout).__name__}")
        if not isinstance(self.network, NetworkProfile):
            raise TypeError(f"EmulatedCluster.network must be a NetworkProfile, got {type(self.network).__name__} "
                            f"(network.load_network('dgx-a100') gives one)")
        if self.layout.ranks < 2:
            raise ValueError(f"EmulatedCluster.layout={self.layout.nodes}x{self.layout.gpus_per_node} is invalid: "
                             f"one GPU needs no emulation (run without it), give at least 2 ranks, e.g. 1x2")
        if isinstance(self.transfer_ctas, bool) or not isinstance(self.transfer_ctas, int) or self.transfer_ctas < 1:
            raise ValueError(f"EmulatedCluster.transfer_ctas={self.transfer_ctas!r} is invalid: give the thread "
                             f"blocks an emulated transfer holds, >= 1 (1 is the default)")
        if isinstance(self.comm_sms, bool) or not isinstance(self.comm_sms, int) or self.comm_sms < 0:
            raise ValueError(f"EmulatedCluster.comm_sms={self.comm_sms!r} is invalid: give the SMs the GEMMs leave "
                             f"to communication, >= 0 ({DEFAULT_COMM_SMS}, what real runs leave NCCL, is the default)")
        if type(self.expert_parallel) is int and self.expert_parallel < 2:
            raise ValueError(f"EmulatedCluster.expert_parallel={self.expert_parallel!r} is invalid: one rank per expert "
                             f"group has no All-to-All to emulate; give {EXPERT_PARALLEL_FLAG} >= 2")
        expert_group_layouts(self.layout, self.expert_parallel)  # raises naming --expert-parallel

    @classmethod
    def parse(cls, spec: str, network: str = "dgx-a100", *, hierarchical: bool = False,
              transfer_ctas: int = 1, comm_sms: int = DEFAULT_COMM_SMS,
              expert_parallel: int | None = None) -> "EmulatedCluster":
        """From ``NODESxGPUS`` (``8x8``: 8 nodes of 8 GPUs) and a network preset or JSON file."""
        match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", str(spec))
        if not match:
            raise ValueError(f"emulated cluster {spec!r} is invalid: give NODESxGPUS, e.g. 8x8 for 8 nodes of 8 GPUs")
        layout = ClusterLayout(int(match.group(1)), int(match.group(2)))
        return cls(layout=layout, network=load_network(network), hierarchical=hierarchical,
                   transfer_ctas=transfer_ctas, comm_sms=comm_sms, expert_parallel=expert_parallel)

    @property
    def ranks(self) -> int:
        """W: every rank of the cluster (the dense part's data parallelism)."""
        return self.layout.ranks

    @property
    def expert_ranks(self) -> int:
        """P: the ranks of rank 0's expert group (the emulated expert group's size)."""
        return self.expert_layout.ranks

    @property
    def expert_layout(self) -> ClusterLayout:
        """Rank 0's expert group on the nodes (network.expert_group_layouts)."""
        return expert_group_layouts(self.layout, self.expert_parallel)[0]

    @property
    def name(self) -> str:
        return f"{self.layout.nodes}x{self.layout.gpus_per_node}"

    def record_fields(self) -> dict:
        """What every record measured in this cluster says about it."""
        return {"measured_as": "emulated", "network": self.network.name, "emulated_cluster": self.name,
                "nodes": self.layout.nodes, "gpus_per_node": self.layout.gpus_per_node,
                "hierarchical": self.hierarchical, "world_size": self.ranks, "transfer_ctas": self.transfer_ctas,
                "comm_sms": self.comm_sms, "expert_parallel": self.expert_ranks}

    def all_to_all_s(self, output_splits: Sequence[int], input_splits: Sequence[int], row_bytes: int, *,
                     flat: bool = False) -> float:
        """Seconds of rank 0's All-to-All over its expert group: it sends input_splits[r] rows
        of `row_bytes` to the group's rank r and receives output_splits[r] from it."""
        layout = self.expert_layout
        traffic = rank_traffic(layout, 0, list(input_splits), list(output_splits))
        if self.hierarchical and not flat:
            return hierarchical_all_to_all_s(self.network, layout, traffic, row_bytes)
        return flat_all_to_all_s(self.network, traffic, row_bytes)

    def small_collective_s(self, *, world: bool = False) -> float:
        """Seconds of the count exchange or an agreement (a few bytes from every rank of the
        expert group); ``world``: from every rank of the cluster (the step's losses and norm)."""
        return small_collective_s(self.network, self.layout if world else self.expert_layout)

    def expert_reduction_s(self, nbytes: float) -> float:
        """Seconds of the expert gradients' all-reduce (``nbytes`` per rank) over the W / P
        ranks that hold the same experts; 0 with one expert group."""
        return all_reduce_s(self.network, expert_group_layouts(self.layout, self.expert_parallel)[1], nbytes)

    def build(self, *, keep_log: bool = False) -> "EmulatedExpertGroup":
        return EmulatedExpertGroup(self, keep_log=keep_log)


HOST_LEAD_S = 2e-3  # WallClockWait._timed_wait: the device's head start on the host


class WallClockWait:
    """Occupies a stream for a span of wall-clock time: one small kernel per wait that spins
    on the GPU's global nanosecond timer (`%globaltimer`, through Triton's inline PTX).

    Why not `torch.cuda._sleep`: it counts SM clock cycles, and the SM clock falls under
    load (measured on an H200: 1980 MHz idle, ~1515 MHz after GEMM warm-up), so a 10 ms
    modelled transfer took 12.7 ms alone and 13.3 ms beside GEMMs, 50 ms took 63–69 ms:
    the emulator inflated communication exactly where it overlaps compute. The timer does
    not move with the clock. What remains (`measure_dilation`) is the real cost of getting
    an SM while GEMMs hold them, which NCCL's kernels also pay.

    ctas: the spinning kernel's thread blocks (default 1). NCCL runs its collectives on a
    few CTAs that each hold an SM's slot for the transfer; ``ctas=k`` holds k of them, so
    the GEMMs running beside a transfer lose what they would lose to NCCL. Off (1) by default.
    """

    def __init__(self, ctas: int = 1):
        if isinstance(ctas, bool) or not isinstance(ctas, int) or ctas < 1:
            raise ValueError(f"ctas={ctas!r} is invalid: give the thread blocks a wait occupies (>= 1; NCCL uses a "
                             f"few per collective, 1 models the least contention)")
        self.ctas = ctas
        self._kernel = None

    def _kernels(self):
        if self._kernel is None:
            self._kernel = _build_wait_kernels()
        return self._kernel

    def sleep(self, seconds: float, device: torch.device) -> None:
        """Occupy the current stream of `device` for `seconds` of wall-clock time."""
        nanoseconds = int(round(seconds * 1e9))
        if nanoseconds > 0:
            with torch.cuda.device(device):
                self._kernels().spin_for_ns[(self.ctas,)](nanoseconds)

    def start(self, device: torch.device) -> torch.Tensor:
        """Note the time now, when the current stream reaches this point (a one-element
        device tensor for `wait_since`)."""
        slot = torch.empty(1, dtype=torch.int64, device=device)
        with torch.cuda.device(device):
            self._kernels().stamp_now[(1,)](slot)
        return slot

    def wait_since(self, started: torch.Tensor, seconds: float) -> None:
        """Occupy the current stream until `seconds` after `started` (from `start`): work
        issued between the two, such as the transfer's own copies, counts in the time."""
        nanoseconds = int(round(seconds * 1e9))
        if nanoseconds > 0:
            with torch.cuda.device(started.device):
                self._kernels().spin_until[(self.ctas,)](started, nanoseconds)

    def measure_dilation(self, device: torch.device, seconds: float = 0.01, gemm_size: int = 8192) -> dict:
        """How long a wait of `seconds` takes, as a ratio to `seconds`: alone on an idle
        device, and beside a loop of bf16 GEMMs on another stream (what every emulated
        record carries: the instrument's own error, measured in the same run)."""
        device = torch.device(device)
        with torch.cuda.device(device):
            self.sleep(1e-4, device)  # compiles the kernel, leaves the idle clock
            torch.cuda.synchronize(device)
            alone = statistics.median(self._timed_wait(seconds, device) for _ in range(3))
            a = torch.randn(gemm_size, gemm_size, device=device, dtype=torch.bfloat16)
            gemm_stream, wait_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)
            beside = []
            for _ in range(3):
                torch.cuda.synchronize(device)
                with torch.cuda.stream(gemm_stream):
                    for _ in range(max(4, int((seconds * 1.5 + HOST_LEAD_S) / 1.4e-3))):  # ~1.4 ms a GEMM (H200)
                        a @ a
                with torch.cuda.stream(wait_stream):
                    beside.append(self._timed_wait(seconds, device))
            torch.cuda.synchronize(device)
        return {"wait_ms": seconds * 1e3, "alone": alone / seconds,
                "beside_gemms": statistics.median(beside) / seconds, "ctas": self.ctas}

    def _timed_wait(self, seconds: float, device: torch.device) -> float:
        """The device's time for one wait of `seconds` on the current stream. A wait of
        HOST_LEAD_S runs first, so the host has queued the timed wait before its start event
        fires: the host's launch cost (Triton's, from Python: 0.1-0.5 ms on a loaded host) is
        not the wait's; in a pass the host runs ahead of the device the same way."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.sleep(HOST_LEAD_S, device)
        start.record()
        self.sleep(seconds, device)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def _build_wait_kernels():
    """The Triton kernels behind `WallClockWait` (imported on first use: CPU runs never need
    Triton): spin for a span, stamp the time into a slot, spin until a span after a stamp."""
    from types import SimpleNamespace

    import triton
    import triton.language as tl

    @triton.jit
    def globaltimer():
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                         is_pure=False, pack=1)

    @triton.jit
    def spin_for_ns(duration_ns):
        start = globaltimer()
        now = start
        while now - start < duration_ns:
            now = globaltimer()

    @triton.jit
    def stamp_now(slot_ptr):
        tl.store(slot_ptr, globaltimer())

    @triton.jit
    def spin_until(slot_ptr, duration_ns):
        start = tl.load(slot_ptr, volatile=True)
        now = globaltimer()
        while now - start < duration_ns:
            now = globaltimer()

    return SimpleNamespace(spin_for_ns=spin_for_ns, stamp_now=stamp_now, spin_until=spin_until)


@dataclass
class EmulatedTiming:
    """How the emulated collectives of a group (and its `for_peer_steps` siblings, which share
    this object) take their modelled time. Set by the step benchmark (app/bench/step.py).

    scale: the modelled seconds are waited this many times over: 1 (default) as modelled; 0
           runs the copies with no wait (the step's compute timed alone, or without its
           All-to-Alls); the log keeps the modelled seconds either way.
    link:  a CUDA stream standing for the node's network link, or None (default). When set,
           every All-to-All's wait runs on it, after the copy, with the issuing stream waiting
           for it, and other modelled traffic (the data-parallel reduction) queues there too:
           transfers that share the NICs take their time one after another, so no step can
           beat the sum of its modelled transfers.
    host_s: a running total of the host seconds spent inside the emulated collectives (pricing,
           the stand-in copies, launching the waits), summed over the threads that issue them.
           A real rank does not pay this: the bench reports it apart from the engine's host
           time (moe_engine/timing.py time_fn's host_counter). The real collectives' own
           issue cost (an NCCL call's) is part of it, so the engine's figure leaves that out.
    """

    scale: float = 1.0
    link: "torch.cuda.Stream | None" = None
    host_s: float = 0.0

    @contextlib.contextmanager
    def counting_host(self) -> Iterator[None]:
        """Adds the host seconds spent within to `host_s`."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.host_s += time.perf_counter() - started


@dataclass(frozen=True)
class EmulatedCall:
    """One collective as rank 0 issued it, with its modelled network time."""

    kind: str                # exchange_counts, all_to_all, all_to_all_async, all_reduce_max/sum, broadcast_object
    output_shape: tuple
    input_shape: tuple
    output_splits: tuple
    input_splits: tuple
    seconds: float


def fill_from_own_block(output_ND: torch.Tensor, input_RD: torch.Tensor, input_splits: Sequence[int]) -> None:
    """Local. output row j = own row j mod |own|, own = the input rows rank 0 sends itself
    (input_RD[:input_splits[0]]; the whole input when that is empty; zeros when the
    input is empty). At most two copies whatever the world size: the whole repeats of the
    block as one broadcast copy, then the remainder — as NCCL issues one kernel per
    collective (the repeats copied by doubling took about log2 W launches per transfer, host
    time that grew with the partitions and flattered none of the settings it slowed)."""
    rows = output_ND.shape[0]
    if rows == 0:
        return
    own = input_splits[0] if len(input_splits) else 0
    source = input_RD[:own] if own else input_RD
    size = source.shape[0]
    if size == 0:
        output_ND.zero_()
        return
    repeats, rest = divmod(rows, size)
    if repeats == 1 or not output_ND.is_contiguous():
        filled = min(size, rows)
        output_ND[:filled].copy_(source[:filled])
        while filled < rows:
            step = min(filled, rows - filled)
            output_ND[filled:filled + step].copy_(output_ND[:step])
            filled += step
        return
    if repeats:
        block = output_ND[:repeats * size].view(repeats, size, *source.shape[1:])
        block.copy_(source.unsqueeze(0).expand_as(block))
    if rest:
        output_ND[repeats * size:].copy_(source[:rest])


# The host range around a freed transfer's copy (`free_transfers`), for a profiler trace: the
# layer bench leaves this work out of a pass's compute floor, since a priced transfer's time
# holds its copy (app/bench/layer_bound.py own_pass_stages).
FREE_TRANSFER_COPY = "emulated.free_transfer_copy"


class EmulatedExpertGroup(ExpertGroup):
    """`ExpertGroup`'s interface as rank 0 of `cluster`, on this process's device alone
    (see the module docstring). A layer built with it holds E / W experts.

    keep_log: log every collective in `calls` (tests; off for benchmarks, where it would
    grow with every pass).
    """

    # ExpertGroup.__init__ looks up a process group; there is none: set its attributes.
    def __init__(self, cluster: EmulatedCluster, *, keep_log: bool = False):
        if not isinstance(cluster, EmulatedCluster):
            raise TypeError(f"cluster must be an EmulatedCluster, got {type(cluster).__name__}")
        self.group = None
        self.size = cluster.expert_ranks
        self.rank = 0
        self.always_communicate = False
        self.comm_sms = cluster.comm_sms  # the SMs pipelined GEMMs leave free, as for NCCL
        self.cluster = cluster
        self.peer_group_size: int | None = None  # FasterMoE's g when its count chunks are peer steps
        self.clock = WallClockWait(cluster.transfer_ctas)
        self.calls: list[EmulatedCall] | None = [] if keep_log else None
        self.dilation: dict | None = None  # WallClockWait.measure_dilation's answer, when measured
        self.timing = EmulatedTiming()  # shared with the for_peer_steps siblings (copy.copy)
        self._seconds: dict[tuple, float] = {}       # price per (splits, row bytes): passes repeat them
        self._source_steps: dict[tuple, torch.Tensor] = {}
        self._free_transfers = False  # within `free_transfers()`
        self.lane_of: EmulatedExpertGroup | None = None  # the group a lane clone stands beside (lane_groups)

    @contextlib.contextmanager
    def free_transfers(self) -> Iterator[None]:
        """Within: All-to-Alls are priced and logged and their rows copied, at no modelled
        time: the pass without its transfers, in its own routing,
        streams and SM reservation (the bench's compute stage). Agreements still cost theirs."""
        previous, self._free_transfers = self._free_transfers, True
        try:
            yield
        finally:
            self._free_transfers = previous

    @contextlib.contextmanager
    def logging_calls(self) -> Iterator[list[EmulatedCall]]:
        """Within: every collective is logged in the list yielded (`calls` as keep_log does)."""
        logged: list[EmulatedCall] = []
        previous, self.calls = self.calls, logged
        try:
            yield logged
        finally:
            self.calls = previous

    @property
    def distributed(self) -> bool:
        return True

    def for_peer_steps(self, group_size: int) -> "EmulatedExpertGroup":
        """The group for a FasterMoE layer of this `group_size`: its count chunks are peer
        steps, which depend on the sending rank. Shares the clock, prices and log."""
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size={group_size!r} is invalid: give FasterMoE's peers per step (>= 1)")
        sibling = copy.copy(self)
        sibling.peer_group_size = min(group_size, self.size)
        return sibling

    def lane_groups(self, count: int) -> list["EmulatedExpertGroup"]:
        """Local. ``count`` groups for lanes 1... of the overlapped micro-batch schedule
        (workers/schedules.py Lanes, which calls this on a layer's group): the same cluster,
        prices, clock and `timing` (its link stream too: both lanes' transfers share the node's
        NICs); their collectives are logged in this group's `calls` and follow its
        `free_transfers()`, as the other lane's do."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count={count!r} is invalid: give the lanes beside lane 0, >= 0")
        clones = [copy.copy(self) for _ in range(count)]
        for clone in clones:
            clone.lane_of = self.lane_of or self
        return clones

    @property
    def _lane_origin(self) -> "EmulatedExpertGroup":
        """The group whose log and transfer switch a lane clone follows (itself otherwise)."""
        return self.lane_of or self

    # -- counts ---------------------------------------------------------------------------------
    def exchange_counts(self, send_counts: torch.Tensor, stats_width: int | None = None) -> torch.Tensor:
        """Collective (emulated). send_counts[dst, ...] -> recv_counts[src, ...]: row w is
        what rank w sends rank 0 when it routes as rank 0 does (module docstring); the last
        ``stats_width`` values of a row (None: STATS) are the pass statistics."""
        W = self.size
        if send_counts.shape[0] != W:
            raise ValueError(f"exchange_counts needs one row per rank of the emulated {W}-rank cluster; "
                             f"got shape {tuple(send_counts.shape)}")
        with self.timing.counting_host():
            seconds = self.cluster.small_collective_s()
            self._occupy_current_stream(seconds, send_counts.device)
            if self.peer_group_size is None or self.peer_group_size >= W:
                recv = send_counts[:1].repeat(W, *([1] * (send_counts.dim() - 1)))
            else:
                recv = self._received_in_peer_steps(send_counts, STATS if stats_width is None else stats_width)
            self._log("exchange_counts", recv, send_counts, (), (), seconds)
        return recv

    def _received_in_peer_steps(self, send_WX: torch.Tensor, stats_width: int) -> torch.Tensor:
        """Local. FasterMoE's table [W, C·L + S]: rank 0's rows for its own experts, all
        in the step rank w sends them ((−w) mod W) // g; the S statistics as rank 0's."""
        W, g = self.size, self.peer_group_size
        C = -(-W // g)
        width = send_WX.shape[1] - stats_width if send_WX.dim() == 2 else -1
        if width <= 0 or width % C:
            raise ValueError(f"this group expects FasterMoE count tables of {C} peer steps (group_size={g}) × L "
                             f"local experts + {STATS} statistics per row; got shape {tuple(send_WX.shape)}: build "
                             f"the layer as FasterMoE(config, group.for_peer_steps(g), group_size=g), the same g")
        totals_L = send_WX[0, :width].view(C, width // C).sum(0)
        recv_WX = torch.empty_like(send_WX)
        recv_WX[:, :width] = (self._steps_one_hot(send_WX.device, C)[:, :, None] * totals_L).reshape(W, width)
        recv_WX[:, width:] = send_WX[0, width:]
        return recv_WX

    def _steps_one_hot(self, device: torch.device, chunks: int) -> torch.Tensor:
        """[W, C] int64 on `device`: 1 at the step in which rank w sends to rank 0 (cached)."""
        key = (device, self.peer_group_size, chunks)
        if key not in self._source_steps:
            step_W = torch.tensor([((-w) % self.size) // self.peer_group_size for w in range(self.size)])
            self._source_steps[key] = torch.nn.functional.one_hot(step_W, chunks).to(device)
        return self._source_steps[key]

    # -- All-to-All -----------------------------------------------------------------------------
    def all_to_all(self, output: torch.Tensor, input: torch.Tensor,
                   output_splits: Sequence[int], input_splits: Sequence[int]) -> None:
        """Collective (emulated), blocking: the copy, then the network time on the current stream."""
        with self.timing.counting_host():
            seconds = self._price(output, input, output_splits, input_splits)
            self._transfer(output, input, input_splits, seconds)
            self._log("all_to_all", output, input, output_splits, input_splits, seconds)

    def all_to_all_async(self, output: torch.Tensor, input: torch.Tensor,
                         output_splits: Sequence[int], input_splits: Sequence[int],
                         streams: StreamSet) -> Pending:
        """Collective (emulated), asynchronous: the copy and the network time on
        ``streams.comm`` (CUDA); on CPU the copy, done at once."""
        with self.timing.counting_host():
            seconds = self._price(output, input, output_splits, input_splits)
            with streams.on_comm():
                self._transfer(output, input, input_splits, seconds)
            self._log("all_to_all_async", output, input, output_splits, input_splits, seconds)
            return streams.record_comm()

    def _price(self, output: torch.Tensor, input: torch.Tensor, output_splits: Sequence[int],
               input_splits: Sequence[int]) -> float:
        """Local, host arithmetic. Checks the splits as all_to_all_single would; the
        modelled seconds of rank 0's bytes (cached: every pass repeats its splits)."""
        W = self.size
        if len(output_splits) != W or len(input_splits) != W:
            raise ValueError(f"All-to-All splits need one entry per rank of the emulated {W}-rank cluster; got "
                             f"{len(output_splits)} output and {len(input_splits)} input splits")
        if sum(output_splits) != output.shape[0] or sum(input_splits) != input.shape[0]:
            raise ValueError(f"All-to-All splits do not match the tensors: output {tuple(output.shape)} vs "
                             f"{list(output_splits)}, input {tuple(input.shape)} vs {list(input_splits)}")
        row_bytes = math.prod(input.shape[1:]) * input.element_size()
        peer_steps = self.peer_group_size is not None and self.peer_group_size < W
        key = (tuple(output_splits), tuple(input_splits), row_bytes, peer_steps)
        seconds = self._seconds.get(key)
        if seconds is None:
            if len(self._seconds) > 4096:  # many distinct passes (a sweep): start over
                self._seconds.clear()
            seconds = self._seconds[key] = self.cluster.all_to_all_s(output_splits, input_splits, row_bytes,
                                                                     flat=peer_steps)
        return seconds

    # -- small agreements -------------------------------------------------------------------------
    def all_reduce_max(self, values: torch.Tensor) -> torch.Tensor:
        """Collective (emulated). Every rank holds the same values: their max is the values."""
        return self._agreement("all_reduce_max", values, values.clone())

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Collective (emulated). Every rank holds the same values: their sum is W times them."""
        return self._agreement("all_reduce_sum", values, values * self.size)

    def _agreement(self, kind: str, values: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
        with self.timing.counting_host():
            seconds = self.cluster.small_collective_s()
            self._occupy_current_stream(seconds, values.device)
            self._log(kind, result, values, (), (), seconds)
        return result

    def broadcast(self, tensor: torch.Tensor, source: int) -> None:
        """Collective (emulated), blocking: FasterMoE's shadowed expert weights. Rank 0 holds
        only its own experts' weights: from another source the tensor is zeros (the shape and
        the time are what count here). Priced as half a ring all-reduce of its bytes over the
        expert group (a pipelined ring moves each byte once per link), on the caller's stream."""
        if source != self.rank:
            tensor.zero_()
        self._blocking_collective("broadcast", tensor)

    def reduce_sum(self, tensor: torch.Tensor, destination: int) -> None:
        """Collective (emulated), blocking: every rank holds the same values, so their sum on
        the destination is W times them (rank 0's tensor, when it is the destination).
        Priced as `broadcast`."""
        if destination == self.rank:
            tensor.mul_(self.size)
        self._blocking_collective("reduce_sum", tensor)

    def _blocking_collective(self, kind: str, tensor: torch.Tensor) -> None:
        seconds = all_reduce_s(self.cluster.network, self.cluster.expert_layout,
                               tensor.numel() * tensor.element_size()) / 2
        self._occupy_current_stream(seconds, tensor.device)
        self._log(kind, tensor, tensor, (), (), seconds)

    def broadcast_object(self, obj):
        """Collective (emulated). Rank 0's object is everyone's."""
        calls = self._lane_origin.calls
        if calls is not None:
            calls.append(EmulatedCall("broadcast_object", (), (), (), (), 0.0))
        return obj

    # -- helpers ----------------------------------------------------------------------------------
    def _transfer(self, output: torch.Tensor, input: torch.Tensor, input_splits: Sequence[int],
                  seconds: float) -> None:
        """Local, on the current stream: the rows' copy, then the wait until `seconds` after the
        copy started (the copy is part of the modelled transfer, not extra time). With a
        `timing.link`, the wait runs there after the copy and the current stream waits for it.
        Within `free_transfers()` the copy only: the rows arrive as they would, at no modelled
        time (an output left as it was would feed the experts whatever the buffer held —
        denormals and NaNs, slow on CPUs — and no longer be the pass it stands for)."""
        if self._lane_origin._free_transfers:
            with torch.profiler.record_function(FREE_TRANSFER_COPY):
                fill_from_own_block(output, input, input_splits)
            return
        seconds *= self.timing.scale
        link = self.timing.link
        if link is not None and output.is_cuda and seconds > 0:
            fill_from_own_block(output, input, input_splits)
            self._hold_link(seconds, output.device, wait=True)
            return
        started = self.clock.start(output.device) if output.is_cuda and seconds > 0 else None
        fill_from_own_block(output, input, input_splits)
        if started is not None:
            self.clock.wait_since(started, seconds)

    def occupy_link(self, seconds: float, device: torch.device, *, wait: bool = True) -> None:
        """Local. `seconds` of modelled traffic on `timing.link` (CUDA; nothing elsewhere): the
        link waits for the current stream's work so far, then holds for `seconds`; with `wait`
        the current stream waits for the link (a transfer the caller needs), without it the
        traffic runs beside the caller's work (the data-parallel reduction: its user waits
        for the link later). Without a link, the current stream holds for `seconds`."""
        with self.timing.counting_host():
            self._hold_link(seconds, device, wait=wait)

    def _hold_link(self, seconds: float, device: torch.device, *, wait: bool) -> None:
        if device.type != "cuda" or seconds <= 0:
            return
        link = self.timing.link
        if link is None:
            self.clock.sleep(seconds, device)
            return
        current = torch.cuda.current_stream(device)
        link.wait_stream(current)
        with torch.cuda.stream(link):
            self.clock.sleep(seconds, device)
        if wait:
            current.wait_stream(link)

    def _occupy_current_stream(self, seconds: float, device: torch.device) -> None:
        if device.type == "cuda":
            self.clock.sleep(seconds * self.timing.scale, device)

    def occupy(self, seconds: float, device: torch.device) -> None:
        """Local. The current stream of `device` holds for `seconds` of modelled time (scaled
        by `timing.scale`), as a blocking collective would (CUDA; nothing elsewhere)."""
        with self.timing.counting_host():
            self._occupy_current_stream(seconds, device)

    def _log(self, kind: str, output: torch.Tensor, input: torch.Tensor, output_splits: Sequence[int],
             input_splits: Sequence[int], seconds: float) -> None:
        calls = self._lane_origin.calls
        if calls is not None:
            calls.append(EmulatedCall(kind, tuple(output.shape), tuple(input.shape), tuple(output_splits),
                                           tuple(input_splits), seconds))
