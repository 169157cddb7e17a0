"""Configuration of a MoE layer, validated at construction.

Every error names the field, the value it got and how to fix it, so a bad
setting fails before any tensor is allocated or any collective is called.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn, Protocol

ACTIVATIONS = ("relu", "gelu", "swiglu")
# How the router turns a token's E logits into its k gate weights:
# "softmax-then-topk": softmax over all E, the k largest, renormalised to sum 1 when k > 1 (GShard);
# "topk-then-softmax": the k largest logits, softmax over those k (Mixtral; weight 1 when k = 1).
# For k > 1 the two are the same function (exp(l_i) / sum over the k chosen), rounded differently.
ROUTER_RULES = ("softmax-then-topk", "topk-then-softmax")
# The one definition of the engines and strategies; every other module imports these.
ENGINES = ("mpipemoe", "fastmoe", "fastermoe")
STRATEGIES = ("none", "S1", "S2", "S3", "S4")   # mpipemoe's memory strategies (docs/design.md §5)
STRATEGY_CHOICES = ("auto", *STRATEGIES)        # what a user may ask for: "auto" lets the planner choose
SPLITS = ("tokens", "peers", "auto")  # how MPipeMoE's n partitions divide a pass (layers.MPipeMoE, split=)


def _fail(field: str, value: object, fix: str) -> NoReturn:
    raise ValueError(f"MoEConfig.{field}={value!r} is invalid: {fix}")


@dataclass(frozen=True)
class MoEConfig:
    """Shape and routing of one MoE feed-forward layer (docs/design.md §4.1).

    d_model:         width of the token vectors (x has last dimension d_model).
    d_hidden:        hidden width of each expert's FFN.
    num_experts:     global number of experts E; must divide evenly by the world size.
    top_k:           experts per token (k); for k > 1 the k gate weights are renormalised.
    capacity_factor: None = dropless; else each expert takes at most
                     ceil(capacity_factor * k * tokens / E) (token, choice) pairs per rank.
    activation:      "relu", "gelu" or "swiglu" (swiglu adds experts.w3).
    bias:            whether the expert FFNs have biases b1 and b2.
    router_rule:     how the gate weights come from the logits (ROUTER_RULES); the
                     load-balance loss reads the softmax over all E either way.
    """

    d_model: int
    d_hidden: int
    num_experts: int
    top_k: int = 2
    capacity_factor: float | None = None
    activation: str = "gelu"
    bias: bool = True
    router_rule: str = "softmax-then-topk"

    def __post_init__(self) -> None:
        for name in ("d_model", "d_hidden", "num_experts", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                _fail(name, value, "give a positive integer")
        if self.top_k > self.num_experts:
            _fail("top_k", self.top_k, f"choose at most num_experts={self.num_experts} experts per token")
        if self.capacity_factor is not None:
            if isinstance(self.capacity_factor, bool) or not isinstance(self.capacity_factor, (int, float)) \
                    or not self.capacity_factor > 0:
                _fail("capacity_factor", self.capacity_factor, "give a number > 0, or None for dropless routing")
        if self.activation not in ACTIVATIONS:
            _fail("activation", self.activation, f"choose one of {', '.join(ACTIVATIONS)}")
        if not isinstance(self.bias, bool):
            _fail("bias", self.bias, "give True or False")
        if self.router_rule not in ROUTER_RULES:
            _fail("router_rule", self.router_rule, f"choose one of {', '.join(ROUTER_RULES)}")

    def experts_per_rank(self, world_size: int) -> int:
        """E_local; raises if the experts cannot be spread evenly over the ranks."""
        if self.num_experts % world_size != 0:
            _fail("num_experts", self.num_experts,
                  f"it must be a multiple of the expert-parallel world size {world_size}; "
                  f"use e.g. {world_size * max(1, round(self.num_experts / world_size))} experts")
        return self.num_experts // world_size

    @property
    def gated(self) -> bool:
        """True when the FFN has a second input projection (w3), as SwiGLU does."""
        return self.activation == "swiglu"

    @property
    def pre_activation_width(self) -> int:
        """Width of the pre-activation A per row: d_hidden, or 2·d_hidden when gated."""
        return 2 * self.d_hidden if self.gated else self.d_hidden


class MemoryBudgetError(ValueError):
    """No setting of the layer fits its memory budget: the engine refuses the pass rather
    than run out of device memory (the benches record the point as not measured)."""


@dataclass(frozen=True)
class MemoryBudget:
    """Device bytes for the activations of ``layers`` MoE layers alike (a model's stack).

    Each layer keeps its saved tensors from its forward to its backward, while the working
    tensors of a pass come and go one layer at a time; so a choice (n, strategy) fits when
    ``layers`` · saved + the larger working set <= ``bytes``. With layers=1 that is the
    layer's own activation peak (what an int ``memory_budget`` means).

    ``in_flight``: micro-batches whose activations are live at once. The overlapped
    micro-batch schedule (workers/schedules.py) runs one micro-batch's forward beside the
    previous one's backward: two stacks of saved tensors and two working sets, so it
    counts ``in_flight`` · (``layers`` · saved + working).

        MPipeMoE(config, memory_budget=MemoryBudget(bytes=6 * 2**30, layers=8))
    """

    bytes: int
    layers: int = 1
    in_flight: int = 1

    def __post_init__(self) -> None:
        for field in ("bytes", "layers", "in_flight"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MemoryBudget.{field}={value!r} is invalid: give an integer >= 1")

    @classmethod
    def of(cls, value: "int | MemoryBudget | None") -> "MemoryBudget | None":
        """``value`` as a budget: an int is one layer's peak; None is no budget."""
        if value is None or isinstance(value, MemoryBudget):
            return value
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"memory_budget={value!r} is invalid: give a positive number of bytes, "
                             "a MemoryBudget(bytes=..., layers=...) or None")
        return cls(value)

    def need(self, saved_bytes: int, working_bytes: int) -> int:
        """Bytes the ``layers`` layers need when each saves ``saved_bytes`` and one pass
        works in ``working_bytes`` (a MemoryEstimate's saved and larger working set), for
        ``in_flight`` micro-batches at once."""
        return self.in_flight * (self.layers * saved_bytes + working_bytes)

    def need_of(self, estimate: "SavedAndPeak") -> int:
        """`need` of an estimate or prediction of one layer (its saved bytes and its peak,
        whose excess over the saved bytes is the working set)."""
        return self.need(estimate.saved_bytes, estimate.peak_bytes - estimate.saved_bytes)


class SavedAndPeak(Protocol):
    """One layer's activation memory as `MemoryBudget.need_of` reads it
    (memory.MemoryEstimate, perf_model.Prediction)."""

    @property
    def saved_bytes(self) -> int: ...

    @property
    def peak_bytes(self) -> int: ...
