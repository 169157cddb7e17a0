"""Schedule simulator: one MoE layer's forward+backward, and a training step, on
W ranks on several nodes (docs/design.md §2, §7), from calibrated parts.

Shapes: see moe_engine's legend (moe_engine/__init__.py).
Beside them: b = R/n rows a rank sends per partition, Nn rows the busiest rank
receives per partition.

The simulator replays, operation by operation, what the engine's host thread
issues (the pipeline's schedule.py, layers.py, dispatcher.py, experts.py) on four
timelines:

    host      the Python thread: issues every operator, in program order, each
              at a measured cost per call, and waits where the engine reads the
              device: once per pass with several ranks (the count tables and the
              pass statistics, `dispatcher.read_counts`), never with one rank;
    compute   the caller's CUDA stream: gathers, grouped GEMMs, activations;
    comm      the All-to-Alls and the count exchange (several ranks only);
    copy      offloads to and restores from pinned host memory.

All three engines run the same pipeline (layers.py): MPipeMoE with its n and
strategy, FasterMoE with one partition per peer group, FastMoE with one partition
that keeps act(A). With one rank there are no collectives: dispatch gathers the
rows straight into expert order, combine concatenates the partitions' outputs,
backward adds each partition's dx with one index_add_. The expert FFN is one
grouped GEMM per projection for all local experts; in backward its input-gradient
part runs first, the dx All-to-All is issued, and the weight-gradient GEMMs run
while it travels.

Each stream runs its operations in order; an operation starts when its stream
is free, the host has issued it, and the events it waits for have fired (the
engine's ``wait_stream`` / ``wait_event``). While two streams are busy at once
each runs slower by the hardware profile's factor (``"compute|comm"`` is how
much slower compute runs beside communication, …): the simulation advances
from event to event, re-rating the work left on each busy stream.

Durations come from a `Parts` object: measured single-GPU parts
(`parts.GpuParts`: grouped-FFN, row-kernel, shell, host-copy curves and host
issue costs) or the performance model's profile (`ProfileParts`, the degenerate
case the tests compare with `PerformanceModel.predict`). All-to-All time comes
from the network model (network.py). Memory is ``memory.predict_memory`` for the
busiest rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from moe_engine.comm import DEFAULT_COMM_SMS
from moe_engine.config import ENGINES, STRATEGIES, MoEConfig
from moe_engine.granularity import SEARCH_SPLITS
from moe_engine.memory import RestorePolicy, predict_memory
from moe_engine.perf_model import SAVING_SLACK
from moe_engine.schedule import COMPUTE, backward_schedule, forward_schedule

from .network import (EXPERT_PARALLEL_FLAG, ClusterLayout, NetworkProfile, Traffic, all_reduce_s, all_to_all_traffic,
                      expert_degrees, expert_group_layouts, flat_all_to_all_s, hierarchical_all_to_all_s,
                      small_collective_s, uniform_load)
from .parts import HOST_LAYER, HostCost, input_grad_share

GPU_STREAMS = ("compute", "comm", "copy")
STREAMS = ("host",) + GPU_STREAMS


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
    (the stream's next op waits), ``sync`` is a blocking host wait on a stream
    (counted in ``host_waits``).
    """

    def __init__(self):
        self.ops: list[Op] = []
        self.host_tail: int | None = None
        self.tail: dict[str, int | None] = {s: None for s in GPU_STREAMS}
        self.pending: dict[str, set] = {s: set() for s in GPU_STREAMS}
        self.host_waits = 0

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
        self.host_waits += 1


# -- what the simulator needs to know of the hardware ----------------------------------------------

class ProfileParts:
    """Parts from a perf_model.HardwareProfile alone: GEMMs at the profile's FLOP rate,
    the expert backward twice the forward (its input gradient half of it, by FLOPs),
    host copies at its bandwidths, no row kernels or layer shell, and the per-partition
    overhead on the host. With these the simulator reproduces PerformanceModel.predict
    where the two schedules coincide (tests)."""

    def __init__(self, profile):
        self.profile = profile
        self.slowdown = dict(profile.slowdown)

    def ffn_s(self, phase, rows, d_model, d_hidden, activation="gelu"):
        A = (2 if activation == "swiglu" else 1) * d_hidden
        gemm1 = 2 * rows * d_model * A / self.profile.gemm_flops
        forward = gemm1 + 2 * rows * d_hidden * d_model / self.profile.gemm_flops
        share = input_grad_share(activation)
        return {"gemm1": gemm1, "forward": forward, "backward": 2 * forward,
                "input_grad": 2 * forward * share, "weight_grads": 2 * forward * (1 - share)}[phase]

    def grouped_ffn_s(self, phase, expert_rows, d_model, d_hidden, activation="gelu"):
        return sum(self.ffn_s(phase, round(m), d_model, d_hidden, activation) for m in expert_rows if m >= 0.5)

    def rows_s(self, op, rows, d_model):
        return 0.0

    def shell_s(self, phase, tokens, d_model):
        return 0.0

    def host_copy_s(self, direction, nbytes):
        rate = self.profile.d2h_bytes_per_s if direction == "d2h" else self.profile.h2d_bytes_per_s
        return nbytes / rate

    def host_cost(self, engine_key, local_experts=8):
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
        cost = self.parts.host_cost(engine_key, local_experts)
        return HostCost(*(self.factor * getattr(cost, f) for f in HostCost.__dataclass_fields__))


