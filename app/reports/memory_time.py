"""Memory against time: one row per engine and setting of a bench point, its forward+backward
time and its memory, both also relative to a reference setting (issue 27).

Used by the Markdown beside a stacked bench's JSON (`mpipemoe bench --layers L`,
app/bench/stack.py) and by section 9 of `mpipemoe report` (bench runs in MLflow, stacked or
not). A record is a bench record as JSON or as an MLflow run's params and metrics (strings
and floats): a stacked one names its ``setting`` and has ``activation_bytes``; an ordinary
one has ``engine``, ``chosen_by``, ``partitions``, ``strategy`` and ``peak_memory_bytes``
(measured on CUDA only). The reference is the first peer (torchtitan), else FastMoE, without
checkpointing where that ran. No torch here: the report reads this module without loading it.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

CKPT = "+ckpt"  # a stacked setting's suffix when each layer runs under activation checkpointing


def as_int(value) -> int | None:
    """An MLflow param or a JSON value as an int (None when it is none)."""
    try:
        return int(float(value))
    except (TypeError, ValueError):
        return None


def as_float(value) -> float | None:
    """An MLflow param or metric or a JSON value as a finite float (None when it is none)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def setting_name(r: dict) -> str:
    """A record's setting: a stack's own name, else engine (and n:strategy for MPipeMoE)."""
    if r.get("setting"):
        return str(r["setting"])
    if r.get("chosen_by") == "auto":
        return "mpipemoe:auto:auto"
    if r.get("chosen_by") == "grid":
        return f"mpipemoe:{as_int(r.get('partitions'))}:{r.get('strategy')}"
    return str(r.get("engine", "?"))


def checkpointed(r: dict) -> bool:
    return bool(r.get("checkpointed")) or setting_name(r).endswith(CKPT)


def memory_bytes(r: dict) -> float | None:
    """A stack's activation memory, else a layer's peak memory (None where not measured)."""
    value = as_float(r.get("activation_bytes"))
    return value if value is not None else as_float(r.get("peak_memory_bytes"))


def reference_setting(records: list[dict]) -> dict | None:
    """What ratios are taken against: the first peer, else FastMoE; without checkpointing
    where that ran."""
    candidates = [r for r in records if r.get("chosen_by") == "peer"] or \
        [r for r in records if r.get("engine") == "fastmoe"]
    candidates.sort(key=checkpointed)  # stable: the first peer stays first
    return candidates[0] if candidates else None


@dataclass(frozen=True)
class MemoryTimeRow:
    key: tuple                  # (model, routing, tokens, layers, world_size, device, dtype)
    reference: str | None       # the setting the ratios are taken against
    setting: str
    chosen: str                 # the n/strategy the layers ran ("1/none" for FastMoE and peers)
    time_ms: float | None
    time_std_ms: float | None
    memory_bytes: float | None
    time_ratio: float | None
    memory_ratio: float | None
    error: str | None = None


def point_key(r: dict) -> tuple:
    return (str(r.get("model")), str(r.get("routing", "uniform")), as_int(r.get("tokens")), as_int(r.get("layers")) or 1,
            as_int(r.get("world_size")), str(r.get("device", "?")), str(r.get("dtype", "?")))


def memory_time_rows(records: list[dict]) -> list[MemoryTimeRow]:
    """Per point (``point_key``), one row per setting, leanest first (unmeasured memory last).
    Where a setting was measured several times the fastest counts; the dense floor is left out."""
    points: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in records:
        if r.get("chosen_by") == "floor":
            continue
        name, time_ms = setting_name(r), as_float(r.get("fwd_bwd_ms"))
        kept = points[point_key(r)].get(name)
        kept_ms = None if kept is None else as_float(kept.get("fwd_bwd_ms"))
        if kept is None or (time_ms is not None and (kept_ms is None or time_ms < kept_ms)):
            points[point_key(r)][name] = r
    rows = []
    for key in sorted(points, key=str):
        point = list(points[key].values())
        reference = reference_setting(point)
        ref_ms = None if reference is None else as_float(reference.get("fwd_bwd_ms"))
        ref_memory = None if reference is None else memory_bytes(reference)
        for r in point:
            time_ms, memory = as_float(r.get("fwd_bwd_ms")), memory_bytes(r)
            chosen = r.get("chosen")
            chosen = ",".join(chosen) if isinstance(chosen, list) else chosen or \
                f"{as_int(r.get('partitions')) or 1}/{r.get('strategy') or 'none'}"
            rows.append(MemoryTimeRow(
                key, None if reference is None else setting_name(reference), setting_name(r), str(chosen), time_ms,
                as_float(r.get("fwd_bwd_ms_std")), memory,
                time_ms / ref_ms if time_ms is not None and ref_ms else None,
                memory / ref_memory if memory is not None and ref_memory else None, r.get("error")))
    return sorted(rows, key=lambda row: (str(row.key), row.memory_bytes is None, row.memory_bytes or 0,
                                         row.time_ms is None, row.time_ms or 0))


