"""The MoE-layer benchmark of `mpipemoe bench` (app/commands/bench.py): every engine side by side
in one process on the same inputs and parameters (docs/design.md §7).

For each (model, tokens) it times forward+backward of FastMoE, FasterMoE, MPipeMoE
with partitions="auto" and strategy="auto" (after its online search settles), an
exhaustive grid of MPipeMoE over partitions × strategies, the dense-GEMM floor of the
same routed work and, with --peers, other libraries' layers on the same inputs and
weights (app/bench/peers.py). All of a point's layers are
timed together in interleaved rounds (`--rounds`, each a warm-up and `--repeats` timed
steps of every layer in turn) and each one's time is the median over rounds, so a
slow spell of the machine falls on every engine alike. It measures peak memory
(CUDA), the expert FFN's GEMM rate against one dense GEMM of the same total shape,
and the performance model's predictions. Records are JSON (and a Markdown table
beside them), and MLflow runs (tag kind=bench) when MLflow is installed.
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from app.bench.parts import (FASTERMOE_GROUP_SIZE, chosen_setting, layer_inputs, markdown_head, peak_memory_bytes,
                             point_config)
from app.bench.stack import CHECKPOINTING, DEFAULT_BUDGET_SHARE, bench_stack_point, progress_line, stack_markdown
from app.bench.shapes import DTYPES, LAYER_SHAPES
from app.bench.peers import build_peer, check_peers, dense_floor_step, peer_summary, peer_table, require_peers
from app.bench.routing_replay import check_routing
from app.tracking.records import DEFAULT_OUT_DIR, BenchPoint, BenchResult, RecordMeta, record_meta
from app.tracking.run_kinds import BENCH, BENCH_SUMMARY, kind_tags
from app.bench.timeline import device_busy_ms, record_trace, trace_name, trace_step
from app.tracking.store import RunLogger, resolve_tracking_uri
from moe_engine import FastMoE, FasterMoE, MoEConfig, MPipeMoE, build_layer
from moe_engine.comm import ExpertGroup
from moe_sim.emulation import FREE_TRANSFER_COPY, EmulatedCluster, EmulatedExpertGroup
from moe_engine.experts import Experts, ExpertSegments
from moe_engine.granularity import GranularitySearch
from moe_engine.memory import HostBufferPool, predict_memory
from moe_engine.perf_model import PerformanceModel, calibrate, device_name
from moe_engine.router import count_ids
from moe_engine.timing import Stopwatch, synchronize, time_fn, time_interleaved

# uniform: random inputs through a random router (about 1/E of the rows per expert);
# skewed: half of each rank's tokens pick expert 0 first (it receives about a third of the rows);
# replay:FILE: the loads a training run logged (`mpipemoe routing`; app/bench/routing_replay.py).
ROUTINGS = ("uniform", "skewed", "replay:FILE")


@dataclass
class BenchSettings:
    models: list
    tokens: list
    num_experts: int = 8
    top_k: int = 2
    activation: str = "gelu"
    dtype: str = "auto"
    partitions: tuple = (1, 2, 4, 8)
    strategies: tuple = ("none", "S1", "S2", "S3", "S4")
    grid: bool = True
    warmup: int = 1
    repeats: int = 3
    rounds: int = 5
    world_size: int = 1
    routings: tuple = ("uniform",)
    bias: bool = True       # expert FFN biases b1, b2 (MoEConfig.bias); --no-bias drops them
    peers: tuple = ()       # other libraries' layers timed beside ours (app/bench/peers.py)
    emulate: str | None = None  # NODESxGPUS: one process as rank 0 of that cluster (moe_sim/emulation.py)
    network: str = "dgx-a100"   # the emulated cluster's network (moe_sim/network.py presets, or a JSON file)
    transfer_ctas: int = 1      # thread blocks each emulated transfer holds (EmulatedCluster.transfer_ctas)
    comm_sms: int | None = None  # SMs the emulated cluster's GEMMs leave to communication (default: NCCL's 16)
    trace: str | None = None    # a folder: one torch.profiler timeline per engine and setting (app/bench/timeline.py)
    layers: int = 1             # > 1: time stacks of residual layers, setting by setting (app/bench/stack.py)
    checkpointing: str | None = None  # stacks: off, on or both (default both)
    memory_budget_share: float | None = None  # stacks: auto@budget's budget, a share of the reference's memory
    memory_budget_gib: float | None = None    # ... or in GiB

    def __post_init__(self):
        for m in self.models:
            if m not in LAYER_SHAPES:
                raise ValueError(f"--model {m!r} is unknown: choose from {', '.join(LAYER_SHAPES)}")
        if not self.tokens or any(t < 1 for t in self.tokens):
            raise ValueError(f"--tokens {self.tokens} is invalid: give positive token counts, e.g. 4096,8192")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r} is invalid: choose auto, bf16, fp16 or fp32")
        for routing in self.routings:
            check_routing(routing)  # uniform, skewed or replay:FILE
        for name in ("repeats", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} {getattr(self, name)} is invalid: give at least 1")
        if self.warmup < 0:
            raise ValueError(f"--warmup {self.warmup} is invalid: give 0 or more")
        if self.num_experts % self.world_size:
            raise ValueError(f"--experts {self.num_experts} must be a multiple of --world-size {self.world_size}")
        cluster = self.emulated_cluster()
        if cluster is not None:
            if self.world_size != 1:
                raise ValueError(f"--emulate {self.emulate} runs one process as rank 0 of the emulated cluster: "
                                 f"drop --world-size {self.world_size} (or drop --emulate to use real ranks)")
            if self.peers:
                raise ValueError(f"--emulate cannot time --peers {','.join(self.peers)}: other libraries' layers do "
                                 f"not run on the emulated group; drop --peers or --emulate")
            if self.num_experts % cluster.ranks:
                raise ValueError(f"--experts {self.num_experts} must be a multiple of the {cluster.ranks} emulated "
                                 f"ranks of --emulate {self.emulate}: give e.g. --experts "
                                 f"{cluster.ranks * max(1, self.num_experts // cluster.ranks)}")
        elif self.comm_sms is not None:
            raise ValueError(f"--comm-sms {self.comm_sms} sets the SMs an emulated cluster leaves to communication: "
                             f"give --emulate NODESxGPUS too (real ranks leave NCCL what NCCL_MAX_CTAS says)")
        check_peers(self.peers, activation=self.activation, bias=self.bias, world_size=self.world_size)
        self._check_stack()

    def _check_stack(self) -> None:
        if self.layers < 1:
            raise ValueError(f"--layers {self.layers} is invalid: give 1 or more")
        stack_options = [f"--{name.replace('_', '-')}" for name in ("checkpointing", "memory_budget_share",
                                                                    "memory_budget_gib")
                         if getattr(self, name) is not None]
        if self.layers == 1:
            if stack_options:
                raise ValueError(f"{' and '.join(stack_options)} time stacks of layers: give --layers L (L >= 2)")
            return
        if self.checkpointing is None:
            self.checkpointing = "both"
        if self.checkpointing not in CHECKPOINTING:
            raise ValueError(f"--checkpointing {self.checkpointing!r} is invalid: choose {', '.join(CHECKPOINTING)}")
        for option in ("emulate", "trace"):
            if getattr(self, option) is not None:
                raise ValueError(f"--{option} times single layers: drop it or drop --layers {self.layers}")
        if self.memory_budget_share is not None and self.memory_budget_gib is not None:
            raise ValueError("give one of --memory-budget-share and --memory-budget-gib")
        for name, value in (("share", self.memory_budget_share), ("gib", self.memory_budget_gib)):
            if value is not None and not value > 0:
                raise ValueError(f"--memory-budget-{name} {value} is invalid: give a number > 0")

    def budgeted(self) -> bool:
        """Whether a stacked bench times auto@budget: a budget was given, or a peer runs."""
        return bool(self.peers) or self.memory_budget_share is not None or self.memory_budget_gib is not None

    def budget_share(self) -> float:
        return DEFAULT_BUDGET_SHARE if self.memory_budget_share is None else self.memory_budget_share

    def emulated_cluster(self) -> EmulatedCluster | None:
        if self.emulate is None:
            return None
        try:
            return EmulatedCluster.parse(self.emulate, self.network, transfer_ctas=self.transfer_ctas,
                                         **({} if self.comm_sms is None else {"comm_sms": self.comm_sms}))
        except ValueError as error:
            raise ValueError(f"--emulate {self.emulate!r} --network {self.network!r}: {error}") from None

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]


# -- measuring one engine -------------------------------------------------------------------------

def _step(layer, x, grad_y):
    layer.zero_grad(set_to_none=True)
    x_in = x.detach().requires_grad_(True)
    y, aux = layer(x_in)
    torch.autograd.backward([y, aux], [grad_y, torch.ones_like(aux)])


def settle_and_measure_memory(layer, x, grad_y, device) -> dict:
    """Lets an automatic layer's search settle, then its peak memory above parameters and
    inputs for one forward+backward (None off CUDA)."""
    if isinstance(layer, MPipeMoE) and layer.partitions == "auto":
        for _ in range(60):  # let the online search settle on an n
            _step(layer, x, grad_y)
            if layer.search.active is None and layer.search.cache:
                break
    _step(layer, x, grad_y)
    synchronize(device)
    layer.zero_grad(set_to_none=True)
    return {"peak_memory_bytes": peak_memory_bytes(lambda: _step(layer, x, grad_y), device)}


# The host probe: the same layer at so few tokens that the device has almost nothing to do,
# so its time is the host's cost of issuing the layer (what the simulator's host term is).
HOST_PROBE_TOKENS = 64


def probe_inputs(x: torch.Tensor, grad_y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HOST_PROBE_TOKENS of the point's tokens, spread over the batch (its routing mix)."""
    stride = max(1, x.shape[0] // HOST_PROBE_TOKENS)
    return x[::stride][:HOST_PROBE_TOKENS].contiguous(), grad_y[::stride][:HOST_PROBE_TOKENS].contiguous()


def time_layers(layers: list, probed: list, x, grad_y, settings: BenchSettings, device,
                extra: tuple = ()) -> list[dict]:
    """Forward+backward time of every layer, timed in interleaved rounds (timing.time_interleaved):
    the median over rounds and the spread between rounds; for the layers marked in `probed`
    also the host probe, timed in the same rounds right after its layer (`host_probe_ms`), so
    both see the machine in the same state. `extra` callables (the dense floor) are timed in
    the same rounds; their results follow the layers'."""
    x_probe, grad_probe = probe_inputs(x, grad_y)
    fns, slots = [], []
    for layer, probe in zip(layers, probed):
        fns.append(lambda layer=layer: _step(layer, x, grad_y))
        slots.append((len(fns) - 1, len(fns) if probe else None))
        if probe:
            fns.append(lambda layer=layer: _step(layer, x_probe, grad_probe))
    for fn in extra:
        fns.append(fn)
        slots.append((len(fns) - 1, None))
    timings = time_interleaved(fns, device, rounds=settings.rounds, warmup=settings.warmup, repeats=settings.repeats)
    results = []
    for main, probe in slots:
        result = {"fwd_bwd_ms": timings[main].median_ms, "fwd_bwd_ms_std": timings[main].spread_s * 1e3}
        if probe is not None:
            result.update(host_probe_ms=timings[probe].median_ms, host_probe_tokens=HOST_PROBE_TOKENS)
        results.append(result)
    return results


def expert_ffn(config: MoEConfig, experts: Experts, counts: list, device, dtype):
    """A callable running the expert FFN forward + backward on sum(counts) rows, counts[e]
    of them for local expert e, with the engines' own kernels."""
    rows = sum(counts)
    x = torch.randn(rows, config.d_model, device=device, dtype=dtype)
    dy = torch.randn_like(x)

    segments = ExpertSegments.from_counts(counts, device)

    def run():
        A = experts.project_in(x, segments)
        experts.project_out(experts.activate(A), segments)
        experts.backward(x, A, dy, segments, experts.grads())
    return run


def expert_gemm_efficiency(config: MoEConfig, tokens: int, local_experts: int, device, dtype, settings) -> dict:
    """Grouped expert FFN (forward + backward) against one dense GEMM chain of the same total rows."""
    rows = config.top_k * tokens
    grouped = Experts(config, local_experts, device=device, dtype=dtype)
    dense = Experts(config, 1, device=device, dtype=dtype)
    counts = [rows // local_experts + (1 if i < rows % local_experts else 0) for i in range(local_experts)]
    grouped_s = time_fn(expert_ffn(config, grouped, counts, device, dtype), device,
                        settings.warmup, settings.repeats).mean_s
    dense_s = time_fn(expert_ffn(config, dense, [rows], device, dtype), device,
                      settings.warmup, settings.repeats).mean_s
    flops = 3 * 2 * rows * config.d_model * (grouped.pre_activation_width + config.d_hidden)
    return {"expert_ffn_ms": grouped_s * 1e3, "dense_ffn_ms": dense_s * 1e3,
            "expert_tflops": flops / grouped_s / 1e12, "dense_tflops": flops / dense_s / 1e12,
            "expert_gemm_efficiency": dense_s / grouped_s}


def busiest_rank_first(router_weight: torch.Tensor, x: torch.Tensor, ranks: int, top_k: int) -> None:
    """In place: swaps router rows so that the rank receiving the most rows of `x` is rank 0.

    An emulated cluster times rank 0 (docs/emulation.md); a real step waits for its busiest
    rank, and the simulator prices that one, so rank 0 must be it. Every rank's experts start
    alike (random), so which rank holds which router rows changes nothing else."""
    with torch.no_grad():
        local = router_weight.shape[0] // ranks
        ids = torch.topk(x @ router_weight.t(), top_k, dim=-1).indices.flatten()
        per_rank = count_ids(ids, router_weight.shape[0]).view(ranks, local).sum(1)
        hot = int(per_rank.argmax())
        if hot:
            rows = router_weight[hot * local:(hot + 1) * local].clone()
            router_weight[hot * local:(hot + 1) * local] = router_weight[:local]
            router_weight[:local] = rows


def pipeline_stages(config: MoEConfig, x: torch.Tensor, router_weight: torch.Tensor, group: ExpertGroup,
                    device, dtype, settings: BenchSettings) -> dict:
    """The two stages MPipeMoE overlaps, each timed alone on this (model, tokens, routing),
    slowest rank's figure (it sets the layer's time):

    all_to_all_ms: the layer's four All-to-Alls of the routed rows (dispatch and combine,
                   forward and backward) with the real per-rank split sizes;
    expert_ms:     the expert FFN forward + backward on the rows this rank receives;
    hot_expert_share: the busiest expert's share of all routed rows;
    expert_load:      every expert's share of all routed rows (what the simulator's
                      validation routes by).
    """
    with torch.no_grad():
        expert_ids = torch.topk(x @ router_weight.t(), config.top_k, dim=-1).indices.flatten()
    local = config.experts_per_rank(group.size)
    rows_per_expert = count_ids(expert_ids, config.num_experts)  # this rank's rows for each expert
    send_counts = rows_per_expert.view(group.size, local)
    recv_counts = group.exchange_counts(send_counts)  # [source rank, local expert]
    send_splits, recv_splits = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
    send = torch.randn(sum(send_splits), config.d_model, device=device, dtype=dtype)
    recv = torch.empty(sum(recv_splits), config.d_model, device=device, dtype=dtype)

    def four_all_to_alls():
        for _ in range(2):  # forward, backward
            group.all_to_all(recv, send, recv_splits, send_splits)  # dispatch (or its gradient's return)
            group.all_to_all(send, recv, send_splits, recv_splits)  # combine

    a2a_s = time_fn(four_all_to_alls, device, settings.warmup, settings.repeats).mean_s
    experts = Experts(config, local, device=device, dtype=dtype)
    expert_s = time_fn(expert_ffn(config, experts, recv_counts.sum(0).tolist(), device, dtype), device,
                       settings.warmup, settings.repeats).mean_s
    all_rows_per_expert = group.all_reduce_sum(rows_per_expert)
    slowest = group.all_reduce_max(torch.tensor([a2a_s, expert_s], device=device, dtype=torch.float64))
    return {"all_to_all_ms": float(slowest[0]) * 1e3, "expert_ms": float(slowest[1]) * 1e3,
            "hot_expert_share": float(all_rows_per_expert.max() / all_rows_per_expert.sum()),
            "expert_load": [round(v, 5) for v in (all_rows_per_expert / all_rows_per_expert.sum()).tolist()]}


def bench_point(model: str, tokens: int, routing: str, settings: BenchSettings, group: ExpertGroup, device,
                log) -> list:
    config, dtype = point_config(model, settings, device)
    d_model, d_hidden = config.d_model, config.d_hidden
    torch.manual_seed(0)
    source = FastMoE(config, group, device=device, dtype=dtype)
    x = layer_inputs(tokens, source.router.weight.detach(), routing, settings.top_k)
    if isinstance(group, EmulatedExpertGroup):
        busiest_rank_first(source.router.weight.detach(), x, group.size, settings.top_k)
    grad_y = torch.randn_like(x)
    profile = calibrate(config, tokens, group, device, dtype, repeats=3)
    model_of_time = PerformanceModel(profile)
    # One pinned-host pool for all MPipeMoE variants: they stay alive together for the
    # interleaved timing, and each would otherwise keep its own offload buffers.
    host_pool = HostBufferPool()
    # An emulated group answers FasterMoE's count exchange by its peer steps (emulation.py).
    faster_group = group.for_peer_steps(FASTERMOE_GROUP_SIZE) if isinstance(group, EmulatedExpertGroup) else group
    variants = [("fastmoe", "baseline", lambda: build_layer("fastmoe", config, group, device=device, dtype=dtype)),
                ("fastermoe", "baseline", lambda: build_layer("fastermoe", config, faster_group,
                                                              group_size=FASTERMOE_GROUP_SIZE, device=device,
                                                              dtype=dtype)),
                ("mpipemoe", "auto", lambda: build_layer("mpipemoe:auto:auto", config, group, profile=profile,
                                                         search=GranularitySearch(candidates=settings.partitions),
                                                         host_pool=host_pool, device=device, dtype=dtype))]
    if settings.grid:
        variants += [("mpipemoe", "grid", lambda n=n, s=s: build_layer(f"mpipemoe:{n}:{s}", config, group,
                                                                       host_pool=host_pool, device=device,
                                                                       dtype=dtype))
                     for n in settings.partitions for s in settings.strategies]
    # measured_rows: each layer's `last_rows` after its measured pass (the host probe's passes
    # below, at 64 tokens, overwrite them); None for peers and the floor.
    layers, memories, measured_rows = [], [], []
    for _, _, build in variants:
        layer = build()
        layer.load_state_dict(source.state_dict())
        memories.append(settle_and_measure_memory(layer, x, grad_y, device))
        measured_rows.append(getattr(layer, "last_rows", None))
        layers.append(layer)
    # Peers (app/bench/peers.py) copy the source's weights into their own layout themselves.
    for peer in settings.peers:
        variants.append((peer, "peer", None))
        layers.append(build_peer(peer, config, source, device, dtype))
        memories.append(settle_and_measure_memory(layers[-1], x, grad_y, device))
    floor = dense_floor_step(config, tokens, device, dtype)
    floor()
    floor_memory = {"peak_memory_bytes": peak_memory_bytes(floor, device)}
    # The automatic layer is not probed: a pass at another token count would start its search
    # there. Its record takes the probe of the grid layer it settled on. Peers are not probed
    # (the probe is for the simulator, which models our engines only).
    times = time_layers(layers, [chosen_by not in ("auto", "peer") for _, chosen_by, _ in variants], x, grad_y,
                        settings, device, extra=(floor,))
    variants.append(("dense-floor", "floor", None))
    memories.append(floor_memory)
    records = []
    measured_rows += [None] * (len(variants) - len(measured_rows))
    for (engine, chosen_by, _), layer, memory, timing, rows in zip(variants, layers + [None], memories, times,
                                                                   measured_rows):
        n, strategy = chosen_setting(layer)
        # The model on the rows this rank actually sent and received in the measured pass
        # (under skew the busiest rank's, which an emulated rank 0 is), not the balanced k·T.
        rows_sent, rows_received, largest_partition = rows or (None, None, None)
        predicted_memory = None if chosen_by in ("peer", "floor") else predict_memory(
            config, tokens, group.size, n if engine != "fastmoe" else 1, strategy, engine=engine,
            dtype=dtype, rows_sent=rows_sent, rows_received=rows_received,
            largest_partition_received=largest_partition).peak_bytes
        record = {"engine": engine, "model": model, "tokens": tokens, "routing": routing, "world_size": group.size,
                  "device": device_name(device), "dtype": str(dtype).replace("torch.", ""),
                  "partitions": n, "strategy": strategy, "chosen_by": chosen_by, **timing, **memory,
                  "predicted_memory_bytes": predicted_memory,
                  **({"rows_sent": rows_sent, "rows_received": rows_received,
                      "largest_partition_received": largest_partition} if rows_sent is not None else {}),
                  "d_model": d_model, "d_hidden": d_hidden, "num_experts": settings.num_experts,
                  "top_k": settings.top_k, "activation": settings.activation, "bias": settings.bias,
                  **group_fields(group)}
        if engine == "mpipemoe":
            record["predicted_fwd_bwd_ms"] = 1e3 * model_of_time.predict(config, tokens, group.size, n, strategy,
                                                                         dtype).total_s
            if chosen_by == "auto":
                record["search_decisions"] = layer.search.decisions
        records.append(record)
    for record in records:
        if record["chosen_by"] == "auto":
            twin = next((r for r in records if r["chosen_by"] == "grid" and r["partitions"] == record["partitions"]
                         and r["strategy"] == record["strategy"]), None)
            if twin:
                record.update(host_probe_ms=twin["host_probe_ms"], host_probe_tokens=twin["host_probe_tokens"])
    emulated = isinstance(group, EmulatedExpertGroup)
    if emulated:
        add_own_pass_stages(records, layers, x, grad_y, settings, device)
    # Every record of an emulated point carries its timeline's account (trace files kept with --trace).
    traced = layers + [None] if settings.trace or emulated else []  # the dense floor is not traced
    del layers, floor
    if device.type == "cuda":
        torch.cuda.empty_cache()
    efficiency = expert_gemm_efficiency(config, tokens, config.experts_per_rank(group.size), device, dtype, settings)
    stages = pipeline_stages(config, x, source.router.weight.detach(), group, device, dtype, settings)
    for record in records:
        record.update(efficiency, **stages, **group_fields(group))
    add_overlap_account(records)
    if traced:
        if settings.trace:
            trace_records(records, traced, x, grad_y, settings.trace, device)
        else:
            with tempfile.TemporaryDirectory() as scratch:
                trace_records(records, traced, x, grad_y, scratch, device, keep_files=False)
    del traced
    for record in records:  # logged whole: a run stopped later keeps every finished point
        log(record)
    return records


def group_fields(group: ExpertGroup) -> dict:
    """What a record says about how its collectives were made: measured on real ranks, or rank
    0 of an emulated cluster (with the emulated wait's measured dilation)."""
    if not isinstance(group, EmulatedExpertGroup):
        return {"measured_as": "measured"}
    fields = group.cluster.record_fields()
    if group.dilation is not None:
        fields.update(emulated_wait_dilation_alone=group.dilation["alone"],
                      emulated_wait_dilation_beside_gemms=group.dilation["beside_gemms"])
    return fields


# -- the bound: stages of the record's own pass --------------------------------------------------

OWN_PASS = "own pass"      # bound_stages: the record's own pass, its transfers priced and then freed
TIMED_ALONE = "timed alone"  # the point's two stages, each timed alone (real ranks: no transfer can be freed)
BOUND_TOLERANCE = 0.98     # a pass below this share of its own-pass bound: the stages were not floors


def _phased_pass(layer, x, grad_y, device) -> tuple[float, float]:
    """Local. One forward+backward of `layer`: the seconds of its forward and of the whole pass,
    both timed inside the pass (nothing waits between the phases)."""
    forward, whole = Stopwatch(device), Stopwatch(device)
    layer.zero_grad(set_to_none=True)
    x_in = x.detach().requires_grad_(True)
    whole.start()
    forward.start()
    y, aux = layer(x_in)
    forward.stop()
    torch.autograd.backward([y, aux], [grad_y, torch.ones_like(aux)])
    whole.stop()
    return forward.elapsed_s(), whole.elapsed_s()


FORWARD_MARK, BACKWARD_MARK = "mpipemoe.forward", "mpipemoe.backward"  # host ranges of a profiled pass


def _marked_pass(layer, x, grad_y) -> None:
    """Local. One forward+backward of `layer`, each phase inside its host range (a profiler's)."""
    layer.zero_grad(set_to_none=True)
    with torch.profiler.record_function(FORWARD_MARK):
        y, aux = layer(x.detach().requires_grad_(True))
    with torch.profiler.record_function(BACKWARD_MARK):
        torch.autograd.backward([y, aux], [grad_y, torch.ones_like(aux)])


def own_pass_stages(layer, x, grad_y, settings: BenchSettings, device) -> dict:
    """The two stages of `layer`'s own pass on its emulated group, each a floor of that pass:

    comm_fwd_ms, comm_bwd_ms:       the network time the emulator prices for the All-to-Alls the
                                    pass issues in its forward and in its backward (each occupies
                                    its stream at least that long);
    compute_fwd_ms, compute_bwd_ms: the same pass with its transfers free (`free_transfers`): the
                                    same routing, partitions, streams and SM reservation, the
                                    network's time gone. On CUDA the device-busy time of each
                                    phase (`device_busy_ms`: its kernels and copies, whatever the
                                    stream, less the freed transfers' copies, which a priced
                                    transfer's time holds), the least of rounds x repeats profiled
                                    passes: a pass timed by events also counts the device waiting
                                    for the host, which the real pass hides behind its transfers.
                                    Elsewhere the fastest of those passes by the clock.
    """
    group = layer.group
    passes = settings.rounds * settings.repeats
    with group.free_transfers():
        for _ in range(settings.warmup):
            _step(layer, x, grad_y)
        synchronize(device)
        if device.type == "cuda":
            trace = record_trace(lambda: _marked_pass(layer, x, grad_y), device, passes)
            forward_ms = min(device_busy_ms(trace, FORWARD_MARK, excluding=FREE_TRANSFER_COPY))
            backward_ms = min(device_busy_ms(trace, BACKWARD_MARK, excluding=FREE_TRANSFER_COPY))
        else:
            samples = [_phased_pass(layer, x, grad_y, device) for _ in range(passes)]
            # The fastest pass, not the median: a floor must hold for every pass the bench times.
            forward_s, whole_s = min(f for f, _ in samples), min(w for _, w in samples)
            forward_ms, backward_ms = forward_s * 1e3, max(0.0, whole_s - forward_s) * 1e3
        layer.zero_grad(set_to_none=True)
        with group.logging_calls() as forward_calls:
            y, aux = layer(x.detach().requires_grad_(True))
        with group.logging_calls() as backward_calls:
            torch.autograd.backward([y, aux], [grad_y, torch.ones_like(aux)])
        synchronize(device)
    layer.zero_grad(set_to_none=True)
    comm_ms = lambda calls: 1e3 * sum(c.seconds for c in calls if c.kind.startswith("all_to_all"))  # noqa: E731
    return {"comm_fwd_ms": comm_ms(forward_calls), "comm_bwd_ms": comm_ms(backward_calls),
            "compute_fwd_ms": forward_ms, "compute_bwd_ms": backward_ms}


def add_own_pass_stages(records: list, layers: list, x, grad_y, settings: BenchSettings, device) -> None:
    """In place, on an emulated point: `own_pass_stages` for every FastMoE, FasterMoE and MPipeMoE
    record. The automatic layer takes its grid twin's (the same setting; extra passes would feed
    its online search), and its own where the grid lacks that setting."""
    for record, layer in zip(records, layers):
        if record["engine"] in ("fastmoe", "fastermoe", "mpipemoe") and record["chosen_by"] != "auto":
            record.update(own_pass_stages(layer, x, grad_y, settings, device))
    for record, layer in zip(records, layers):
        if record["chosen_by"] == "auto":
            twin = next((r for r in records if r["chosen_by"] == "grid" and r["partitions"] == record["partitions"]
                         and r["strategy"] == record["strategy"]), None)
            record.update({k: twin[k] for k in STAGE_KEYS} if twin else own_pass_stages(layer, x, grad_y, settings,
                                                                                          device))


STAGE_KEYS = ("comm_fwd_ms", "comm_bwd_ms", "compute_fwd_ms", "compute_bwd_ms")


def add_overlap_account(records: list) -> None:
    """In place: for every record of a point, the overlap bound at its n, its per-phase floor,
    t / bound, and the share of the ideal saving over FastMoE it realizes,
    (FastMoE − t) / (FastMoE − bound(n)) (docs/design.md §7).

    From the record's own pass (`own_pass_stages`, emulated points): bound(n) = max(C, K) +
    min(C, K) / n with C its transfers' time and K its compute, forward plus backward, and the
    per-phase floor max(C_fwd, K_fwd) + max(C_bwd, K_bwd). Else from the point's stages timed
    alone (`all_to_all_ms`, `expert_ms`), without a per-phase floor."""
    fast = next((r for r in records if r["engine"] == "fastmoe"), None)
    for record in records:
        if record["engine"] not in ("mpipemoe", "fastermoe", "fastmoe"):
            continue
        n = record["partitions"]  # FasterMoE overlaps per peer step: its partitions are its steps
        if all(record.get(key) is not None for key in STAGE_KEYS):
            comm, compute = record["comm_fwd_ms"] + record["comm_bwd_ms"], \
                record["compute_fwd_ms"] + record["compute_bwd_ms"]
            record.update(bound_stages=OWN_PASS, overlap_bound_ms=overlap_bound_ms(comm, compute, n),
                          phase_floor_ms=max(record["comm_fwd_ms"], record["compute_fwd_ms"])
                          + max(record["comm_bwd_ms"], record["compute_bwd_ms"]))
        elif record.get("all_to_all_ms") is not None:
            record.update(bound_stages=TIMED_ALONE,
                          overlap_bound_ms=overlap_bound_ms(record["all_to_all_ms"], record["expert_ms"], n))
        else:
            continue
        bound = record["overlap_bound_ms"]
        if bound > 0:
            record["bound_ratio"] = record["fwd_bwd_ms"] / bound
        if fast is not None and fast["fwd_bwd_ms"] - bound > 1e-9:
            record["realized_saving"] = (fast["fwd_bwd_ms"] - record["fwd_bwd_ms"]) / (fast["fwd_bwd_ms"] - bound)


class BoundError(ValueError):
    """A record ran faster than BOUND_TOLERANCE x its own-pass bound: the bound is no floor."""


def check_bounds(records: list, out: str) -> None:
    """Raises BoundError naming the records timed on a GPU below BOUND_TOLERANCE x their own-pass
    bound. CPU records are not checked: there the emulated transfers take no time (docs/emulation.md)."""
    below = [r for r in records if r.get("bound_stages") == OWN_PASS and r.get("device", "cpu") != "cpu"
             and r["fwd_bwd_ms"] < BOUND_TOLERANCE * r["overlap_bound_ms"]]
    if not below:
        return
    first = below[0]
    raise BoundError(
        f"{len(below)} record(s) ran below {BOUND_TOLERANCE}x their bound, first {first['model']} "
        f"{first.get('routing', 'uniform')} {first['tokens']} tokens {first['engine']} {first['chosen_by']} "
        f"{first['partitions']}/{first['strategy']}: {first['fwd_bwd_ms']:.2f} ms against a bound of "
        f"{first['overlap_bound_ms']:.2f} ms; the stage times are not floors of the pass, so its bound_ratio "
        f"and realized_saving in {out} are wrong: report it with that file")


def trace_records(records: list, layers: list, x, grad_y, folder: str, device, keep_files: bool = True) -> None:
    """In place: one timeline per record that has a layer (app/bench/timeline.py), its stream account
    under ``timeline`` and, with `keep_files`, its file under ``trace_file``."""
    for record, layer in zip(records, layers):
        if layer is None:
            continue
        path = os.path.join(folder, trace_name(record))
        record["timeline"] = trace_step(lambda layer=layer: _step(layer, x, grad_y), device, path)
        if keep_files:
            record["trace_file"] = path


# -- summaries: the targets of docs/design.md §7, from the records ---------------------------

def overlap_bound_ms(all_to_all_ms: float, expert_ms: float, partitions: int) -> float:
    """The pipelined layer's floor: the longer stage, plus one partition of the shorter one
    (the fill before the stages overlap); n = 1 gives the serial sum."""
    return max(all_to_all_ms, expert_ms) + min(all_to_all_ms, expert_ms) / partitions


def summarize(records: list) -> list:
    """Per (model, routing, tokens): auto vs grid best, strategy pick vs fastest, memory vs
    FastMoE, and the auto choice's time against the overlap bound."""
    summaries = []
    keys = sorted({(r["model"], r.get("routing", "uniform"), r["tokens"]) for r in records})
    for model, routing, tokens in keys:
        point = [r for r in records if (r["model"], r.get("routing", "uniform"), r["tokens"]) == (model, routing, tokens)]
        by = lambda engine, chosen_by: [r for r in point if r["engine"] == engine and r["chosen_by"] == chosen_by]  # noqa
        fast, faster, auto, grid = by("fastmoe", "baseline"), by("fastermoe", "baseline"), by("mpipemoe", "auto"), \
            by("mpipemoe", "grid")
        if not (fast and auto):
            continue
        fast, auto = fast[0], auto[0]
        summary = {"model": model, "tokens": tokens, "routing": routing, "auto_partitions": auto["partitions"],
                   "auto_strategy": auto["strategy"], "auto_fwd_bwd_ms": auto["fwd_bwd_ms"],
                   "fastmoe_fwd_bwd_ms": fast["fwd_bwd_ms"],
                   "speedup_vs_fastmoe": fast["fwd_bwd_ms"] / auto["fwd_bwd_ms"],
                   "expert_gemm_efficiency": auto.get("expert_gemm_efficiency")}
        if faster:
            summary["speedup_vs_fastermoe"] = faster[0]["fwd_bwd_ms"] / auto["fwd_bwd_ms"]
        if auto.get("all_to_all_ms") is not None:
            summary.update(all_to_all_ms=auto["all_to_all_ms"], expert_ms=auto["expert_ms"],
                           hot_expert_share=auto["hot_expert_share"])
        if auto.get("overlap_bound_ms"):  # its own pass's (add_overlap_account)
            bound = auto["overlap_bound_ms"]
            summary.update(overlap_bound_ms=bound, bound_stages=auto["bound_stages"],
                           auto_vs_overlap_bound=auto["fwd_bwd_ms"] / bound - 1,
                           overlap_efficiency=bound / auto["fwd_bwd_ms"],
                           **({"phase_floor_ms": auto["phase_floor_ms"]} if "phase_floor_ms" in auto else {}))
        if fast.get("peak_memory_bytes") and auto.get("peak_memory_bytes"):
            summary["memory_ratio_vs_fastmoe"] = auto["peak_memory_bytes"] / fast["peak_memory_bytes"]
            summary["predicted_memory_error"] = auto["predicted_memory_bytes"] / auto["peak_memory_bytes"] - 1
        if grid:
            # The best is the fastest of every setting measured: every n x strategy, auto included.
            best = min([auto, *grid], key=lambda r: r["fwd_bwd_ms"])
            summary.update(grid_best_partitions=best["partitions"], grid_best_strategy=best["strategy"],
                           grid_best_chosen_by=best["chosen_by"], grid_best_fwd_bwd_ms=best["fwd_bwd_ms"],
                           auto_vs_grid_best=auto["fwd_bwd_ms"] / best["fwd_bwd_ms"] - 1)
            shared = [r for r in grid if r["strategy"] != "none"]
            same_n = [r for r in grid if r["partitions"] == auto["partitions"]]
            if same_n:
                fastest = min(same_n, key=lambda r: r["fwd_bwd_ms"])
                picked = next((r for r in same_n if r["strategy"] == auto["strategy"]), None)
                if picked:
                    summary["strategy_pick_vs_fastest"] = picked["fwd_bwd_ms"] / fastest["fwd_bwd_ms"] - 1
                    summary["fastest_strategy_at_auto_n"] = fastest["strategy"]
            keep = [r for r in grid if r["strategy"] == "none"]
            cheapest = [r for r in shared if r.get("peak_memory_bytes")]
            if keep and cheapest and keep[0].get("peak_memory_bytes"):
                lean = min(cheapest, key=lambda r: r["peak_memory_bytes"])
                summary["leanest_memory_ratio_vs_none"] = lean["peak_memory_bytes"] / max(
                    r["peak_memory_bytes"] for r in keep)
            summary.update(memory_saving_setting(fast, [auto, *grid]))
        summary.update(overlap_summary(point, auto))
        summary.update(peer_summary(point))
        summaries.append(summary)
    return summaries


def overlap_summary(point: list, auto: dict) -> dict:
    """The point's fastest MPipeMoE setting (any strategy) and the share of the ideal saving
    over FastMoE it, auto and FasterMoE realize (`add_overlap_account`)."""
    settings = [r for r in point if r["engine"] == "mpipemoe" and r.get("overlap_bound_ms") is not None]
    if not settings:
        return {}
    best = min(settings, key=lambda r: r["fwd_bwd_ms"])
    summary = {"best_setting": f"{best['partitions']}/{best['strategy']}", "best_fwd_bwd_ms": best["fwd_bwd_ms"],
               "best_overlap_bound_ms": best["overlap_bound_ms"], "best_realized_saving": best.get("realized_saving"),
               "auto_realized_saving": auto.get("realized_saving")}
    faster = [r for r in point if r["engine"] == "fastermoe" and r.get("realized_saving") is not None]
    if faster:
        summary["fastermoe_realized_saving"] = faster[0]["realized_saving"]
    return summary


LEAN_MEMORY_RATIO = 0.55  # a memory-saving setting: at most this share of FastMoE's activation peak


def memory_saving_setting(fastmoe: dict, settings: list) -> dict:
    """The fastest MPipeMoE setting peaking at <= LEAN_MEMORY_RATIO of FastMoE's memory,
    against the fastest setting of all (empty without memory figures, or when none is lean)."""
    measured = [r for r in settings if r.get("peak_memory_bytes")]
    if not fastmoe.get("peak_memory_bytes") or not measured:
        return {}
    lean = [r for r in measured if r["peak_memory_bytes"] <= LEAN_MEMORY_RATIO * fastmoe["peak_memory_bytes"]]
    if not lean:
        return {}
    best_lean = min(lean, key=lambda r: r["fwd_bwd_ms"])
    fastest = min(measured, key=lambda r: r["fwd_bwd_ms"])
    return {"lean_setting": f"{best_lean['partitions']}/{best_lean['strategy']}",
            "lean_memory_ratio_vs_fastmoe": best_lean["peak_memory_bytes"] / fastmoe["peak_memory_bytes"],
            "lean_vs_fastest": best_lean["fwd_bwd_ms"] / fastest["fwd_bwd_ms"] - 1,
            "fastest_setting": f"{fastest['partitions']}/{fastest['strategy']}"}


def targets(summaries: list) -> dict:
    """docs/design.md §7's targets, checked on the summaries (None where the data cannot say)."""
    def share(values, limit):
        values = [v for v in values if v is not None]
        return (sum(v <= limit for v in values) / len(values)) if values else None

    best_n = {}
    for s in summaries:
        if "grid_best_partitions" in s:
            best_n.setdefault(f"{s['model']}/{s.get('routing', 'uniform')}", []).append((s["tokens"], s["grid_best_partitions"]))
    monotone = {key: all(a[1] <= b[1] for a, b in zip(sorted(ns), sorted(ns)[1:])) for key, ns in best_n.items()}
    return {
        "within_15pct_of_overlap_bound": share([s.get("auto_vs_overlap_bound") for s in summaries], 0.15),
        "best_realizes_90pct_of_ideal_saving": share(
            [None if s.get("best_realized_saving") is None else -s["best_realized_saving"] for s in summaries], -0.9),
        "auto_within_5pct_of_grid_best": share([s.get("auto_vs_grid_best") for s in summaries], 0.05),
        "strategy_pick_within_3pct": share([s.get("strategy_pick_vs_fastest") for s in summaries], 0.03),
        "memory_saving_within_5pct": share([s.get("lean_vs_fastest") for s in summaries], 0.05),
        "best_n_by_tokens": {key: [n for _, n in sorted(ns)] for key, ns in best_n.items()},
        "best_n_non_decreasing": monotone,
    }


def overlap_table(summaries: list) -> list:
    """The overlap account per point (Markdown lines; none without stage timings)."""
    rows = [s for s in summaries if "best_setting" in s]
    if not rows:
        return []
    fmt = lambda v, f: "–" if v is None else format(v, f)  # noqa: E731
    lines = ["## Overlap account", "",
             "Realized = (FastMoE − t) / (FastMoE − bound(n)): the share of the ideal saving a setting realizes "
             "(docs/engine.md, \"Reading a timeline\"). Best = the fastest MPipeMoE setting, any strategy.", "",
             "| model | routing | tokens | FastMoE ms | best setting | best ms | bound(n) ms | best realized | "
             "auto realized | FasterMoE realized |", "|" + "---|" * 10]
    for s in rows:
        lines.append(f"| {s['model']} | {s.get('routing', 'uniform')} | {s['tokens']} | {s['fastmoe_fwd_bwd_ms']:.2f} | "
                     f"{s['best_setting']} | {s['best_fwd_bwd_ms']:.2f} | {s['best_overlap_bound_ms']:.2f} | "
                     f"{fmt(s['best_realized_saving'], '.0%')} | {fmt(s.get('auto_realized_saving'), '.0%')} | "
                     f"{fmt(s.get('fastermoe_realized_saving'), '.0%')} |")
    return lines + [""]


def markdown_table(result: BenchResult | dict) -> str:
    """The Markdown beside a bench JSON: a BenchResult, or its JSON form (tests build partial points)."""
    if isinstance(result, BenchResult):
        meta, summaries, records = result.meta, result.summaries, [point.to_json() for point in result.records]
    else:
        meta, summaries, records = RecordMeta.from_json(result["meta"]), result["summaries"], result["records"]
    run = meta.extra
    lines = markdown_head("MoE layer benchmark", meta)
    if run.get("complete") is False:
        lines += [f"**Incomplete**: the run was stopped; these are the {len(records)} records of the "
                  "points it finished.", ""]
    if run.get("measured_as") == "emulated":
        lines += [f"**Emulated**: one {run['device']} ran the real engine as rank 0 of a {run['emulated_cluster']} "
                  f"cluster on the {run['network']} network, whose delays are modelled (docs/emulation.md). "
                  "These are not measurements of a real cluster, and the layers' outputs are not meaningful.", ""]
    elif run["world_size"] == 1:
        lines += ["With one GPU the All-to-All is a local copy, so there is nothing to overlap: "
                  "speedups over the baselines need several GPUs and are not claimed here.", ""]
    fmt = lambda v, f: "–" if v is None else format(v, f)  # noqa: E731
    checks = targets(summaries)
    lines += ["## Targets", "",
              f"- auto within 15% of the overlap bound: {fmt(checks['within_15pct_of_overlap_bound'], '.0%')} "
              "of the points",
              f"- auto within 5% of the fastest setting (every n × strategy, auto included): {fmt(checks['auto_within_5pct_of_grid_best'], '.0%')} of the points",
              f"- strategy pick within 3% of the fastest at its n: {fmt(checks['strategy_pick_within_3pct'], '.0%')} "
              "of the points (target ≥ 90%)",
              f"- a memory-saving setting (≤ {LEAN_MEMORY_RATIO:.2f}x FastMoE's peak) within 5% of the fastest "
              f"setting: {fmt(checks['memory_saving_within_5pct'], '.0%')} of the points",
              f"- the fastest setting realizes ≥ 90% of the ideal saving: "
              f"{fmt(checks.get('best_realizes_90pct_of_ideal_saving'), '.0%')} of the points"]
    for key, ns in checks["best_n_by_tokens"].items():
        verdict = "non-decreasing" if checks["best_n_non_decreasing"][key] else "NOT monotone"
        lines.append(f"- best n by token count, {key}: {', '.join(map(str, ns))} ({verdict})")
    lines += ["", "## Per model, routing and token count", "",
              "Overlap bound = max(C, K) + min(C, K) / n, C the All-to-All time and K the compute, from each "
              "record's own pass on an emulated cluster (the transfers' priced time; the pass with its transfers "
              "free), else the point's two stages timed alone (All-to-All ms, expert ms).", "",
              "| model | routing | tokens | auto n | auto strategy | auto ms | FastMoE ms | speedup vs FastMoE | "
              "speedup vs FasterMoE | memory vs FastMoE | All-to-All ms | expert ms | auto vs bound | grid best | "
              "auto vs grid best | strategy pick vs fastest at n | lean setting (memory vs FastMoE) | lean vs fastest | "
              "expert GEMM eff. |", "|" + "---|" * 19]
    for s in summaries:
        lines.append(
            f"| {s['model']} | {s.get('routing', 'uniform')} | {s['tokens']} | {s['auto_partitions']} | "
            f"{s['auto_strategy']} | "
            f"{s['auto_fwd_bwd_ms']:.2f} | {s['fastmoe_fwd_bwd_ms']:.2f} | {fmt(s['speedup_vs_fastmoe'], '.2f')} | "
            f"{fmt(s.get('speedup_vs_fastermoe'), '.2f')} | {fmt(s.get('memory_ratio_vs_fastmoe'), '.2f')} | "
            f"{fmt(s.get('all_to_all_ms'), '.2f')} | {fmt(s.get('expert_ms'), '.2f')} | "
            f"{fmt(s.get('auto_vs_overlap_bound'), '+.1%')} | "
            f"{s.get('grid_best_partitions', '–')}/{s.get('grid_best_strategy', '–')} | "
            f"{fmt(s.get('auto_vs_grid_best'), '+.1%')} | {fmt(s.get('strategy_pick_vs_fastest'), '+.1%')} | "
            + (f"{s['lean_setting']} ({fmt(s.get('lean_memory_ratio_vs_fastmoe'), '.2f')}) | {fmt(s.get('lean_vs_fastest'), '+.1%')} | "
               if "lean_setting" in s else "– | – | ")
            + f"{fmt(s.get('expert_gemm_efficiency'), '.0%')} |")
    lines += [""] + overlap_table(summaries)
    lines += [""] + peer_table(summaries)
    lines += ["## Every measurement", "",
              "Bound = the overlap bound at the record's n; phase floor = max(C, K) of the forward plus that of "
              "the backward (own pass only); t / bound below 0.98 on a GPU fails the bench.", "",
              "| model | routing | tokens | engine | chosen by | n | strategy | fwd+bwd ms | ± | peak MiB | predicted MiB "
              "| bound ms | phase floor ms | t / bound | realized | comm idle ms | compute idle ms |",
              "|" + "---|" * 17]
    for r in records:
        peak = r.get("peak_memory_bytes")
        lines.append(f"| {r['model']} | {r.get('routing', 'uniform')} | {r['tokens']} | {r['engine']} | "
                     f"{r['chosen_by']} | {r['partitions']} | "
                     f"{r['strategy']} | {r['fwd_bwd_ms']:.2f} | {r['fwd_bwd_ms_std']:.2f} | "
                     f"{'–' if peak is None else f'{peak / 2**20:.0f}'} | "
                     f"{fmt(r.get('predicted_memory_bytes') and r['predicted_memory_bytes'] / 2**20, '.0f')} | "
                     f"{fmt(r.get('overlap_bound_ms'), '.2f')} | {fmt(r.get('phase_floor_ms'), '.2f')} | "
                     f"{fmt(r.get('bound_ratio'), '.2f')} | {fmt(r.get('realized_saving'), '.0%')} | {fmt(r.get('timeline', {}).get('comm_idle_ms'), '.1f')} | "
                     f"{fmt(r.get('timeline', {}).get('compute_idle_ms'), '.1f')} |")
    return "\n".join(lines) + "\n"


# -- running ----------------------------------------------------------------------------------

def _rank_main(rank: int, settings: BenchSettings, init_file: str, queue) -> None:
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= settings.world_size
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if settings.world_size > 1:
        dist.init_process_group("nccl" if use_cuda else "gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=settings.world_size, timeout=timedelta(minutes=5))
    cluster = settings.emulated_cluster()
    group = cluster.build() if cluster is not None else ExpertGroup(None)
    if isinstance(group, EmulatedExpertGroup) and use_cuda:
        group.dilation = group.clock.measure_dilation(device)
    log = (lambda r: queue.put(("record", r))) if rank == 0 else (lambda r: None)
    try:
        records = []
        for model in settings.models:
            for routing in settings.routings:
                for tokens in settings.tokens:
                    point = bench_stack_point if settings.layers > 1 else bench_point
                    records += point(model, tokens, routing, settings, group, device, log)
        if rank == 0:
            queue.put(("done", records))
    finally:
        if settings.world_size > 1:
            dist.destroy_process_group()


class _Reporter:
    """Rank 0's channel in the one-process case: each record is printed and handed on as
    it arrives (what `queue.put` carries between processes otherwise)."""

    def __init__(self, on_record):
        self.on_record = on_record
        self.records: list | None = None

    def put(self, item) -> None:
        kind, payload = item
        if kind == "record":
            self.on_record(payload)
        else:
            self.records = payload


def run_bench(settings: BenchSettings, printer=print, on_record=None) -> list:
    """Every rank benchmarks; rank 0's records come back, each printed (and passed to
    `on_record`) as soon as its point is measured."""
    started = time.time()

    def arrived(record: dict) -> None:
        printer(_progress_line(record, time.time() - started))
        if on_record is not None:
            on_record(record)

    if settings.world_size == 1:
        reporter = _Reporter(arrived)
        _rank_main(0, settings, "", reporter)
        return reporter.records
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank_main, args=(r, settings, os.path.join(tmp, "init"), q))
                 for r in range(settings.world_size)]
        for p in procs:
            p.start()
        try:
            while True:
                kind, payload = q.get(timeout=3600)
                if kind == "record":
                    arrived(payload)
                if kind == "done":
                    break
            for p in procs:
                p.join()
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
    return payload


def _progress_line(r: dict, elapsed_s: float) -> str:
    if "setting" in r:  # a stack's (app/bench/stack.py)
        return progress_line(r, elapsed_s)
    peak = r.get("peak_memory_bytes")
    return (f"  [{elapsed_s:6.0f} s] {r['model']:>6} {r.get('routing', 'uniform'):<7} {r['tokens']:>6} tok  {r['engine']:<11} {r['chosen_by']:<8} n={r['partitions']:<2} "
            f"{r['strategy']:<4}  {r['fwd_bwd_ms']:9.2f} ms  "
            f"{'' if peak is None else f'peak {peak / 2**20:8.0f} MiB'}")


def log_to_mlflow(result: dict, tracking_uri: str | None, experiment: str, printer=print) -> int:
    """One MLflow run per record (tag kind=bench), plus one per summary (kind=bench-summary)."""
    try:
        import mlflow  # noqa: F401  (optional: the records are in the JSON either way)
    except ImportError:
        printer("MLflow is not installed here: records stay in the JSON (log them later with --import).")
        return 0
    uri = resolve_tracking_uri(tracking_uri)
    if uri == "none":
        return 0
    meta = result["meta"]
    count = 0
    for kind, rows in ((BENCH, result["records"]), (BENCH_SUMMARY, result["summaries"])):
        for row in rows:
            name = row.get("setting") or row.get("engine", "summary")
            run = RunLogger.start(uri, experiment, run_name=f"{row['model']}-{row['tokens']}-{name}",
                                  tags={**kind_tags(kind), "device": meta["device"], "command": meta["command"][:250],
                                        "measured_as": meta.get("measured_as", "measured")})
            params = {k: v for k, v in row.items() if isinstance(v, (str, int)) and not isinstance(v, bool)}
            params.update(world_size=meta["world_size"], date=meta["date"], torch=meta["torch"],
                          **{k: meta[k] for k in ("network", "emulated_cluster") if k in meta})
            metrics = {k: float(v) for k, v in row.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None}
            run.log_params(params)
            run.log_metrics(metrics, step=0, flush=True)
            run.finish()
            count += 1
    printer(f"Logged {count} MLflow runs to {uri} (experiment {experiment!r}).")
    return count


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def bench_and_write(settings: BenchSettings, out: str | None, tracking_uri: str | None, experiment: str) -> int:
    """`mpipemoe bench` once its flags are settings: run the points, write the JSON and the Markdown
    beside it (``out``, default under out/), log to MLflow and check the bounds; 1 when stopped early."""
    on_gpu = torch.cuda.is_available()
    require_peers(settings.peers)
    device = device_name(torch.device("cuda")) if on_gpu else "cpu"
    cluster = settings.emulated_cluster()
    where = (f"1 × {device} as rank 0 of an emulated {cluster.name} {cluster.network.name} cluster" if cluster
             else f"{settings.world_size} × {device}")
    stacked = settings.layers > 1
    if stacked:
        print(f"Benchmarking stacks of {settings.layers} layers of {', '.join(settings.models)} at {settings.tokens} "
              f"tokens per rank on {where}, setting by setting (checkpointing {settings.checkpointing}): "
              f"{''.join(peer + ', ' for peer in settings.peers)}FastMoE, FasterMoE, MPipeMoE auto"
              f"{' and the n × strategy grid' if settings.grid else ''}"
              f"{', auto@budget' if settings.budgeted() else ''}...", flush=True)
    else:
        print(f"Benchmarking {', '.join(settings.models)} at {settings.tokens} tokens per rank on "
              f"{where}: FastMoE, FasterMoE, MPipeMoE auto"
              f"{' and the n × strategy grid' if settings.grid else ''}"
              f"{''.join(', ' + peer for peer in settings.peers)}, the dense floor...", flush=True)
    started = time.time()
    out = out or os.path.join(DEFAULT_OUT_DIR, f"{'stacked' if stacked else 'bench'}-"
                                   f"{device.replace(' ', '-').lower()}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json")
    # An emulated run's world size is the emulated cluster's (so nothing reads its records as
    # one GPU's); it ran in one process.
    emulated = {**cluster.record_fields(), "processes": 1} if cluster else {"measured_as": "measured"}

    def meta(complete: bool) -> RecordMeta:
        return RecordMeta.from_json({**record_meta("bench", on_gpu), "device": device,
                                     "world_size": settings.world_size, **emulated, "settings": asdict(settings),
                                     "wall_s": round(time.time() - started, 1), "complete": complete})

    def write(records: list, complete: bool) -> tuple[dict, str]:
        """The JSON and the Markdown beside it, both whole (a stacked run writes them after each setting)."""
        if stacked:
            result = {"meta": meta(complete).to_json(), "records": records, "summaries": []}
            markdown = stack_markdown(result)
        else:
            summaries = summarize(records)
            typed = BenchResult(meta=meta(complete), records=[BenchPoint.from_json(r) for r in records],
                                summaries=summaries, targets=targets(summaries))
            result, markdown = typed.to_json(), markdown_table(typed)
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1, default=str)
        with open(os.path.splitext(out)[0] + ".md", "w") as f:
            f.write(markdown)
        return result, markdown

    finished: list = []

    def arrived(record: dict) -> None:
        finished.append(record)
        if stacked:  # a later setting's failure or a stop loses none of the earlier ones
            write(finished, complete=False)

    previous = signal.signal(signal.SIGTERM, _interrupt)  # `timeout` and schedulers stop with SIGTERM
    try:
        records, complete = run_bench(settings, lambda line: print(line, flush=True), arrived), True
    except KeyboardInterrupt:
        records, complete = finished, False
        print(f"Stopped: writing the {len(records)} records of the {'settings' if stacked else 'points'} "
              "finished so far", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    result, markdown = write(records, complete)
    print(markdown.split("## Every measurement")[0])
    print(f"Wrote {out} and {os.path.splitext(out)[0]}.md")
    log_to_mlflow(result, tracking_uri, experiment)
    check_bounds(result["records"], out)  # after writing: the records that show it are kept
    return 0 if complete else 1
