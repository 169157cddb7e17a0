"""The public MoE layers: MPipeMoE and the FastMoE / FasterMoE baselines.

All three share `MoELayerBase`: the same configuration, the same parameters
(router.weight, experts.w1/b1/w2/b2[/w3]) and the same call,
``y, aux_loss = layer(x)``. They differ only in step 3 below, how the routed
rows travel to the experts and back.

    1. route       softmax top-k gate, capacity, load-balance loss      (local)
    2. plan        partition rows, exchange counts                      (local + one collective)
    3. experts     dispatch → expert FFN → combine                       (engine-specific)
    4. un-permute  weight each row by its gate and sum per token        (local)

Legend: T tokens on this rank, D d_model, K top_k, R rows sent.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from . import dispatcher
from .comm import ExpertGroup, all_to_all_with_grad
from .config import STRATEGIES, MoEConfig
from .experts import Experts
from .memory import HostBufferPool, RestorePolicy, predict_memory
from .pipeline import PipelinedExperts, PipelineRun
from .granularity import GranularitySearch, PassTiming, skew_bucket
from .perf_model import SHARED_STRATEGIES, HardwareProfile, PerformanceModel, ProfileCache
from .router import Router, Routing, count_ids
from .streams import StreamSet

log = logging.getLogger(__name__)

class NonFiniteInputError(ValueError):
    """NaN or Inf in some rank's MoE layer input; raised on every rank together."""


@dataclass(frozen=True)
class AgreedStep:
    """Values every rank agrees on for one pass (max over ranks)."""

    max_tokens: int
    skew_bucket: int


class MoELayerBase(nn.Module):
    """Router + this rank's experts + the checks every engine shares."""

    def __init__(self, config: MoEConfig, group: dist.ProcessGroup | None = None, *, device=None, dtype=None):
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
        self.config = config
        self.group = ExpertGroup(group)
        self.local_experts = config.experts_per_rank(self.group.size)
        self.router = Router(config, device=device, dtype=dtype)
        self.experts = Experts(config, self.local_experts, device=device, dtype=dtype)

    # -- shared steps ---------------------------------------------------------------
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
        if x.dtype != self.router.weight.dtype:
            raise TypeError(f"x has dtype {x.dtype} but the layer's parameters are "
                            f"{self.router.weight.dtype}; call layer.to({x.dtype}) or cast x")
        return x.reshape(-1, x.shape[-1])

    def _agree(self, x_TD: torch.Tensor, routing: Routing) -> AgreedStep:
        """One small collective (max over ranks of three numbers): every rank learns
        whether any rank got NaN/Inf, so all raise together instead of some waiting in
        an All-to-All, and all see the same token count and routing skew."""
        bad = (~torch.isfinite(x_TD)).any()
        load_E = count_ids(routing.expert_ids_TK, self.config.num_experts, weights=routing.keep_TK)
        # Built on the input's device (fills, no host copies), read once after the collective.
        local = torch.zeros(3, dtype=torch.int64, device=x_TD.device)
        local[0], local[1], local[2] = bad, x_TD.shape[0], skew_bucket(load_E)
        bad_anywhere, tokens, skew = self.group.all_reduce_max(local).tolist()
        if bad_anywhere:
            where = "this rank's" if bool(bad) else "another rank's"
            raise NonFiniteInputError(f"NaN or Inf in {where} MoE layer input; check the loss scale and "
                             f"learning rate, or the data that produced it")
        return AgreedStep(max_tokens=tokens, skew_bucket=skew)

    def _partition_rows(self, routing: Routing, agreed: AgreedStep) -> tuple[torch.Tensor, int]:
        """Local. Partition of each (token, choice) pair, and the number of partitions."""
        zeros = torch.zeros(routing.expert_ids_TK.numel(), dtype=torch.long, device=routing.expert_ids_TK.device)
        return zeros, 1

    def _run_experts(self, x_TD: torch.Tensor, plan: dispatcher.DispatchPlan, agreed: AgreedStep) -> torch.Tensor:
        """Engine-specific: rows in send order (R × D) after dispatch → experts → combine.
        Any choice that changes which collectives run must depend on ``agreed`` values
        only (never on this rank's token count), or ranks with different batches hang."""
        raise TypeError(f"{type(self).__name__} is abstract; use MPipeMoE, FastMoE or FasterMoE")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x_TD = self._tokens(x)
        routing = self.router(x_TD)                                                    # 1. route
        agreed = self._agree(x_TD, routing)
        partition_P, num_partitions = self._partition_rows(routing, agreed)            # 2. plan
        plan = dispatcher.plan_dispatch(routing, partition_P, num_partitions,
                                        self.config.num_experts, self.group)
        y_RD = self._run_experts(x_TD, plan, agreed)                                   # 3. experts
        y_TD = dispatcher.unpermute(y_RD, plan, routing.weights_TK, routing.keep_TK)   # 4. un-permute
        return y_TD.reshape(x.shape), routing.aux_loss.to(x.dtype)


