"""Schedule simulator: one MoE layer's forward+backward, and a training step, on
P ranks in N nodes (DESIGN.md §2, §7), from calibrated parts.

Legend: T tokens per rank, k top_k, D d_model, H d_hidden, A pre-activation
width, L local experts, n partitions, b = k·T/n rows a rank sends per
partition, Nn rows the busiest rank receives per partition.

The simulator replays, operation by operation, what the engine's host thread
issues (pipeline.py, layers.py) on four timelines:

    host      the Python thread: issues every kernel and collective, in program
              order, and waits where the engine reads the device: twice per pass,
              whatever n (the routing agreement and the dispatch plan's counts);
    compute   the caller's CUDA stream: gathers, GEMMs, activations;
    comm      the All-to-Alls;
    copy      offloads to and restores from pinned host memory.

Each stream runs its operations in order; an operation starts when its stream
is free, the host has issued it, and the events it waits for have fired (the
engine's ``wait_stream`` / ``wait_event``). While two streams are busy at once
each runs slower by the hardware profile's factor (``"compute|comm"`` is how
much slower compute runs beside communication, …): the simulation advances
from event to event, re-rating the work left on each busy stream.

Durations come from a `Parts` object: measured single-GPU parts
(`parts.GpuParts`: GEMM, row-kernel, shell, host-copy curves and host issue
costs) or the performance model's profile (`ProfileParts`, the degenerate case
the tests compare with `PerformanceModel.predict`). All-to-All time on several
ranks comes from the network model (network.py); on one rank it is the local
copy the engine makes. Memory is ``memory.predict_memory`` for the busiest rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .memory import RestorePolicy, predict_memory
from .network import (ClusterLayout, NetworkProfile, Traffic, all_reduce_s, all_to_all_traffic,
                      flat_all_to_all_s, hierarchical_all_to_all_s, small_collective_s, uniform_load)

GPU_STREAMS = ("compute", "comm", "copy")
STREAMS = ("host",) + GPU_STREAMS
ENGINES = ("mpipemoe", "fastmoe", "fastermoe")
STRATEGIES = ("none", "S1", "S2", "S3", "S4")


# -- the event-level scheduler ------------------------------------------------------------------

@dataclass(frozen=True)
class Op:
    name: str
    stream: str
    seconds: float
    after: tuple = ()


@dataclass(frozen=True)
class Timeline:
    """Result of a simulated schedule: when each op finished, and each stream's busy time."""

    makespan_s: float
    finish_s: tuple
    busy_s: dict


def run_schedule(ops: list[Op], slowdown: dict | None = None) -> Timeline:
    """Simulate `ops` (each stream in list order; `after` holds indices of earlier ops)."""
    slowdown = slowdown or {}
    queues = {s: [i for i, op in enumerate(ops) if op.stream == s] for s in STREAMS}
    unknown = {op.stream for op in ops} - set(STREAMS)
    if unknown:
        raise ValueError(f"ops on unknown stream(s) {sorted(unknown)}; streams are {', '.join(STREAMS)}")
    head = {s: 0 for s in STREAMS}
    finish = [math.nan] * len(ops)
    running: dict[str, list] = {}          # stream -> [op index, work left in alone-seconds]
    busy = {s: 0.0 for s in STREAMS}
    now = 0.0

    def factor(stream: str) -> float:
        if stream == "host":
            return 1.0
        others = [o for o in running if o != stream and o != "host"]
        return max([1.0] + [max(1.0, float(slowdown.get(f"{stream}|{o}", 1.0))) for o in others])

    while True:
        started = True
        while started:  # start every op whose stream is free and whose inputs are done
            started = False
            for s in STREAMS:
                if s in running or head[s] >= len(queues[s]):
                    continue
                i = queues[s][head[s]]
                if all(finish[d] <= now for d in ops[i].after):  # nan compares False: not done
                    head[s] += 1
                    if ops[i].seconds <= 0:
                        finish[i] = now
                    else:
                        running[s] = [i, ops[i].seconds]
                    started = True
        if not running:
            if any(head[s] < len(queues[s]) for s in STREAMS):
                stuck = [ops[queues[s][head[s]]].name for s in STREAMS if head[s] < len(queues[s])]
                raise RuntimeError(f"schedule deadlock: waiting ops {stuck}")
            return Timeline(now, tuple(finish), busy)
        rates = {s: 1.0 / factor(s) for s in running}
        step = min(left / rates[s] for s, (_, left) in running.items())
        now += step
        for s in list(running):
            entry = running[s]
            entry[1] -= step * rates[s]
            busy[s] += step
            if entry[1] <= 1e-15:
                finish[entry[0]] = now
                del running[s]


