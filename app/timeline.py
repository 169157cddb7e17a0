"""Timelines of one layer pass (`mpipemoe bench --trace DIR`): a torch.profiler trace per
engine and setting, in Chrome/Perfetto JSON, and the stream account read from it.

    mpipemoe bench --model gpt-xl --tokens 32768 --emulate 8x8 --network dgx-h200 --experts 64 \
        --partitions 1,4 --strategies none --trace out/traces

Open a trace at https://ui.perfetto.dev (or chrome://tracing). The account says, for the
traced forward+backward, how long the device was busy on each stream, how long each stream
sat idle inside the pass, and how long communication and compute ran at the same time:
the overlap the pipeline achieved (docs/engine.md, "Reading a timeline").

Streams are named by what runs on them: `comm` holds the All-to-Alls (NCCL kernels, or the
emulated link's wait kernel), `copy` the host copies (device↔host memcpy), `compute` the rest.
"""
from __future__ import annotations

import gzip
import json
import os
import re
from dataclasses import dataclass
from typing import Callable

import torch

# Kernels that are communication: NCCL's, and the emulated link's wall-clock wait (moe_sim/emulation.py).
COMM_KERNEL = re.compile(r"nccl|spin_for_ns", re.IGNORECASE)
HOST_COPY = re.compile(r"Memcpy (DtoH|HtoD)", re.IGNORECASE)


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


def device_events(trace: dict) -> list[dict]:
    """The device-side events (kernels, memcpys, memsets) of a Chrome trace."""
    kinds = ("kernel", "gpu_memcpy", "gpu_memset")
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in kinds]


def stream_account(trace: dict) -> dict:
    """Local. The stream account of a trace of one pass (module docstring): span, busy and idle
    milliseconds per stream role, communication/compute overlap, and the kernel count."""
    by_stream: dict[int, list[dict]] = {}
    for event in device_events(trace):
        by_stream.setdefault(int(event.get("args", {}).get("stream", -1)), []).append(event)
    if not by_stream:
        return {}
    roles: dict[str, list[Interval]] = {}
    for events in by_stream.values():
        names = " ".join(e.get("name", "") for e in events)
        role = "comm" if COMM_KERNEL.search(names) else "copy" if HOST_COPY.search(names) else "compute"
        roles.setdefault(role, []).extend(Interval(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events)
    start = min(iv.start_us for ivs in roles.values() for iv in ivs)
    end = max(iv.end_us for ivs in roles.values() for iv in ivs)
    busy = {role: _union_us(ivs) for role, ivs in roles.items()}
    span_ms = (end - start) / 1e3
    account = {"span_ms": span_ms, "kernels": sum(len(events) for events in by_stream.values())}
    for role, ivs in sorted(busy.items()):
        account[f"{role}_busy_ms"] = _length_us(ivs) / 1e3
        account[f"{role}_idle_ms"] = span_ms - account[f"{role}_busy_ms"]
    account["all_idle_ms"] = span_ms - _length_us(_union_us([iv for ivs in busy.values() for iv in ivs])) / 1e3
    if "comm" in busy and "compute" in busy:
        account["comm_compute_overlap_ms"] = _intersection_us(busy["comm"], busy["compute"]) / 1e3
    return account


def trace_step(step: Callable[[], None], device: torch.device, path: str) -> dict:
    """Runs `step` once under torch.profiler (after one untraced call), writes the trace to
    `path` (gzip when it ends in .gz) and returns its stream account."""
    step()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=activities) as profiler:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    raw = path[:-3] if path.endswith(".gz") else path
    profiler.export_chrome_trace(raw)
    with open(raw) as handle:
        trace = json.load(handle)
    if path.endswith(".gz"):
        with gzip.open(path, "wt") as handle:
            json.dump(trace, handle)
        os.remove(raw)
    return stream_account(trace)


def trace_name(record: dict) -> str:
    """File name of a record's trace: model, tokens, routing, engine and setting."""
    setting = f"{record['partitions']}-{record['strategy']}"
    parts = [record["model"], str(record["tokens"]), record.get("routing", "uniform"), record["engine"],
             record["chosen_by"], setting]
    return "-".join(re.sub(r"[^A-Za-z0-9_.]+", "_", str(p)) for p in parts) + ".json.gz"