class FastMoE(MoELayerBase):
    """Keep-everything baseline: one dispatch, all experts, one combine; no overlap,
    no memory reuse; autograd saves whatever each op needs (as FastMoE does)."""

    def _run_experts(self, x_TD, plan, agreed):
        (p,) = plan.partitions
        x_RD = dispatcher.gather_rows(x_TD, p.token_index_R)
        received_ND = all_to_all_with_grad(self.group, x_RD, p.recv_splits, p.send_splits)
        x_ND = dispatcher.to_expert_major(received_ND, p.expert_order_N)
        y_ND = self.experts(x_ND, p.expert_counts)
        y_received_ND = dispatcher.from_expert_major(y_ND, p.source_order_N)
        return all_to_all_with_grad(self.group, y_received_ND, p.send_splits, p.recv_splits)


class _PipelinedLayer(MoELayerBase):
    """Runs step 3 through the pipelined schedule (pipeline.py)."""

    def __init__(self, config, group=None, *, host_pool: HostBufferPool | None = None, device=None, dtype=None):
        super().__init__(config, group, device=device, dtype=dtype)
        self.host_pool = host_pool if host_pool is not None else HostBufferPool()
        self._streams: dict[torch.device, StreamSet] = {}

    def streams_for(self, device: torch.device) -> StreamSet:
        if device not in self._streams:
            self._streams[device] = StreamSet(device)
        return self._streams[device]

    def _strategy_for(self, x_TD: torch.Tensor, plan: dispatcher.DispatchPlan, agreed: AgreedStep) -> str:
        return "none"

    def _pass_timing(self, device: torch.device) -> PassTiming | None:
        return None

    def _run_experts(self, x_TD, plan, agreed):
        self.last_strategy = self._strategy_for(x_TD, plan, agreed)
        run = PipelineRun(self.experts, self.group, plan, self.streams_for(x_TD.device),
                          RestorePolicy.of(self.last_strategy), self.host_pool,
                          timing=self._pass_timing(x_TD.device) if torch.is_grad_enabled() else None)
        e = self.experts
        return PipelinedExperts.apply(x_TD, run, e.w1, e.b1, e.w2, e.b2, e.w3)


class FasterMoE(_PipelinedLayer):
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

    def _partition_rows(self, routing, agreed):
        partition_P = dispatcher.partition_by_peers(routing.expert_ids_TK, self.local_experts,
                                                    self.group.rank, self.group.size, self.group_size)
        return partition_P, self.steps


class MPipeMoE(_PipelinedLayer):
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

    def _partition_rows(self, routing, agreed):
        if self.partitions == "auto":
            n = self.search.choose(agreed.max_tokens, agreed.skew_bucket, self.group,
                                   timing_wanted=torch.is_grad_enabled(),
                                   min_partitions=self._fewest_partitions_within_budget(agreed.max_tokens,
                                                                                        routing.weights_TK.dtype))
        else:
            n = self.partitions
        self.last_partitions = n
        tokens = routing.expert_ids_TK.shape[0]
        return dispatcher.partition_by_tokens(tokens, self.config.top_k, n, routing.expert_ids_TK.device), n

    def _fewest_partitions_within_budget(self, tokens: int, dtype: torch.dtype) -> int:
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

    def _strategy_for(self, x_TD, plan, agreed):
        """The strategy of this pass: the same on every rank (it decides whether backward
        runs re-communication All-to-Alls), so it is chosen from agreed values only."""
        strategy = self.strategy
        if strategy == "auto":
            model = self.performance_model(x_TD, agreed.max_tokens)
            strategy = model.choose(self.config, agreed.max_tokens, self.group.size, x_TD.dtype,
                                    [len(plan.partitions)], SHARED_STRATEGIES, self.memory_budget).strategy
        if torch.is_grad_enabled() and RestorePolicy.of(strategy).offloads:
            strategy = self._host_memory_fallback(strategy, x_TD, plan, agreed)
        return strategy

    def _host_memory_fallback(self, strategy: str, x_TD: torch.Tensor, plan: dispatcher.DispatchPlan,
                              agreed: AgreedStep) -> str:
        """``strategy``, or S4 (no host memory) on every rank when the host buffers of this
        pass do not fit on some rank. One collective (a max over ranks), run only when the
        agreed pass shape (tokens, skew, n, strategy) differs from the last one checked."""
        key = (agreed.max_tokens, agreed.skew_bucket, len(plan.partitions), strategy)
        if self._host_check is not None and self._host_check[0] == key:
            return "S4" if self._host_check[1] else strategy
        policy = RestorePolicy.of(strategy)
        widths = [self.config.d_model] * policy.offload_input + \
            [self.experts.pre_activation_width] * policy.offload_preactivation
        requests = [(p.rows_received * w, x_TD.dtype) for p in plan.partitions for w in widths]
        grow = self.host_pool.bytes_to_grow(requests)
        usable = self.host_pool.usable_bytes() if grow else 0
        short_local = torch.tensor([int(grow > usable)], dtype=torch.int64)
        short = bool(self.group.all_reduce_max(
            short_local.to(x_TD.device) if self.group.distributed and x_TD.is_cuda else short_local).item())
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
