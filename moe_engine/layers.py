"""The public MoE layers: MPipeMoE and the FastMoE / FasterMoE baselines.

All three share `MoELayerBase`: the same configuration, the same parameters
(router.weight, experts.w1/b1/w2/b2[/w3]), the same call ``y, aux_loss = layer(x)``
and the same kernels (dispatcher.py, experts.py, pipeline.py). They differ only in
how step 2 cuts the routed rows into partitions and what step 3 keeps for backward,
so a measured difference between them is the method's, not the implementation's:

    1. route       softmax top-k gate, capacity, load-balance loss          (local)
    2. plan        partition rows, exchange counts + pass statistics        (local + one collective)
    3. experts     dispatch → expert FFN → combine, pipelined per partition  (pipeline.py)
    4. un-permute  weight each row by its gate and sum per token            (local)

FastMoE: one partition, keeps everything autograd would (T_DI, A and act(A)).
FasterMoE: partitions along the destination ranks, keeps everything.
MPipeMoE: partitions along the tokens (n chosen online), shares buffers and restores
them by a strategy S1–S4 (chosen by the performance model).

Host reads: with several ranks a pass reads the device once (the count tables and the
pass statistics, together); with one rank never (dispatcher.py says how).

Legend (the engine's, see docs/engine.md): T tokens on this rank, D d_model, K top_k,
E experts, C count chunks, R rows sent.
"""
from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
import torch.nn as nn

from . import dispatcher
from .comm import ExpertGroup
from .config import STRATEGIES, MoEConfig
from .dispatcher import DispatchPlan, PassStats
from .experts import Experts
from .memory import HostBufferPool, RestorePolicy, predict_memory
from .pipeline import PipelinedExperts, PipelineRun
from .granularity import GranularitySearch, PassTiming, skew_bucket
from .perf_model import SHARED_STRATEGIES, HardwareProfile, PerformanceModel, ProfileCache
from .router import Router, Routing
from .streams import StreamSet

log = logging.getLogger(__name__)


class NonFiniteInputError(ValueError):
    """NaN or Inf in some rank's MoE layer input; raised on every rank together."""


