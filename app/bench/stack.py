"""`mpipemoe bench --layers L`: L residual MoE layers, h = h + layer(h)[0], timed and measured
setting by setting (issue 27).

    mpipemoe bench --layers 4 --tokens 256 --partitions 1,2 --strategies none,S3   # tiny, on CPU
    mpipemoe bench --model gpt-xl --tokens 32768 --layers 8 --activation swiglu --no-bias \\
        --peers torchtitan --partitions 1,2,4,8 --strategies none,S3,S4           # one GPU

The settings are the bench's own (app/bench/layer.py: FastMoE, FasterMoE, MPipeMoE auto/auto and
the --partitions × --strategies grid) and the --peers (torchtitan), each run with and/or
without torch.utils.checkpoint (non-reentrant) around every layer (--checkpointing), and
``auto@budget``: MPipeMoE auto/auto under MemoryBudget(budget, layers=L) (each layer's saved
tensors count L times, one working set once), the budget --memory-budget-gib G, or
--memory-budget-share X of the reference setting's activation memory (default 0.15 when a
peer runs). The reference (`reference_setting`) is the first peer, else FastMoE, without
checkpointing where that ran; it is measured first.

A stack of 8 gpt-xl layers holds several GiB of weights, so the settings are not timed in
interleaved rounds as `bench` times single layers: each is built, measured and freed in
turn. Its time is the mean of --repeats × --rounds forward+backward passes after --warmup
(and after an automatic layer's search settled), ± their standard deviation; its activation
memory the peak of one forward+backward above what is allocated before it (weights, their
gradients, the input), None off CUDA. A setting that raises is recorded with its error and
the next one runs.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from app.bench.parts import (FASTERMOE_GROUP_SIZE, chosen_setting, chosen_split, layer_inputs, markdown_head,
                             not_measured_lines, peak_memory_bytes, point_config)
from app.reports.memory_time import CKPT, memory_time_table, reference_setting
from app.bench.peers import build_peer
from lm.model import recomputed
from moe_engine import FastMoE, MemoryBudget, MoEConfig, MPipeMoE, build_layer
from moe_engine.comm import ExpertGroup
from moe_engine.granularity import SEARCH_SPLITS, GranularitySearch, Setting
from moe_engine.memory import HostBufferPool
from moe_engine.perf_model import calibrate, device_name
from moe_engine.timing import synchronize, time_fn

CHECKPOINTING = ("off", "on", "both")
DEFAULT_BUDGET_SHARE = 0.15  # issue 27's target: <= 0.15x torchtitan's activation memory
BUDGET = "auto@budget"


class Stack(torch.nn.Module):
    """h = h + layer(h)[0] for each layer, each optionally under activation checkpointing
    (lm.model.recomputed, as `mpipemoe train --activation-checkpointing full` runs its blocks: the
    layer's forward runs again in backward)."""

    def __init__(self, layers, checkpointed: bool):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        self.checkpointed = checkpointed

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            def run(h, layer=layer):
                return layer(h)[0]
            h = h + (recomputed(run, h) if self.checkpointed else run(h))
        return h


@dataclass(frozen=True)
class StackSetting:
    """One stack to measure: `spec` is a build_layer spec, a peer's name or BUDGET."""
    engine: str
    spec: str
    chosen_by: str          # baseline, auto, grid, peer or budget (as bench's records say)
    checkpointed: bool

    @property
    def name(self) -> str:
        return self.spec + (CKPT if self.checkpointed else "")


def stack_settings(partitions, strategies, grid: bool, peers, checkpointing: str, budget: bool) -> list[StackSetting]:
    """Every setting of a point, in the order measured: the peers, FastMoE, FasterMoE,
    MPipeMoE auto, the grid, auto@budget; each without then with checkpointing (as asked)."""
    bases = [(peer, peer, "peer") for peer in peers] + \
        [("fastmoe", "fastmoe", "baseline"), ("fastermoe", "fastermoe", "baseline"),
         ("mpipemoe", "mpipemoe:auto:auto", "auto")]
    if grid:
        bases += [("mpipemoe", f"mpipemoe:{n}:{s}", "grid") for n in partitions for s in strategies]
    if budget:
        bases.append(("mpipemoe", BUDGET, "budget"))
    modes = {"off": (False,), "on": (True,), "both": (False, True)}[checkpointing]
    return [StackSetting(engine, spec, chosen_by, ckpt) for engine, spec, chosen_by in bases for ckpt in modes]


def build_stack(setting: StackSetting, config: MoEConfig, layers: int, source, group: ExpertGroup, device, dtype,
                **options) -> Stack:
    """The L layers of `setting`, every one with `source`'s weights; `options` go to our
    engines' layers (bench's: group_size, profile, search, host_pool, memory_budget)."""
    def one():
        if setting.chosen_by == "peer":
            return build_peer(setting.spec, config, source, device, dtype)
        spec = "mpipemoe:auto:auto" if setting.spec == BUDGET else setting.spec
        layer = build_layer(spec, config, group, device=device, dtype=dtype, **options)
        layer.load_state_dict(source.state_dict())
        return layer
    return Stack([one() for _ in range(layers)], setting.checkpointed)


def measure_stack(stack: Stack, x: torch.Tensor, grad_y: torch.Tensor, device, warmup: int, repeats: int) -> dict:
    """fwd_bwd_ms (mean) and its spread, activation_bytes (None off CUDA), and the n/strategy
    every layer ran."""
    def step():  # the gradients stay allocated between passes: they are not activations
        stack(x.detach().requires_grad_(True)).backward(grad_y)

    step()
    searches = [layer.search for layer in stack.layers if isinstance(layer, MPipeMoE) and layer.partitions == "auto"]
    for _ in range(60):  # let automatic layers' searches settle on an n
        if all(search.active is None and search.cache for search in searches):
            break
        step()
    synchronize(device)
    activation = peak_memory_bytes(step, device)
    timing = time_fn(step, device, warmup, repeats)
    chosen = Counter((*chosen_setting(layer), chosen_split(layer)) for layer in stack.layers)
    (n, strategy, split), _ = chosen.most_common(1)[0]
    return {"fwd_bwd_ms": timing.mean_ms, "fwd_bwd_ms_std": timing.stdev_s * 1e3, "activation_bytes": activation,
            "partitions": n, "strategy": strategy, "split": split,
            "chosen": sorted(f"{Setting(p, sp).label}/{s}" for p, s, sp in chosen)}


def add_ratios(record: dict, reference: dict | None) -> None:
    """In place: time_vs_<reference> and memory_vs_<reference> where both were measured."""
    if reference is None or record.get("fwd_bwd_ms") is None or not reference.get("fwd_bwd_ms"):
        return
    name = reference["setting"]
    record["reference"] = name
    record[f"time_vs_{name}"] = record["fwd_bwd_ms"] / reference["fwd_bwd_ms"]
    if record.get("activation_bytes") and reference.get("activation_bytes"):
        record[f"memory_vs_{name}"] = record["activation_bytes"] / reference["activation_bytes"]


def memory_budget(settings, layers: int, reference: dict | None) -> MemoryBudget:
    """--memory-budget-gib, else --memory-budget-share of the reference's activation memory."""
    if settings.memory_budget_gib is not None:
        return MemoryBudget(int(settings.memory_budget_gib * 2**30), layers)
    share = settings.budget_share()
    if reference is None or not reference.get("activation_bytes"):
        raise RuntimeError(f"--memory-budget-share {share} needs the reference setting's activation memory, "
                           f"which {'was not measured (CUDA only)' if reference else 'did not run'}: "
                           "give --memory-budget-gib G instead")
    return MemoryBudget(int(share * reference["activation_bytes"]), layers)


def bench_stack_point(model: str, tokens: int, routing: str, settings, group: ExpertGroup, device, log) -> list:
    """Records of every setting at one (model, tokens, routing): each logged as soon as it is
    measured (or failed)."""
    config, dtype = point_config(model, settings, device)
    torch.manual_seed(0)
    source = FastMoE(config, group, device=device, dtype=dtype)
    x = layer_inputs(tokens, source.router.weight.detach(), routing, settings.top_k, settings.seed)
    grad_y = torch.randn_like(x)
    profile = calibrate(config, tokens, group, device, dtype, repeats=3)
    host_pool = HostBufferPool()
    L = settings.layers
    common = {"model": model, "tokens": tokens, "routing": routing, "layers": L, "world_size": group.size,
              "device": device_name(device), "dtype": str(dtype).replace("torch.", ""), "d_model": config.d_model,
              "d_hidden": config.d_hidden, "num_experts": config.num_experts, "top_k": config.top_k,
              "activation": config.activation, "bias": config.bias, "measured_as": "measured"}
    records: list[dict] = []
    for setting in stack_settings(settings.partitions, settings.strategies, settings.grid, settings.peers,
                                  settings.checkpointing, settings.budgeted()):
        record = {"setting": setting.name, "engine": setting.engine, "chosen_by": setting.chosen_by,
                  "checkpointed": setting.checkpointed, **common}
        stack = None
        try:
            options: dict = {}
            if setting.engine == "fastermoe":
                options["group_size"] = FASTERMOE_GROUP_SIZE
            elif setting.engine == "mpipemoe":
                options["host_pool"] = host_pool
                if setting.chosen_by in ("auto", "budget"):
                    # both splits, as a user's auto layer times them (one rank keeps the token split)
                    options.update(profile=profile, search=GranularitySearch(candidates=settings.partitions,
                                                                             splits=SEARCH_SPLITS))
                if setting.chosen_by == "budget":
                    options["memory_budget"] = budget = memory_budget(settings, L, reference_setting(records))
                    record["budget_bytes"] = budget.bytes
                    if settings.memory_budget_gib is None:
                        record["budget_share"] = settings.budget_share()
            stack = build_stack(setting, config, L, source, group, device, dtype, **options)
            record.update(measure_stack(stack, x, grad_y, device, settings.warmup, settings.repeats * settings.rounds))
        except Exception as error:  # recorded; the next setting runs
            record.update(fwd_bwd_ms=None, fwd_bwd_ms_std=None, activation_bytes=None,
                          error=f"{type(error).__name__}: {error}".strip().splitlines()[0][:500])
        del stack
        if device.type == "cuda":
            torch.cuda.empty_cache()
        add_ratios(record, reference_setting(records + [record]))
        records.append(record)
        log(record)
    return records


def progress_line(r: dict, elapsed_s: float) -> str:
    """One printed line per setting as it finishes."""
    head = f"  [{elapsed_s:6.0f} s] {r['model']:>6} {r['tokens']:>6} tok  L={r['layers']}  {r['setting']:<22}"
    if r.get("error"):
        return f"{head} failed: {r['error']}"
    memory = r.get("activation_bytes")
    return (f"{head} n/strategy {','.join(r['chosen']):<6} {r['fwd_bwd_ms']:9.2f} ms"
            + ("" if memory is None else f"  activation {memory / 2**20:8.0f} MiB"))


def stack_markdown(result: dict) -> str:
    """The Markdown beside a stacked bench's JSON: memory against time, one row per setting."""
    from app.tracking.records import RecordMeta

    meta, records = RecordMeta.from_json(result["meta"]), result["records"]
    lines = markdown_head("Stacked MoE layers", meta)
    if meta.extra.get("complete") is False:
        lines += [f"**Incomplete**: these are the {len(records)} settings measured so far (the run is going on, "
                  "or it stopped).", ""]
    lines += not_measured_lines(meta.extra.get("not_measured") or [])
    lines += memory_time_table(records)
    failed = [r for r in records if r.get("error")]
    if failed:
        lines += ["## Failed settings", ""] + [f"- {r['model']} {r['tokens']} {r['setting']}: {r['error']}"
                                                for r in failed] + [""]
    return "\n".join(lines) + "\n"
