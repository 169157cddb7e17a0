"""One point of the training-step bench (app/bench/step.py): every engine, setting and
schedule at one routing, token count and micro-batch count, timed three ways in interleaved
rounds (as modelled, without the All-to-Alls, compute alone; `bench_step_point`) with the host
probe beside them (HOST_PROBE_SEQ_LEN), with the modelled collectives, the expert load, the
peak memory and the timeline of each: its records."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from app.bench.parts import chosen_setting, chosen_split, same_setting, setting_label, setting_n
from app.bench.step_bound import add_bound_account
from app.bench.step_settings import StepSettings
from app.bench.step_training import StepParts, step_batches, training_step
from app.bench.step_variants import RoutingPushes, Variant
from app.bench.timeline import device_busy_floor_ms, procedure, trace_step
from lm.model import ModelPreset, MoETransformer, model_flops_per_token
from moe_engine.perf_model import device_name
from moe_engine.timing import time_interleaved
from workers.loop import peak_flops
from workers.schedules import choose_schedule

# The host probe: the step's compute alone (every modelled transfer at zero time) on K
# micro-batches of one sequence of this many tokens, so that the device has almost nothing
# to do and the time is the host's cost of issuing the step (the simulator's host term is
# matched to it: app/bench/simulate_validation.py).
HOST_PROBE_SEQ_LEN = 64


def _logged_step(parts: StepParts, schedule: str, batches: list) -> dict:
    """One step with the group's log on: the modelled seconds of its All-to-Alls and small
    collectives, and of the reduction."""
    group = parts.group
    layers: list[Any] = parts.model.moe_layers()
    siblings: dict[int, Any] = {id(m.group): m.group for m in layers}
    for sibling in siblings.values():
        sibling.calls = []
    training_step(schedule, parts, batches)
    calls = [c for sibling in siblings.values() for c in (sibling.calls or [])]
    for sibling in siblings.values():
        sibling.calls = None
    a2a = sum(c.seconds for c in calls if c.kind.startswith("all_to_all"))
    small = sum(c.seconds for c in calls if not c.kind.startswith("all_to_all"))  # counts, agreements
    small += 2 * group.cluster.small_collective_s(world=True)  # the step's own: losses and the norm, all W ranks
    return {"all_to_all_ms": a2a * 1e3, "small_collectives_ms": small * 1e3,
            "reduction_ms": sum(parts.reduction.issued) * 1e3, "reduction_buckets": len(parts.reduction.buckets),
            "expert_reduction_ms": parts.reduction.expert_seconds * 1e3}


def _with_network(parts: StepParts, a2a_scale: float, reduction_scale: float, fn: Callable[[], Any]) -> Callable:
    def run() -> None:
        timing = parts.group.timing
        timing.scale, parts.reduction.scale = a2a_scale, reduction_scale
        try:
            fn()
        finally:
            timing.scale, parts.reduction.scale = 1.0, 1.0
    return run


def _settle(variant: Variant, step: Callable[[], Any]) -> None:
    """Let the automatic layers' searches settle (every MoE layer cached an n)."""
    step()
    if variant.chosen_by != "auto":
        return
    for _ in range(60):
        searches = [getattr(layer, "search", None) for layer in variant.model.moe_layers()]
        if all(s is None or (s.active is None and s.cache) for s in searches):
            return
        step()


def _expert_load(model: MoETransformer, step: Callable[[], Any], device: torch.device) -> dict:
    """Every MoE layer's share of the routed pairs per expert over one step (workers/load.py)."""
    from workers.load import ExpertLoad

    load = ExpertLoad(model.moe_layers(), device)
    try:
        step()
        routed_LE = load.routed_LE.tolist()
    finally:
        load.remove()
    shares_LE = [[round(count / max(1, sum(row)), 5) for count in row] for row in routed_LE]
    return {"expert_load": shares_LE[0], "expert_load_by_layer": shares_LE,
            "hot_expert_share": max(max(row) for row in shares_LE)}


