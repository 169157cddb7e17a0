"""The public MoE layers: MPipeMoE and the FastMoE / FasterMoE baselines.

All three share `MoELayerBase`: the same configuration, the same parameters
(router.weight, experts.w1/b1/w2/b2[/w3]), the same call ``y, aux_loss = layer(x)``
and the same kernels (dispatcher.py, experts.py, pipeline.py). They differ only in
how step 2 cuts the routed rows into partitions and what step 3 keeps for backward,
so a measured difference between them is the method's, not the implementation's:

    1. route       softmax top-k gate, capacity, load-balance loss          (local)
    2. plan        partition rows, exchange counts + agreed values, the      (local + one collective)
                   planner's n and strategy on them (planner.py)
    3. experts     dispatch → expert FFN → combine, pipelined per partition  (pipeline.py)
    4. un-permute  weight each row by its gate and sum per token            (local)

FastMoE: one partition, keeps everything autograd would (T_DI, A and act(A)).
FasterMoE: partitions along the destination ranks, keeps everything.
MPipeMoE: partitions along the tokens (n chosen online), shares buffers and restores
them by a strategy S1–S4 (chosen by the performance model). The layers only execute:
the tuning policy is each layer's `Planner`.

Host reads: with several ranks a pass reads the device once (the count tables and the
pass statistics, together); with one rank never (dispatcher.py says how). The sync-free
capacity mode (``sync_free_capacity``, MPipeMoE and FastMoE, off by default) reads
nothing with several ranks too: each partition sends every expert a fixed number of rows
(padded), so the All-to-Alls' splits are static; pairs beyond that capacity are dropped
and counted on the device (`MoELayerBase.overflowed`), which the caller must check and,
where it is not 0, rerun the step dropless (`MoELayerBase.dropless`).

Shapes: see moe_engine's legend (moe_engine/__init__.py).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import threading
from typing import Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from . import dispatcher
from .comm import ExpertGroup
from .config import SPLITS, MemoryBudget, MoEConfig
from .dispatcher import STATS, CapacityLayout, DispatchPlan, PassStats
from .experts import Experts, compute_dtype
from .granularity import SEARCH_SPLITS, GranularitySearch, skew_bucket
from .memory import HostBufferPool, RestorePolicy
from .perf_model import HardwareProfile, ProfileCache
from .pipeline import PipelinedExperts, PipelineRun
from .planner import Planner, PassPlan
from .router import Router, Routing
from .shadowing import (COST_VALUES, ShadowCosts, ShadowPass, choose_replicated, choose_shadowed, shadow_pass,
                        shadowed_output)
from .streams import StreamSet


def recomputing() -> bool:
    """Whether this forward runs inside a backward: an activation checkpoint's recomputation
    (autograd's current graph task; -1 outside backward)."""
    return torch._C._current_graph_task_id() != -1


class NonFiniteInputError(ValueError):
    """NaN or Inf in some rank's MoE layer input; raised on every rank of the layer's group
    together (``on_nonfinite_input="raise"``)."""


NONFINITE_INPUT_POLICIES = ("raise", "flag")


class MoELayerBase(nn.Module):
    """Router + this rank's experts + the steps every engine shares."""

    keep_activation = False  # FastMoE keeps act(A) for backward, as autograd would
    shadowing = False        # FasterMoE shadows hot experts (shadowing.py)
    # Pass shapes whose capacity layouts a layer keeps (token counts seen in training are few).
    MAX_CAPACITY_LAYOUTS = 16

    def __init__(self, config: MoEConfig, group: dist.ProcessGroup | ExpertGroup | None = None, *,
                 host_pool: HostBufferPool | None = None, device=None, dtype=None):
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
        self.config = config
        self.group = group if isinstance(group, ExpertGroup) else ExpertGroup(group)
        self.local_experts = config.experts_per_rank(self.group.size)
        self.router = Router(config, device=device, dtype=dtype)
        self.experts = Experts(config, self.local_experts, device=device, dtype=dtype)
        self.host_pool = host_pool if host_pool is not None else HostBufferPool()
        self.planner = Planner(config, self.group, host_pool=self.host_pool)  # one partition, keep everything
        self._streams: dict[torch.device, StreamSet] = {}
        # (rows sent, rows received, the most one partition received) of the last pass
        self.last_rows: tuple[int, int, int] | None = None
        # the experts the last pass shadowed (FasterMoE's shadowing, MPipeMoE's hot_replicas) and
        # the rows this rank computed with them (memory.predict_memory's replicas, replica_rows)
        self.last_shadowed: tuple[int, ...] = ()
        self.last_replica_rows = 0
        # plans of recent forwards per lane, for a checkpointed forward's recomputation
        # (bounded: forwards never recomputed fall off the far end); the lane whose forwards
        # run now (``lane``), and the lane a thread's backward recomputes (``replaying_lane``)
        self._recorded_plans: dict[int, collections.deque[PassPlan]] = {}
        self._lane_index = 0
        self._replay_lane_of_thread: dict[int, int] = {}
        # Lanes of the overlapped micro-batch schedule (workers/schedules.py): lane 0 is the
        # layer's own group and streams; lane i > 0 a process group of the same ranks and its
        # own streams (set_lanes), so that two micro-batches in flight never pair each
        # other's collectives nor queue behind each other's side streams.
        self._lanes: list[tuple[ExpertGroup, dict[torch.device, StreamSet]]] = []
        # The sync-free capacity mode (off: None; the subclasses that take it set it after
        # their planner): its static layouts per pass shape, and its device counters
        # [pairs overflowed, passes with a non-finite input] since the caller last reset them.
        self._sync_free_capacity: float | None = None
        self._capacity_layouts: dict[tuple, CapacityLayout] = {}
        self._capacity_counters: torch.Tensor | None = None
        # NaN/Inf in the input (seen with several ranks, in the exchanged pass statistics):
        # "raise" NonFiniteInputError on every rank of the layer's group together, which is safe
        # only when no other group's collective follows (the group is the world); "flag" runs the
        # pass on (every collective issued, sized from the agreed counts) and sets
        # `nonfinite_input` when this rank's input held them, for a caller that decides on values
        # reduced over every rank (the trainer: workers/loop.py).
        self.on_nonfinite_input = "raise"
        self.nonfinite_input = False

    def take_nonfinite_input(self) -> bool:
        """Local. Whether a pass since the last call met NaN/Inf in this rank's input
        (``on_nonfinite_input="flag"``); clears it."""
        seen, self.nonfinite_input = self.nonfinite_input, False
        return seen

    def set_lanes(self, groups: Sequence[dist.ProcessGroup | ExpertGroup | None]) -> None:
        """Local. The process groups of lanes 1, 2, ... (each: the same ranks as the layer's
        group, a distinct communicator); lane 0 stays the layer's own. Each lane gets its
        own side streams."""
        own = (self.group, self._streams)
        lanes = [own]
        for group in groups:
            lane_group = group if isinstance(group, ExpertGroup) else ExpertGroup(group)
            if (lane_group.size, lane_group.rank) != (self.group.size, self.group.rank):
                raise ValueError(f"a lane's group has rank {lane_group.rank} of {lane_group.size}, the layer's "
                                 f"{self.group.rank} of {self.group.size}: give a group of the layer's ranks")
            lanes.append((lane_group, {}))
        self._lanes = lanes

    @property
    def lanes(self) -> int:
        """How many lanes the layer has (1 until `set_lanes`)."""
        return max(1, len(self._lanes))

    @contextlib.contextmanager
    def lane(self, index: int) -> Iterator[None]:
        """Local. Forwards inside run on lane ``index``'s group and streams (their backward
        keeps them: a pass's PipelineRun holds its group and streams). Only the thread that
        issues forwards may switch lanes; the planner follows the layer's group."""
        if index == 0 and not self._lanes:
            yield
            return
        if not 0 <= index < len(self._lanes):
            raise ValueError(f"lane {index} does not exist: the layer has {self.lanes} (set_lanes adds more)")
        previous = (self.group, self._streams, self._lane_index)
        self.group, self._streams = self._lanes[index]
        self._lane_index = index
        self.planner.group = self.group
        try:
            yield
        finally:
            self.group, self._streams, self._lane_index = previous
            self.planner.group = self.group

    @contextlib.contextmanager
    def replaying_lane(self, index: int) -> Iterator[None]:
        """Local. A backward on the calling thread belongs to a micro-batch of lane ``index``:
        a checkpointed forward it recomputes replays that lane's plans (the overlapped
        schedule's helper thread runs micro-batch k's backward while the next forward, on
        the other lane, records its own)."""
        thread = threading.get_ident()
        self._replay_lane_of_thread[thread] = index
        try:
            yield
        finally:
            del self._replay_lane_of_thread[thread]

    @property
    def host_bytes_held(self) -> int:
        """Local. Bytes of pinned host memory the layer's pool holds now (handed out and free;
        shared by every layer given the same pool): the figure to log per layer."""
        return self.host_pool.bytes_held

    def streams_for(self, device: torch.device) -> StreamSet:
        if device not in self._streams:
            self._streams[device] = StreamSet(device)
        return self._streams[device]

    # -- the sync-free capacity mode --------------------------------------------------------------
    @property
    def sync_free_capacity(self) -> float | None:
        """The capacity factor of the sync-free capacity mode, or None (off: the dropless
        exchange). Settable: ``layer.sync_free_capacity = None`` switches the mode off (e.g.
        for a dropless rerun of a step that overflowed; `dropless` does it for a block)."""
        return self._sync_free_capacity

    @sync_free_capacity.setter
    def sync_free_capacity(self, factor: float | None) -> None:
        self._sync_free_capacity = self._checked_capacity(factor)

    def _checked_capacity(self, factor: float | None) -> float | None:
        """Local. ``factor`` as a float, or None; raises naming the fix where the layer cannot
        run the mode."""
        if factor is None:
            return None
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) \
                or factor <= 0:
            raise ValueError(f"sync_free_capacity={factor!r} is invalid: give a capacity factor > 0 (the rows a "
                             f"partition sends each expert, as a multiple of its even share K*T/E; e.g. 1.25), "
                             f"or None for the dropless exchange")
        planner = self.planner
        if planner.partitions == "auto":
            raise ValueError(f"sync_free_capacity={factor!r} needs a fixed partitions, not 'auto': the online "
                             f"search agrees on n through the count exchange this mode drops; give partitions=N "
                             f"(e.g. 2), or sync_free_capacity=None")
        if planner.strategy == "auto":
            raise ValueError(f"sync_free_capacity={factor!r} needs a fixed strategy, not 'auto': the performance "
                             f"model's profile agreement rides the count exchange this mode drops; give "
                             f"strategy='none', 'S1', 'S2', 'S3' or 'S4', or sync_free_capacity=None")
        if planner.split != "tokens":
            raise ValueError(f"sync_free_capacity={factor!r} needs split='tokens' (a capacity per token "
                             f"partition), not {planner.split!r}: give split='tokens', or sync_free_capacity=None")
        return float(factor)

    @contextlib.contextmanager
    def dropless(self) -> Iterator[None]:
        """Local. Forwards inside run the dropless exchange (the sync-free capacity mode off),
        e.g. the rerun of a step whose `overflowed` is not 0; the factor is restored after."""
        factor = self._sync_free_capacity
        self._sync_free_capacity = None
        try:
            yield
        finally:
            self._sync_free_capacity = factor

    @property
    def overflowed(self) -> torch.Tensor:
        """Int64 scalar on the device: this rank's (token, choice) pairs that the sync-free
        capacity mode dropped because their expert's capacity was full, summed over the
        passes since `reset_capacity_counters` (a checkpoint's recomputation does not count
        again). Never read by the layer: the caller reads it (with the loss), agrees over
        the ranks (the sum or max: another rank may overflow where this one did not) and,
        where it is not 0, reruns the step dropless (`dropless`). 0 (on the CPU) before any
        pass in the mode."""
        return self._counters()[0]

    @property
    def nonfinite_inputs(self) -> torch.Tensor:
        """Int64 scalar on the device: the passes in the sync-free capacity mode whose input
        on this rank held NaN or Inf, since `reset_capacity_counters` (the dropless exchange
        raises `NonFiniteInputError` instead; this mode reads nothing, so it only counts)."""
        return self._counters()[1]

    def reset_capacity_counters(self) -> None:
        """Local. Zero `overflowed` and `nonfinite_inputs` (in place: a CUDA graph that adds
        to them keeps adding to the same tensor)."""
        if self._capacity_counters is not None:
            self._capacity_counters.zero_()

    def _counters(self, device: torch.device | None = None) -> torch.Tensor:
        """The counters, made (zero) on ``device`` when they are not there yet."""
        counters = self._capacity_counters
        if device is not None and (counters is None or counters.device != device):
            counters = self._capacity_counters = torch.zeros(2, dtype=torch.int64, device=device)
        return counters if counters is not None else torch.zeros(2, dtype=torch.int64)

    # -- step 1: input -------------------------------------------------------------------------
    def _tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Local. Validate x and view it as (tokens, d_model)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"x has dtype {x.dtype}; the MoE layer needs a floating-point input "
                            f"(cast it, e.g. x.to({self.router.weight.dtype}))")
        if x.dim() not in (2, 3) or x.shape[-1] != self.config.d_model:
            raise ValueError(f"x has shape {tuple(x.shape)}; expected (tokens, d_model) or "
                             f"(batch, seq, d_model) with d_model={self.config.d_model}")
        if x.dtype != self.router.weight.dtype and not torch.is_autocast_enabled(x.device.type):
            # (under autocast the layer computes in the autocast dtype whatever x's is)
            raise TypeError(f"x has dtype {x.dtype} but the layer's parameters are "
                            f"{self.router.weight.dtype}; call layer.to({x.dtype}) or cast x")
        return x.reshape(-1, x.shape[-1])

    # -- step 2: plan ------------------------------------------------------------------------------
    def _chunk_pairs(self, routing: Routing, chunks: int) -> torch.Tensor:
        """Local. Chunk of each (token, choice) pair."""
        return torch.zeros(routing.expert_ids_TK.numel(), dtype=torch.long, device=routing.expert_ids_TK.device)

    def _plan_partitions(self, routing: Routing, chunk_P: torch.Tensor, pass_plan: PassPlan,
                         tables: dispatcher.CountTables) -> DispatchPlan:
        """Local. The dispatch plan of the pass plan's partitions, from the exchanged counts:
        runs of the count chunks (split by tokens, or FasterMoE's chunks by peer step), or,
        split by peers, groups of destinations (`dispatcher.plan_exchanged_by_peers`)."""
        if pass_plan.split == "peers":
            return dispatcher.plan_exchanged_by_peers(routing, pass_plan.partitions, tables, self.group)
        return dispatcher.plan_exchanged(routing, chunk_P, pass_plan.partitions, tables, self.group)

    def plan(self, x_TD: torch.Tensor, routing: Routing) -> tuple[DispatchPlan, PassPlan]:
        """Step 2 (`_plan_pass`), the dispatch plan and the pass plan."""
        plan, pass_plan, _ = self._plan_pass(x_TD, routing)
        return plan, pass_plan

    def _shadow_costs(self, dtype: torch.dtype, device: torch.device) -> ShadowCosts:
        """Local. The terms of the shadowing rule for experts running in ``dtype``."""
        return ShadowCosts.of(self.config, dtype, self.experts.w1.dtype)

    def _choose_shadowed(self, load_WE: np.ndarray, costs: ShadowCosts) -> tuple[int, ...]:
        """Local, host arithmetic, on agreed values. The experts to shadow (FasterMoE's rule)."""
        return choose_shadowed(load_WE.sum(axis=0), costs)

    def _plan_pass(self, x_TD: torch.Tensor, routing: Routing
                   ) -> tuple[DispatchPlan, PassPlan, ShadowPass | None]:
        """Step 2. With one rank: local, no device reads. With several: count rows (local),
        exchange counts with every rank's pass statistics and planner values (one
        collective), read both (the pass's one device read), raise together on NaN/Inf (or
        flag them: ``on_nonfinite_input``), then the planner decides on the agreed values
        (planner.py) and the rows are planned (local).
        An offloading strategy's host check may add the planner's one agreement.
        The planner prices the dtype the experts run in (`compute_dtype`: autocast's under
        autocast), not the input's.
        With `shadowing` (FasterMoE, several ranks) the shadowing rule's costs and this rank's
        rows per global expert ride in the count exchange too: every rank then chooses the
        same shadowed experts from rank 0's costs and the summed rows (shadowing.py), and
        their pairs are left out of the dispatch (the returned `ShadowPass`)."""
        E, planner = self.config.num_experts, self.planner
        if recomputing():
            self._replay_lane()  # (refused here, before any collective, where it must be)
        dtype = compute_dtype(x_TD)
        if self._sync_free_capacity is not None and self.group.distributed:
            return self._plan_capacity(x_TD, routing, dtype)
        values = planner.local_values(x_TD.device, dtype)
        if not self.group.distributed:
            agreed = planner.agree(PassStats(False, x_TD.shape[0], 0), np.array([values], dtype=np.int64),
                                   x_TD.device, dtype)
            replayed = self._replayed_plan()
            pass_plan = replayed or planner.decide(agreed)
            n = pass_plan.partitions
            plan = dispatcher.plan_single(routing, self._chunk_pairs(routing, n), n, E, agreed.stats)
            return plan, replayed or self._record_plan(planner.check_host_memory(pass_plan, plan, agreed)), None
        chunks = planner.count_chunks
        chunk_P = self._chunk_pairs(routing, chunks)
        counts_CE = dispatcher.count_rows(routing, chunk_P, chunks, E, single=False)
        skew = skew_bucket(counts_CE.sum(0)) if planner.wants_skew else 0
        stats = dispatcher.pass_stats(x_TD, skew, values)
        shadow_values = COST_VALUES + E if self.shadowing else 0
        if shadow_values:
            costs = torch.tensor(self._shadow_costs(dtype, x_TD.device).values(), dtype=torch.int64)
            stats = torch.cat([stats, costs.to(x_TD.device, non_blocking=True), counts_CE.sum(0)])
        tables = dispatcher.read_counts(counts_CE, dispatcher.exchange_counts(counts_CE, stats, self.group),
                                        STATS + len(values) + shadow_values)
        if tables.stats.nonfinite and self.on_nonfinite_input == "flag":
            self.nonfinite_input |= bool(tables.stats_W[self.group.rank, 0])
        elif tables.stats.nonfinite:
            where = "this rank's" if tables.stats_W[self.group.rank, 0] else "another rank's"
            raise NonFiniteInputError(f"NaN or Inf in {where} MoE layer input; check the loss scale and "
                                      f"learning rate, or the data that produced it")
        agreed = planner.agree(tables.stats, tables.stats_W[:, STATS:STATS + len(values)], x_TD.device, dtype)
        replayed = self._replayed_plan()
        pass_plan = replayed or planner.decide(agreed)
        shadow = None
        if shadow_values:
            if replayed is None:
                shadow_W = tables.stats_W[:, STATS + len(values):]
                shadowed = self._choose_shadowed(shadow_W[:, COST_VALUES:],
                                                 ShadowCosts.from_values(shadow_W[0, :COST_VALUES]))
                pass_plan = dataclasses.replace(pass_plan, shadowed=shadowed)
            if pass_plan.shadowed:
                shadowed = pass_plan.shadowed
                shadow = shadow_pass(routing, shadowed, tables.sent_CE.sum(axis=0)[list(shadowed)], E)
                routing, tables = shadow.dispatched, dispatcher.without_experts(tables, shadowed, self.group.rank)
        plan = self._plan_partitions(routing, chunk_P, pass_plan, tables)
        return plan, replayed or self._record_plan(planner.check_host_memory(pass_plan, plan, agreed)), shadow

    def _plan_capacity(self, x_TD: torch.Tensor, routing: Routing, dtype: torch.dtype
                       ) -> tuple[DispatchPlan, PassPlan, None]:
        """Step 2 in the sync-free capacity mode with several ranks: local, no device reads,
        no count exchange. The planner's fixed n and strategy need no agreement; the rows
        follow the pass's `CapacityLayout` (every rank has the same token count, so the same
        capacities and splits); the pairs that overflowed and a NaN/Inf in the input are
        added to the device counters (`overflowed`, `nonfinite_inputs`). An offloading
        strategy's host check still agrees once per pass shape (`Planner.check_host_memory`)."""
        planner, tokens, device = self.planner, x_TD.shape[0], x_TD.device
        agreed = planner.agree(PassStats(False, tokens, 0), np.zeros((1, 0), dtype=np.int64), device, dtype)
        replayed = self._replayed_plan()
        pass_plan = replayed or planner.decide(agreed)
        n = pass_plan.partitions
        key = (tokens, n, device, self._sync_free_capacity)
        layout = self._capacity_layouts.get(key)
        if layout is None:
            if len(self._capacity_layouts) >= self.MAX_CAPACITY_LAYOUTS:
                self._capacity_layouts.clear()
            layout = self._capacity_layouts[key] = CapacityLayout(
                tokens, n, self._sync_free_capacity, self.config.top_k, self.group.size,  # type: ignore[arg-type]  # (set: the mode is on)
                self.local_experts, device)
        plan, overflowed = dispatcher.plan_capacity(routing, self._chunk_pairs(routing, n), layout)
        if not recomputing():
            self._counters(device).add_(torch.stack([overflowed, (~torch.isfinite(x_TD)).any()]))
        return plan, replayed or self._record_plan(planner.check_host_memory(pass_plan, plan, agreed)), None

    # Activation checkpointing (torch.utils.checkpoint) runs a forward again inside backward
    # and needs the same tensors saved: the recomputation must run the plan the original
    # forward ran (the online search moves on between passes). Forwards that record for
    # backward push their plan on their lane's stack; a recomputation pops the latest of its
    # backward's lane (``replaying_lane``; else the current one), last in first out as
    # backward visits a micro-batch's forwards. Every rank recomputes the same layers in the
    # same order, so every rank replays, and skips the planner's agreements, alike.
    def _record_plan(self, pass_plan: PassPlan) -> PassPlan:
        """Local. Remember the plan of a forward that records for backward (not of a
        recomputation: a reentrant checkpoint's forward runs without grad, so its
        recomputation finds nothing to replay and must leave nothing behind)."""
        if torch.is_grad_enabled() and not recomputing():
            self._recorded_plans.setdefault(self._lane_index, collections.deque(maxlen=64)).append(pass_plan)
        return pass_plan

    def _replay_lane(self) -> int:
        """Local. The lane whose plans a recomputation replays: its backward's
        (``replaying_lane``), else the current one. Raises, before the recomputation's first
        collective and on every rank alike, for a recomputation in a lane's backward thread
        with several ranks: the layer's group is whichever lane the other thread forwards on
        at that moment, which differs between ranks."""
        lane = self._replay_lane_of_thread.get(threading.get_ident())
        if lane is not None and self.group.distributed:
            raise RuntimeError(f"an activation checkpoint recomputes this MoE layer in the backward of lane {lane}, "
                               f"beside the next micro-batch's forward, and its collectives would go to the group "
                               f"that forward is using: with several ranks, checkpoint the MoE layers only under "
                               f"the sequential micro-batch schedule")
        return self._lane_index if lane is None else lane

    def _replayed_plan(self) -> PassPlan | None:
        """Local. The plan of the forward being recomputed, when this forward runs inside
        backward (a checkpointed forward's recomputation); None otherwise."""
        if not recomputing():
            return None
        recorded = self._recorded_plans.get(self._replay_lane())
        return recorded.pop() if recorded else None

    # -- step 3: experts ---------------------------------------------------------------------
    def _run_experts(self, x_TD: torch.Tensor, plan: DispatchPlan, pass_plan: PassPlan) -> torch.Tensor:
        """Rows in send order (R × D, in the compute dtype) after dispatch → experts → combine, with the planner's
        n and strategy (decided on agreed values only: they decide which collectives run)."""
        self.last_strategy = pass_plan.strategy
        if torch.is_grad_enabled() and RestorePolicy.of(pass_plan.strategy).offloads and x_TD.is_cuda \
                and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"strategy {pass_plan.strategy} cannot be captured in a CUDA graph for training: its offloads "
                f"take pinned host buffers each pass (allocating them and querying their copies' events is not "
                f"capturable), and every replay would write the same host buffers; capture with strategy S4 or "
                f"none (forward-only capture under torch.no_grad offloads nothing and works)")
        # The pass's actual rows (this rank's), for the routing-aware memory model
        # (memory.predict_memory's rows_sent / rows_received).
        received = [p.rows_received for p in plan.partitions]
        self.last_rows = (plan.send_offsets[-1], sum(received), max(received, default=0))
        experts = self.experts
        # Mixed precision (float32 master weights under autocast): the experts compute, and
        # the All-to-Alls move rows, in the autocast dtype, the one the planner priced. The
        # weights are cast once per pass, outside autograd: the pipeline sums their gradients
        # over the partitions in float32 and hands them to the float32 parameters directly.
        # Without autocast both casts are no-ops.
        compute = compute_dtype(x_TD)
        with torch.no_grad():
            experts = experts.cast(compute)
        x_TD = x_TD.to(compute)
        # Partitions overlap communication with the GEMMs: leave the comm kernels their SMs.
        overlaps = not plan.single and pass_plan.partitions > 1
        run = PipelineRun(experts, self.group, plan, self.streams_for(x_TD.device),
                          RestorePolicy.of(pass_plan.strategy), self.host_pool,
                          timing=self.planner.timing_for_pass(pass_plan, x_TD.device)
                          if torch.is_grad_enabled() and not recomputing() else None,
                          keep_activation=self.keep_activation,
                          reserved_sms=self.group.comm_sms if overlaps else 0)
        e = self.experts
        # The rows stay in the compute dtype: the combine weights them into the layer's dtype.
        return PipelinedExperts.apply(x_TD, run, e.w1, e.b1, e.w2, e.b2, e.w3)  # type: ignore[no-any-return]  # (Function.apply is untyped)

    def capture_refusal(self, x_TD: torch.Tensor) -> str | None:
        """Local. Why a pass on ``x_TD`` cannot be captured in a CUDA graph (it would read
        device values on the host, which aborts the capture), or None. Checked up front by
        `forward` while a capture is on, so the refusal names the cause instead of CUDA's
        "operation not permitted when stream is capturing"."""
        if self.group.distributed and self._sync_free_capacity is None:
            return (f"{self.group.size} ranks exchange their row counts and read them on the host to size "
                    f"the All-to-Alls (the sync-free capacity mode, sync_free_capacity=, reads nothing)")
        if self.group.distributed:
            return None  # capacity mode: static splits, and the rows per expert are known on the host
        compute = compute_dtype(x_TD)
        return self.experts.host_count_reads(compute, x_TD.device, torch.is_grad_enabled())

    def forward(self, x: torch.Tensor, with_z_loss: bool = False) -> tuple[torch.Tensor, ...]:
        """``(y, aux_loss)``, the output and the router's load-balance loss; with
        ``with_z_loss``, ``(y, aux_loss, z_loss)`` (the router z-loss, unweighted)."""
        x_TD = self._tokens(x)
        if x_TD.is_cuda and torch.cuda.is_current_stream_capturing():
            reason = self.capture_refusal(x_TD)
            if reason is not None:
                raise RuntimeError(f"this MoE layer cannot be captured in a CUDA graph: {reason}; capture one "
                                   f"rank with bf16 parameters (or a torch whose grouped kernel writes float32) "
                                   f"on sm90/sm100, or run it eagerly")
        routing = self.router(x_TD)                                                    # 1. route
        plan, pass_plan, shadow = self._plan_pass(x_TD, routing)                       # 2. plan
        self.last_shadowed = pass_plan.shadowed
        self.last_replica_rows = sum(shadow.rows_S) if shadow is not None else 0
        y_RD = self._run_experts(x_TD, plan, pass_plan)                                # 3. experts
        dispatched = shadow.dispatched if shadow is not None else routing
        y_TD = dispatcher.unpermute(y_RD, plan, routing.weights_TK, dispatched.keep_TK,  # 4. un-permute
                                    out_dtype=x_TD.dtype)
        if shadow is not None:  # FasterMoE: the shadowed experts' pairs, computed here (shadowing.py)
            y_TD = y_TD + shadowed_output(x_TD, routing, shadow, self.experts, self.group, self.config, y_RD,
                                          compute_dtype(x_TD), x_TD.dtype)
        if with_z_loss:
            return y_TD.reshape(x.shape), routing.aux_loss.to(x.dtype), routing.z_loss
        return y_TD.reshape(x.shape), routing.aux_loss.to(x.dtype)


