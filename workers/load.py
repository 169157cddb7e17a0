"""Per-expert load of every MoE layer during training: tokens per expert, imbalance, drops.

    load = ExpertLoad(model.moe_layers(), device)   # hooks each layer's router
    ...                                             # training steps: counts add up on the device
    metrics = load.read(world_size)                 # collective, at log steps only; resets

Each MoE layer's router returns a ``Routing`` (moe_engine/router.py): the global expert of
every (token, choice) pair of this rank's tokens and whether a capacity limit kept it. A
forward hook on the router adds them to two ``[L, E]`` int64 tables on the device with
``count_ids`` (a scatter-add: no read of the device, unlike ``bincount`` on CUDA), in
training mode only (validation passes, and a forward that activation checkpointing runs
again in backward, are not counted). ``read`` sums the tables over
ranks (one all-reduce), reads them once and starts afresh, so the training steps in
between pay no host synchronisation for these metrics.

Metrics (over the steps since the last read, all ranks' tokens), for MoE layer l:

- ``moe_load/l{l}/tokens_e{e}``: (token, choice) pairs routed to expert e, before any
  capacity drop (the histogram of the layer's load);
- ``moe_load/l{l}/imbalance``: max over experts / mean over experts of those counts
  (1.0: perfectly balanced; E: everything on one expert);
- ``moe_load/l{l}/dropped_fraction``: pairs dropped by the capacity limit / pairs routed
  (only with a ``capacity_factor``; dropless routing drops nothing);
- ``moe_load/imbalance_max``: the largest imbalance over the layers.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any
import math

import torch
from torch import nn

from moe_engine.layers import recomputing
from moe_engine.router import count_ids
from workers.distributed import all_reduce_sum_


class ExpertLoad:
    """Token counts per expert of ``layers`` (MoE layers with a ``router``), on ``device``."""

    def __init__(self, layers: Sequence[Any], device: torch.device):
        config = layers[0].config
        self.num_experts = config.num_experts
        self.capacity = config.capacity_factor is not None
        self.routed_LE = torch.zeros(len(layers), self.num_experts, dtype=torch.int64, device=device)
        self.kept_LE = torch.zeros_like(self.routed_LE)
        self.handles = [layer.router.register_forward_hook(functools.partial(self._count, index))
                        for index, layer in enumerate(layers)]

    def _count(self, index: int, router: nn.Module, inputs: Any, routing: Any) -> None:
        """Local (a forward hook): add this pass's pairs to layer ``index``'s counts."""
        if not router.training or recomputing():  # (activation checkpointing's second forward)
            return
        with torch.no_grad():
            ids_TK = routing.expert_ids_TK
            self.routed_LE[index] += count_ids(ids_TK, self.num_experts)
            if self.capacity:
                self.kept_LE[index] += count_ids(ids_TK, self.num_experts, routing.keep_TK)

    def read(self, world_size: int) -> dict[str, float]:
        """Collective: the metrics over every rank's tokens since the last read (see the
        module docstring); the counts start afresh."""
        both_2LE = torch.stack([self.routed_LE, self.kept_LE])
        all_reduce_sum_(both_2LE, world_size)
        routed_LE, kept_LE = both_2LE.tolist()  # the one device read
        self.routed_LE.zero_()
        self.kept_LE.zero_()
        metrics, worst = {}, math.nan
        for layer, (routed_E, kept_E) in enumerate(zip(routed_LE, kept_LE)):
            total = sum(routed_E)
            if total == 0:
                continue
            imbalance = max(routed_E) / (total / len(routed_E))
            worst = imbalance if math.isnan(worst) else max(worst, imbalance)
            metrics[f"moe_load/l{layer}/imbalance"] = imbalance
            metrics.update({f"moe_load/l{layer}/tokens_e{e}": count for e, count in enumerate(routed_E)})
            if self.capacity:
                metrics[f"moe_load/l{layer}/dropped_fraction"] = 1 - sum(kept_E) / total
        if not math.isnan(worst):
            metrics["moe_load/imbalance_max"] = worst
        return metrics

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
