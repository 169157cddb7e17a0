"""`mpipemoe bench --step`: the whole training step on one device as rank 0 of an emulated
cluster, every engine side by side (docs/emulation.md, "The training step").

    mpipemoe bench --step --model gpt-xl --layers 4 --emulate 8x8 --network dgx-h200 --tokens 32768 \\
        --micro-batches 1,2 --partitions 1,2,4 --strategies none,S4 --schedule sequential,overlapped
    mpipemoe bench --step --model tiny-gpt --emulate 2x2 --tokens 256 --micro-batches 1,2   # CPU, seconds

What one step is (as workers/loop.py's Trainer.step runs it): K micro-batches of the
step's tokens, each a forward under autocast (embeddings, attention, norms, every MoE layer,
LM head, loss) and a backward, in the order of the micro-batch schedule
(workers/schedules.py forward_backward: "sequential", or "overlapped": the forward of k+1
beside the backward of k, on the MoE layers' lanes); the dense gradients reduced across the
data-parallel ranks during the last backward (sequential) or after it (overlapped); the
expert gradients divided by W; the global gradient norm (one small collective), the clip
and the fused AdamW step. Each schedule of --schedule (sequential, overlapped, auto:
choose_schedule's pick) is a setting of its own, timed once per point (point_schedules). The MoE layers' collectives are
emulated as `mpipemoe bench --emulate` does (moe_sim/emulation.py). The data-parallel
reduction is modelled (`GradientReduction`): DDP's buckets, each a ring all-reduce over the
data-parallel ranks priced by moe_sim/network.py, issued when its last gradient is ready
(sequential) or all after the last backward (overlapped), and waited for at the end of
backward. The overlapped schedule's lane 1 uses lane clones of the emulated group
(EmulatedExpertGroup.lane_groups): the same link. All modelled transfers take their time one after another
on one stream standing for the node's link (EmulatedTiming.link): the All-to-Alls and the
reduction share the NICs.

Each engine and setting is timed three ways in the same interleaved rounds (so a slow spell
of the machine falls on all alike): the step as modelled (`step_ms`); with the All-to-Alls
and small collectives at zero time (`no_all_to_all_ms`: the copies run, the waits do not);
and with every modelled transfer at zero time (`compute_ms`: the step's compute alone in its
conditions; on CUDA its device-busy time, profiled: `compute_floor_ms`). `step_bound_ms` = max(compute_ms, all_to_all_ms + reduction_ms), the modelled
link time: no schedule beats either, and on CUDA a record faster than 0.98x its bound fails
the run (`check_bounds`) after the records are written (on CPU no wait runs: not checked). `exposed_all_to_all_ms` = step_ms −
no_all_to_all_ms. The automatic setting takes the bound terms of the grid setting it settled
on (timing it with the network off could start its search again).

Parameters are shared by every model of a run (the engines have one layout), so one set of
float32 master weights, gradients and AdamW state stays resident; the step's peak memory
includes them.

Its parts: the settings (app/bench/step_settings.py), the step timed (app/bench/step_training.py),
the engines' models (app/bench/step_variants.py), the bound and its check (app/bench/step_bound.py).
"""
from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from app.bench.parts import chosen_setting
from app.tracking.records import DEFAULT_OUT_DIR, RecordMeta, record_meta
from app.bench.step_bound import add_bound_account, check_bounds
from app.bench.step_settings import StepSettings
from app.bench.step_training import GradientReduction, StepParts, step_batches, training_step
from app.bench.step_variants import RoutingPushes, Variant, build_variants
from app.bench.timeline import PASS_MARK, device_busy_ms, record_trace, trace_step
from lm.model import (ModelPreset, MoETransformer, model_flops_per_token)
from moe_engine.perf_model import device_name
from moe_engine.timing import time_interleaved
from workers.distributed import DenseParallel
from workers.loop import build_optimizer, peak_flops
from workers.schedules import Lanes, choose_schedule

LR = 1e-6                      # small: the router barely moves over the bench's steps