class FastMoE(MoELayerBase):
    """Keep-everything baseline: one dispatch, all experts, one combine; no partitions,
    no memory reuse; keeps T_DI, A and act(A) for backward, as autograd would (as
    FastMoE does). Same kernels as the other engines."""

    keep_activation = True

    def __init__(self, config, group=None, *, sync_free_capacity: float | None = None, device=None, dtype=None):
        super().__init__(config, group, device=device, dtype=dtype)
        self.sync_free_capacity = sync_free_capacity


class FasterMoE(MoELayerBase):
    """FasterMoE-style baseline: the batch is split along the *device* dimension.
    Step s exchanges with one group of `group_size` peers (ranks rank+s·g … rank+s·g+g−1)
    and overlaps that exchange with the previous step's experts. No memory reuse.

    shadowing: FasterMoE's dynamic shadowing (shadowing.py; on by default, so that the
                  baseline is FasterMoE at its best under skew): per pass, the experts its
                  cost model picks have their weights broadcast to every rank, their pairs
                  computed where their tokens are, and their gradients summed back onto
                  the owner. Decided from every rank's counts (the same everywhere).
    profile:      a HardwareProfile whose GEMM rate and All-to-All bandwidth price the
                  rule (rank 0's figures are used on every rank); None: FasterMoE's
                  defaults (50 Gbit/s links, 11.5 TFLOP/s).
    """

    def __init__(self, config, group=None, *, group_size: int = 4, shadowing: bool = True,
                 profile: HardwareProfile | None = None, sync_free_capacity: float | None = None,
                 device=None, dtype=None):
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size={group_size!r} is invalid: give a positive integer "
                             f"(peers per exchange step; FasterMoE uses 4)")
        if not isinstance(shadowing, bool):
            raise ValueError(f"shadowing={shadowing!r} is invalid: give True (shadow hot experts, FasterMoE's "
                             f"default here) or False")
        if profile is not None and not isinstance(profile, HardwareProfile):
            raise ValueError(f"profile={profile!r} is invalid: give a HardwareProfile (its GEMM rate and "
                             f"All-to-All bandwidth price the shadowing rule) or None for FasterMoE's defaults")
        super().__init__(config, group, device=device, dtype=dtype)
        self.shadowing = shadowing
        self.shadow_profile = profile
        self.group_size = min(group_size, self.group.size)
        self.planner = Planner(config, self.group, partitions=self.steps, host_pool=self.host_pool)
        self.sync_free_capacity = sync_free_capacity

    def _checked_capacity(self, factor):
        if factor is not None:
            raise ValueError(f"sync_free_capacity={factor!r} is not supported by FasterMoE (its steps split by "
                             f"destination ranks, sized by the count exchange): leave it None, or use FastMoE "
                             f"or MPipeMoE for the sync-free capacity mode")
        return None

    def _shadow_costs(self, dtype: torch.dtype, device: torch.device) -> ShadowCosts:
        return ShadowCosts.of(self.config, dtype, self.experts.w1.dtype, self.shadow_profile)

    @property
    def steps(self) -> int:
        return -(-self.group.size // self.group_size)

    def _chunk_pairs(self, routing, chunks):
        return dispatcher.chunk_by_peers(routing.expert_ids_TK, self.local_experts,
                                         self.group.rank, self.group.size, self.group_size)


class MPipeMoE(MoELayerBase):
    """MPipeMoE: the batch's tokens are split into n partitions; partition i+1's
    All-to-All overlaps partition i's experts; T_DI / A / T_DO share one-partition
    buffers and backward restores them by the strategy S1–S4 ("none" keeps all).
    Its tuning policy (the search, the strategy choice, the host check) is its
    `planner` (planner.py); the layer executes the planner's plan.

    partitions:    "auto" (online search, granularity.py) or an int ≥ 1.
    strategy:      "auto" (performance model, perf_model.py), "none", "S1", "S2", "S3" or "S4".
    profile:       a HardwareProfile, or a ProfileCache shared by the model's layers
                   (default: a cache of this layer's own); a missing profile is measured
                   on the first pass that needs one, by all ranks together, and where the
                   ranks' profiles differ (per-node files) all adopt rank 0's, with a warning.
                   Its key's dtype is the one the experts run in (autocast's under autocast).
    memory_budget: bytes the layer's activations may use; "auto" then picks the fastest
                   strategy that fits (and "none" may compete), or fails naming the need.
                   For a model of L such layers give MemoryBudget(bytes=..., layers=L): each
                   layer's saved tensors count L times, one working set once.
    search:        the GranularitySearch to use (candidates, re-check period, ...).
    split:         how the n partitions divide a pass: "tokens" (the paper's: n contiguous
                   token ranges, each one All-to-All over every rank), "peers" (FasterMoE's:
                   partition i holds the rows for one group of W/n destination ranks, so a
                   pass sends W messages whatever n; n must divide the expert-parallel world
                   size W) or "auto" (the search times both at each candidate n; needs
                   partitions="auto"). Default: the given search's `splits`; else "auto" with
                   partitions="auto", "tokens" with a fixed n. Either way the partitions
                   share the buffers and restore them by the strategy.
    hot_replicas:  replicate the hottest expert on every rank of the group where the
                   performance model's terms say it pays (shadowing.choose_replicated: its rows
                   off the busiest rank's link and compute, against its weights broadcast and
                   its gradients reduced): each rank computes its own rows of it, beside the
                   partitions, which carry the other experts' rows. Decided on every rank's
                   rows per expert and rank 0's costs (from the planner's profile once it has
                   one, else FasterMoE's defaults), riding the count exchange. Off by default;
                   needs the dropless exchange (not sync_free_capacity). `last_shadowed` names
                   the replicated expert of the last pass.
    sync_free_capacity: None (default: the dropless exchange, one host read per pass with
                   several ranks) or a capacity factor f > 0: the sync-free capacity mode.
                   Partition i of T_i tokens sends each expert C_i = ceil(f·K·T_i/E) rows,
                   padded, so the All-to-Alls have static splits and a pass reads nothing on
                   the host (and can be captured in a CUDA graph). Needs a fixed partitions,
                   a fixed strategy and split "tokens", and the same token count on every
                   rank. Pairs past a capacity are dropped and counted in `overflowed`: the
                   caller must check it and rerun such a step dropless (`dropless`). With
                   one rank it changes nothing (that pass reads nothing already).
    """

    def __init__(self, config, group=None, partitions="auto", strategy="auto", *,
                 profile: HardwareProfile | ProfileCache | None = None,
                 memory_budget: int | MemoryBudget | None = None,
                 search: GranularitySearch | None = None, host_pool: HostBufferPool | None = None,
                 split: str | None = None, sync_free_capacity: float | None = None, hot_replicas: bool = False,
                 device=None, dtype=None):
        if split is not None and split not in SPLITS:
            raise ValueError(f"split={split!r} is invalid: give one of {', '.join(map(repr, SPLITS))}")
        if not isinstance(hot_replicas, bool):
            raise ValueError(f"hot_replicas={hot_replicas!r} is invalid: give True (replicate the hottest expert "
                             f"where the performance model says it pays) or False")
        if hot_replicas and sync_free_capacity is not None:
            raise ValueError(f"hot_replicas=True needs the dropless exchange (its decision rides the count "
                             f"exchange), not sync_free_capacity={sync_free_capacity!r}: give one of them")
        super().__init__(config, group, host_pool=host_pool, device=device, dtype=dtype)
        split, search = self._split_and_search(partitions, split, search)
        self.planner = Planner(config, self.group, partitions, strategy, profile=profile,
                               memory_budget=memory_budget, search=search, host_pool=self.host_pool,
                               split=split if split != "auto" else "tokens")
        self.partitions, self.strategy, self.memory_budget, self.split = partitions, strategy, memory_budget, split
        self.search = self.planner.search
        self.last_partitions: int | None = None
        self.last_split: str | None = None
        self.last_strategy: str | None = None  # type: ignore[assignment]  # (None until the first pass)
        self.sync_free_capacity = sync_free_capacity
        self.shadowing = hot_replicas

    def _shadow_costs(self, dtype: torch.dtype, device: torch.device) -> ShadowCosts:
        """The replication rule's terms from the planner's profile (a HardwareProfile, or one
        its ProfileCache has agreed for this group, device and dtype), else FasterMoE's
        defaults. Only rank 0's are used (they ride the count exchange)."""
        profile = self.planner.profile
        if isinstance(profile, ProfileCache):
            profile = profile.profiles.get(ProfileCache._key(self.group.size, device, dtype))  # type: ignore[assignment]
        return ShadowCosts.of(self.config, dtype, self.experts.w1.dtype,
                              profile if isinstance(profile, HardwareProfile) else None)

    def _choose_shadowed(self, load_WE: np.ndarray, costs: ShadowCosts) -> tuple[int, ...]:
        return choose_replicated(load_WE, costs)

    def _split_and_search(self, partitions: int | str, split: str | None, search: GranularitySearch | None
                          ) -> tuple[str, GranularitySearch | None]:
        """The split (the default resolved, see the class docstring) and the search, checked
        against each other and the world size W: a peer split's n divides W."""
        world = self.group.size
        if partitions != "auto":
            split = split or "tokens"
            if split == "auto":
                raise ValueError(f"split='auto' needs partitions='auto' (the search times both splits); with "
                                 f"partitions={partitions!r} give split='tokens' or 'peers'")
            if split == "peers" and isinstance(partitions, int) and not isinstance(partitions, bool) \
                    and partitions >= 1 and world % partitions:
                raise ValueError(f"partitions={partitions} is invalid with split='peers': give a divisor of the "
                                 f"expert-parallel world size {world} (each partition is W/n peers)")
            return split, search
        splits = {"tokens": ("tokens",), "peers": ("peers",), "auto": SEARCH_SPLITS}
        if search is None:
            split = split or "auto"
            search = GranularitySearch(splits=splits[split])
        elif split is None:
            split = "auto" if len(search.splits) > 1 else search.splits[0]
        elif tuple(search.splits) != splits[split]:
            raise ValueError(f"split={split!r} contradicts the search's splits={search.splits}: give "
                             f"GranularitySearch(splits={splits[split]}) or leave split out")
        search.limit_to_world(world)
        return split, search

    def _chunk_pairs(self, routing, chunks):
        tokens = routing.expert_ids_TK.shape[0]
        return dispatcher.chunk_by_tokens(tokens, self.config.top_k, chunks, routing.expert_ids_TK.device)


    def _run_experts(self, x_TD, plan, pass_plan):
        self.last_partitions, self.last_split = pass_plan.partitions, pass_plan.split
        return super()._run_experts(x_TD, plan, pass_plan)

    @property
    def profile(self) -> HardwareProfile | ProfileCache:
        """The planner's profile (a HardwareProfile given, once the ranks differed, is
        replaced by rank 0's)."""
        return self.planner.profile

    @property
    def host_fallback_reason(self) -> str | None:
        """Why the last host-memory check chose S4 over an offload (None: it fitted)."""
        return self.planner.host_fallback_reason
