"""Top-k gate: softmax and top-k choice (in the order ``MoEConfig.router_rule`` names),
capacity, load-balance loss.

Shapes: see moe_engine's legend (moe_engine/__init__.py).
Everything here is local to the rank (no collectives).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from .config import MoEConfig


@dataclass(frozen=True)
class Routing:
    """Where each token goes and with what weight.

    expert_ids_TK: global expert of each (token, choice), int64.
    weights_TK:    gate weight of each (token, choice), in the router dtype;
                   dropped pairs keep their weight here but are excluded by keep_TK.
    keep_TK:       False where a capacity limit dropped the pair.
    aux_loss:      load-balance loss, a scalar in the router dtype.
    """

    expert_ids_TK: torch.Tensor
    weights_TK: torch.Tensor
    keep_TK: torch.Tensor
    aux_loss: torch.Tensor


def count_ids(ids: torch.Tensor, size: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """How often each id in [0, size) occurs in ``ids`` (each counted ``weights`` times,
    default once), int64 on the ids' device. ``torch.bincount`` gives the same numbers but
    on CUDA reads the largest id back to size its output: a wait for the device."""
    counted = torch.ones_like(ids, dtype=torch.int64) if weights is None else weights.to(torch.int64)
    return torch.zeros(size, dtype=torch.int64, device=ids.device).scatter_add_(0, ids.flatten(), counted.flatten())


def router_dtype(dtype: torch.dtype) -> torch.dtype:
    """Router math runs in fp32, or wider when the input is wider."""
    return torch.promote_types(dtype, torch.float32)


def expert_capacity(config: MoEConfig, tokens: int) -> int | None:
    """Pairs each expert accepts from this rank's tokens; None when dropless."""
    if config.capacity_factor is None:
        return None
    return math.ceil(config.capacity_factor * config.top_k * tokens / config.num_experts)


def capacity_mask(expert_ids_TK: torch.Tensor, num_experts: int, capacity: int | None) -> torch.Tensor:
    """keep_TK for GShard-order filling: all first choices in token order, then all
    second choices, and so on; an expert keeps its first `capacity` pairs."""
    if capacity is None:
        return torch.ones_like(expert_ids_TK, dtype=torch.bool)
    ids_KT = expert_ids_TK.t()
    one_hot_KTE = torch.nn.functional.one_hot(ids_KT, num_experts)
    position_KTE = one_hot_KTE.reshape(-1, num_experts).cumsum(0).reshape(one_hot_KTE.shape) - 1
    position_KT = (position_KTE * one_hot_KTE).sum(-1)
    return (position_KT < capacity).t()


class Router(nn.Module):
    """logits = x @ weightᵀ, weight [E, D] (replicated on every rank)."""

    def __init__(self, config: MoEConfig, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.d_model, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=config.d_model ** -0.5)

    def forward(self, x_TD: torch.Tensor) -> Routing:
        config = self.config
        # The logits GEMM runs in the input dtype (cuBLAS accumulates 16-bit GEMMs in
        # fp32), so autograd keeps x itself rather than a widened copy; softmax,
        # top-k, renormalisation and the balance loss run in fp32 or wider.
        logits_TE = (x_TD @ self.weight.t()).to(router_dtype(x_TD.dtype))
        probs_TE = torch.softmax(logits_TE, dim=-1)
        if config.router_rule == "topk-then-softmax":
            top_logits_TK, expert_ids_TK = torch.topk(logits_TE, config.top_k, dim=-1)
            weights_TK = torch.softmax(top_logits_TK, dim=-1)
        else:
            weights_TK, expert_ids_TK = torch.topk(probs_TE, config.top_k, dim=-1)
            if config.top_k > 1:
                weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        keep_TK = capacity_mask(expert_ids_TK, config.num_experts,
                                expert_capacity(config, x_TD.shape[0]))
        return Routing(expert_ids_TK, weights_TK, keep_TK, self._balance_loss(probs_TE, expert_ids_TK))

    def _balance_loss(self, probs_TE: torch.Tensor, expert_ids_TK: torch.Tensor) -> torch.Tensor:
        """E * sum_e f_e * p_e over this rank's tokens (0 for an empty batch)."""
        tokens, num_experts = probs_TE.shape
        if tokens == 0:
            return probs_TE.sum() * 0.0
        first_choice_fraction_E = count_ids(expert_ids_TK[:, 0], num_experts).to(probs_TE.dtype) / tokens
        mean_prob_E = probs_TE.mean(dim=0)
        return num_experts * (first_choice_fraction_E * mean_prob_E).sum()