# -- the operator calls the engine's host issues per partition ------------------------------------
#
# Every operator call costs host time (a kernel launch, or allocator work). The parts
# measure the host's cost of a partition on one GPU; it is spread over the partition's
# calls, and a partition on several ranks, which calls more operators (the All-to-Alls,
# their receive buffers, the re-orders by expert), is charged for its calls at that
# rate. The counts are the engine's own: tests/moe_sim/test_simulator.py counts the calls of
# pipeline.py on CPU (tests/moe_engine/test_host_reads.py OperatorCalls) and compares them with these.
# None of them grows with the number of experts (one grouped GEMM per projection).

def _projection_calls(shape: "LayerShape") -> tuple[int, int]:
    """Calls of GEMM1 and of GEMM2 (Experts.project_in / project_out): one grouped GEMM
    per projection (SwiGLU: w1 and w3 for GEMM1) and, with biases, the bias rows
    (repeat_interleave, index_select, add_)."""
    bias = 3 if shape.bias else 0
    return 1 + int(shape.gated) + bias, 1 + bias


def forward_calls(policy: RestorePolicy, shape: "LayerShape", several: bool, reorder: bool) -> dict:
    """Operator calls of one partition of pipeline.pipelined_forward, by step. `several`:
    more than one rank (All-to-Alls); `reorder`: received rows are re-ordered by expert
    (several ranks and several local experts)."""
    gemm1, gemm2 = _projection_calls(shape)
    return {
        "gather": 1,                                              # x_TD.index_select (1. dispatch)
        "dispatch": 2 * several,                                  # new_empty + all_to_all
        "to expert order": int(reorder),                          # index_select (2. experts)
        "GEMM1": gemm1,
        "activation, GEMM2": (2 if shape.gated else 1) + gemm2,   # act (SwiGLU: silu, mul_) + GEMM2
        "to source order": int(reorder),
        "offload T_DI": int(policy.offload_input),                # copy_ to a pooled host buffer (3. offload)
        "offload A": (2 if shape.gated else 1) * policy.offload_preactivation,
        "combine": int(several),                                  # all_to_all into y_RD (4. combine)
    }


def backward_calls(policy: RestorePolicy, shape: "LayerShape", several: bool, reorder: bool,
                   keep_activation: bool = False, first: bool = False, only: bool = False) -> dict:
    """Operator calls of one partition of pipeline.pipelined_backward, by step. `first`:
    the first partition backward runs (it adds no earlier gradients); `only`: the one
    partition of a one-rank pass (its dx is passed on as it is)."""
    gemm1, _ = _projection_calls(shape)
    gated, bias, recommunicate = int(shape.gated), int(shape.bias), policy.recommunicate_input
    # (GELU: its backward and, unless kept, act(A) for w2's gradient: gelu, gelu_backward)
    activation_backward = 5 if shape.gated else 2 if shape.activation == "relu" else 1 + int(not keep_activation)
    return {
        "dy": 2 * several,                                        # new_empty + all_to_all
        "re-gather": int(recommunicate),                          # x_TD.index_select (S2, S4)
        "re-dispatch": 2 * (recommunicate and several),           # new_empty + all_to_all
        "restore T_DI": 2 * policy.offload_input,                 # empty + copy_
        "restore A": 2 * (1 + gated) * policy.offload_preactivation,
        "T_DI to expert order": int(recommunicate and reorder),
        "recompute A": gemm1 * policy.recompute_preactivation,   # GEMM1 (S3, S4)
        "dy to expert order": int(reorder),
        # Experts.input_grad: dh = dy·w2ᵀ, the activation's backward, dx = dA·w1ᵀ (SwiGLU:
        # + dup·w3ᵀ and its add_)
        "input gradient": 1 + activation_backward + 1 + 2 * gated,
        "dx to source order": int(reorder),
        "dx": int(several or not only),                           # all_to_all (one rank: copy_) into dx_RD
        # Experts.weight_grads: act(A) again (ReLU, unless kept; the input gradient made
        # SwiGLU's and GELU's), dW2, dW1 (dW3), bias gradients (a grouped GEMM each, against the
        # pass's columns of ones: experts.PassRows)
        "weight gradients": int(shape.activation == "relu" and not keep_activation) + 2 + gated + 2 * bias,
        "accumulate gradients": 0 if first else 2 + gated + 2 * bias,   # add_ into the earlier partitions'
    }


# -- the layer and where it runs ------------------------------------------------------------------

def _positive_int(owner: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}.{name}={value!r} is invalid: give an integer >= 1")


