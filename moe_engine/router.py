"""Top-k gate: softmax and top-k choice (in the order ``MoEConfig.router_rule`` names),
capacity, load-balance loss, router z-loss, and the expert bias of auxiliary-loss-free
balancing.

Auxiliary-loss-free balancing (DeepSeek-V3; torchtitan's ``expert_bias``, Megatron-Core's
``--moe-router-enable-expert-bias``): each router holds a per-expert bias ``expert_bias``
(a buffer: no gradient, saved with the model) that is added to the scores the top-k
*selects* on (the softmax probabilities under "softmax-then-topk", the logits under
"topk-then-softmax"); the gate weights of the chosen experts still come from the unbiased
scores. The trainer moves it after each optimizer step by ``update_expert_bias``: an
expert that got fewer than the mean count of the step's tokens gains ``rate``, one that got
more loses ``rate``. A zero bias (the default) selects exactly as without one.

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
    z_loss:        router z-loss (ST-MoE): mean over tokens of logsumexp(logits)^2, a scalar
                   in the router dtype (0 for an empty batch); the caller weights it.
    """

    expert_ids_TK: torch.Tensor
    weights_TK: torch.Tensor
    keep_TK: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor


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


def update_expert_bias(bias_E: torch.Tensor, counts_E: torch.Tensor, rate: float) -> None:
    """Local, in place: ``bias_E += rate * sign(mean(counts_E) - counts_E)`` (DeepSeek-V3's
    update; an expert at the mean keeps its bias). ``counts_E``: the step's (token, choice)
    pairs per expert, summed over every rank that holds the layer, so every rank computes the
    same update from the same numbers."""
    counts_E = counts_E.to(device=bias_E.device, dtype=torch.float64)
    bias_E.add_(torch.sign(counts_E.mean() - counts_E).to(bias_E.dtype), alpha=rate)


def z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """Local. ST-MoE's router z-loss, mean over tokens of logsumexp(logits)^2 (0 for no token)."""
    if logits_TE.shape[0] == 0:
        return logits_TE.sum() * 0.0
    return torch.logsumexp(logits_TE, dim=-1).square().mean()


class Router(nn.Module):
    """logits = x @ weightᵀ, weight [E, D] (replicated on every rank); ``expert_bias`` [E]
    (float32 buffer, zeros until a trainer moves it) shifts the top-k selection only.
    ``z_loss_grad``: whether the routing's z-loss carries a gradient (a trainer with a z-loss
    coefficient sets it); by default its value is computed from detached logits, for the
    logs, and keeps nothing for backward."""

    expert_bias: torch.Tensor
    z_loss_grad: bool = False

    def __init__(self, config: MoEConfig, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.d_model, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=config.d_model ** -0.5)
        self.register_buffer("expert_bias", torch.zeros(config.num_experts, device=device, dtype=torch.float32))

    def _load_from_state_dict(self, state_dict: dict[str, torch.Tensor], prefix: str, *args: object,
                              **kwargs: object) -> None:
        # A state without the bias (a model saved before routers had one, a Mixtral
        # checkpoint: Mixtral has none) loads as a zero bias, which selects as before.
        state_dict.setdefault(prefix + "expert_bias", torch.zeros_like(self.expert_bias))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x_TD: torch.Tensor) -> Routing:
        config = self.config
        # The logits GEMM runs in the input dtype (cuBLAS accumulates 16-bit GEMMs in
        # fp32), so autograd keeps x itself rather than a widened copy; softmax,
        # top-k, renormalisation and the losses run in fp32 or wider.
        logits_TE = (x_TD @ self.weight.t()).to(router_dtype(x_TD.dtype))
        probs_TE = torch.softmax(logits_TE, dim=-1)
        # the selection's scores carry the expert bias; the gate weights come from the unbiased ones
        bias_E = self.expert_bias.to(logits_TE.dtype)
        if config.router_rule == "topk-then-softmax":
            expert_ids_TK = torch.topk(logits_TE.detach() + bias_E, config.top_k, dim=-1).indices
            weights_TK = torch.softmax(logits_TE.gather(1, expert_ids_TK), dim=-1)
        else:
            expert_ids_TK = torch.topk(probs_TE.detach() + bias_E, config.top_k, dim=-1).indices
            weights_TK = probs_TE.gather(1, expert_ids_TK)
            if config.top_k > 1:
                weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        keep_TK = capacity_mask(expert_ids_TK, config.num_experts,
                                expert_capacity(config, x_TD.shape[0]))
        return Routing(expert_ids_TK, weights_TK, keep_TK, self._balance_loss(probs_TE, expert_ids_TK),
                       z_loss(logits_TE if self.z_loss_grad else logits_TE.detach()))

    def _balance_loss(self, probs_TE: torch.Tensor, expert_ids_TK: torch.Tensor) -> torch.Tensor:
        """E * sum_e f_e * p_e over this rank's tokens (0 for an empty batch)."""
        tokens, num_experts = probs_TE.shape
        if tokens == 0:
            return probs_TE.sum() * 0.0
        first_choice_fraction_E = count_ids(expert_ids_TK[:, 0], num_experts).to(probs_TE.dtype) / tokens
        mean_prob_E = probs_TE.mean(dim=0)
        return num_experts * (first_choice_fraction_E * mean_prob_E).sum()