class Program:
    """Builds the op list the way the engine's host thread issues work.

    ``launch`` charges host time, then queues a device op that waits for that issue
    and for the events recorded against its stream; ``wait`` is ``wait_event``
    (the stream's next op waits), ``sync`` is a blocking host wait on a stream.
    """

    def __init__(self):
        self.ops: list[Op] = []
        self.host_tail: int | None = None
        self.tail: dict[str, int | None] = {s: None for s in GPU_STREAMS}
        self.pending: dict[str, set] = {s: set() for s in GPU_STREAMS}

    def _add(self, name: str, stream: str, seconds: float, after) -> int:
        self.ops.append(Op(name, stream, max(0.0, seconds), tuple(sorted(a for a in after if a is not None))))
        return len(self.ops) - 1

    def host(self, seconds: float, name: str = "host", after=()) -> int:
        self.host_tail = self._add(name, "host", seconds, [self.host_tail, *after])
        return self.host_tail

    def launch(self, stream: str, seconds: float, name: str, host_s: float = 0.0, kernels: int = 1) -> int:
        """Issue an operation of `kernels` kernel launches: the host issues them one by one
        (host_s in all) and each runs as soon as it is issued, so the host's issuing and
        the device's running overlap kernel by kernel."""
        kernels = max(1, int(kernels))
        for k in range(kernels):
            issue = self.host(host_s / kernels, f"issue {name}")
            op = self._add(name, stream, seconds / kernels, [issue, *self.pending[stream]])
            self.pending[stream].clear()
        self.tail[stream] = op
        return op

    def wait(self, stream: str, op: int | None) -> None:
        if op is not None:
            self.pending[stream].add(op)

    def wait_stream(self, stream: str, other: str) -> None:
        self.wait(stream, self.tail[other])

    def sync(self, stream: str, name: str = "sync") -> None:
        self.host(0.0, name, after=[self.tail[stream]])


# -- what the simulator needs to know of the hardware ----------------------------------------------

class ProfileParts:
    """Parts from a perf_model.HardwareProfile alone: GEMMs at the profile's FLOP rate,
    the expert backward twice the forward, host copies at its bandwidths, no row kernels
    or layer shell, and the per-partition overhead on the host. With these the simulator
    reproduces PerformanceModel.predict where the two schedules coincide (tests)."""

    def __init__(self, profile):
        self.profile = profile
        self.slowdown = dict(profile.slowdown)

    def ffn_s(self, phase, rows, d_model, d_hidden, activation="gelu"):
        A = (2 if activation == "swiglu" else 1) * d_hidden
        gemm1 = 2 * rows * d_model * A / self.profile.gemm_flops
        forward = gemm1 + 2 * rows * d_hidden * d_model / self.profile.gemm_flops
        return {"gemm1": gemm1, "forward": forward, "backward": 2 * forward,
                "autograd_forward": forward, "autograd_backward": 2 * forward}[phase]

    def rows_s(self, op, rows, d_model):
        return 0.0

    def shell_s(self, phase, tokens, d_model):
        return 0.0

    def host_copy_s(self, direction, nbytes):
        rate = self.profile.d2h_bytes_per_s if direction == "d2h" else self.profile.h2d_bytes_per_s
        return nbytes / rate

    def local_all_to_all_s(self, nbytes):
        return self.profile.a2a_latency_s + nbytes / self.profile.a2a_bytes_per_s

    def autograd_ffn_s(self, phase, rows, local_experts, d_model, d_hidden, activation="gelu"):
        return local_experts * self.ffn_s(f"autograd_{phase}", rows, d_model, d_hidden, activation)

    def host_cost(self, engine_key, local_experts=8):
        from .parts import HostCost

        p = self.profile.partition_overhead_s
        return HostCost(0.0, p, 0.0, p, 0.0)


class HostScaled:
    """Parts whose host issue costs are multiplied by `factor` (everything else as measured):
    another CPU (the measured run-to-run spread of host-bound layers is about ±25%), or
    factor 0 for the device-only bound a launch-free engine (CUDA graphs) would approach."""

    def __init__(self, parts, factor: float):
        if not factor >= 0:
            raise ValueError(f"host scale {factor!r} is invalid: give a factor >= 0 (1 = as measured)")
        self.parts, self.factor = parts, factor
        self.slowdown = parts.slowdown

    def __getattr__(self, name):
        return getattr(self.parts, name)

    def host_cost(self, engine_key, local_experts=8):
        from .parts import HostCost

        cost = self.parts.host_cost(engine_key, local_experts)
        return HostCost(*(self.factor * getattr(cost, f) for f in HostCost.__dataclass_fields__))


