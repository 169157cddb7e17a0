"""FasterMoE's dynamic shadowing (He et al., "FasterMoE", PPoPP'22, §4), for the FasterMoE baseline,
and MPipeMoE's hot-expert replication (`choose_replicated`), which runs the same steps.

A hot expert's tokens cost more to send to its owner (and its output back, forward and
backward) than its weights cost to send to every rank: FasterMoE then *shadows* it. Per
pass:

  1. decide   which experts to shadow, from every rank's rows per global expert (they ride
              in the count exchange the pass makes anyway, so every rank holds the same
              table and decides the same, by construction; `choose_shadowed`).   (local)
  2. weights  each shadowed expert's parameters are broadcast from its owner to every rank
              of the expert group (one broadcast per expert, in expert order). (collective)
  3. compute  each rank runs its own pairs of a shadowed expert itself, with those weights;
              they are not dispatched (the All-to-Alls carry the other experts' rows only).
                                                                                  (local)
  4. backward the shadowed weights' gradients are summed onto their owner (one reduce per
              expert, in expert order), before the pipeline's backward starts.  (collective)

The rule (the paper's performance model, as FasterMoE ships it in `fmoe/fastermoe/shadow_policy.py`):
a pass costs about Lat(B) = 3·c·B + 4·f·B, where B is the load of the busiest non-shadowed
expert (rows, over all ranks), c one row's FFN forward (backward is twice that: 3c) and f
one row's trip on the link (dispatch and combine, forward and backward: 4f). Experts are
taken hottest first; shadowing the i hottest costs i·m (m: one expert's parameters on the
link) and leaves B_{i+1} as the busiest load. The next expert is shadowed while
Lat(B_{i+1}) + i·m < the latency so far. The terms are the engine's performance-model
figures where a `HardwareProfile` is given (its GEMM rate and All-to-All bandwidth), else
FasterMoE's own defaults (50 Gbit/s links, 11.5 TFLOP/s GEMMs); the bytes are the compute
dtype's (rows) and the parameters' (weights).

Shapes: see moe_engine's legend (moe_engine/__init__.py); S shadowed experts, X one
expert's parameters flattened (w1, b1, w2, b2, w3 as present).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .comm import ExpertGroup
from .config import MoEConfig
from .perf_model import HardwareProfile
from .router import Routing

# FasterMoE's defaults for its policy (FMOE_FASTER_GLBPLC_NETBW, FMOE_FASTER_GLBPLC_GPUTP):
# used where the layer is given no HardwareProfile.
DEFAULT_LINK_BYTES_PER_S = 50e9 / 8
DEFAULT_GEMM_FLOPS = 11.5e12
# The values the costs add to the count exchange's statistics (before the E loads).
COST_VALUES = 3
PARAMETER_NAMES = ("w1", "b1", "w2", "b2", "w3")


@dataclass(frozen=True)
class ShadowCosts:
    """The terms of FasterMoE's rule, in seconds.

    row_s:          one row (D values of the compute dtype) over the link.
    expert_s:       one expert's parameters over the link.
    compute_row_s:  one row through one expert's FFN, forward."""

    row_s: float
    expert_s: float
    compute_row_s: float

    @classmethod
    def of(cls, config: MoEConfig, compute_dtype: torch.dtype, parameter_dtype: torch.dtype,
           profile: HardwareProfile | None = None) -> ShadowCosts:
        """Local. The costs of ``config``'s experts from ``profile`` (None: FasterMoE's defaults)."""
        link = profile.a2a_bytes_per_s if profile is not None else DEFAULT_LINK_BYTES_PER_S
        flops = profile.gemm_flops if profile is not None else DEFAULT_GEMM_FLOPS
        D, H, A = config.d_model, config.d_hidden, config.pre_activation_width
        row_bytes = D * torch.empty((), dtype=compute_dtype).element_size()
        expert_bytes = expert_parameters(config) * torch.empty((), dtype=parameter_dtype).element_size()
        return cls(row_bytes / link, expert_bytes / link, 2 * D * (A + H) / flops)

    def values(self) -> list[int]:
        """Local. The three costs as int64 (their float64 bits), to ride in the count exchange."""
        bits = np.asarray([self.row_s, self.expert_s, self.compute_row_s], dtype=np.float64).view(np.int64)
        return [int(b) for b in bits]

    @classmethod
    def from_values(cls, values: Sequence[int] | np.ndarray) -> ShadowCosts:
        """Local. The inverse of `values`."""
        row_s, expert_s, compute_row_s = np.asarray(values, dtype=np.int64).view(np.float64).tolist()
        return cls(row_s, expert_s, compute_row_s)

    def latency(self, busiest_rows: float) -> float:
        """Lat(B) = 3·c·B + 4·f·B: the pass as bound by its busiest expert's B rows."""
        return (3 * self.compute_row_s + 4 * self.row_s) * busiest_rows


