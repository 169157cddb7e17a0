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
conditions, the fastest of its wall-clock timings; on CUDA also `compute_device_busy_ms`, the
device's busy time in it, profiled: `device_busy_floor_ms`). `step_bound_ms` = max(compute_ms, all_to_all_ms + reduction_ms), the modelled
link time: no schedule beats either, and on CUDA a record faster than 0.98x its bound fails
the run (`check_bounds`) after the records are written (on CPU no wait runs: not checked). `exposed_all_to_all_ms` = step_ms −
no_all_to_all_ms.

Beside each wall time, the host's: `host_ms` (the step as modelled) and `compute_host_ms` (its
compute alone) are how long the host took to issue one step, until it returned without waiting
for the device (moe_engine/timing.py); `emulator_host_ms` and `compute_emulator_host_ms` the part
of it spent inside the emulated collectives (pricing, the stand-in copies, launching the waits),
which a real rank does not pay. A step whose compute_host_ms less compute_emulator_host_ms
exceeds its compute_device_busy_ms keeps the device waiting for Python. The automatic setting takes the bound terms of the grid setting it settled
on (timing it with the network off could start its search again).

Parameters are shared by every model of a run (the engines have one layout), so one set of
float32 master weights, gradients and AdamW state stays resident; the step's peak memory
includes them.

Its parts: the settings (app/bench/step_settings.py), the step timed
(app/bench/step_training.py), the engines' models (app/bench/step_variants.py), one point timed
(app/bench/step_point.py), the bound and its check (app/bench/step_bound.py), the Markdown and
the MLflow runs (app/bench/step_summary.py).
"""
from __future__ import annotations

import os
import time
from typing import Callable

import torch

from app.tracking.records import DEFAULT_OUT_DIR, record_meta
from app.bench.parts import MEMORY_ERRORS, memory_failure, release_memory, setting_n
from app.bench.step_bound import check_bounds
from app.bench.step_point import bench_step_point
from app.bench.step_settings import StepSettings
from app.bench.step_summary import log_step_records, step_markdown
from app.bench.step_training import GradientReduction, StepParts
from app.bench.step_variants import RoutingPushes, build_variants
from moe_engine.perf_model import device_name
from workers.distributed import DenseParallel
from workers.loop import build_optimizer
from workers.schedules import Lanes

LR = 1e-6                      # small: the router barely moves over the bench's steps


# -- the run -------------------------------------------------------------------------------------

def run_step_bench(settings: StepSettings, device: torch.device, log: Callable[[dict], None],
                   not_measured: Callable[[dict], None] | None = None) -> list[dict]:
    """Every routing, token count and micro-batch count of ``settings`` (module docstring).
    A point that runs out of device memory, or whose memory budget the engine refuses
    (parts.MEMORY_ERRORS), is passed to ``not_measured`` (its routing, tokens, micro-batches
    and the error's first line), its memory freed, and the run goes on with the next point;
    without ``not_measured`` the error ends the run."""
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
                    try:
                        records += bench_step_point(settings, preset, variants, pushes, lambda v: all_parts[id(v)],
                                                    routing, tokens, k, device, log)
                    except MEMORY_ERRORS as error:
                        if not_measured is None:
                            raise
                        reason = memory_failure(error)
                    else:
                        continue
                    # out of the handler: the error's frames (and their tensors) are gone
                    release_point_memory(variants, device)
                    not_measured({"model": settings.model, "routing": routing, "tokens": tokens,
                                  "micro_batches": k, "reason": reason})
    finally:
        pushes.remove()
        reduction.remove()
        for lane in lanes.values():
            lane.close()
    return records


def release_point_memory(variants: list, device: torch.device) -> None:
    """After a point ran out of memory: drop every gradient the failed step left (the
    models share their parameters) and the graph it held, and give the cached blocks back,
    so the next point starts from the models' own memory."""
    for variant in variants:
        variant.model.zero_grad(set_to_none=True)
    release_memory(device)


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
    skipped: list[dict] = []

    def write(complete: bool) -> dict:
        """The JSON and the Markdown, whole (rewritten after every record: a run stopped by a
        time limit keeps the points it finished)."""
        meta = {**record_meta("bench", on_gpu), "device": name, "world_size": cluster.ranks,
                **cluster.record_fields(), "processes": 1, "kind": "step", "settings": settings.to_json(),
                "wall_s": round(time.time() - started, 1), "complete": complete, "not_measured": skipped}
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
                f"n={setting_n(record):<2} {record['strategy']:<4} {record.get('schedule', 'sequential'):<10} "
                f"{record['step_ms']:9.2f} ms"
                + (f"  bound {record['step_bound_ms']:.2f}" if record.get("step_bound_ms") else ""))
        write(complete=False)

    def not_measured(point: dict) -> None:
        skipped.append(point)
        printer(f"  [{time.time() - started:6.0f} s] {point['model']} {point['routing']:<8} {point['tokens']:>6} tok "
                f"K={point['micro_batches']} not measured: {point['reason']}")
        write(complete=False)

    try:
        run_step_bench(settings, device, arrived, not_measured)
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