@dataclass(frozen=True)
class LayerShape:
    """One MoE layer and the tokens each rank feeds it (bf16 unless dtype_bytes says;
    expert biases b1, b2 unless bias is False)."""

    d_model: int
    d_hidden: int
    num_experts: int
    tokens: int
    top_k: int = 2
    activation: str = "gelu"
    dtype_bytes: int = 2
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("d_model", "d_hidden", "num_experts", "tokens", "top_k", "dtype_bytes"):
            _positive_int("LayerShape", name, getattr(self, name))
        if self.activation not in ("relu", "gelu", "swiglu"):
            raise ValueError(f"LayerShape.activation={self.activation!r} is invalid: choose relu, gelu or swiglu")
        if not isinstance(self.bias, bool):
            raise ValueError(f"LayerShape.bias={self.bias!r} is invalid: give True or False")

    @property
    def gated(self) -> bool:
        return self.activation == "swiglu"

    @property
    def pre_activation_width(self) -> int:
        return 2 * self.d_hidden if self.gated else self.d_hidden

    def config(self):
        return MoEConfig(self.d_model, self.d_hidden, self.num_experts, top_k=self.top_k, activation=self.activation,
                         bias=self.bias)

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
    # SMs a pipelined pass's GEMMs leave to communication (ExpertGroup.comm_sms): the engine
    # leaves DEFAULT_COMM_SMS on a real cluster; 0 (every SM) stays the default here until
    # the simulator's committed answers are made again with it (docs/simulate.md).
    comm_sms: int = 0

    def __post_init__(self) -> None:
        if self.layout.ranks > 1 and self.network is None:
            raise ValueError("Cluster.network is None but the layout has several ranks: give a NetworkProfile "
                             "(e.g. network.PRESETS['dgx-a100'])")
        if isinstance(self.comm_sms, bool) or not isinstance(self.comm_sms, int) or self.comm_sms < 0:
            raise ValueError(f"Cluster.comm_sms={self.comm_sms!r} is invalid: give the SMs the GEMMs leave to "
                             f"communication, an integer >= 0 (the engine's default: {DEFAULT_COMM_SMS})")

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
    all_to_all_s: float = 0.0            # one full-size (n = 1) All-to-All; none with one rank
    leaving_node: float = 0.0
    host_waits: int = 0                  # blocking device reads per pass (1 with several ranks, 0 with one)
    split: str = "tokens"                # MPipeMoE's split ("peers": FasterMoE's partitions; layers.MPipeMoE)

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


class _Layer:
    """Sizes and per-op durations of one layer on the busiest rank."""

    def __init__(self, shape: LayerShape, cluster: Cluster, parts, partitions: int, peers: list | None = None):
        self.shape, self.cluster, self.parts, self.n = shape, cluster, parts, partitions
        self.gemm_scale = 1.0  # the SM carve-out of a pipelined pass (carve_out_scale), set by _build
        W = cluster.layout.ranks
        if shape.num_experts % W:
            raise ValueError(f"LayerShape.num_experts={shape.num_experts} is not a multiple of the {W} ranks; "
                             f"use {W * max(1, shape.num_experts // W)} experts or fewer ranks")
        self.local = shape.num_experts // W
        self.load = cluster.load_for(shape.num_experts)
        self.rows_sent = shape.top_k * shape.tokens                      # R
        self.b = math.ceil(self.rows_sent / partitions)                  # rows sent per partition
        self.traffic: Traffic = (all_to_all_traffic(cluster.layout, self.load, peers) if W > 1 else
                                 Traffic(0, 0, 0, 0, 1.0, 0.0))
        # Rows of each local expert of the busiest receiver, per partition.
        hot = max(range(W), key=lambda r: sum(self.load[r * self.local:(r + 1) * self.local]))
        share = self.load[hot * self.local:(hot + 1) * self.local]
        total = sum(self.load)
        in_exchange = self.traffic.received / max(sum(share) / total * W, 1e-30) if W > 1 else 1.0
        self.expert_rows = [self.b * W * s / total * in_exchange for s in share]
        self.Nn = sum(self.expert_rows)

    # durations ------------------------------------------------------------------------------
    def ffn(self, phase: str) -> float:
        """One partition's expert FFN `phase` (gemm1, forward, input_grad, weight_grads) on
        the busiest rank: one grouped GEMM per projection over its local experts."""
        sh = self.shape
        return self.gemm_scale * self.parts.grouped_ffn_s(phase, self.expert_rows, sh.d_model, sh.d_hidden,
                                                          sh.activation)

    def rows(self, op: str, count: float) -> float:
        return self.parts.rows_s(op, round(count), self.shape.d_model)

    def elementwise(self, values: float, passes: int) -> float:
        """An elementwise kernel that reads or writes each of `values` values `passes` times
        in all (a fill: 1, an add_ of two tensors: 3), from the copy curve (2 passes)."""
        D = self.shape.d_model
        return passes / 2 * self.parts.rows_s("copy", round(values / D), D)

    def all_to_all(self, rows: float) -> float:
        """One All-to-All of `rows` rows per rank; 0 with one rank, which has none."""
        sh, cl = self.shape, self.cluster
        if cl.layout.ranks == 1:
            return 0.0
        nbytes = rows * sh.d_model * sh.dtype_bytes
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
        W = cluster.layout.ranks
        peers = None
        if W > 1:
            load = cluster.load_for(shape.num_experts)
            candidates = [list(range(s * group, min((s + 1) * group, W))) for s in range(steps)]
            peers = max(candidates, key=lambda c: (all_to_all_traffic(cluster.layout, load, c).inter, len(c)))
        super().__init__(shape, cluster, parts, 1, peers=peers)
        self.n = steps
        # Traffic fractions are relative to all rows a rank sends; one step sends the
        # rows of its peers (uniform routing: g/W of them).
        self.scale = W / len(peers) if peers else 1.0
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
    """Router and dispatch plan (layers.MoELayerBase.plan). One rank: all local, nothing
    read back (dispatcher.plan_single). Several ranks: count rows and the pass
    statistics, the count exchange (one small collective, which carries the statistics:
    there is no separate agreement), the pass's one device read (dispatcher.read_counts:
    the host waits for everything issued so far), then the plan on the host."""
    sh, cl = layer.shape, layer.cluster
    shell = layer.parts.shell_s("forward", sh.tokens, sh.d_model)
    prog.launch("compute", shell / 2, "router", host.prelude_s / 2)
    if cl.layout.ranks == 1:
        prog.launch("compute", 0.0, "plan", host.prelude_s / 2)
        return
    prog.launch("compute", 0.0, "count rows and pass statistics", host.prelude_s / 4)
    prog.wait_stream("comm", "compute")
    prog.launch("comm", small_collective_s(cl.network, cl.layout), "count exchange")
    prog.sync("comm", "read counts")
    prog.host(host.prelude_s / 4, "plan")


