"""Auxiliary-loss-free load balancing in training: each MoE layer's expert bias, moved after
every optimizer step from that step's tokens per expert (moe_engine/router.py).

    balance = ExpertBalance(model.moe_layers(), rate, device)  # hooks each layer's router
    balance.start_step()                 # a step's (or its dropless rerun's) first forward
    ...                                  # forwards: this step's counts add up on the device
    counts = balance.counts_LE           # the trainer sums them over every rank (its loss all-reduce)
    balance.update(summed_counts_LE)     # after the optimizer step: bias += rate * sign(mean - count)

Every rank holds every MoE layer (its router is replicated; the experts are split over
the expert group and replicated across groups), so the counts summed over the whole world
are each layer's counts over every rank that holds it. The trainer sums them in the step's
loss all-reduce (workers/loop.py), which runs on every rank every step: no collective is
added, and every rank moves its bias by the same numbers. The counts are whole numbers
(float64 sums below 2**53 are exact in any order), so the bias stays bitwise the same on
every rank. The bias is a buffer of the router: no gradient, kept out of DDP's buffer
broadcast (workers/distributed.py), saved in checkpoints with the model.

A forward that activation checkpointing runs again in backward is not counted again.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from moe_engine.layers import recomputing
from moe_engine.router import count_ids, update_expert_bias


class ExpertBalance:
    """This step's (token, choice) pairs per expert of ``layers`` (MoE layers with a
    ``router``) on ``device``, and the update of their routers' ``expert_bias`` by ``rate``
    (0: off; nothing is hooked nor counted)."""

    def __init__(self, layers: Sequence[Any], rate: float, device: torch.device):
        self.routers = [layer.router for layer in layers]
        self.rate = rate
        self.num_experts = layers[0].config.num_experts
        self.counts_LE = torch.zeros(len(layers), self.num_experts, dtype=torch.int64, device=device)
        self.handles = [router.register_forward_hook(functools.partial(self._count, index))
                        for index, router in enumerate(self.routers)] if self.enabled else []

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def _count(self, index: int, router: nn.Module, inputs: Any, routing: Any) -> None:
        """Local (a forward hook): add this training forward's pairs to layer ``index``."""
        if not router.training or recomputing():
            return
        with torch.no_grad():
            self.counts_LE[index] += count_ids(routing.expert_ids_TK, self.num_experts)

    def start_step(self) -> None:
        """Local. The counts start afresh (a step's first forward, or its dropless rerun's)."""
        self.counts_LE.zero_()

    @torch.no_grad()
    def update(self, summed_LE: torch.Tensor) -> None:
        """Local. Every layer's bias moved by ``rate`` from ``summed_LE``, the step's counts
        summed over every rank (the same tensor on every rank)."""
        for router, counts_E in zip(self.routers, summed_LE):
            update_expert_bias(router.expert_bias, counts_E, self.rate)

    def bias_metrics(self) -> dict[str, float]:
        """Local (one device read). ``expert_bias/l{l}/e{e}``: each layer's bias vector, and
        ``expert_bias/absmax``: the largest magnitude over the layers."""
        bias_LE = torch.stack([router.expert_bias for router in self.routers]).tolist()
        metrics = {f"expert_bias/l{layer}/e{e}": value
                   for layer, bias_E in enumerate(bias_LE) for e, value in enumerate(bias_E)}
        metrics["expert_bias/absmax"] = max(abs(v) for bias_E in bias_LE for v in bias_E)
        return metrics

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def step_imbalance(counts_LE: Sequence[Sequence[float]]) -> dict[str, float]:
    """Local. ``moe_load/step_imbalance_max``: the largest max/mean ratio of a layer's tokens
    per expert over the layers, in one step (1.0: even; E: every pair on one expert)."""
    worst = math.nan
    for counts_E in counts_LE:
        total = sum(counts_E)
        if total:
            ratio = max(counts_E) / (total / len(counts_E))
            worst = ratio if math.isnan(worst) else max(worst, ratio)
    return {} if math.isnan(worst) else {"moe_load/step_imbalance_max": worst}