class MoELayerBase(nn.Module):
    """Router + this rank's experts + the steps every engine shares."""

    keep_activation = False  # FastMoE keeps act(A) for backward, as autograd would

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
        self._streams: dict[torch.device, StreamSet] = {}

    def streams_for(self, device: torch.device) -> StreamSet:
        if device not in self._streams:
            self._streams[device] = StreamSet(device)
        return self._streams[device]

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

    # -- step 2: plan (engine hooks) -------------------------------------------------------------
    def _count_chunks(self) -> int:
        """Chunks the counts are exchanged in: a multiple of every n this pass may use."""
        return 1

    def _chunk_pairs(self, routing: Routing, chunks: int) -> torch.Tensor:
        """Local. Chunk of each (token, choice) pair."""
        return torch.zeros(routing.expert_ids_TK.numel(), dtype=torch.long, device=routing.expert_ids_TK.device)

    def _partitions(self, stats: PassStats) -> int:
        """n for this pass, from agreed values only (it decides which collectives run)."""
        return 1

    def _wants_skew(self) -> bool:
        return False

    def plan(self, x_TD: torch.Tensor, routing: Routing) -> DispatchPlan:
        """Step 2. With one rank: local, no device reads. With several: count rows (local),
        exchange counts with every rank's pass statistics (one collective), read both
        (the pass's one device read), raise together on NaN/Inf, choose n, plan (local)."""
        E = self.config.num_experts
        if not self.group.distributed:
            stats = PassStats(False, x_TD.shape[0], 0)
            n = self._partitions(stats)
            return dispatcher.plan_single(routing, self._chunk_pairs(routing, n), n, E, stats)
        chunks = self._count_chunks()
        chunk_P = self._chunk_pairs(routing, chunks)
        counts_CE = dispatcher.count_rows(routing, chunk_P, chunks, E, single=False)
        skew = skew_bucket(counts_CE.sum(0)) if self._wants_skew() else 0
        stats = dispatcher.pass_stats(x_TD, skew)
        tables = dispatcher.read_counts(counts_CE, dispatcher.exchange_counts(counts_CE, stats, self.group))
        agreed = tables.stats
        if agreed.nonfinite:
            where = "this rank's" if tables.stats_W[self.group.rank, 0] else "another rank's"
            raise NonFiniteInputError(f"NaN or Inf in {where} MoE layer input; check the loss scale and "
                                      f"learning rate, or the data that produced it")
        return dispatcher.plan_exchanged(routing, chunk_P, self._partitions(agreed), tables, self.group)

    # -- step 3: experts ---------------------------------------------------------------------
    def _strategy_for(self, x_TD: torch.Tensor, plan: DispatchPlan) -> str:
        return "none"

    def _pass_timing(self, device: torch.device) -> PassTiming | None:
        return None

    def _run_experts(self, x_TD: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """Rows in send order (R × D) after dispatch → experts → combine. Any choice that
        changes which collectives run depends on agreed values only (plan.stats), never
        on this rank's token count, or ranks with different batches would hang."""
        self.last_strategy = self._strategy_for(x_TD, plan)
        experts, out_dtype = self.experts, x_TD.dtype
        device_type = x_TD.device.type
        if torch.is_autocast_enabled(device_type):
            # Mixed precision (float32 master weights under autocast): the experts compute,
            # and the All-to-Alls move rows, in the autocast dtype. The weights are cast once
            # per pass; autograd takes their gradients back to float32 through the cast.
            compute = torch.get_autocast_dtype(device_type)
            experts = experts.cast(compute)
            x_TD = x_TD.to(compute)
        run = PipelineRun(experts, self.group, plan, self.streams_for(x_TD.device),
                          RestorePolicy.of(self.last_strategy), self.host_pool,
                          timing=self._pass_timing(x_TD.device) if torch.is_grad_enabled() else None,
                          keep_activation=self.keep_activation)
        e = experts
        return PipelinedExperts.apply(x_TD, run, e.w1, e.b1, e.w2, e.b2, e.w3).to(out_dtype)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x_TD = self._tokens(x)
        routing = self.router(x_TD)                                                    # 1. route
        plan = self.plan(x_TD, routing)                                                # 2. plan
        y_RD = self._run_experts(x_TD, plan)                                           # 3. experts
        y_TD = dispatcher.unpermute(y_RD, plan, routing.weights_TK, routing.keep_TK)   # 4. un-permute
        return y_TD.reshape(x.shape), routing.aux_loss.to(x.dtype)


class FastMoE(MoELayerBase):
    """Keep-everything baseline: one dispatch, all experts, one combine; no partitions,
    no memory reuse; keeps T_DI, A and act(A) for backward, as autograd would (as
    FastMoE does). Same kernels as the other engines."""

    keep_activation = True

    def __init__(self, config, group=None, *, device=None, dtype=None):
        super().__init__(config, group, device=device, dtype=dtype)


class FasterMoE(MoELayerBase):
    """FasterMoE-style baseline: the batch is split along the *device* dimension.
    Step s exchanges with one group of `group_size` peers (ranks rank+s·g … rank+s·g+g−1)
    and overlaps that exchange with the previous step's experts. No memory reuse."""

    def __init__(self, config, group=None, *, group_size: int = 4, device=None, dtype=None):
        super().__init__(config, group, device=device, dtype=dtype)
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size={group_size!r} is invalid: give a positive integer "
                             f"(peers per exchange step; FasterMoE uses 4)")
        self.group_size = min(group_size, self.group.size)

    @property
    def steps(self) -> int:
        return -(-self.group.size // self.group_size)

    def _count_chunks(self):
        return self.steps

    def _chunk_pairs(self, routing, chunks):
        return dispatcher.chunk_by_peers(routing.expert_ids_TK, self.local_experts,
                                         self.group.rank, self.group.size, self.group_size)

    def _partitions(self, stats):
        return self.steps


class MPipeMoE(MoELayerBase):
    """MPipeMoE: the batch's tokens are split into n partitions; partition i+1's
    All-to-All overlaps partition i's experts; T_DI / A / T_DO share one-partition
    buffers and backward restores them by the strategy S1–S4 ("none" keeps all).

    partitions:    "auto" (online search, granularity.py) or an int ≥ 1.
    strategy:      "auto" (performance model, perf_model.py), "none", "S1", "S2", "S3" or "S4".
    profile:       a HardwareProfile, or a ProfileCache shared by the model's layers
                   (default: a cache of this layer's own); a missing profile is measured
                   on the first pass that needs one, by all ranks together.
    memory_budget: bytes the layer's activations may use; "auto" then picks the fastest
                   strategy that fits (and "none" may compete), or fails naming the need.
    search:        the GranularitySearch to use (candidates, re-check period, ...).
    host_pool:     pinned host buffers for offloads; share one between layers if you like.
                   An offloading strategy (S1–S3) whose buffers would not fit in the host
                   memory the pool may take falls back to S4 on every rank, with a logged
                   reason (``host_fallback_reason``).
    """

    def __init__(self, config, group=None, partitions="auto", strategy="auto", *,
                 profile: HardwareProfile | ProfileCache | None = None, memory_budget: int | None = None,
                 search: GranularitySearch | None = None, host_pool: HostBufferPool | None = None,
                 device=None, dtype=None):
        super().__init__(config, group, host_pool=host_pool, device=device, dtype=dtype)
        if partitions != "auto" and (isinstance(partitions, bool) or not isinstance(partitions, int)
                                     or partitions < 1):
            raise ValueError(f"partitions={partitions!r} is invalid: give 'auto' or an integer >= 1")
        if strategy != "auto" and strategy not in STRATEGIES:
            raise ValueError(f"strategy={strategy!r} is invalid: give 'auto' or one of {', '.join(STRATEGIES)}")
        if memory_budget is not None and (not isinstance(memory_budget, int) or memory_budget <= 0):
            raise ValueError(f"memory_budget={memory_budget!r} is invalid: give a positive number of bytes or None")
        self.partitions = partitions
        self.strategy = strategy
        self.profile = profile if profile is not None else ProfileCache()
        self.memory_budget = memory_budget
        self.search = search if search is not None else GranularitySearch()
        self.last_partitions: int | None = None
        self.last_strategy: str | None = None
        self.host_fallback_reason: str | None = None  # why the last check chose S4 over an offload
        self._host_check: tuple | None = None         # (pass shape, fell back) of the last host check

    def _count_chunks(self):
        """n when fixed; with the online search, a multiple of every candidate n (n is
        chosen only once the pass statistics arrive with the counts)."""
        if self.partitions != "auto":
            return self.partitions
        return math.lcm(*self.search.candidates)

    def _chunk_pairs(self, routing, chunks):
        tokens = routing.expert_ids_TK.shape[0]
        return dispatcher.chunk_by_tokens(tokens, self.config.top_k, chunks, routing.expert_ids_TK.device)

    def _wants_skew(self):
        return self.partitions == "auto"

    def _partitions(self, stats):
        if self.partitions == "auto":
            n = self.search.choose(stats.max_tokens, stats.skew_bucket, self.group,
                                   timing_wanted=torch.is_grad_enabled(),
                                   min_partitions=self._fewest_partitions_within_budget(stats.max_tokens))
        else:
            n = self.partitions
        self.last_partitions = n
        return n

    def _fewest_partitions_within_budget(self, tokens: int) -> int:
        """With a memory budget, the smallest candidate n whose leanest strategy fits
        (the memory model shrinks as n grows); 1 without a budget."""
        if self.memory_budget is None:
            return 1
        param_dtype = self.router.weight.dtype
        for n in self.search.candidates:
            leanest = min(predict_memory(self.config, tokens, self.group.size, n, s, dtype=param_dtype).peak_bytes
                          for s in STRATEGIES)
            if leanest <= self.memory_budget:
                return n
        return self.search.candidates[-1]

    def _pass_timing(self, device):
        return self.search.timing_for_pass(self.last_partitions, device) if self.partitions == "auto" else None

    def performance_model(self, x_TD: torch.Tensor, tokens: int | None = None) -> PerformanceModel:
        """The model over this layer's profile (from the shared cache, or measured now
        on every rank when the cache has none). ``tokens``: the token count to measure
        with, the same on every rank (default: this rank's)."""
        profile = self.profile
        if isinstance(profile, ProfileCache):
            tokens = x_TD.shape[0] if tokens is None else tokens
            profile = profile.get_or_measure(self.config, max(tokens, 1), self.group, x_TD.device, x_TD.dtype)
        return PerformanceModel(profile)

    def _strategy_for(self, x_TD, plan):
        """The strategy of this pass: the same on every rank (it decides whether backward
        runs re-communication All-to-Alls), so it is chosen from agreed values only."""
        strategy = self.strategy
        if strategy == "auto":
            model = self.performance_model(x_TD, plan.stats.max_tokens)
            strategy = model.choose(self.config, plan.stats.max_tokens, self.group.size, x_TD.dtype,
                                    [len(plan.partitions)], SHARED_STRATEGIES, self.memory_budget).strategy
        if torch.is_grad_enabled() and RestorePolicy.of(strategy).offloads:
            strategy = self._host_memory_fallback(strategy, x_TD, plan)
        return strategy

    def _host_memory_fallback(self, strategy: str, x_TD: torch.Tensor, plan: DispatchPlan) -> str:
        """``strategy``, or S4 (no host memory) on every rank when the host buffers of this
        pass do not fit on some rank. One collective (a max over ranks), run only when the
        agreed pass shape (tokens, skew, n, strategy) differs from the last one checked."""
        agreed = plan.stats
        key = (agreed.max_tokens, agreed.skew_bucket, len(plan.partitions), strategy)
        if self._host_check is not None and self._host_check[0] == key:
            return "S4" if self._host_check[1] else strategy
        policy = RestorePolicy.of(strategy)
        widths = [self.config.d_model] * policy.offload_input + \
            [self.experts.pre_activation_width] * policy.offload_preactivation
        requests = [(p.rows_received * w, x_TD.dtype) for p in plan.partitions for w in widths]
        grow = self.host_pool.bytes_to_grow(requests)
        usable = self.host_pool.usable_bytes() if grow else 0
        short_local = torch.tensor([int(grow > usable)], dtype=torch.int64, device=x_TD.device)
        short = bool(self.group.all_reduce_max(short_local).item())
        self._host_check = (key, short)
        if short:
            where = (f"needs {grow:,} more bytes of host memory, {usable:,} usable" if grow > usable
                     else "does not fit on another rank")
            self.host_fallback_reason = (f"{strategy} for {agreed.max_tokens} tokens, n={len(plan.partitions)} "
                                         f"{where}: using S4 (re-communication + recomputation) instead")
            log.warning("MPipeMoE: %s", self.host_fallback_reason)
            return "S4"
        self.host_fallback_reason = None
        return strategy
