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

import torch
import torch.distributed as dist
import torch.nn as nn

from . import dispatcher
from .comm import ExpertGroup, all_to_all_with_grad
from .config import STRATEGIES, MoEConfig
from .experts import Experts
from .memory import HostBufferPool, RestorePolicy
from .pipeline import PipelinedExperts, PipelineRun
from .router import Router, Routing
from .streams import StreamSet


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

    def _check_finite(self, x_TD: torch.Tensor) -> None:
        """One small collective: every rank learns whether any rank got NaN/Inf, so all
        raise together instead of some waiting in an All-to-All."""
        bad = (~torch.isfinite(x_TD)).any().to(torch.int64).reshape(1)
        bad_anywhere = int(self.group.all_reduce_max(bad).item())
        if bad_anywhere:
            where = "this rank's" if bool(bad.item()) else "another rank's"
            raise ValueError(f"NaN or Inf in {where} MoE layer input; check the loss scale and "
                             f"learning rate, or the data that produced it")

    def _partition_rows(self, routing: Routing, tokens: int) -> tuple[torch.Tensor, int]:
        """Local. Partition of each (token, choice) pair, and the number of partitions."""
        zeros = torch.zeros(routing.expert_ids_TK.numel(), dtype=torch.long, device=routing.expert_ids_TK.device)
        return zeros, 1

    def _run_experts(self, x_TD: torch.Tensor, plan: dispatcher.DispatchPlan) -> torch.Tensor:
        """Engine-specific: rows in send order (R × D) after dispatch → experts → combine."""
        raise TypeError(f"{type(self).__name__} is abstract; use MPipeMoE, FastMoE or FasterMoE")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x_TD = self._tokens(x)
        self._check_finite(x_TD)
        tokens = x_TD.shape[0]
        routing = self.router(x_TD)                                                    # 1. route
        partition_P, num_partitions = self._partition_rows(routing, tokens)            # 2. plan
        plan = dispatcher.plan_dispatch(routing, partition_P, num_partitions,
                                        self.config.num_experts, self.group)
        y_RD = self._run_experts(x_TD, plan)                                           # 3. experts
        y_TD = dispatcher.unpermute(y_RD, plan, routing.weights_TK)                    # 4. un-permute
        return y_TD.reshape(x.shape), routing.aux_loss.to(x.dtype)


class FastMoE(MoELayerBase):
    """Keep-everything baseline: one dispatch, all experts, one combine; no overlap,
    no memory reuse; autograd saves whatever each op needs (as FastMoE does)."""

    def _run_experts(self, x_TD, plan):
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

    def _strategy_for(self, plan) -> str:
        return "none"

    def _run_experts(self, x_TD, plan):
        self.last_strategy = self._strategy_for(plan)
        run = PipelineRun(self.experts, self.group, plan, self.streams_for(x_TD.device),
                          RestorePolicy.of(self.last_strategy), self.host_pool)
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

    def _partition_rows(self, routing, tokens):
        partition_P = dispatcher.partition_by_peers(routing.expert_ids_TK, self.local_experts,
                                                    self.group.rank, self.group.size, self.group_size)
        return partition_P, self.steps


class MPipeMoE(_PipelinedLayer):
    """MPipeMoE: the batch's tokens are split into n partitions; partition i+1's
    All-to-All overlaps partition i's experts; T_DI / A / T_DO share one-partition
    buffers and backward restores them by the strategy S1–S4 ("none" keeps all).

    partitions: "auto" (online search) or an int ≥ 1.
    strategy:   "auto" (performance model), "none", "S1", "S2", "S3" or "S4".
    host_pool:  pinned host buffers for offloads; share one between layers if you like.
    """

    def __init__(self, config, group=None, partitions="auto", strategy="auto", *,
                 host_pool: HostBufferPool | None = None, device=None, dtype=None):
        super().__init__(config, group, host_pool=host_pool, device=device, dtype=dtype)
        if partitions != "auto" and (isinstance(partitions, bool) or not isinstance(partitions, int)
                                     or partitions < 1):
            raise ValueError(f"partitions={partitions!r} is invalid: give 'auto' or an integer >= 1")
        if strategy != "auto" and strategy not in STRATEGIES:
            raise ValueError(f"strategy={strategy!r} is invalid: give 'auto' or one of {', '.join(STRATEGIES)}")
        self.partitions = partitions
        self.strategy = strategy
        self.last_partitions: int | None = None
        self.last_strategy: str | None = None

    def _partition_rows(self, routing, tokens):
        n = self.partitions if self.partitions != "auto" else 1
        self.last_partitions = n
        return dispatcher.partition_by_tokens(tokens, self.config.top_k, n, routing.expert_ids_TK.device), n

    def _strategy_for(self, plan):
        return self.strategy if self.strategy != "auto" else "S4"