# -- one point -----------------------------------------------------------------------------------

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
    grid_settings = {chosen_setting(v.model.moe_layers()[0]) for v in variants if v.chosen_by == "grid"}
    fns: list[Callable[[], object]] = []
    for entry in timed:
        parts = parts_of(entry.variant)
        entry.slot = [len(fns)]
        fns.append(entry.step)
        if entry.variant.chosen_by != "auto" or chosen_setting(entry.variant.model.moe_layers()[0]) not in grid_settings:
            entry.slot.append(len(fns))
            fns.append(_with_network(parts, 0.0, 1.0, entry.step))
            entry.slot.append(len(fns))
            fns.append(_with_network(parts, 0.0, 0.0, entry.step))
    timings = time_interleaved(fns, device, rounds=settings.rounds, warmup=settings.warmup, repeats=settings.repeats)
    flops_per_token = model_flops_per_token(preset)
    peak = peak_flops(device, str(dtype).replace("torch.", ""))
    records = []
    for entry, comm in zip(timed, modelled):
        variant, slot = entry.variant, entry.slot
        n, strategy = chosen_setting(variant.model.moe_layers()[0])
        memory = _peak_memory(entry.step, device)
        step_ms = timings[slot[0]].median_ms
        record: dict[str, Any] = {
            "kind": "step", "engine": variant.engine, "chosen_by": variant.chosen_by, "partitions": n,
            "strategy": strategy, "schedule": entry.schedule, **schedules[entry.schedule], "model": settings.model,
            "layers": preset.num_layers, "tokens": tokens, "micro_batches": micro_batches,
            "batch_size": tokens // (micro_batches * preset.seq_len), "seq_len": preset.seq_len,
            "routing": routing, "step_ms": step_ms, "step_ms_std": timings[slot[0]].spread_s * 1e3,
            "tokens_per_s": tokens / (step_ms / 1e3), **comm,
            "model_tflops_per_s": flops_per_token * tokens / (step_ms / 1e3) / 1e12,
            "mfu": None if peak is None else flops_per_token * tokens / (step_ms / 1e3) / peak, **memory, **load,
            "d_model": preset.d_model, "d_hidden": preset.d_hidden, "num_heads": preset.num_heads,
            "num_experts": preset.num_experts, "top_k": preset.top_k, "activation": preset.activation,
            "vocab_size": preset.vocab_size, "causal": preset.kind == "gpt", "dtype": str(dtype).replace("torch.", ""),
            "device": device_name(device), **group.cluster.record_fields()}
        if len(slot) == 3:
            record.update(no_all_to_all_ms=timings[slot[1]].median_ms,
                          compute_ms=compute_floor_ms(fns[slot[2]], timings[slot[2]], device,
                                                      settings.rounds * settings.repeats))
        if group.dilation is not None:
            record.update(emulated_wait_dilation_alone=group.dilation["alone"],
                          emulated_wait_dilation_beside_gemms=group.dilation["beside_gemms"])
        if variant.chosen_by == "auto":
            first: Any = variant.model.moe_layers()[0]
            record["search_decisions"] = first.search.decisions  # the first layer's
        records.append(record)
    for record in records:
        if "compute_ms" not in record:  # the automatic setting: its grid twin's bound terms (same schedule)
            twin = next((r for r in records if r["chosen_by"] == "grid" and r["partitions"] == record["partitions"]
                         and r["strategy"] == record["strategy"] and r["schedule"] == record["schedule"]
                         and "compute_ms" in r), None)
            if twin is not None:
                record.update(no_all_to_all_ms=twin["no_all_to_all_ms"], compute_ms=twin["compute_ms"],
                              bound_terms_from="grid twin")
        add_bound_account(record)
    if settings.trace:
        for record, entry in zip(records, timed):
            path = os.path.join(settings.trace, step_trace_name(record))
            record["timeline"] = trace_step(_procedure(entry.step), device, path)
            record["trace_file"] = path
    for record in records:
        record.setdefault("timeline", {})
        log(record)
    return records


def compute_floor_ms(compute_alone: Callable[[], Any], timing: Any, device: torch.device, passes: int) -> float:
    """The step's compute alone (every modelled transfer at zero time), as a floor: on CUDA the
    least device-busy time of `passes` profiled steps (app/bench/timeline.py device_busy_ms: the
    device waiting for the host is not compute, and the modelled step hides that wait behind its
    transfers); elsewhere the fastest of the timed steps (`timing`)."""
    if device.type != "cuda":
        return timing.fastest_ms
    return min(device_busy_ms(record_trace(_procedure(compute_alone), device, passes), PASS_MARK))


def _procedure(fn: Callable[[], Any]) -> Callable[[], None]:
    def run() -> None:
        fn()
    return run


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
             f"{record['partitions']}-{record['strategy']}", record.get("schedule", "sequential")]
    return "-".join(re.sub(r"[^A-Za-z0-9_.]+", "_", p) for p in parts) + ".json.gz"


# -- the run -------------------------------------------------------------------------------------