def point_schedules(settings: StepSettings, preset: ModelPreset, tokens: int, micro_batches: int,
                    dtype: torch.dtype) -> dict[str, dict]:
    """The schedules a point runs, each once: {schedule: {"schedule_asked": the settings of
    --schedule that come to it (a comma list), "schedule_reason": why}}. "auto" takes choose_schedule's
    choice (two micro-batches in flight within ``settings.moe_memory_gib``, when given); one
    micro-batch a step runs the sequential schedule whatever was asked."""
    budget = None if settings.moe_memory_gib is None else int(settings.moe_memory_gib * 2**30)
    resolved: dict[str, dict] = {}
    for asked in settings.schedules:
        ran, why = choose_schedule(asked, micro_batches, budget_bytes=budget, preset=preset,
                                   tokens=tokens // micro_batches, world_size=settings.cluster.ranks, dtype=dtype)
        if ran == "overlapped" and micro_batches < 2:
            ran, why = "sequential", "one micro-batch a step: nothing to overlap"
        entry = resolved.setdefault(ran, {"schedule_asked": "", "schedule_reason": "asked for"})
        entry["schedule_asked"] = ",".join(filter(None, (entry["schedule_asked"], asked)))
        if why != "asked for":
            entry["schedule_reason"] = why
    return resolved


@dataclass
class Timed:
    """One engine and setting under one schedule at a point: what the interleaved rounds time."""

    variant: Variant
    schedule: str
    step: Callable[[], Any]
    slot: list = field(default_factory=list)  # its indices among the timed functions


def bench_step_point(settings: StepSettings, preset: ModelPreset, variants: list[Variant], pushes: RoutingPushes,
                     parts_of: Callable[[Variant], StepParts], routing: str, tokens: int, micro_batches: int,
                     device: torch.device, log: Callable[[dict], None]) -> list[dict]:
    group = parts_of(variants[0]).group
    dtype = settings.compute_dtype(device)
    schedules = point_schedules(settings, preset, tokens, micro_batches, dtype)
    batches = step_batches(preset, tokens, micro_batches, device, settings.seed)
    probe_seq_len = min(HOST_PROBE_SEQ_LEN, preset.seq_len)
    probe_batches = step_batches(preset, micro_batches * probe_seq_len, micro_batches, device, settings.seed,
                                 seq_len=probe_seq_len)
    pushes.set(routing, variants[0].model, tokens // micro_batches, group.size, settings.seed)
    # variant-major: a setting's schedules side by side in the records
    timed = [Timed(v, schedule, functools.partial(training_step, schedule, parts_of(v), batches))
             for v in variants for schedule in schedules]
    for entry in timed:
        _settle(entry.variant, entry.step)
    modelled = [_logged_step(parts_of(t.variant), t.schedule, batches) for t in timed]
    load = _expert_load(variants[0].model, timed[0].step, device)
    # Three timings per engine, setting and schedule, interleaved: as modelled, without the
    # All-to-Alls, compute alone; the automatic one only as modelled when the grid has its setting.
    # A fourth, the host probe, for all but the automatic one (a step at the probe's few tokens
    # would start its search there): its record takes its grid twin's.
    def setting_of(variant: Variant) -> tuple:
        first = variant.model.moe_layers()[0]
        return (*chosen_setting(first), chosen_split(first))

    grid_settings = {setting_of(v) for v in variants if v.chosen_by == "grid"}
    fns: list[Callable[[], object]] = []
    for entry in timed:
        parts = parts_of(entry.variant)
        entry.slot = [len(fns)]
        fns.append(entry.step)
        if entry.variant.chosen_by != "auto" or setting_of(entry.variant) not in grid_settings:
            entry.slot.append(len(fns))
            fns.append(_with_network(parts, 0.0, 1.0, entry.step))
            entry.slot.append(len(fns))
            fns.append(_with_network(parts, 0.0, 0.0, entry.step))
        if entry.variant.chosen_by != "auto":
            entry.slot.append(len(fns))
            fns.append(_with_network(parts, 0.0, 0.0,
                                     functools.partial(training_step, entry.schedule, parts, probe_batches)))
    timings = time_interleaved(fns, device, rounds=settings.rounds, warmup=settings.warmup, repeats=settings.repeats,
                               host_counter=lambda: group.timing.host_s)
    flops_per_token = model_flops_per_token(preset)
    peak = peak_flops(device, str(dtype).replace("torch.", ""))
    records = []
    for entry, comm in zip(timed, modelled):
        variant, slot = entry.variant, entry.slot
        n, strategy, split = setting_of(variant)
        memory = _peak_memory(entry.step, device)
        step_ms = timings[slot[0]].median_ms
        record: dict[str, Any] = {
            "kind": "step", "engine": variant.engine, "chosen_by": variant.chosen_by, "partitions": n,
            "strategy": strategy, "split": split, "schedule": entry.schedule, **schedules[entry.schedule], "model": settings.model,
            "layers": preset.num_layers, "tokens": tokens, "micro_batches": micro_batches,
            "batch_size": tokens // (micro_batches * preset.seq_len), "seq_len": preset.seq_len,
            "routing": routing, "step_ms": step_ms, "step_ms_std": timings[slot[0]].spread_s * 1e3,
            "host_ms": timings[slot[0]].host_ms, "emulator_host_ms": timings[slot[0]].counted_ms,
            "tokens_per_s": tokens / (step_ms / 1e3), **comm,
            "model_tflops_per_s": flops_per_token * tokens / (step_ms / 1e3) / 1e12,
            "mfu": None if peak is None else flops_per_token * tokens / (step_ms / 1e3) / peak, **memory, **load,
            "d_model": preset.d_model, "d_hidden": preset.d_hidden, "num_heads": preset.num_heads,
            "num_experts": preset.num_experts, "top_k": preset.top_k, "activation": preset.activation,
            "vocab_size": preset.vocab_size, "causal": preset.kind == "gpt", "dtype": str(dtype).replace("torch.", ""),
            "device": device_name(device), **group.cluster.record_fields()}
        if len(slot) == 4:
            record.update(host_probe_ms=timings[slot[3]].median_ms, host_probe_tokens=micro_batches * probe_seq_len,
                          host_probe_seq_len=probe_seq_len)
        if len(slot) >= 3:
            record.update(no_all_to_all_ms=timings[slot[1]].median_ms, compute_ms=timings[slot[2]].fastest_ms,
                          compute_host_ms=timings[slot[2]].host_ms,
                          compute_emulator_host_ms=timings[slot[2]].counted_ms,
                          compute_device_busy_ms=device_busy_floor_ms(fns[slot[2]], device,
                                                                      settings.rounds * settings.repeats))
        if group.dilation is not None:
            record.update(emulated_wait_dilation_alone=group.dilation["alone"],
                          emulated_wait_dilation_beside_gemms=group.dilation["beside_gemms"])
        if variant.chosen_by == "auto":
            first: Any = variant.model.moe_layers()[0]
            record["search_decisions"] = first.search.decisions  # the first layer's
        records.append(record)
    for record in records:
        twin = next((r for r in records if r["chosen_by"] == "grid" and same_setting(r, record)
                     and r["schedule"] == record["schedule"] and "compute_ms" in r), None)
        if record["chosen_by"] == "auto" and twin is not None:  # the host probe of the setting it settled on
            record.update({key: twin[key] for key in ("host_probe_ms", "host_probe_tokens", "host_probe_seq_len")})
        if "compute_ms" not in record and twin is not None:  # the automatic setting: its grid twin's bound terms
            record.update({key: twin[key] for key in ("no_all_to_all_ms", "compute_ms", "compute_host_ms",
                                                      "compute_emulator_host_ms", "compute_device_busy_ms")},
                          bound_terms_from="grid twin")
        add_bound_account(record)
    if settings.trace:
        for record, entry in zip(records, timed):
            path = os.path.join(settings.trace, step_trace_name(record))
            record["timeline"] = trace_step(procedure(entry.step), device, path)
            record["trace_file"] = path
    for record in records:
        record.setdefault("timeline", {})
        log(record)
    return records


def _peak_memory(step: Callable[[], Any], device: torch.device) -> dict:
    """Peak CUDA memory of one step (absolute: the shared weights and AdamW state included)
    and above what was allocated before it; None off CUDA."""
    if device.type != "cuda":
        return {"peak_memory_bytes": None, "peak_above_start_bytes": None}
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return {"peak_memory_bytes": int(peak), "peak_above_start_bytes": int(peak - start)}


def step_trace_name(record: dict) -> str:
    import re

    parts = ["step", record["model"], str(record["layers"]), str(record["tokens"]), f"k{record['micro_batches']}",
             record["routing"].rsplit("/", 1)[-1], record["engine"], record["chosen_by"],
             f"{setting_n(record)}-{record['strategy']}", record.get("schedule", "sequential")]
    return "-".join(re.sub(r"[^A-Za-z0-9_.]+", "_", p) for p in parts) + ".json.gz"