class _Pipelined:
    """Prices the schedule pipeline.py executes (schedule.py), op by op, as every engine
    runs it (layers.py): MPipeMoE with its n and strategy, FasterMoE with one partition
    per peer group, FastMoE with one partition that keeps act(A) for backward."""

    def __init__(self, layer: _Layer, strategy: str, host, keep_activation: bool = False):
        self.layer, self.policy, self.host = layer, RestorePolicy.of(strategy), host
        self.keep_activation = keep_activation
        self.several = layer.cluster.layout.ranks > 1
        # With several ranks the received rows arrive by source rank and are re-ordered by
        # expert and back (dispatcher.plan_exchanged), unless a rank holds one expert.
        self.reorder = self.several and layer.local > 1
        self.a2a = layer.all_to_all(layer.b)

    def _measured_calls(self, phase: str, **flags) -> int:
        """Calls of one partition of the layer whose host cost the parts measured (one
        rank, parts.HOST_LAYER; MPipeMoE's lines, which never keep act(A)): host seconds
        per call are its per-partition cost over these."""
        measured = replace(self.layer.shape, activation=HOST_LAYER["activation"], bias=HOST_LAYER["bias"])
        if phase == "forward":
            return sum(forward_calls(self.policy, measured, False, False).values())
        return sum(backward_calls(self.policy, measured, False, False, **flags).values())

    @staticmethod
    def _issuer(prog: Program, calls: dict, per_call: float):
        def issue(stream: str, seconds: float, step: str, i: int, kernels: int | None = None) -> int:
            """Launch `step` of partition i: its calls' host cost, its device time spread
            over `kernels` launches (default one per call)."""
            return prog.launch(stream, seconds, f"{step} {i}", calls[step] * per_call,
                               kernels=calls[step] if kernels is None else kernels)
        return issue

    @staticmethod
    def _walk(prog: Program, ops: list, price: dict) -> list:
        """Issue the schedule's `ops` as pipeline.py does: a wait for a side-stream operation
        is made on the compute stream (Pending.wait), and a side-stream operation first
        waits for the compute stream (StreamSet.on_comm / on_copy). `price[op.name](op)`
        launches the op's work; returns the last program op of each (None: it launched none)."""
        issued: list = []
        for op in ops:
            for earlier in op.after:
                if ops[earlier].stream != COMPUTE:
                    prog.wait("compute", issued[earlier])
            if op.stream != COMPUTE:
                prog.wait_stream(op.stream, "compute")
            issued.append(price[op.name](op))
        return issued

    def forward(self, prog: Program) -> int:
        layer, policy, host, a2a = self.layer, self.policy, self.host, self.a2a
        sh, n, b, Nn = layer.shape, layer.n, layer.b, layer.Nn
        calls = forward_calls(policy, sh, self.several, self.reorder)
        issue = self._issuer(prog, calls, host.forward_per_partition_s / self._measured_calls("forward"))
        gemm1, ffn = layer.ffn("gemm1"), layer.ffn("forward")
        _prelude(prog, layer, host)

        def experts(op):
            i = op.partition
            if self.reorder:
                issue("compute", layer.rows("gather", Nn), "to expert order", i)
            last = issue("compute", gemm1, "GEMM1", i)
            last = issue("compute", ffn - gemm1, "activation, GEMM2", i)
            if self.reorder:
                last = issue("compute", layer.rows("gather", Nn), "to source order", i)
            return last

        price = {
            "gather": lambda op: issue("compute", layer.rows("gather", b), "gather", op.partition),
            "dispatch": lambda op: issue("comm", a2a, "dispatch", op.partition, kernels=1),
            "experts": experts,
            "offload_input": lambda op: issue("copy", layer.host_copy("d2h", sh.d_model), "offload T_DI",
                                              op.partition),
            "offload_preactivation": lambda op: issue("copy", layer.host_copy("d2h", sh.pre_activation_width),
                                                      "offload A", op.partition),
            "combine": lambda op: issue("comm", a2a, "combine", op.partition),
        }
        ops = forward_schedule(n, policy, self.several)
        issued = self._walk(prog, ops, price)
        for op, last in zip(ops, issued):  # the combines and copies
            if op.stream != COMPUTE and op.name != "dispatch":
                prog.wait("compute", last)
        if not self.several and n > 1:  # one rank: the partitions' outputs, concatenated
            prog.launch("compute", layer.rows("copy", layer.rows_sent), "concatenate")
        fixed_rest = max(host.forward_fixed_s - host.prelude_s, 0.0)
        return prog.launch("compute", layer.parts.shell_s("forward", sh.tokens, sh.d_model) / 2, "un-permute",
                           fixed_rest)

    def backward(self, prog: Program) -> int:
        layer, policy, host, a2a = self.layer, self.policy, self.host, self.a2a
        sh, n, b, Nn = layer.shape, layer.n, layer.b, layer.Nn
        D, H = sh.d_model, sh.d_hidden
        calls = backward_calls(policy, sh, self.several, self.reorder, self.keep_activation)
        per_call = host.backward_per_partition_s / self._measured_calls("backward")
        issue = self._issuer(prog, calls, per_call)
        # The measured line is fixed + per partition × n on one rank; what this engine's
        # partitions call less there (the first adds no earlier gradients, a lone one
        # copies no dx, FastMoE does not recompute act(A)) stays in the fixed part, so the
        # measured layer on one rank totals the line.
        issued = (self._measured_calls("backward", keep_activation=self.keep_activation, first=True, only=n == 1)
                  + (n - 1) * self._measured_calls("backward", keep_activation=self.keep_activation))
        fixed = host.backward_fixed_s + n * host.backward_per_partition_s - issued * per_call
        shell = layer.parts.shell_s("backward", sh.tokens, D)
        prog.launch("compute", shell / 2, "un-permute backward", fixed / 2)
        input_grad, weight_grads = layer.ffn("input_grad"), layer.ffn("weight_grads")
        if self.keep_activation and not sh.gated:
            # FastMoE kept act(A): its weight gradients skip recomputing it (read A, write h).
            weight_grads = max(weight_grads - layer.elementwise(Nn * H, 2), 0.0)
        gradients = layer.local * (D * H * (2 + sh.gated) + sh.bias * (D + H))
        accumulate = layer.elementwise(gradients, 3)

        def step(op) -> int:  # backward labels its operations by step (partitions in reverse)
            return n - 1 - op.partition

        def recover_input(op):
            if policy.recommunicate_input and not self.several:  # one rank: re-gathered into expert order
                return issue("compute", layer.rows("gather", b), "re-gather", step(op))
            if policy.recommunicate_input and self.reorder:
                return issue("compute", layer.rows("gather", Nn), "T_DI to expert order", step(op))
            return None

        def dgrad(op):
            if self.reorder:
                issue("compute", layer.rows("gather", Nn), "dy to expert order", step(op))
            last = issue("compute", input_grad, "input gradient", step(op))
            if self.reorder:
                last = issue("compute", layer.rows("gather", Nn), "dx to source order", step(op))
            return last

        def return_dx(op):
            if self.several:  # dx goes back into its rows of dx_RD, beside the weight gradients
                return issue("comm", a2a, "dx", step(op), kernels=1)
            if n > 1:         # one rank: into its rows of dx_RD (a lone partition's dx is dx_RD)
                return issue("compute", layer.rows("copy", b), "dx", step(op))
            return None

        def wgrad(op):
            last = issue("compute", weight_grads, "weight gradients", step(op))
            if step(op):
                last = issue("compute", accumulate, "accumulate gradients", step(op))
            return last

        price = {
            "fetch_dy": lambda op: issue("comm", a2a, "dy", step(op), kernels=1),
            "regather": lambda op: issue("compute", layer.rows("gather", b), "re-gather", step(op)),
            "redispatch": lambda op: issue("comm", a2a, "re-dispatch", step(op), kernels=1),
            "restore_input": lambda op: issue("copy", layer.host_copy("h2d", D), "restore T_DI", step(op),
                                              kernels=1),
            "restore_preactivation": lambda op: issue("copy", layer.host_copy("h2d", sh.pre_activation_width),
                                                      "restore A", step(op), kernels=1 + sh.gated),
            "recover_input": recover_input,
            "recompute": lambda op: issue("compute", layer.ffn("gemm1"), "recompute A", step(op)),
            "dgrad": dgrad,
            "return_dx": return_dx,
            "wgrad": wgrad,
        }
        ops = backward_schedule(n, policy, self.several)
        for op, last in zip(ops, self._walk(prog, ops, price)):
            if op.name == "return_dx" and op.stream != COMPUTE:
                prog.wait("compute", last)
        prog.wait_stream("compute", "comm")
        prog.wait_stream("compute", "copy")
        # Each token sums its K rows of dx (DispatchPlan.sum_rows_per_token): one gather, one sum.
        prog.launch("compute", layer.rows("gather", layer.rows_sent) + layer.elementwise(sh.tokens * D, sh.top_k + 1),
                    "sum dx per token")
        return prog.launch("compute", shell / 2, "router backward", fixed / 2)