def run_step_bench(settings: StepSettings, device: torch.device, log: Callable[[dict], None]) -> list[dict]:
    """Every routing, token count and micro-batch count of ``settings`` (module docstring)."""
    torch.manual_seed(settings.seed)
    group = settings.cluster.build()
    if device.type == "cuda":
        group.dilation = group.clock.measure_dilation(device)
        group.timing.link = torch.cuda.Stream(device)
    preset = settings.preset()
    variants = build_variants(settings, preset, group, device)
    parallel = DenseParallel(variants[0].model, world_size=1, device=device,
                             compute_dtype=settings.compute_dtype(device))
    optimizer = build_optimizer(parallel, LR, 0.1)
    reduction = GradientReduction(parallel.dense, group, device, parallel.expert)
    # The overlapped schedule's lanes: the MoE layers' lane clones of the emulated group
    # (EmulatedExpertGroup.lane_groups: the same link), a compute stream per lane on CUDA.
    overlaps = settings.schedules != ("sequential",) and max(settings.micro_batches) >= 2
    lanes = {id(v): Lanes.create(v.model) for v in variants} if overlaps else {}
    all_parts = {id(v): StepParts(v.model, DenseParallel(v.model, world_size=1, device=device,
                                                         compute_dtype=settings.compute_dtype(device)),
                                  optimizer, reduction, group, device, settings.compute_dtype(device), lanes.get(id(v)))
                 for v in variants}
    pushes = RoutingPushes(variants)
    records: list[dict] = []
    try:
        for routing in settings.routings:
            for tokens in settings.tokens:
                for k in settings.micro_batches:
                    records += bench_step_point(settings, preset, variants, pushes, lambda v: all_parts[id(v)],
                                                routing, tokens, k, device, log)
    finally:
        pushes.remove()
        reduction.remove()
        for lane in lanes.values():
            lane.close()
    return records


def plain_baselines(point: list[dict]) -> dict[str, float]:
    """{engine: step ms} of the baselines at one point: their sequential (plain) step, or
    their only schedule's when the run timed no sequential one."""
    base: dict[str, float] = {}
    for q in point:
        if q["chosen_by"] == "baseline" and (q["engine"] not in base or q.get("schedule", "sequential") == "sequential"):
            base[q["engine"]] = q["step_ms"]
    return base


def step_markdown(result: dict) -> str:
    """The Markdown beside a step bench JSON (generated from it)."""
    meta = RecordMeta.from_json(result["meta"])
    lines = [f"# Training step on an emulated cluster — {meta.extra['device']} as rank 0 of "
             f"{meta.extra.get('emulated_cluster')} {meta.extra.get('network')}, {meta.date}", "",
             f"Command: `{meta.command}`  ", f"torch {meta.torch}, Python {meta.python}, git {meta.git_commit or '?'}",
             "", "Generated by `mpipemoe bench --step` from the JSON beside this file; do not edit. "
             "Bound = max(compute alone, All-to-Alls + reduction on the link); exposed All-to-All = step − "
             "the step with the All-to-Alls at zero time; schedule = the micro-batch schedule that ran (a setting's "
             "schedules on adjacent rows, with their peak memory); vs FastMoE / FasterMoE = against their "
             "sequential (plain) step at the point (docs/emulation.md, \"The training step\").", "",
             "| model | layers | routing | tokens | K | engine | chosen by | n | strategy | schedule | step ms | ± | "
             "bound ms | vs bound | compute ms | All-to-All ms | exposed A2A ms | reduction ms | MFU | peak GiB | "
             "vs FastMoE | vs FasterMoE |", "|" + "---|" * 22]
    fmt = lambda v, f: "–" if v is None else format(v, f)  # noqa: E731
    for r in result["records"]:
        point = [q for q in result["records"] if (q["model"], q["routing"], q["tokens"], q["micro_batches"])
                 == (r["model"], r["routing"], r["tokens"], r["micro_batches"])]
        base = plain_baselines(point)
        peak = r.get("peak_memory_bytes")
        lines.append(
            f"| {r['model']} | {r['layers']} | {r['routing']} | {r['tokens']} | {r['micro_batches']} | {r['engine']} | "
            f"{r['chosen_by']} | {r['partitions']} | {r['strategy']} | {r.get('schedule', 'sequential')} | "
            f"{r['step_ms']:.2f} | {r['step_ms_std']:.2f} | "
            f"{fmt(r.get('step_bound_ms'), '.2f')} | {fmt(r.get('step_vs_bound'), '+.1%')} | "
            f"{fmt(r.get('compute_ms'), '.2f')} | {r['all_to_all_ms']:.2f} | "
            f"{fmt(r.get('exposed_all_to_all_ms'), '.2f')} | {r['reduction_ms']:.2f} | {fmt(r.get('mfu'), '.1%')} | "
            f"{fmt(peak and peak / 2**30, '.1f')} | "
            f"{fmt(base.get('fastmoe') and base['fastmoe'] / r['step_ms'], '.2f')} | "
            f"{fmt(base.get('fastermoe') and base['fastermoe'] / r['step_ms'], '.2f')} |")
    return "\n".join(lines) + "\n"


