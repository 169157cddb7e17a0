"""Brute-force MoE reference (used by the tests and `mpipemoe check`): one token and one expert at a time, from the documented
parameter layout (docs/design.md §4.1). Deliberately naive; every engine is compared with it.

`reference_moe` takes the *global* parameters (all E experts) and one rank's tokens.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .config import MoEConfig


def expert_ffn(x_D: Tensor, e: int, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None,
               w3: Tensor | None, activation: str) -> Tensor:
    """FFN of global expert e on one token."""
    pre = x_D @ w1[e] + (b1[e] if b1 is not None else 0)
    if activation == "relu":
        h = torch.relu(pre)
    elif activation == "gelu":
        h = F.gelu(pre)
    else:
        assert w3 is not None, "swiglu needs w3"
        h = F.silu(pre) * (x_D @ w3[e])
    return h @ w2[e] + (b2[e] if b2 is not None else 0)


def reference_moe(x_TD: Tensor, router_weight: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor,
                  b2: Tensor | None, w3: Tensor | None, config: MoEConfig,
                  expert_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Returns (y_TD, aux_loss) for one rank's tokens. ``expert_bias`` [E] (None: zeros) is
    added to the scores the top-k selects on, never to the gate weights."""
    T, E, K = x_TD.shape[0], config.num_experts, config.top_k
    wide = torch.promote_types(x_TD.dtype, torch.float32)
    choices, weights = [], []
    probs = []
    for t in range(T):
        logits = torch.stack([x_TD[t].to(wide) @ router_weight[e].to(wide) for e in range(E)])
        p = torch.softmax(logits, dim=0)
        probs.append(p)
        bias = logits.new_zeros(E) if expert_bias is None else expert_bias.to(logits)
        if config.router_rule == "topk-then-softmax":  # softmax over the k largest (biased) logits
            top_e = torch.topk(logits.detach() + bias, K).indices
            top_w = torch.softmax(logits[top_e], dim=0)
        else:  # softmax over all E, the k largest (biased) renormalised
            top_e = torch.topk(p.detach() + bias, K).indices
            top_w = p[top_e]
            if K > 1:
                top_w = top_w / top_w.sum()
        choices.append([int(e) for e in top_e])
        weights.append(top_w)
    # GShard capacity: all first choices in token order, then second choices, ...
    keep = [[True] * K for _ in range(T)]
    if config.capacity_factor is not None:
        capacity = math.ceil(config.capacity_factor * K * T / E)
        used = [0] * E
        for k in range(K):
            for t in range(T):
                e = choices[t][k]
                keep[t][k] = used[e] < capacity
                used[e] += 1
    rows = []
    for t in range(T):
        y = torch.zeros_like(x_TD[t])
        for k in range(K):
            if keep[t][k]:
                e = choices[t][k]
                y = y + weights[t][k].to(x_TD.dtype) * expert_ffn(x_TD[t], e, w1, b1, w2, b2, w3, config.activation)
        rows.append(y)
    y_TD = torch.stack(rows) if rows else x_TD.new_zeros(0, x_TD.shape[1])
    if T == 0:
        aux = router_weight.sum().to(wide) * 0
    else:
        f = [sum(1 for t in range(T) if choices[t][0] == e) / T for e in range(E)]
        mean_p = torch.stack(probs).mean(0)
        aux = E * sum((f[e] * mean_p[e] for e in range(E)), mean_p.new_zeros(()))
    return y_TD, aux
