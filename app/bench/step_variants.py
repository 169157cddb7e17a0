"""The models the training-step bench times (app/bench/step.py): one per engine and setting
(Variant: FastMoE, FasterMoE, MPipeMoE auto and the n x strategy grid; `build_variants`),
sharing one set of parameters (`share_parameters`), and the per-layer push towards the
routing asked for (RoutingPushes)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from app.bench.parts import FASTERMOE_GROUP_SIZE
from app.bench.routing_replay import routing_push
from app.bench.step_settings import StepSettings
from lm.model import ModelPreset, MoETransformer, init_parameters
from moe_engine.memory import HostBufferPool
from moe_sim.emulation import EmulatedExpertGroup

def share_parameters(source: nn.Module, target: nn.Module) -> None:
    """In place: every parameter of ``target`` becomes ``source``'s of the same name (the
    engines share one layout), so the models of a run hold one set of weights."""
    for name, param in source.named_parameters():
        owner, _, leaf = name.rpartition(".")
        setattr(target.get_submodule(owner) if owner else target, leaf, param)


@dataclass
class Variant:
    engine: str
    chosen_by: str
    spec: tuple  # (partitions, strategy, split) asked for (split None: the layer's default)
    model: MoETransformer


def build_variants(settings: StepSettings, preset: ModelPreset, group: EmulatedExpertGroup, device: torch.device
                   ) -> list[Variant]:
    """FastMoE, FasterMoE, MPipeMoE auto and the grid, sharing the first one's parameters."""
    faster_group = group.for_peer_steps(FASTERMOE_GROUP_SIZE)
    plans = [("fastmoe", "baseline", (1, "none", None), group),
             ("fastermoe", "baseline", ("auto", "auto", None), faster_group),
             ("mpipemoe", "auto", ("auto", "auto", None), group)]  # auto as a user gets it: both splits timed
    if settings.grid:
        plans += [("mpipemoe", "grid", (n, s, split), group) for split in settings.splits for n in settings.partitions
                  if split == "tokens" or (n > 1 and group.size % n == 0) for s in settings.strategies]
    variants: list[Variant] = []
    # One pinned-host pool for all models: their steps run one at a time, and each would
    # otherwise keep its own offload buffers (as in the layer bench).
    host_pool = HostBufferPool()
    for engine, chosen_by, (n, strategy, split), on in plans:
        model = MoETransformer(preset, engine=engine, group=on, partitions=n, strategy=strategy, host_pool=host_pool,
                               split=split if engine == "mpipemoe" else None)
        if variants:
            share_parameters(variants[0].model, model)
            model.to(device)
        else:
            model.to(device)
            init_parameters(model, settings.seed)
        model.train()
        variants.append(Variant(engine, chosen_by, (n, strategy, split), model))
    return variants


class RoutingPushes:
    """Per MoE layer, the push towards the routing asked for (app/bench/routing_replay.py), added to
    the layer's input by a forward pre-hook on every model; set per point."""

    def __init__(self, variants: list[Variant]):
        self.pushes_L: list[torch.Tensor | None] = [None] * len(variants[0].model.moe_layers())
        self.handles = [layer.register_forward_pre_hook(self._hook(index))
                        for variant in variants for index, layer in enumerate(variant.model.moe_layers())]

    def _hook(self, index: int) -> Callable:
        def add_push(module: nn.Module, args: tuple) -> tuple | None:
            push = self.pushes_L[index]
            if push is None:
                return None
            x = args[0]
            if push.numel() != x.numel():  # the host probe's few tokens: a sample spread over the point's
                D = x.shape[-1]
                push = push.view(-1, D)[::push.numel() // x.numel()][: x.numel() // D]
            return (x + push.view(x.shape).to(x.dtype),) + tuple(args[1:])
        return add_push

    def set(self, routing: str, model: MoETransformer, micro_tokens: int, ranks: int, seed: int) -> None:
        layers: list[Any] = model.moe_layers()
        for index, layer in enumerate(layers):
            self.pushes_L[index] = routing_push(routing, layer.router.weight, micro_tokens, model.preset.top_k,
                                                ranks, layer=index, seed=seed, impose_uniform=True)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