def log_step_records(result: dict, tracking_uri: str | None, experiment: str, printer=print) -> int:
    """One MLflow run per step record (tag mpipemoe.kind=bench-step, measured_as=emulated)."""
    try:
        import mlflow  # noqa: F401  (optional: the records are in the JSON either way)
    except ImportError:
        printer("MLflow is not installed here: the step records stay in the JSON.")
        return 0
    from app.tracking.run_kinds import BENCH_STEP, kind_tags
    from app.tracking.store import RunLogger, resolve_tracking_uri

    uri = resolve_tracking_uri(tracking_uri)
    if uri == "none":
        return 0
    meta = result["meta"]
    for row in result["records"]:
        run = RunLogger.start(uri, experiment, run_name=f"step-{row['model']}-{row['tokens']}-k{row['micro_batches']}-"
                                                        f"{row['engine']}-{row['chosen_by']}-{row.get('schedule', 'sequential')}",
                              tags={**kind_tags(BENCH_STEP), "device": meta["device"], "command": meta["command"][:250],
                                    "measured_as": "emulated"})
        run.log_params({k: v for k, v in row.items() if isinstance(v, (str, int)) and not isinstance(v, bool)})
        run.log_metrics({k: float(v) for k, v in row.items()
                         if isinstance(v, (int, float)) and not isinstance(v, bool)}, step=0, flush=True)
        run.finish()
    printer(f"Logged {len(result['records'])} MLflow runs to {uri} (experiment {experiment!r}).")
    return len(result["records"])


def run_and_write(settings: StepSettings, out: str | None, tracking_uri: str | None, experiment: str,
                  printer: Callable[[str], None] = print) -> int:
    """The step bench on this process's device: records printed as they come, the JSON and
    the Markdown written, MLflow runs logged; then the bound check (a violation raises)."""
    import json

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda") if on_gpu else torch.device("cpu")
    name = device_name(device) if on_gpu else "cpu"
    cluster = settings.cluster
    printer(f"Timing the training step of {settings.model} ({settings.preset().num_layers} layers, "
            f"{settings.num_experts} experts) at {settings.tokens} tokens per GPU, micro-batches "
            f"{list(settings.micro_batches)}, schedules {', '.join(settings.schedules)}, on 1 x {name} as rank 0 of an emulated {cluster.name} "
            f"{cluster.network.name} cluster: FastMoE, FasterMoE, MPipeMoE auto"
            f"{' and the n x strategy grid' if settings.grid else ''}...")
    started = time.time()
    out = out or os.path.join(DEFAULT_OUT_DIR, f"step-{name.replace(' ', '-').lower()}-"
                                               f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json")

    finished: list[dict] = []

    def write(complete: bool) -> dict:
        """The JSON and the Markdown, whole (rewritten after every record: a run stopped by a
        time limit keeps the points it finished)."""
        meta = {**record_meta("bench", on_gpu), "device": name, "world_size": cluster.ranks,
                **cluster.record_fields(), "processes": 1, "kind": "step", "settings": settings.to_json(),
                "wall_s": round(time.time() - started, 1), "complete": complete}
        result = {"meta": meta, "records": finished}
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as handle:
            json.dump(result, handle, indent=1, default=str)
        with open(os.path.splitext(out)[0] + ".md", "w") as handle:
            handle.write(step_markdown(result))
        return result

    def arrived(record: dict) -> None:
        finished.append(record)
        printer(f"  [{time.time() - started:6.0f} s] {record['model']} {record['routing']:<8} {record['tokens']:>6} tok "
                f"K={record['micro_batches']} {record['engine']:<10} {record['chosen_by']:<8} "
                f"n={record['partitions']:<2} {record['strategy']:<4} {record.get('schedule', 'sequential'):<10} "
                f"{record['step_ms']:9.2f} ms"
                + (f"  bound {record['step_bound_ms']:.2f}" if record.get("step_bound_ms") else ""))
        write(complete=False)

    try:
        run_step_bench(settings, device, arrived)
    except KeyboardInterrupt:
        write(complete=False)
        printer(f"Stopped: wrote the {len(finished)} records finished so far to {out}")
        raise
    result = write(complete=True)
    printer(step_markdown(result))
    printer(f"Wrote {out} and {os.path.splitext(out)[0]}.md")
    log_step_records(result, tracking_uri, experiment, printer)
    if device.type == "cuda":
        check_bounds(finished)
    else:  # no modelled wait runs on CPU: the three timings are one computation, apart by noise
        printer("The bounds are not checked on CPU: the emulated transfers take no time there.")
    return 0