def expert_parameters(config: MoEConfig) -> int:
    """Host arithmetic. Values in one expert's parameters (w1, b1, w2, b2, w3 as present)."""
    D, H = config.d_model, config.d_hidden
    return 2 * D * H + (D * H if config.gated else 0) + ((H + D) if config.bias else 0)


def choose_shadowed(load_E: Sequence[int] | np.ndarray, costs: ShadowCosts) -> tuple[int, ...]:
    """Local, host arithmetic. The experts to shadow (ascending ids) for rows per global
    expert ``load_E`` (summed over every rank), by FasterMoE's greedy rule (module
    docstring). Experts of equal load are taken in id order, so equal inputs give equal
    answers; the coldest expert is never shadowed."""
    load = np.asarray(load_E, dtype=np.int64)
    order = sorted(range(load.size), key=lambda e: (-int(load[e]), e))
    best = costs.latency(float(load[order[0]])) if order else 0.0
    chosen: list[int] = []
    for i in range(len(order) - 1):
        latency = costs.latency(float(load[order[i + 1]])) + (i + 1) * costs.expert_s
        if latency >= best:
            break
        best = latency
        chosen.append(order[i])
    return tuple(sorted(chosen))


def choose_replicated(load_WE: np.ndarray, costs: ShadowCosts) -> tuple[int, ...]:
    """Local, host arithmetic. MPipeMoE's hot-expert replication (its minimal form: the
    hottest expert, on every rank of the group), from every rank's rows per global expert
    ``load_WE`` [W, E]: () or (the hottest expert,), lowest id among equals.

    A pass is bound by its busiest rank: on the link by the rows it receives (dispatch and
    combine, forward and backward: 4·f per row), in compute by the rows it runs (3·c per
    row). A replica takes the hot expert's rows off its owner's link and compute; each rank
    then runs its own rows of that expert, and its weights cross the link twice (broadcast
    forward, gradient reduction backward: 2·m). Replicate where that is faster."""
    load = np.asarray(load_WE, dtype=np.int64)
    world, experts = load.shape
    total_E = load.sum(axis=0)
    if not total_E.any():
        return ()
    hot = int(np.argmax(total_E))
    received_W = total_E.reshape(world, experts // world).sum(axis=1)
    without_E = total_E.copy()
    without_E[hot] = 0
    received_after_W = without_E.reshape(world, experts // world).sum(axis=1)
    before = 4 * costs.row_s * received_W.max() + 3 * costs.compute_row_s * received_W.max()
    after = (4 * costs.row_s * received_after_W.max() + 3 * costs.compute_row_s * (received_after_W + load[:, hot]).max()
             + 2 * costs.expert_s)
    return (hot,) if after < before else ()


@dataclass(frozen=True)
class ShadowPass:
    """One pass's shadowing on this rank (the layer's step 2 builds it, steps 3-4 use it).

    experts:    the shadowed global experts, ascending (the same on every rank).
    rows_S:     this rank's rows for each of them (host, from the count tables).
    dispatched: the routing the All-to-Alls carry: the shadowed pairs left out (not kept)."""

    experts: tuple[int, ...]
    rows_S: tuple[int, ...]
    dispatched: Routing


def shadow_pass(routing: Routing, experts: tuple[int, ...], rows_S: Sequence[int], num_experts: int) -> ShadowPass:
    """Local, no device reads (one small host-to-device copy). The pass's `ShadowPass`."""
    shadowed_E = torch.zeros(num_experts, dtype=torch.bool)
    shadowed_E[list(experts)] = True
    shadowed_TK = shadowed_E.to(routing.expert_ids_TK.device, non_blocking=True)[routing.expert_ids_TK]
    dispatched = dataclasses.replace(routing, keep_TK=routing.keep_TK & ~shadowed_TK)
    return ShadowPass(experts, tuple(int(r) for r in rows_S), dispatched)


class _BroadcastShadowed(torch.autograd.Function):
    """Forward: the shadowed experts' parameters, [S, X], broadcast from their owners.
    Backward: their gradients summed onto the owners (`ExpertGroup.reduce_sum`), handed to
    the owner's parameters (the other ranks get none).

    ``anchor`` (the pipeline's output rows) is an input only so that backward runs this
    node's reductions before the pipeline's backward on every rank: autograd runs a node
    once every node that uses its output has run, so the collectives' order is the same
    everywhere by construction. It gets no gradient."""

    @staticmethod
    def forward(ctx: Any, group: ExpertGroup, experts: tuple[int, ...], local: int, anchor: torch.Tensor,
                *parameters: torch.Tensor) -> torch.Tensor:
        width = sum(p[0].numel() for p in parameters)
        flat_SX = parameters[0].new_empty(len(experts), width)
        for j, expert in enumerate(experts):
            owner, index = divmod(expert, local)
            if owner == group.rank:
                torch.cat([p[index].reshape(-1) for p in parameters], out=flat_SX[j])
            group.broadcast(flat_SX[j], owner)
        ctx.group, ctx.experts, ctx.local = group, experts, local
        ctx.shapes = [p.shape for p in parameters]
        return flat_SX

    @staticmethod
    def backward(ctx: Any, grad_SX: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        group, local = ctx.group, ctx.local
        grads: list[torch.Tensor | None] = [None] * len(ctx.shapes)
        sizes = [int(np.prod(shape[1:])) for shape in ctx.shapes]
        for j, expert in enumerate(ctx.experts):
            owner, index = divmod(expert, local)
            summed_X = grad_SX[j].contiguous().clone()
            group.reduce_sum(summed_X, owner)
            if owner != group.rank:
                continue
            for k, (piece, shape) in enumerate(zip(summed_X.split(sizes), ctx.shapes)):
                if grads[k] is None:
                    grads[k] = grad_SX.new_zeros(shape)
                grads[k][index] += piece.view(shape[1:])  # type: ignore[index]  # (set just above)
        ctx.group = None
        return (None, None, None, None, *grads)


def shadowed_output(x_TD: torch.Tensor, routing: Routing, shadow: ShadowPass, experts: torch.nn.Module,
                    group: ExpertGroup, config: MoEConfig, anchor: torch.Tensor, compute: torch.dtype,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """Steps 2-4 of the module docstring: y_t = Σ_k w_tk · FFN_e(x_t) over this rank's kept
    pairs (t, k) whose expert e is shadowed ([T, D] in ``out_dtype``), the weights broadcast
    (a collective per expert) and their gradients reduced to the owners in backward.
    The rows are found with this rank's per-expert row counts (host, `ShadowPass.rows_S`):
    no device read."""
    parameters = [getattr(experts, name) for name in PARAMETER_NAMES if getattr(experts, name) is not None]
    names = [name for name in PARAMETER_NAMES if getattr(experts, name) is not None]
    flat_SX = _BroadcastShadowed.apply(group, shadow.experts, experts.local_experts, anchor, *parameters)  # type: ignore[no-untyped-call]  # (Function.apply is untyped)
    tokens, top_k = routing.expert_ids_TK.shape
    S = len(shadow.experts)
    # each kept pair of a shadowed expert, grouped by expert (ascending), in pair order
    slot_E = torch.full((config.num_experts,), S, dtype=torch.int64)
    slot_E[list(shadow.experts)] = torch.arange(S)
    slot_P = torch.where(routing.keep_TK.flatten(),
                         slot_E.to(x_TD.device, non_blocking=True)[routing.expert_ids_TK.flatten()], S)
    pairs_R = torch.argsort(slot_P, stable=True)[:sum(shadow.rows_S)]
    x_RD = x_TD.to(compute).index_select(0, pairs_R // top_k)
    sizes = [int(np.prod(getattr(experts, name).shape[1:])) for name in names]
    outputs, start = [], 0
    for j, rows in enumerate(shadow.rows_S):
        weights = dict(zip(names, (piece.view(getattr(experts, name).shape[1:]).to(compute)
                                   for name, piece in zip(names, flat_SX[j].split(sizes)))))
        x_ND = x_RD[start:start + rows]
        pre_NH = x_ND @ weights["w1"]
        if "b1" in weights:
            pre_NH = pre_NH + weights["b1"]
        if config.activation == "relu":
            h_NH = F.relu(pre_NH)
        elif config.activation == "gelu":
            h_NH = F.gelu(pre_NH)
        else:
            h_NH = F.silu(pre_NH) * (x_ND @ weights["w3"])
        y_ND = h_NH @ weights["w2"]
        outputs.append(y_ND + weights["b2"] if "b2" in weights else y_ND)
        start += rows
    y_RD = torch.cat(outputs) if outputs else x_RD
    sum_dtype = torch.promote_types(torch.promote_types(out_dtype, compute), routing.weights_TK.dtype)
    gate_R = routing.weights_TK.reshape(-1).index_select(0, pairs_R).to(sum_dtype)
    y_TD = torch.zeros(tokens, x_TD.shape[1], dtype=sum_dtype, device=x_TD.device).index_add(
        0, pairs_R // top_k, y_RD.to(sum_dtype) * gate_R.unsqueeze(1))
    return y_TD.to(out_dtype)
