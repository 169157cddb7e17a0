"""The one place that turns an engine name or spec into a MoE layer.

    from moe_engine import build_layer
    layer = build_layer("mpipemoe:4:S3", MoEConfig(1024, 4096, 8), group, dtype=torch.bfloat16)

A spec is "fastmoe", "fastermoe[:group_size]" or "mpipemoe[:partitions[:strategy[:split]]]"
(partitions an integer or "auto"; split "tokens" or "peers", MPipeMoE's `split`), as the
bench, the tools and the tests name engines.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from .comm import ExpertGroup
from .config import ENGINES, SPLITS, STRATEGY_CHOICES, MoEConfig
from .layers import FastMoE, FasterMoE, MPipeMoE
from .perf_model import HardwareProfile

# Options only one engine takes; the others ignore them, so one call serves every engine
# (lm.model builds each layer of a model this way, whatever its engine). Every engine takes
# sync_free_capacity (FasterMoE refuses any value but None).
MPIPEMOE_OPTIONS = ("partitions", "strategy", "profile", "memory_budget", "search", "host_pool", "split",
                    "hot_replicas")
FASTERMOE_OPTIONS = ("group_size", "shadowing")


@dataclass(frozen=True)
class EngineSpec:
    """An engine and the settings its spec string names (None: the engine's default)."""

    engine: str
    partitions: int | str | None = None
    strategy: str | None = None
    group_size: int | None = None
    split: str | None = None

    @classmethod
    def parse(cls, spec: str) -> EngineSpec:
        engine, *args = spec.split(":")
        if engine not in ENGINES:
            raise ValueError(f"engine={engine!r} is unknown: choose one of {', '.join(ENGINES)}")
        most = {"fastmoe": 0, "fastermoe": 1, "mpipemoe": 3}[engine]
        if len(args) > most:
            raise ValueError(f"engine spec {spec!r} is invalid: {engine} takes at most {most} setting(s) "
                             f"(e.g. fastmoe, fastermoe:4, mpipemoe:4:S3, mpipemoe:16:none:peers)")
        try:
            if engine == "fastermoe":
                return cls(engine, group_size=int(args[0]) if args else None)
            partitions = args[0] if args and args[0] == "auto" else int(args[0]) if args else None
        except ValueError:
            raise ValueError(f"engine spec {spec!r} is invalid: {args[0]!r} is not an integer") from None
        strategy = args[1] if len(args) > 1 else None
        if strategy is not None and strategy not in STRATEGY_CHOICES:
            raise ValueError(f"engine spec {spec!r} is invalid: strategy {strategy!r}: choose one of "
                             f"{', '.join(STRATEGY_CHOICES)}")
        split = args[2] if len(args) > 2 else None
        if split is not None and split not in SPLITS:
            raise ValueError(f"engine spec {spec!r} is invalid: split {split!r}: choose one of {', '.join(SPLITS)}")
        return cls(engine, partitions=partitions, strategy=strategy, split=split)

    def options(self) -> dict[str, int | str]:
        """The settings the spec names, as ``build_layer`` options."""
        return {name: value for name, value in (("partitions", self.partitions), ("strategy", self.strategy),
                                                ("group_size", self.group_size), ("split", self.split))
                if value is not None}


def build_layer(engine: str | EngineSpec, config: MoEConfig, group: ExpertGroup | None = None,
                **engine_options: Any) -> nn.Module:
    """One MoE layer of ``engine`` (a name or a spec) over ``group``. ``engine_options`` are
    the layer's keyword arguments (device, dtype; MPIPEMOE_OPTIONS, FASTERMOE_OPTIONS); a
    setting named by both the spec and an option must agree."""
    spec = engine if isinstance(engine, EngineSpec) else EngineSpec.parse(engine)
    for name, value in spec.options().items():
        if engine_options.setdefault(name, value) != value:
            raise ValueError(f"{name}={engine_options[name]!r} contradicts the engine spec {engine!r}: "
                             f"give it once")
    common = {k: v for k, v in engine_options.items() if k not in MPIPEMOE_OPTIONS + FASTERMOE_OPTIONS}
    if spec.engine == "mpipemoe":
        return MPipeMoE(config, group, **common, **{k: v for k, v in engine_options.items() if k in MPIPEMOE_OPTIONS})
    if spec.engine == "fastermoe":
        # a HardwareProfile prices its shadowing rule (a ProfileCache, MPipeMoE's, is not one)
        profile = engine_options.get("profile")
        return FasterMoE(config, group, **common, profile=profile if isinstance(profile, HardwareProfile) else None,
                         **{k: v for k, v in engine_options.items() if k in FASTERMOE_OPTIONS})
    return FastMoE(config, group, **common)