def _local_all_to_all_s(parts, nbytes: float, d_model: int, s: int) -> float:
    """One rank: the All-to-All is the engine's local copy of the rows."""
    if hasattr(parts, "local_all_to_all_s"):
        return parts.local_all_to_all_s(nbytes)
    return parts.rows_s("copy", round(nbytes / (d_model * s)), d_model)


# -- the layer and where it runs ------------------------------------------------------------------

def _positive_int(owner: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}.{name}={value!r} is invalid: give an integer >= 1")


@dataclass(frozen=True)
class LayerShape:
    """One MoE layer and the tokens each rank feeds it (bf16 unless dtype_bytes says)."""

    d_model: int
    d_hidden: int
    num_experts: int
    tokens: int
    top_k: int = 2
    activation: str = "gelu"
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        for name in ("d_model", "d_hidden", "num_experts", "tokens", "top_k", "dtype_bytes"):
            _positive_int("LayerShape", name, getattr(self, name))
        if self.activation not in ("relu", "gelu", "swiglu"):
            raise ValueError(f"LayerShape.activation={self.activation!r} is invalid: choose relu, gelu or swiglu")

    @property
    def pre_activation_width(self) -> int:
        return 2 * self.d_hidden if self.activation == "swiglu" else self.d_hidden

    def config(self):
        from .config import MoEConfig

        return MoEConfig(self.d_model, self.d_hidden, self.num_experts, top_k=self.top_k, activation=self.activation)

    def torch_dtype(self):
        import torch

        return {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[self.dtype_bytes]


@dataclass(frozen=True)
class Cluster:
    """Where the layer runs: layout, network and routing (load share of each expert)."""

    layout: ClusterLayout
    network: NetworkProfile | None = None
    load: tuple | None = None            # per expert; None = uniform
    hierarchical: bool = False           # two-level All-to-All instead of the flat one

    def __post_init__(self) -> None:
        if self.layout.ranks > 1 and self.network is None:
            raise ValueError("Cluster.network is None but the layout has several ranks: give a NetworkProfile "
                             "(e.g. network.PRESETS['dgx-a100'])")

    def load_for(self, num_experts: int) -> list[float]:
        return list(self.load) if self.load is not None else uniform_load(num_experts)


def single_gpu() -> Cluster:
    return Cluster(ClusterLayout(1, 1))


@dataclass(frozen=True)
class LayerResult:
    engine: str
    partitions: int
    strategy: str
    forward_s: float
    backward_s: float
    peak_bytes: int
    host_bytes: int
    busy_s: dict = field(default_factory=dict)
    all_to_all_s: float = 0.0            # one full-size (n = 1) All-to-All
    leaving_node: float = 0.0

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


class _Layer:
    """Sizes and per-op durations of one layer on the busiest rank."""

    def __init__(self, shape: LayerShape, cluster: Cluster, parts, partitions: int, peers: list | None = None):
        self.shape, self.cluster, self.parts, self.n = shape, cluster, parts, partitions
        P = cluster.layout.ranks
        if shape.num_experts % P:
            raise ValueError(f"LayerShape.num_experts={shape.num_experts} is not a multiple of the {P} ranks; "
                             f"use {P * max(1, shape.num_experts // P)} experts or fewer ranks")
        self.local = shape.num_experts // P
        self.load = cluster.load_for(shape.num_experts)
        self.rows_sent = shape.top_k * shape.tokens                      # R
        self.b = math.ceil(self.rows_sent / partitions)                  # rows sent per partition
        self.traffic: Traffic = (all_to_all_traffic(cluster.layout, self.load, peers) if P > 1 else
                                 Traffic(0, 0, 0, 0, 1.0, 0.0))
        # Rows of each local expert of the busiest receiver, per partition.
        hot = max(range(P), key=lambda r: sum(self.load[r * self.local:(r + 1) * self.local]))
        share = self.load[hot * self.local:(hot + 1) * self.local]
        total = sum(self.load)
        in_exchange = self.traffic.received / max(sum(share) / total * P, 1e-30) if P > 1 else 1.0
        self.expert_rows = [self.b * P * s / total * in_exchange for s in share]
        self.Nn = sum(self.expert_rows)

    # durations ------------------------------------------------------------------------------
    def ffn(self, phase: str) -> float:
        sh = self.shape
        return sum(self.parts.ffn_s(phase, round(m), sh.d_model, sh.d_hidden, sh.activation)
                   for m in self.expert_rows if m >= 0.5)

    def autograd_ffn(self, phase: str) -> float:
        """FastMoE's autograd FFN over all local experts (their mean rows)."""
        sh = self.shape
        mean = sum(self.expert_rows) / len(self.expert_rows)
        return self.parts.autograd_ffn_s(phase, round(mean), len(self.expert_rows), sh.d_model, sh.d_hidden,
                                         sh.activation)

    def rows(self, op: str, count: float) -> float:
        return self.parts.rows_s(op, round(count), self.shape.d_model)

    def all_to_all(self, rows: float) -> float:
        sh, cl = self.shape, self.cluster
        nbytes = rows * sh.d_model * sh.dtype_bytes
        if cl.layout.ranks == 1:
            return _local_all_to_all_s(self.parts, nbytes, sh.d_model, sh.dtype_bytes)
        if cl.hierarchical:
            return hierarchical_all_to_all_s(cl.network, cl.layout, self.traffic, nbytes)
        return flat_all_to_all_s(cl.network, self.traffic, nbytes)

    def host_copy(self, direction: str, width: int) -> float:
        return self.parts.host_copy_s(direction, self.Nn * width * self.shape.dtype_bytes)


class _FasterLayer(_Layer):
    """FasterMoE: step s exchanges with the ring offsets s·g … s·g+g−1 only. Steps differ
    in where their peers sit (same node or not); every step gets the traffic of the
    slowest one (most rows over the NIC)."""

    def __init__(self, shape, cluster, parts, steps: int, group: int):
        P = cluster.layout.ranks
        peers = None
        if P > 1:
            load = cluster.load_for(shape.num_experts)
            candidates = [list(range(s * group, min((s + 1) * group, P))) for s in range(steps)]
            peers = max(candidates, key=lambda c: (all_to_all_traffic(cluster.layout, load, c).inter, len(c)))
        super().__init__(shape, cluster, parts, 1, peers=peers)
        self.n = steps
        # Traffic fractions are relative to all rows a rank sends; one step sends the
        # rows of its peers (uniform routing: g/P of them).
        self.scale = P / len(peers) if peers else 1.0
        self.b = math.ceil(self.rows_sent / self.scale)
        self.rows_received_total = self.Nn * steps

    def all_to_all(self, rows: float) -> float:
        """A step exchanges with a few peers: always the flat exchange (a hierarchical one
        aggregates messages to every node, which a peer group does not have)."""
        cl = self.cluster
        if cl.layout.ranks == 1:
            return super().all_to_all(rows * self.scale)
        nbytes = rows * self.scale * self.shape.d_model * self.shape.dtype_bytes
        return flat_all_to_all_s(cl.network, self.traffic, nbytes)


def _prelude(prog: Program, layer: _Layer, host) -> None:
    """Router, routing agreement and dispatch plan: the host waits for the device twice
    (the agreement's read, and the plan's one read of both count tables), plus the two
    small collectives on several ranks."""
    sh, cl = layer.shape, layer.cluster
    shell = layer.parts.shell_s("forward", sh.tokens, sh.d_model)
    prog.launch("compute", shell / 2, "router", host.prelude_s / 2)
    prog.sync("compute", "agree")
    if cl.layout.ranks > 1:
        prog.host(small_collective_s(cl.network, cl.layout), "agree collective")
    prog.launch("compute", 0.0, "count rows", host.prelude_s / 4)
    if cl.layout.ranks > 1:
        prog.host(small_collective_s(cl.network, cl.layout), "count exchange")
    prog.sync("compute", "plan counts")
    prog.host(host.prelude_s / 4, "plan")


class _Pipelined:
    """pipeline.pipelined_forward and pipelined_backward, op for op (MPipeMoE, FasterMoE)."""

    def __init__(self, layer: _Layer, strategy: str, host):
        self.layer, self.policy, self.host = layer, RestorePolicy.of(strategy), host
        self.a2a = layer.all_to_all(layer.b)

    def forward(self, prog: Program) -> int:
        layer, policy, host, a2a = self.layer, self.policy, self.host, self.a2a
        sh, n, b, Nn = layer.shape, layer.n, layer.b, layer.Nn
        D, A = sh.d_model, sh.pre_activation_width
        L = len(layer.expert_rows)
        # The host's per-partition cost, spread over the kernels of a partition.
        per_op = host.forward_per_partition_s / (2 * L + 6 + policy.offload_input + policy.offload_preactivation)
        _prelude(prog, layer, host)
        dispatched, combined, copies = [None] * n, [None] * n, [[] for _ in range(n)]

        def issue_dispatch(i):
            if i >= 2:
                prog.wait("compute", dispatched[i - 2])
            prog.launch("compute", layer.rows("gather", b), f"gather {i}", per_op)
            prog.wait_stream("comm", "compute")
            dispatched[i] = prog.launch("comm", a2a, f"dispatch {i}", per_op)

        def run_experts(i):
            prog.wait("compute", dispatched[i])
            if i >= 2:
                for c in copies[i - 2]:
                    prog.wait("compute", c)
                prog.wait("compute", combined[i - 2])
            prog.launch("compute", layer.rows("gather", Nn), f"T_DI {i}", per_op)
            prog.launch("compute", layer.ffn("forward"), f"experts {i}", (2 * L + 1) * per_op, kernels=2 * L + 1)
            prog.launch("compute", layer.rows("gather", Nn), f"to source order {i}", per_op)
            if policy.offload_input:
                prog.wait_stream("copy", "compute")
                copies[i].append(prog.launch("copy", layer.host_copy("d2h", D), f"offload T_DI {i}", per_op))
            if policy.offload_preactivation:
                prog.wait_stream("copy", "compute")
                copies[i].append(prog.launch("copy", layer.host_copy("d2h", A), f"offload A {i}", per_op))
            prog.wait_stream("comm", "compute")
            combined[i] = prog.launch("comm", a2a, f"combine {i}", per_op)

        issue_dispatch(0)
        for i in range(n):
            if i + 1 < n:
                issue_dispatch(i + 1)
            run_experts(i)
        for op in combined + [c for cs in copies for c in cs]:
            prog.wait("compute", op)
        fixed_rest = max(host.forward_fixed_s - host.prelude_s, 0.0)
        return prog.launch("compute", layer.parts.shell_s("forward", sh.tokens, D) / 2, "un-permute", fixed_rest)

    def backward(self, prog: Program) -> int:
        layer, policy, host, a2a = self.layer, self.policy, self.host, self.a2a
        sh, n, b, Nn = layer.shape, layer.n, layer.b, layer.Nn
        D, A = sh.d_model, sh.pre_activation_width
        shell_bwd = layer.parts.shell_s("backward", sh.tokens, D)
        prog.launch("compute", shell_bwd / 2, "un-permute backward", host.backward_fixed_s / 2)
        prog.launch("compute", 0.5 * layer.rows("copy", sh.tokens) + 0.5 * layer.rows("copy", layer.local * 2 * sh.d_hidden),
                    "zero dx and expert grads")
        L = len(layer.expert_rows)
        kernels = 6 * L + 10 + (3 if policy.recommunicate_input else 1 if policy.offload_input else 0) \
            + policy.offload_preactivation + L * policy.recompute_preactivation
        per_op = host.backward_per_partition_s / kernels
        fetched_dy, fetched_input, fetched_preact, returned = [None] * n, [None] * n, [None] * n, [None] * n

        def issue_fetch(step):
            prog.wait_stream("comm", "compute")
            fetched_dy[step] = prog.launch("comm", a2a, f"dy {step}", per_op)
            if policy.recommunicate_input:
                if step >= 2:
                    prog.wait("compute", fetched_input[step - 2])
                prog.launch("compute", layer.rows("gather", b), f"re-gather {step}", per_op)
                prog.wait_stream("comm", "compute")
                fetched_input[step] = prog.launch("comm", a2a, f"re-dispatch {step}", per_op)
            elif policy.offload_input:
                prog.wait_stream("copy", "compute")
                fetched_input[step] = prog.launch("copy", layer.host_copy("h2d", D), f"restore T_DI {step}", per_op)
            if policy.offload_preactivation:
                prog.wait_stream("copy", "compute")
                fetched_preact[step] = prog.launch("copy", layer.host_copy("h2d", A), f"restore A {step}", per_op)

        def restore_and_backward(step):
            prog.wait("compute", fetched_input[step])
            if policy.recommunicate_input:
                prog.launch("compute", layer.rows("gather", Nn), f"T_DI order {step}", per_op)
            if policy.recompute_preactivation:
                prog.launch("compute", layer.ffn("gemm1"), f"recompute A {step}", L * per_op, kernels=L)
            else:
                prog.wait("compute", fetched_preact[step])
            prog.wait("compute", fetched_dy[step])
            prog.launch("compute", layer.rows("gather", Nn), f"dy order {step}", per_op)
            # activation recompute, dW2 and db2 per expert, dh, activation backward, dW1, db1, dx
            prog.launch("compute", layer.ffn("backward"), f"expert backward {step}", (6 * L + 5) * per_op,
                        kernels=6 * L + 5)
            if step >= 2:
                prog.wait("compute", returned[step - 2])
            prog.launch("compute", layer.rows("gather", Nn), f"dx order {step}", per_op)
            prog.wait_stream("comm", "compute")
            returned[step] = prog.launch("comm", a2a, f"dx {step}", per_op)

        def accumulate(step):
            prog.wait("compute", returned[step])
            prog.launch("compute", layer.rows("index_add", b), f"accumulate dx {step}", per_op)

        issue_fetch(0)
        for step in range(n):
            if step + 1 < n:
                issue_fetch(step + 1)
            restore_and_backward(step)
            if step >= 1:
                accumulate(step - 1)
        accumulate(n - 1)
        prog.wait_stream("compute", "comm")
        prog.wait_stream("compute", "copy")
        return prog.launch("compute", shell_bwd / 2, "router backward", host.backward_fixed_s / 2)


class _Serial:
    """layers.FastMoE under autograd: one blocking All-to-All each way, nothing overlaps.
    The host's cost is spread over the kernels in proportion to their count."""

    def __init__(self, layer: _Layer, host):
        self.layer, self.host = layer, host
        self.a2a = layer.all_to_all(layer.rows_sent)
        self.L = len(layer.expert_rows)

    @staticmethod
    def _chain(prog: Program, steps, host_s: float) -> int:
        per_kernel = host_s / sum(kernels for *_, kernels in steps)
        op = None
        for name, seconds, stream, kernels in steps:
            prog.wait_stream(stream, "compute" if stream == "comm" else "comm")
            op = prog.launch(stream, seconds, name, per_kernel * kernels, kernels=kernels)
        return op

    def forward(self, prog: Program) -> int:
        layer, host, a2a, L = self.layer, self.host, self.a2a, self.L
        sh, R, Nn = layer.shape, layer.rows_sent, layer.Nn
        _prelude(prog, layer, host)
        shell = layer.parts.shell_s("forward", sh.tokens, sh.d_model)
        return self._chain(prog, [
            ("gather", layer.rows("gather", R), "compute", 1), ("dispatch", a2a, "comm", 1),
            ("to expert order", layer.rows("gather", Nn), "compute", 1),
            ("experts", layer.autograd_ffn("forward"), "compute", 2 * L + 3),
            ("to source order", layer.rows("gather", Nn), "compute", 1), ("combine", a2a, "comm", 1),
            ("un-permute", shell / 2, "compute", 5)], max(host.forward_s(1) - host.prelude_s, 0.0))

    def backward(self, prog: Program) -> int:
        layer, host, a2a, L = self.layer, self.host, self.a2a, self.L
        sh, R, Nn = layer.shape, layer.rows_sent, layer.Nn
        shell_bwd = layer.parts.shell_s("backward", sh.tokens, sh.d_model)
        return self._chain(prog, [
            ("un-permute backward", shell_bwd / 2, "compute", 5), ("combine backward", a2a, "comm", 1),
            ("to source order backward", layer.rows("index_add", Nn), "compute", 2),
            ("experts backward", layer.autograd_ffn("backward"), "compute", 6 * L),
            ("to expert order backward", layer.rows("index_add", Nn), "compute", 2),
            ("dispatch backward", a2a, "comm", 1), ("gather backward", layer.rows("index_add", R), "compute", 2),
            ("router backward", shell_bwd / 2, "compute", 8)], host.backward_s(1))


def fastermoe_steps(ranks: int, group_size: int = 4) -> int:
    return -(-ranks // min(group_size, ranks))


def _check(engine: str, partitions: int, strategy: str) -> None:
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r} is invalid: choose one of {', '.join(ENGINES)}")
    _positive_int("simulate_layer", "partitions", partitions)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is invalid: choose one of {', '.join(STRATEGIES)}")


def _build(engine: str, shape: LayerShape, cluster: Cluster, parts, partitions: int, strategy: str,
           group_size: int):
    """(schedule object, layer, partitions, strategy) as the engine runs them."""
    if engine == "fastmoe":
        layer = _Layer(shape, cluster, parts, 1)
        return _Serial(layer, parts.host_cost("fastmoe", layer.local)), layer, 1, "none"
    if engine == "fastermoe":
        P = cluster.layout.ranks
        steps = fastermoe_steps(P, group_size)
        layer = _FasterLayer(shape, cluster, parts, steps, min(group_size, P))
        base, slope = parts.host_cost("fastermoe", layer.local), parts.host_cost("mpipemoe|none", layer.local)
        # One-rank FasterMoE has one step: its own measured cost; each further step adds
        # what a further MPipeMoE partition adds (the same pipeline code).
        host = replace(base, forward_fixed_s=base.forward_s(1) - slope.forward_per_partition_s,
                       forward_per_partition_s=slope.forward_per_partition_s,
                       backward_fixed_s=base.backward_s(1) - slope.backward_per_partition_s,
                       backward_per_partition_s=slope.backward_per_partition_s)
        return _Pipelined(layer, "none", host), layer, steps, "none"
    layer = _Layer(shape, cluster, parts, partitions)
    host = parts.host_cost(f"mpipemoe|{strategy}", layer.local)
    return _Pipelined(layer, strategy, host), layer, partitions, strategy


def _memory(engine: str, shape: LayerShape, cluster: Cluster, layer: _Layer, partitions: int, strategy: str):
    received = layer.rows_received_total if isinstance(layer, _FasterLayer) else layer.Nn * layer.n
    return predict_memory(shape.config(), shape.tokens, cluster.layout.ranks, partitions, strategy, engine=engine,
                          dtype=shape.torch_dtype(), rows_received=round(received))


def simulate_layer(engine: str, shape: LayerShape, cluster: Cluster, parts, partitions: int = 1,
                   strategy: str = "none", group_size: int = 4) -> LayerResult:
    """Forward+backward of one layer of `engine` on the busiest rank of `cluster`.

    mpipemoe: `partitions` and `strategy` as given. fastmoe: one partition, keep
    everything. fastermoe: ceil(P / group_size) steps, step s exchanging with the ring
    offsets s·g … s·g+g−1 (layers.FasterMoE), keep everything.
    """
    _check(engine, partitions, strategy)
    schedule, layer, partitions, strategy = _build(engine, shape, cluster, parts, partitions, strategy, group_size)
    prog = Program()
    forward_end = schedule.forward(prog)
    schedule.backward(prog)
    timeline = run_schedule(prog.ops, parts.slowdown)
    forward_s = timeline.finish_s[forward_end]
    memory = _memory(engine, shape, cluster, layer, partitions, strategy)
    full = _Layer(shape, cluster, parts, 1)
    return LayerResult(engine, partitions, strategy, forward_s, timeline.makespan_s - forward_s,
                       memory.peak_bytes, memory.host_bytes, timeline.busy_s,
                       all_to_all_s=full.all_to_all(full.b), leaving_node=full.traffic.leaving_node)


def all_to_all_options(shape: LayerShape, cluster: Cluster, parts) -> dict:
    """One All-to-All of the whole batch (k·T rows per rank): flat and hierarchical
    seconds, and the fraction of rows that leaves the node."""
    layer = _Layer(shape, cluster, parts, 1)
    if cluster.layout.ranks == 1:
        local = layer.all_to_all(layer.b)
        return {"flat_s": local, "hierarchical_s": local, "leaving_node": 0.0}
    nbytes = layer.rows_sent * shape.d_model * shape.dtype_bytes
    return {"flat_s": flat_all_to_all_s(cluster.network, layer.traffic, nbytes),
            "hierarchical_s": hierarchical_all_to_all_s(cluster.network, cluster.layout, layer.traffic, nbytes),
            "leaving_node": layer.traffic.leaving_node}


PARTITION_CANDIDATES = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class EngineChoice:
    """What each engine would run at one setting, and MPipeMoE's options."""

    fastmoe: LayerResult
    fastermoe: LayerResult
    fastest: LayerResult          # MPipeMoE: the fastest (n, strategy), "none" included
    chosen: LayerResult           # MPipeMoE as "auto" runs it: fastest n, then the fastest restore
                                  # strategy that lowers the peak below keeping everything
    grid: tuple                   # every MPipeMoE (n, strategy) simulated


def compare_engines(shape: LayerShape, cluster: Cluster, parts, partitions=PARTITION_CANDIDATES,
                    group_size: int = 4, tolerance: float = 0.05) -> EngineChoice:
    """The three engines at one setting. MPipeMoE's n is the largest within `tolerance`
    of the fastest (as granularity.GranularitySearch picks it), its strategy the
    performance model's rule (perf_model.PerformanceModel.choose)."""
    grid = tuple(simulate_layer("mpipemoe", shape, cluster, parts, n, s)
                 for n in partitions for s in STRATEGIES)
    fastest = min(grid, key=lambda r: r.total_s)
    by_n = {}
    for n in partitions:
        options = [r for r in grid if r.partitions == n]
        keep = next(r for r in options if r.strategy == "none")
        saving = [r for r in options if r.strategy != "none" and r.peak_bytes < keep.peak_bytes]
        by_n[n] = min(saving or [keep], key=lambda r: r.total_s)
    best_time = min(r.total_s for r in by_n.values())
    chosen = by_n[max(n for n, r in by_n.items() if r.total_s <= best_time * (1 + tolerance))]
    return EngineChoice(simulate_layer("fastmoe", shape, cluster, parts),
                        simulate_layer("fastermoe", shape, cluster, parts, group_size=group_size),
                        fastest, chosen, grid)


# -- a training step of a whole MoE transformer ------------------------------------------------------

@dataclass(frozen=True)
class ModelShape:
    """A MoE transformer as app.model builds it: every block is pre-LN attention and a MoE layer."""

    d_model: int
    d_hidden: int
    num_layers: int
    num_heads: int
    seq_len: int
    num_experts: int
    top_k: int = 2
    activation: str = "gelu"
    vocab_size: int = 259
    causal: bool = True

    def __post_init__(self) -> None:
        for name in ("d_model", "d_hidden", "num_layers", "num_heads", "seq_len", "num_experts", "top_k",
                     "vocab_size"):
            _positive_int("ModelShape", name, getattr(self, name))

    def layer(self, tokens: int) -> LayerShape:
        return LayerShape(self.d_model, self.d_hidden, self.num_experts, tokens, self.top_k, self.activation)

    @property
    def replicated_params(self) -> int:
        """Parameters every rank holds: attention, layer norms, routers, embeddings."""
        D = self.d_model
        per_layer = 4 * D * D + 4 * D + 4 * D + self.num_experts * D
        return self.num_layers * per_layer + (self.vocab_size + self.seq_len) * D + 2 * D

    def expert_params(self, ranks: int) -> int:
        """Expert parameters on one rank (its E / P experts in every layer)."""
        D, H = self.d_model, self.d_hidden
        per_expert = 2 * D * H + H + D + (D * H if self.activation == "swiglu" else 0)
        return self.num_layers * (self.num_experts // ranks) * per_expert


@dataclass(frozen=True)
class StepResult:
    engine: str
    partitions: int
    strategy: str
    step_s: float
    moe_s: float               # all MoE layers, forward and backward
    dense_s: float             # attention blocks, embeddings and head
    all_reduce_s: float        # replicated gradients, one flat all-reduce after backward
    optimizer_s: float
    peak_bytes: int
    state_bytes: int           # parameters, gradients and AdamW moments
    activation_bytes: int      # saved for backward over all layers


def dense_flops_per_s(parts, d_model: int, d_hidden: int, rows: int) -> float:
    """GEMM rate of the GPU at this width and row count, from the expert FFN's forward."""
    flops = 2 * rows * d_model * 2 * d_hidden
    return flops / max(parts.ffn_s("forward", rows, d_model, d_hidden), 1e-12)


def memory_bytes_per_s(parts, d_model: int) -> float:
    """Device memory bandwidth (bytes read + written per second) from the copy curve."""
    rows = 131072
    seconds = parts.rows_s("copy", rows, d_model)
    return 2 * rows * d_model * 2 / seconds if seconds > 0 else float("inf")


def simulate_step(engine: str, model: ModelShape, tokens: int, cluster: Cluster, parts, partitions: int = 1,
                  strategy: str = "none", group_size: int = 4, dtype_bytes: int = 2) -> StepResult:
    """One training step (forward, backward, gradient all-reduce, AdamW) on the busiest rank.

    The MoE layer is simulated (simulate_layer) and repeated per block; the dense parts are
    their FLOPs at the GPU's GEMM rate (attention kernels assumed at that rate too) plus
    four passes over the activations for norms and residuals; AdamW is memory-bound
    (14 bytes moved per parameter). Memory: parameters, gradients and AdamW moments in
    the model dtype (8 bytes per bf16 parameter), each block's saved activations
    (attention: 7·T·D values and the softmax statistics; MoE: memory.predict_memory), the
    largest MoE working set and the logits.
    """
    layer_shape = model.layer(tokens)
    moe = simulate_layer(engine, layer_shape, cluster, parts, partitions, strategy, group_size)
    D, T, S = model.d_model, tokens, model.seq_len
    rate = dense_flops_per_s(parts, D, model.d_hidden, T)
    bandwidth = memory_bytes_per_s(parts, D)
    attention = 2 * T * 4 * D * D + 4 * T * S * D * (0.5 if model.causal else 1.0)
    elementwise = 4 * 2 * T * D * dtype_bytes / bandwidth
    head = 2 * T * D * model.vocab_size
    dense = model.num_layers * (3 * attention / rate + 3 * elementwise) + 3 * head / rate
    P = cluster.layout.ranks
    params = model.replicated_params + model.expert_params(P)
    reduce = all_reduce_s(cluster.network, cluster.layout, model.replicated_params * dtype_bytes) if P > 1 else 0.0
    optimizer = 14 * params / bandwidth * dtype_bytes / 2
    memory = _memory(moe.engine, layer_shape, cluster, _build(engine, layer_shape, cluster, parts, partitions, strategy,
                                                             group_size)[1], moe.partitions, moe.strategy)
    attention_saved = 7 * T * D * dtype_bytes + T * model.num_heads * 4
    activations = model.num_layers * (attention_saved + memory.saved_bytes)
    state = 4 * params * dtype_bytes
    working = max(memory.forward_working_bytes, memory.backward_working_bytes)
    peak = state + activations + working + T * model.vocab_size * 4
    step = model.num_layers * moe.total_s + dense + reduce + optimizer
    return StepResult(engine, moe.partitions, moe.strategy, step, model.num_layers * moe.total_s, dense, reduce,
                      optimizer, peak, state, activations)
