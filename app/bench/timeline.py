"""Timelines of one layer pass (`mpipemoe bench --trace DIR`): a torch.profiler trace per
engine and setting, in Chrome/Perfetto JSON, and the stream account read from it.

    mpipemoe bench --model gpt-xl --tokens 32768 --emulate 8x8 --network dgx-h200 --experts 64 \
        --partitions 1,4 --strategies none --trace out/traces

Open a trace at https://ui.perfetto.dev (or chrome://tracing). The account says, for the
traced forward+backward, how long the device was busy on each stream, how long each stream
sat idle inside the pass, and how long communication and compute ran at the same time:
the overlap the pipeline achieved (docs/engine.md, "Reading a timeline").

Device time is counted by role: `comm` is the All-to-Alls (NCCL kernels, the emulated link's
wait kernel, and whatever else runs on a stream that holds them but no GEMM), `copy` the host
copies (device↔host memcpy), `compute` the rest.
"""
from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from app.bench.parts import setting_n
from workers.schedules import profiler_config

# Kernels that are communication: NCCL's, and the emulated link's wall-clock wait (moe_sim/emulation.py).
COMM_KERNEL = re.compile(r"nccl|spin_for_ns|spin_until|stamp_now", re.IGNORECASE)
HOST_COPY = re.compile(r"Memcpy (DtoH|HtoD)", re.IGNORECASE)
GEMM_KERNEL = re.compile(r"gemm|cutlass|sm90_xmma|cublas", re.IGNORECASE)
# The host events that launch device work: the CUDA runtime's (cudaLaunchKernel: torch's kernels)
# and the driver's (cuLaunchKernel: Triton's, the emulated link's waits among them). Reading the
# runtime's alone dropped every wait on the link from the timelines (GPU run at b0bd8da).
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


@dataclass(frozen=True)
class Interval:
    start_us: float
    end_us: float


def _union_us(intervals: list[Interval]) -> list[Interval]:
    """Local. The union of intervals, as sorted disjoint intervals."""
    merged: list[Interval] = []
    for iv in sorted(intervals, key=lambda iv: iv.start_us):
        if merged and iv.start_us <= merged[-1].end_us:
            merged[-1] = Interval(merged[-1].start_us, max(merged[-1].end_us, iv.end_us))
        else:
            merged.append(iv)
    return merged


def _length_us(intervals: list[Interval]) -> float:
    return sum(iv.end_us - iv.start_us for iv in intervals)