def fastermoe_steps(ranks: int, group_size: int = 4) -> int:
    return -(-ranks // min(group_size, ranks))


def _check(engine: str, partitions: int, strategy: str) -> None:
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r} is invalid: choose one of {', '.join(ENGINES)}")
    _positive_int("simulate_layer", "partitions", partitions)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is invalid: choose one of {', '.join(STRATEGIES)}")


def _host_cost(parts, engine: str, strategy: str, local_experts: int):
    """The host cost line the engine's schedule is charged. FastMoE and FasterMoE were
    measured at their one partition on one GPU: that total, and each further partition
    (FasterMoE's steps on several ranks) adds what a further MPipeMoE partition adds —
    the same pipeline code."""
    if engine == "mpipemoe":
        return parts.host_cost(f"mpipemoe|{strategy}", local_experts)
    base, slope = parts.host_cost(engine, local_experts), parts.host_cost("mpipemoe|none", local_experts)
    return replace(base, forward_fixed_s=base.forward_s(1) - slope.forward_per_partition_s,
                   forward_per_partition_s=slope.forward_per_partition_s,
                   backward_fixed_s=base.backward_s(1) - slope.backward_per_partition_s,
                   backward_per_partition_s=slope.backward_per_partition_s)


def _build(engine: str, shape: LayerShape, cluster: Cluster, parts, partitions: int, strategy: str,
           group_size: int, split: str = "tokens"):
    """(schedule object, layer, partitions, strategy) as the engine runs them."""
    W = cluster.layout.ranks
    if engine == "fastmoe":
        layer, partitions, strategy = _Layer(shape, cluster, parts, 1), 1, "none"
    elif engine == "fastermoe":
        partitions, strategy = fastermoe_steps(W, group_size), "none"
        layer = _FasterLayer(shape, cluster, parts, partitions, min(group_size, W))
    elif split == "peers":  # MPipeMoE on FasterMoE's partitions: groups of W/n peers
        if W % partitions:
            raise ValueError(f"partitions={partitions} is invalid with split='peers': give a divisor of the "
                             f"{W} ranks of the expert group")
        layer = _FasterLayer(shape, cluster, parts, partitions, W // partitions)
    else:
        layer = _Layer(shape, cluster, parts, partitions)
    if W > 1 and layer.n > 1:  # layers.py: partitions overlap communication, the GEMMs leave it SMs
        layer.gemm_scale = carve_out_scale(parts, cluster.comm_sms)
    host = _host_cost(parts, engine, strategy, layer.local)
    return _Pipelined(layer, strategy, host, keep_activation=engine == "fastmoe"), layer, partitions, strategy


def _memory(engine: str, shape: LayerShape, cluster: Cluster, layer: _Layer, partitions: int, strategy: str):
    received = layer.rows_received_total if isinstance(layer, _FasterLayer) else layer.Nn * layer.n
    return predict_memory(shape.config(), shape.tokens, cluster.layout.ranks, partitions, strategy, engine=engine,
                          dtype=shape.torch_dtype(), rows_received=round(received))


# SMs of the GPUs whose parts the simulator reads (GpuParts.device), for the SM carve-out.
SM_COUNTS = {"NVIDIA H200": 132, "NVIDIA H100 80GB HBM3": 132, "NVIDIA A100-SXM4-80GB": 108}


def carve_out_scale(parts, comm_sms: int) -> float:
    """How much longer the expert GEMMs of a pipelined pass take than the parts' (measured
    on every SM): the engine runs them with `comm_sms` SMs left to the communication kernels
    (layers.py, StreamSet.reserving_sms), so a GEMM that fills the GPU gets SMs / (SMs -
    comm_sms) of its time. 1 where the parts' GPU is not in SM_COUNTS."""
    sms = SM_COUNTS.get(getattr(parts, "device", ""), 0)
    if not sms or comm_sms <= 0:
        return 1.0
    return sms / max(sms - comm_sms, 1)


def _carved_slowdown(slowdown: dict, scale: float) -> dict:
    """The parts' factors with compute-beside-communication made relative to a carved GEMM:
    it was measured carved against a GEMM alone on every SM (perf_model._slowdowns)."""
    if scale == 1.0 or "compute|comm" not in slowdown:
        return slowdown
    return {**slowdown, "compute|comm": max(1.0, slowdown["compute|comm"] / scale)}


def simulate_layer(engine: str, shape: LayerShape, cluster: Cluster, parts, partitions: int = 1,
                   strategy: str = "none", group_size: int = 4, split: str = "tokens") -> LayerResult:
    """Forward+backward of one layer of `engine` on the busiest rank of `cluster`.

    mpipemoe: `partitions`, `strategy` and `split` as given (split "peers": FasterMoE's
    partitions, groups of W/n peers, with the strategy's restores). fastmoe: one partition, keep
    everything (act(A) too). fastermoe: ceil(W / group_size) steps, step s exchanging
    with the ring offsets s·g … s·g+g−1 (layers.FasterMoE), keep everything.
    """
    _check(engine, partitions, strategy)
    if split not in SEARCH_SPLITS:
        raise ValueError(f"split={split!r} is invalid: give 'tokens' or 'peers'")
    split = split if engine == "mpipemoe" else "peers" if engine == "fastermoe" else "tokens"
    schedule, layer, partitions, strategy = _build(engine, shape, cluster, parts, partitions, strategy, group_size,
                                                   split)
    prog = Program()
    forward_end = schedule.forward(prog)
    schedule.backward(prog)
    timeline = run_schedule(prog.ops, _carved_slowdown(parts.slowdown, layer.gemm_scale))
    forward_s = timeline.finish_s[forward_end]
    memory = _memory(engine, shape, cluster, layer, partitions, strategy)
    full = _Layer(shape, cluster, parts, 1)
    return LayerResult(engine, partitions, strategy, forward_s, timeline.makespan_s - forward_s,
                       memory.peak_bytes, memory.host_bytes, timeline.busy_s,
                       all_to_all_s=full.all_to_all(full.b), leaving_node=full.traffic.leaving_node,
                       host_waits=prog.host_waits, split=split)


def all_to_all_options(shape: LayerShape, cluster: Cluster, parts) -> dict:
    """One All-to-All of the whole batch (K·T rows per rank): flat and hierarchical
    seconds, and the fraction of rows that leaves the node."""
    layer = _Layer(shape, cluster, parts, 1)
    if cluster.layout.ranks == 1:  # one rank has no All-to-All
        return {"flat_s": 0.0, "hierarchical_s": 0.0, "leaving_node": 0.0}
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
    chosen: LayerResult           # MPipeMoE as "auto" runs it: fastest n, then the fastest choice,
                                  # or a restore strategy that lowers the peak for <= SAVING_SLACK more
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
        quickest = min(options, key=lambda r: r.total_s)
        saving = [r for r in options if r.strategy != "none" and r.peak_bytes < keep.peak_bytes
                  and r.total_s <= (1 + SAVING_SLACK) * quickest.total_s]
        by_n[n] = min(saving, key=lambda r: r.total_s) if saving else quickest
    best_time = min(r.total_s for r in by_n.values())
    chosen = by_n[max(n for n, r in by_n.items() if r.total_s <= best_time * (1 + tolerance))]
    return EngineChoice(simulate_layer("fastmoe", shape, cluster, parts),
                        simulate_layer("fastermoe", shape, cluster, parts, group_size=group_size),
                        fastest, chosen, grid)


# -- a training step of a whole MoE transformer ------------------------------------------------------

@dataclass(frozen=True)
class ModelShape:
    """A MoE transformer as lm.model builds it: every block is pre-LN attention and a MoE layer."""

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
        """Expert parameters on one rank (its E / W experts in every layer)."""
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
    all_reduce_s: float        # dense gradients in float32 (DDP all-reduce or FSDP2 reduce-scatter)
    optimizer_s: float
    peak_bytes: int
    state_bytes: int           # float32 master parameters, gradients, AdamW moments + compute copy
    activation_bytes: int      # saved for backward over all layers
    micro_batches: int = 1
    exposed_reduction_s: float = 0.0  # the part of all_reduce_s the last backward did not hide
    small_collectives_s: float = 0.0  # the losses' and the gradient norm's all-reduces
    expert_parallel: int = 1          # P: the ranks of one expert group (W: no expert replicas)
    expert_reduction_s: float = 0.0   # expert gradients in float32 over the W / P replicas, after the backward
    host_s: float = 0.0               # the MoE layers' host issue cost (their busy host), in moe_s


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
                  strategy: str = "none", group_size: int = 4, dtype_bytes: int = 2,
                  shard_dense: bool = False, micro_batches: int = 1, overlap_reduction: bool = False,
                  expert_parallel: int | None = None, split: str = "tokens") -> StepResult:
    """One training step (forward, backward, gradient all-reduce, AdamW) on the busiest rank,
    trained as ``workers/loop.py`` does: float32 master weights, compute in ``dtype_bytes``.

    ``tokens`` per rank per step in ``micro_batches`` micro-batches, each priced at its
    share of the tokens, one after another (the sequential schedule). ``overlap_reduction``:
    the dense gradients' reduction runs beside the last micro-batch's backward, as DDP's
    buckets do (and `mpipemoe bench --step` models): it starts once the first bucket is
    ready (after the head's and the last block's backward) and only what outlasts the rest
    of that backward is exposed; without it the reduction follows the backward (the
    simulator's earlier, serial price). The step's two small collectives (losses, norm) are
    priced by the network model.

    ``expert_parallel``: the expert-parallel degree P (None: W). The MoE layers run on one
    expert group (P consecutive ranks: inside a node when P <= G, so their All-to-Alls use
    NVLink only), each rank holding E / P experts; the expert gradients (float32) are then
    all-reduced over the W / P ranks holding the same experts (one per node when P >= G),
    after the backward as ``DenseParallel.finish_gradients`` does (``expert_reduction_s``,
    never hidden).

    The MoE layer is simulated (simulate_layer) and repeated per block; the dense parts are
    their FLOPs at the GPU's GEMM rate (attention kernels assumed at that rate too) plus
    four passes over the activations for norms and residuals; the dense gradients are
    reduced in float32 (the same bytes for DDP's all-reduce and FSDP2's reduce-scatter +
    all-gather); AdamW is memory-bound on float32 state (28 bytes moved per parameter).
    Memory: float32 parameters, gradients and both AdamW moments (16 bytes per parameter;
    the dense part divided by the ranks under ``shard_dense``) plus a compute-dtype copy of
    the parameters, each block's saved activations (attention: 7·T·D values and the softmax
    statistics; MoE: memory.predict_memory), the largest MoE working set and the logits.
    """
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1 \
            or tokens % micro_batches:
        raise ValueError(f"micro_batches={micro_batches!r} is invalid: give a count >= 1 that divides tokens={tokens}")
    K = micro_batches
    W = cluster.layout.ranks
    group_layout, replica_layout = expert_group_layouts(cluster.layout, expert_parallel)
    P = group_layout.ranks
    if model.num_experts % P:
        raise ValueError(f"ModelShape.num_experts={model.num_experts} is not a multiple of the expert-parallel degree "
                         f"{P}: use {EXPERT_PARALLEL_FLAG} "
                         f"{', '.join(str(p) for p in expert_degrees(cluster.layout) if model.num_experts % p == 0)}")
    expert_cluster = replace(cluster, layout=group_layout)
    layer_shape = model.layer(tokens // K)
    moe = simulate_layer(engine, layer_shape, expert_cluster, parts, partitions, strategy, group_size, split)
    D, T, S = model.d_model, tokens // K, model.seq_len
    rate = dense_flops_per_s(parts, D, model.d_hidden, T)
    bandwidth = memory_bytes_per_s(parts, D)
    attention = 2 * T * 4 * D * D + 4 * T * S * D * (0.5 if model.causal else 1.0)
    elementwise = 4 * 2 * T * D * dtype_bytes / bandwidth
    head = 2 * T * D * model.vocab_size
    dense = model.num_layers * (3 * attention / rate + 3 * elementwise) + 3 * head / rate
    params = model.replicated_params + model.expert_params(P)
    reduce = all_reduce_s(cluster.network, cluster.layout, model.replicated_params * 4) if W > 1 else 0.0
    expert_reduce = all_reduce_s(cluster.network, replica_layout, model.expert_params(P) * 4)
    dense_here = -(-model.replicated_params // W) if shard_dense else model.replicated_params
    master = dense_here + model.expert_params(P)
    optimizer = 28 * master / bandwidth
    memory = _memory(moe.engine, layer_shape, expert_cluster,
                     _build(engine, layer_shape, expert_cluster, parts, partitions, strategy, group_size,
                            moe.split)[1],
                     moe.partitions, moe.strategy)
    attention_saved = 7 * T * D * dtype_bytes + T * model.num_heads * 4
    activations = model.num_layers * (attention_saved + memory.saved_bytes)
    state = 16 * master + (params * dtype_bytes if dtype_bytes != 4 else 0)
    working = max(memory.forward_working_bytes, memory.backward_working_bytes)
    peak = state + activations + working + T * model.vocab_size * 4
    small = 2 * small_collective_s(cluster.network, cluster.layout) if W > 1 else 0.0
    exposed = reduce
    if overlap_reduction:
        backward = model.num_layers * (moe.backward_s + 2 * attention / rate + 2 * elementwise) + 2 * head / rate
        first_bucket = (backward - 2 * head / rate) / model.num_layers + 2 * head / rate
        exposed = max(0.0, reduce - (backward - first_bucket))
    step = K * (model.num_layers * moe.total_s + dense) + exposed + expert_reduce + optimizer + small
    return StepResult(engine, moe.partitions, moe.strategy, step, K * model.num_layers * moe.total_s, K * dense, reduce,
                      optimizer, peak, state, activations, K, exposed, small, P, expert_reduce,
                      K * model.num_layers * moe.busy_s["host"])