def _fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def memory_time_table(records: list[dict], heading: str = "## Memory against time") -> list[str]:
    """Markdown lines: one table per point (none when no record has a time or an error)."""
    rows = memory_time_rows(records)
    if not rows:
        return []
    lines = [heading, "",
             "Forward+backward time and memory of every setting, leanest first; memory is a stack's activation "
             "memory (the peak of one forward+backward above weights, gradients and input), else a layer's peak "
             "memory; measured on CUDA only (– elsewhere). Ratios below 1: less than the reference. "
             "`+ckpt`: every layer under torch.utils.checkpoint.", ""]
    by_point = defaultdict(list)
    for row in rows:
        by_point[row.key].append(row)
    for (model, routing, tokens, layers, world, device, dtype), point in by_point.items():
        reference = point[0].reference or "none"
        lines += [f"### {model}, {tokens} tokens, {layers} layer{'s' if layers != 1 else ''}, {routing} routing, "
                  f"{world} × {device}, {dtype} — against {reference}", "",
                  "| setting | n/strategy | fwd+bwd ms | ± | memory MiB | time / reference | memory / reference |",
                  "|" + "---|" * 7]
        for row in point:
            if row.error:
                lines.append(f"| {row.setting} | – | failed: {row.error.replace('|', '/')} | | | | |")
                continue
            lines.append(f"| {row.setting} | {row.chosen} | {_fmt(row.time_ms, '.2f')} | {_fmt(row.time_std_ms, '.2f')} "
                         f"| {_fmt(row.memory_bytes and row.memory_bytes / 2**20, '.0f')} | "
                         f"{_fmt(row.time_ratio, '.2f')} | {_fmt(row.memory_ratio, '.2f')} |")
        lines.append("")
    return lines


def plot_memory_time(rows: list[MemoryTimeRow], path: Path) -> bool:
    """Memory against time per point (only settings with both measured); False when none has."""
    measured = [r for r in rows if r.time_ms is not None and r.memory_bytes is not None]
    if not measured:
        return False
    from matplotlib.figure import Figure  # no pyplot: no global figure state, Agg canvas

    by_point = defaultdict(list)
    for row in measured:
        by_point[row.key].append(row)
    figure = Figure(figsize=(6.4 * len(by_point), 4.8), layout="constrained")
    for ax, (key, point) in zip(figure.subplots(1, len(by_point), squeeze=False)[0], by_point.items()):
        relative = all(r.time_ratio is not None and r.memory_ratio is not None for r in point)
        for ckpt, marker in ((False, "o"), (True, "x")):
            mine = [r for r in point if r.setting.endswith(CKPT) == ckpt]
            if not mine:
                continue
            xs = [r.time_ratio if relative else r.time_ms for r in mine]
            ys = [r.memory_ratio if relative else (r.memory_bytes or 0) / 2**20 for r in mine]
            ax.scatter(xs, ys, marker=marker, label="checkpointed" if ckpt else "not checkpointed")
            for x, y, r in zip(xs, ys, mine):
                ax.annotate(r.setting.removesuffix(CKPT), (x, y), fontsize=6, xytext=(3, 3),
                            textcoords="offset points")
        model, routing, tokens, layers, world, device, dtype = key
        against = f" / {point[0].reference}" if relative else ""
        ax.set(title=f"{model}, {tokens} tokens, {layers} layer(s)", xlabel=f"fwd+bwd time{against or ' (ms)'}",
               ylabel=f"memory{against or ' (MiB)'}")
        ax.legend(fontsize=7)
    figure.savefig(path, dpi=100)
    return True


def load_memory_time(tracking_uri: str, experiments: list[str] | None = None) -> list[dict]:
    """The measured (not emulated) bench runs' params and metrics, one dict per run."""
    from app.tracking.run_kinds import BENCH
    from app.tracking.store import finished_runs_of_kind

    return [{**run.data.params, **run.data.metrics} for _, run in finished_runs_of_kind(tracking_uri, experiments, BENCH)
            if run.data.tags.get("measured_as") != "emulated"]


def section_memory_time(records: list[dict], out: Path) -> list[str]:
    """Section 9 of `mpipemoe report`: stacked points, and single-layer points with memory."""
    shown = [r for r in records if (as_int(r.get("layers")) or 1) > 1 or memory_bytes(r) is not None]
    keys = {point_key(r) for r in shown}
    shown = [r for r in records if point_key(r) in keys]
    lines = memory_time_table(shown, "## 9. Memory against time")
    if not lines:
        return []
    if plot_memory_time(memory_time_rows(shown), out / "memory_time.png"):
        lines[2:2] = ["![memory against time](memory_time.png)", ""]
    return lines
