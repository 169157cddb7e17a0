"""Pieces of `mpipemoe bench` that its stacked mode (app/bench/stack.py) shares: a point's
layer configuration and inputs, the n/strategy a layer ran, the peak-memory measurement,
and the Markdown head. (No app module imports a command module: tests/test_layers.py.)"""
from __future__ import annotations

import gc
from typing import Any

import torch

from app.bench.shapes import LAYER_SHAPES
from app.tracking.records import RecordMeta
from app.bench.routing_replay import HOT_EXPERT_TOKENS, routing_push
from moe_sim.routing import HOT_EXPERT
from moe_engine import FasterMoE, MemoryBudgetError, MoEConfig
from moe_engine.granularity import Setting

FASTERMOE_GROUP_SIZE = 4  # FasterMoE's peers per exchange step (layers.FasterMoE's default, FasterMoE's own)
# What a point that does not fit raises: the device's out-of-memory error, or the engine's own
# refusal of a budget no setting fits. The benches record such a point as not measured and go on.
MEMORY_ERRORS = (torch.OutOfMemoryError, MemoryBudgetError)


def memory_failure(error: BaseException) -> str:
    """The reason a point not measured gives for ``error`` (one of MEMORY_ERRORS): its kind
    and its message's first line."""
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else type(error).__name__
    return ("out of memory: " if isinstance(error, torch.OutOfMemoryError) else "memory budget refused: ") + first


def release_memory(device) -> None:
    """After a point that did not fit: collect what its frames held and give the cached
    blocks back, so the next point starts from what is live."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(step, device) -> int | None:
    """Peak CUDA memory of one call of `step` above what is allocated before it (None off CUDA)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - baseline


def layer_inputs(tokens: int, router_weight: torch.Tensor, routing: str, top_k: int = 2, seed: int = 0) -> torch.Tensor:
    """This rank's tokens; ``hot-expert`` pushes every other one towards expert 0
    (HOT_EXPERT_TOKENS), the others (zipf:S, hot:F, replay:...) each towards the top-k experts
    of their counts (app/bench/routing_replay.py; a replay: the file's most imbalanced layer)."""
    x = torch.randn(tokens, router_weight.shape[1], device=router_weight.device, dtype=router_weight.dtype)
    if routing == HOT_EXPERT:
        hot = router_weight[0].float()
        x[HOT_EXPERT_TOKENS] += (8.0 * hot / hot.norm()).to(x.dtype)
    elif routing != "uniform":
        push = routing_push(routing, router_weight, tokens, top_k, seed=seed)
        if push is not None:
            x += push
    return x


def point_config(model: str, settings: Any, device) -> tuple[MoEConfig, torch.dtype]:
    """The layer's config at `model`'s shape with the bench's options, and its dtype on `device`."""
    d_model, d_hidden = LAYER_SHAPES[model]
    return MoEConfig(d_model, d_hidden, settings.num_experts, top_k=settings.top_k, activation=settings.activation,
                     bias=settings.bias), settings.torch_dtype(device)


def chosen_setting(layer) -> tuple[int, str]:
    """The n and strategy a layer ran its last pass with (FasterMoE: its peer steps; 1/none
    for FastMoE, peers and no layer)."""
    n = getattr(layer, "last_partitions", None) or (layer.steps if isinstance(layer, FasterMoE) else 1)
    return n, getattr(layer, "last_strategy", None) or "none"


def chosen_split(layer) -> str:
    """How the last pass's partitions split it: MPipeMoE's `last_split` ("tokens" or
    "peers"), "peers" for FasterMoE, "tokens" for FastMoE, peers and no layer."""
    if isinstance(layer, FasterMoE):
        return "peers"
    return getattr(layer, "last_split", None) or "tokens"


def setting_label(record: dict) -> str:
    """A record's MPipeMoE setting as the reports name it: "n/strategy", "n:peers/strategy"
    when its partitions split the pass by peers."""
    return f"{setting_n(record)}/{record['strategy']}"


def same_setting(a: dict, b: dict) -> bool:
    """Whether two records ran the same n, strategy and split (an auto record and its grid twin)."""
    return (a["partitions"], a["strategy"], a.get("split", "tokens")) == \
        (b["partitions"], b["strategy"], b.get("split", "tokens"))


def setting_n(record: dict) -> str:
    """The n column of a report: n, "n:peers" for an MPipeMoE pass split by peers."""
    if record.get("engine") != "mpipemoe":
        return str(record["partitions"])
    return str(Setting(record["partitions"], record.get("split") or "tokens").label)


def not_measured_lines(points: list[dict]) -> list[str]:
    """The Markdown list of the points a run recorded as not measured (its meta's
    ``not_measured``: model, routing, tokens, the step bench's micro_batches, reason)."""
    if not points:
        return []
    lines = ["Points not measured (the run went on with the next point):", ""]
    for point in points:
        k = point.get("micro_batches")
        lines.append(f"- {point['model']}, {point['routing']} routing, {point['tokens']} tokens"
                     f"{'' if k is None else f', K={k}'}: {point['reason']}")
    return lines + [""]


def markdown_head(title: str, meta: RecordMeta) -> list[str]:
    """The first lines of the Markdown beside a bench JSON: what ran where, when, with which code."""
    return [f"# {title} — {meta.extra['device']} × {meta.extra['world_size']}, {meta.date}", "",
            f"Command: `{meta.command}`  ", f"torch {meta.torch}, Python {meta.python}, git {meta.git_commit or '?'}",
            "", "Generated by `mpipemoe bench` from the JSON beside this file; do not edit.", ""]


def engine_host_ms(record: dict, prefix: str = "") -> float | None:
    """The engine's host time of a record's `{prefix}host_ms`: less the emulator's own host work
    (`{prefix}emulator_host_ms`), which a real rank does not pay; None where it was not timed."""
    host = record.get(f"{prefix}host_ms")
    if host is None:
        return None
    return host - (record.get(f"{prefix}emulator_host_ms") or 0.0)