def _intersection_us(a: list[Interval], b: list[Interval]) -> float:
    """Local. Total length of the intersection of two sorted disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        low, high = max(a[i].start_us, b[j].start_us), min(a[i].end_us, b[j].end_us)
        if high > low:
            total += high - low
        if a[i].end_us < b[j].end_us:
            i += 1
        else:
            j += 1
    return total


PASS_MARK = "mpipemoe.pass"  # the record_function around each traced pass


def device_events(trace: dict, last_pass_only: bool = True) -> list[dict]:
    """The device-side events (kernels, memcpys, memsets) of a Chrome trace; with
    `last_pass_only`, those launched since the last `PASS_MARK` range began (when there is
    one): the pass traced in steady state, its kernels queued behind the pass before it. Not
    only inside the range: a helper thread (the overlapped schedule's) may still be launching
    the pass's last kernels when the range ends, and nothing is traced after the last pass."""
    kinds = ("kernel", "gpu_memcpy", "gpu_memset")
    events = trace.get("traceEvents", [])
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in kinds]
    marks = _ranges(events, PASS_MARK)  # the host's ranges (the device track repeats them in device time)
    if not (last_pass_only and marks):
        return device
    _, start, _ = marks[-1]
    launched = {e["args"]["correlation"]: float(e["ts"]) for e in events
                if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    return [e for e in device if start <= launched.get(e.get("args", {}).get("correlation"), -1.0)]


def _roles(events: list[dict]) -> list[str]:
    """Local. The role of each device event: `comm` for communication kernels, and for
    everything on a stream that holds communication but no GEMM (the pipeline's comm stream:
    the emulated link's copies too); `copy` for host copies; `compute` for the rest."""
    comm_streams = set()
    gemm_streams = set()
    for event in events:
        stream = event.get("args", {}).get("stream", -1)
        if COMM_KERNEL.search(event.get("name", "")):
            comm_streams.add(stream)
        if GEMM_KERNEL.search(event.get("name", "")):
            gemm_streams.add(stream)
    roles = []
    for event in events:
        name, stream = event.get("name", ""), event.get("args", {}).get("stream", -1)
        if COMM_KERNEL.search(name) or (stream in comm_streams and stream not in gemm_streams):
            roles.append("comm")
        elif HOST_COPY.search(name):
            roles.append("copy")
        else:
            roles.append("compute")
    return roles


def stream_account(trace: dict) -> dict:
    """Local. The account of a trace of one pass (module docstring): its span, and the busy
    and idle milliseconds of communication, compute and host copies, how long communication
    ran beside compute and how long with none beside it (exposed), how long nothing ran,
    and the device event count."""
    events = device_events(trace)
    if not events:
        return {}
    busy_by_role: dict[str, list[Interval]] = {}
    for event, role in zip(events, _roles(events)):
        start = float(event["ts"])
        busy_by_role.setdefault(role, []).append(Interval(start, start + float(event["dur"])))
    busy = {role: _union_us(ivs) for role, ivs in busy_by_role.items()}
    start = min(ivs[0].start_us for ivs in busy.values())
    end = max(ivs[-1].end_us for ivs in busy.values())
    span_ms = (end - start) / 1e3
    account = {"span_ms": span_ms, "device_events": len(events)}
    for role, ivs in sorted(busy.items()):
        account[f"{role}_busy_ms"] = _length_us(ivs) / 1e3
        account[f"{role}_idle_ms"] = span_ms - account[f"{role}_busy_ms"]
    account["all_idle_ms"] = span_ms - _length_us(_union_us([iv for ivs in busy.values() for iv in ivs])) / 1e3
    if "comm" in busy:
        beside = _intersection_us(busy["comm"], busy["compute"]) / 1e3 if "compute" in busy else 0.0
        account["comm_beside_compute_ms"] = beside
        account["comm_exposed_ms"] = account["comm_busy_ms"] - beside  # communication with no compute beside it
    return account


# What the profiler's C++ side (Kineto) writes to stderr on every start and stop, whatever its
# log level: "USDT:... profiler_start", "STAGE:... Completed Stage: Warm Up".
PROFILER_CHATTER = re.compile(r"^(USDT|STAGE):\S+ \S+ \d+:\d+ \S+\.cpp:\d+\] ")


@contextlib.contextmanager
def _without_profiler_chatter() -> Iterator[None]:
    """Local. Holds back the profiler's own stderr lines (PROFILER_CHATTER, one pair per traced
    pass): stderr goes to a scratch file meanwhile, and every other line is written back after."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real stderr (an embedding host): nothing to hold back
        yield
        return
    with tempfile.TemporaryFile(mode="w+b") as scratch:
        os.dup2(scratch.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            scratch.seek(0)
            kept = [line for line in scratch.read().decode(errors="replace").splitlines(keepends=True)
                    if not PROFILER_CHATTER.match(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def record_trace(run: Callable[[], None], device: torch.device, passes: int = 2) -> dict:
    """Runs `run` once untraced, then `passes` times back to back under torch.profiler, each
    inside a `PASS_MARK` range, and returns the Chrome trace (a dict). Every host thread is
    recorded (workers/schedules.py profiler_config): the overlapped micro-batch schedule
    launches its backwards from a helper thread, and autograd launches every backward from
    its device thread."""
    run()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    with _without_profiler_chatter(), torch.profiler.profile(activities=activities,
                                                             experimental_config=profiler_config()) as profiler:
        for _ in range(passes):
            with torch.profiler.record_function(PASS_MARK):
                run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as scratch:
        raw = os.path.join(scratch, "trace.json")
        profiler.export_chrome_trace(raw)
        with open(raw) as handle:
            return json.load(handle)


def trace_step(step: Callable[[], None], device: torch.device, path: str, passes: int = 2) -> dict:
    """`record_trace` of `step`, written to `path` (gzip when it ends in .gz); returns the
    stream account of the last pass: the steady state, where a pass's first kernels wait
    behind the previous pass as they do in training. The account keeps only kernels whose
    launch it saw."""
    trace = record_trace(step, device, passes)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    opener: Callable = gzip.open if path.endswith(".gz") else open
    with opener(path, "wt") as handle:
        json.dump(trace, handle)
    return stream_account(trace)


def _ranges(events: list[dict], name: str) -> list[tuple[object, float, float]]:
    """Local. (host thread, start µs, end µs) of every host range called `name`, by start."""
    marks = [e for e in events if e.get("ph") == "X" and e.get("name") == name and e.get("cat") == "user_annotation"]
    return sorted(((e.get("tid"), float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in marks),
                  key=lambda r: r[1])


def device_busy_ms(trace: dict, mark: str, *, excluding: str | None = None) -> list[float]:
    """Local. For each host range called `mark` in a trace (in order of start): how long the
    device was busy with the work launched inside it, from any host thread (autograd launches
    a backward from its own): the union of its kernels', copies' and memsets' device intervals
    over every stream. With `excluding`: less the work launched inside ranges of that name on
    the launching thread (the emulator's copies that a modelled transfer's time already holds).

    A floor of that work's device time: what no schedule of the same kernels can beat, however
    far ahead the host runs (a pass timed by events also counts the device waiting for the host)."""
    events = trace.get("traceEvents", [])
    launched = {e["args"]["correlation"]: (e.get("tid"), float(e["ts"])) for e in events
                if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    skipped = _ranges(events, excluding) if excluding else []
    kinds = ("kernel", "gpu_memcpy", "gpu_memset")
    device = [(launched[e["args"]["correlation"]], e) for e in events
              if e.get("ph") == "X" and e.get("cat") in kinds and e.get("args", {}).get("correlation") in launched]
    kept = [(at, e) for (tid, at), e in device
            if not any(tid == s_tid and start <= at <= end for s_tid, start, end in skipped)]
    busy = []
    for _, start, end in _ranges(events, mark):
        inside = [Interval(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for at, e in kept if start <= at <= end]
        busy.append(_length_us(_union_us(inside)) / 1e3)
    return busy


def device_busy_floor_ms(compute_alone: Callable[[], Any], device: torch.device, passes: int) -> float | None:
    """How long the device is busy running `compute_alone` (a step or a layer pass with every
    modelled transfer at zero time): the least device-busy time (`device_busy_ms`) of `passes`
    profiled calls; None off CUDA. Below the wall clock of the same calls (the step bench's
    `compute_ms`) by the time the device waits for the host: how host-bound they are. Not a floor
    itself: kernels of two streams that overlap unprofiled can run one after another under the
    profiler (gpt-xl, two micro-batches of 8k tokens on an H100: 170.6 ms busy against 146.3 ms
    for the timed step with its All-to-Alls at zero time)."""
    if device.type != "cuda":
        return None
    return min(device_busy_ms(record_trace(procedure(compute_alone), device, passes), PASS_MARK))


def procedure(fn: Callable[[], Any]) -> Callable[[], None]:
    """`fn` with its result dropped (record_trace runs procedures)."""
    def run() -> None:
        fn()
    return run


def trace_name(record: dict) -> str:
    """File name of a record's trace: model, tokens, routing, engine and setting."""
    setting = f"{setting_n(record)}-{record['strategy']}"
    parts = [record["model"], str(record["tokens"]), record.get("routing", "uniform"), record["engine"],
             record["chosen_by"], setting]
    return "-".join(re.sub(r"[^A-Za-z0-9_.]+", "_", str(p)) for p in parts) + ".json.gz"
