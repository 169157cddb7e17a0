"""The report of ``mpipemoe report`` (app/commands/report.py): Markdown with PNG plots, generated
from MLflow runs.

Reads two kinds of runs (tag ``kind``): layer benchmarks (``kind=bench``, from
``mpipemoe bench``: fwd_bwd_ms, peak/predicted memory) and training runs
(``kind=train``, from ``mpipemoe train`` and sweeps: tokens_per_s, peak memory).
Each becomes a ``Record``; the sections are pure functions of the records:

1. speedup and memory of MPipeMoE against the FastMoE/FasterMoE-style baselines,
   per (model, tokens);
2. time and memory per memory-reuse strategy;
3. the best number of partitions n against tokens, with every violation of the
   assumed monotonicity (best n non-decreasing in tokens) marked;
4. predicted against measured peak memory;
5. simulated clusters (``mpipemoe simulate`` runs, tag ``kind=simulate``; app/reports/simulate.py).
6. the largest batch under a memory cap (``mpipemoe capacity`` runs; app/reports/capacity.py).
7. emulated clusters (``mpipemoe bench --emulate`` runs, tag ``measured_as=emulated``;
   app/reports/emulated.py), and 7b their training steps (``mpipemoe bench --step``;
   app/reports/step.py). Emulated runs never enter sections 1–4.
8. training runs' validation loss and per-expert load over steps (app/reports/training.py).
9. memory against time: every setting of a bench point, time and memory relative to the
   peer (torchtitan) or FastMoE (app/reports/memory_time.py); stacks of layers (``mpipemoe bench
   --layers L``) appear only here, single layers where peak memory was measured.
10. one section per sweep study (``mpipemoe sweep``): its ranking, pruned trials and the best run's
   curves (app/reports/studies.py).

The sections present are numbered 1, 2, 3, ... in this order: the numbers above are those of a
report with every kind of data.

Runs of the two kinds are never compared with each other. Time is the layer's
forward+backward in ms for benchmarks and ms per 1000 tokens (1e6 / tokens_per_s)
for training runs. Where one configuration was measured several times, the
fastest measurement counts (best-of). A section without data says so.

matplotlib (the ``ray`` extra) is imported where a figure is drawn: a report without
figures, and the tests of its tables, need none.
"""
from __future__ import annotations

import datetime
import os
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from app.reports.capacity import load_capacity_runs, section_capacity
from app.reports.emulated import load_emulated, section_emulated
from app.reports.step import load_steps, section_steps
from app.reports.memory_time import as_float as _float, as_int as _int, load_memory_time, section_memory_time
from app.tracking.run_kinds import BENCH, TRAIN, run_kind, run_segments
from app.reports.simulate import load_simulations, section_simulations
from app.tracking.store import check_store, client, finished_runs, resolve_tracking_uri, unfinished_runs
from app.reports.studies import load_studies, section_study
from app.reports.training import load_training_curves, section_training
from lm.errors import invocation, os_error

ENGINE = "mpipemoe"
BASELINES = ("fastmoe", "fastermoe")
STRATEGY_ORDER = ("none", "S1", "S2", "S3", "S4")
DEFAULT_OUT = "out/report"  # an ignored folder, never the committed results/


@dataclass(frozen=True)
class Record:
    """One measurement, normalised from an MLflow run of either kind."""

    kind: str                      # "bench" or "train"
    run_id: str
    experiment: str
    engine: str
    model: str
    tokens: int | None             # tokens per rank (batch x seq_len for training)
    world_size: int | None
    device: str
    dtype: str
    partitions: int | None         # the n used; None if "auto" and the chosen n was not logged
    strategy: str                  # the strategy used ("auto" if the chosen one was not logged)
    auto_partitions: bool          # n chosen by the engine (online search), not fixed by the caller
    auto_strategy: bool            # strategy chosen by the performance model, not fixed
    time_ms: float | None
    peak_memory_bytes: float | None
    predicted_memory_bytes: float | None
    segments: str = ""             # a resumed training run whose settings changed: its segments

    @property
    def config_key(self) -> tuple:
        """What must match for two records to be compared."""
        return (self.kind, self.model, self.tokens, self.world_size, self.device, self.dtype)


# --------------------------------------------------------------------------- loading

def to_record(run_id: str, experiment: str, params: dict, metrics: dict, tags: dict) -> Record | None:
    """A ``Record`` from one run's params/metrics/tags, or None for runs of no known kind."""
    if tags.get("measured_as") == "emulated":  # rank 0 of a modelled cluster: section 7 only
        return None
    kind = run_kind(tags) or \
        ("bench" if "fwd_bwd_ms" in metrics else "train" if "preset" in params else "")
    segments = run_segments(tags) if kind == TRAIN else []
    if segments:  # resumed with other settings: the summary metrics are those of the last segment
        params = {**params, **{k: str(v) for k, v in segments[-1].items() if k != "from_step" and v is not None}}
    engine = params.get("engine")
    if kind not in (BENCH, TRAIN) or not engine:
        return None
    model = params.get("model") or params.get("preset") or "?"
    if kind == BENCH and (_int(params.get("layers")) or 1) > 1:  # a stack of layers: section 9 only
        return None
    if kind == BENCH:  # mpipemoe bench: chosen_by=auto means the engine chose n and strategy
        if params.get("routing", "uniform") != "uniform":  # skewed routing: its own series
            model = f"{model}/{params['routing']}"
        auto_partitions = auto_strategy = params.get("chosen_by") == "auto"
        tokens = _int(params.get("tokens"))
        device, dtype = params.get("device", "?"), params.get("dtype", "?")
        time_ms = _float(metrics.get("fwd_bwd_ms"))
        peak = _float(metrics.get("peak_memory_bytes"))
    else:  # mpipemoe train (app.jobs.launch.run_job): TrainJob fields, resolved settings under "resolved."
        auto_partitions = params.get("partitions") == "auto"
        auto_strategy = params.get("strategy") == "auto"
        seq_len = _int(params.get("seq_len")) or _int(params.get("resolved.seq_len"))
        batch_size = _int(params.get("batch_size"))
        tokens = batch_size * seq_len if batch_size and seq_len else _int(params.get("tokens"))
        use_gpu = params.get("resolved.use_gpu", params.get("use_gpu"))
        device = {"True": "cuda", "False": "cpu"}.get(use_gpu, "?")
        dtype = params.get("resolved.dtype", params.get("dtype", "?"))
        # the run's median tokens/s and max peak (summary_*), else the last step's values
        tokens_per_s = _float(metrics.get("summary_tokens_per_s", metrics.get("tokens_per_s")))
        time_ms = 1e6 / tokens_per_s if tokens_per_s else None
        peak = _float(metrics.get("summary_peak_memory_bytes", metrics.get("peak_memory_bytes")))
    # what an "auto" run settled on, when logged (training runs tag it)
    partitions = _int(params.get("partitions"))
    if partitions is None:
        partitions = _int(tags.get("partitions", metrics.get("partitions")))
    strategy = params.get("strategy", "?")
    if strategy == "auto" and tags.get("strategy") in ("none", "S1", "S2", "S3", "S4"):
        strategy = tags["strategy"]
    world_size = _int(params.get("world_size", params.get("num_workers")))
    return Record(kind=kind, run_id=run_id, experiment=experiment, engine=engine, model=model,
                  tokens=tokens, world_size=world_size, device=device, dtype=dtype,
                  partitions=partitions, strategy=strategy, auto_partitions=auto_partitions,
                  auto_strategy=auto_strategy, time_ms=time_ms, peak_memory_bytes=peak,
                  predicted_memory_bytes=_float(metrics.get("predicted_memory_bytes",
                                                            params.get("predicted_memory_bytes"))),
                  segments=describe_segments(segments))


def describe_segments(segments: list[dict]) -> str:
    """``steps 1-25: engine mpipemoe, partitions 2; from step 26: engine fastmoe`` (the
    settings that differ from the segment before), "" for a run of one segment."""
    if len(segments) < 2:
        return ""
    parts = []
    for index, segment in enumerate(segments):
        before = segments[index - 1] if index else {}
        changed = ", ".join(f"{k} {v}" for k, v in segment.items()
                            if k != "from_step" and (not index and k in ("engine", "partitions", "strategy")
                                                     or index and before.get(k) != v))
        end = segments[index + 1]["from_step"] - 1 if index + 1 < len(segments) else None
        span = f"steps {segment['from_step']}-{end}" if end is not None else f"from step {segment['from_step']}"
        parts.append(f"{span}: {changed}")
    return "; ".join(parts)


def load_records(tracking_uri: str, experiments: list[str] | None = None) -> list[Record]:
    """Records of the FINISHED runs in ``experiments`` (default: every experiment)."""
    records = []
    for experiment, run in finished_runs(tracking_uri, experiments):
        record = to_record(run.info.run_id, experiment, run.data.params, run.data.metrics, run.data.tags)
        if record is not None:
            records.append(record)
    return records


# --------------------------------------------------------------------------- analysis

def _fastest(records: list[Record]) -> Record | None:
    timed = [r for r in records if r.time_ms is not None]
    return min(timed, key=lambda r: r.time_ms) if timed else None


def _sort_key(key: tuple) -> tuple:
    """Sort mixed tuples (numbers, strings, None): numbers ascending, then the rest by text."""
    return tuple((0, v, "") if isinstance(v, (int, float)) else (1, 0, str(v)) for v in key)


@dataclass(frozen=True)
class Comparison:
    """MPipeMoE against one baseline at one configuration."""

    key: tuple                     # Record.config_key
    baseline: str
    engine_ms: float
    baseline_ms: float
    engine_memory: float | None
    baseline_memory: float | None

    @property
    def speedup(self) -> float:
        return self.baseline_ms / self.engine_ms

    @property
    def memory_ratio(self) -> float | None:
        if self.engine_memory is None or not self.baseline_memory:
            return None
        return self.engine_memory / self.baseline_memory


def baseline_comparisons(records: list[Record]) -> list[Comparison]:
    """Per configuration: MPipeMoE (its own automatic choice if measured, else its fastest
    setting) against the fastest measurement of each baseline."""
    groups = defaultdict(list)
    for r in records:
        groups[r.config_key].append(r)
    rows = []
    for key in sorted(groups, key=_sort_key):
        group = groups[key]
        ours = [r for r in group if r.engine == ENGINE]
        engine = _fastest([r for r in ours if r.auto_partitions and r.auto_strategy]) or _fastest(ours)
        if engine is None:
            continue
        for baseline in BASELINES:
            base = _fastest([r for r in group if r.engine == baseline])
            if base is not None:
                rows.append(Comparison(key, baseline, engine.time_ms, base.time_ms,
                                       engine.peak_memory_bytes, base.peak_memory_bytes))
    return rows


@dataclass(frozen=True)
class StrategyRow:
    """Time and memory of each strategy (and the automatic choice) at one configuration."""

    key: tuple
    time_ms: dict                  # label -> ms; labels: none, S1..S4, "auto (S3)"
    memory: dict                   # label -> peak bytes (None if not measured)

    @property
    def fastest(self) -> str:
        fixed = {k: v for k, v in self.time_ms.items() if not k.startswith("auto")}
        return min(fixed, key=fixed.get)

    @property
    def auto_label(self) -> str | None:
        return next((k for k in self.time_ms if k.startswith("auto")), None)

    def auto_slowdown(self) -> float | None:
        """Time of the automatic choice over the fastest fixed strategy, minus 1."""
        auto = self.auto_label
        if auto is None:
            return None
        return self.time_ms[auto] / self.time_ms[self.fastest] - 1


def strategy_rows(records: list[Record]) -> list[StrategyRow]:
    groups = defaultdict(list)
    for r in records:
        if r.engine == ENGINE and r.time_ms is not None:
            groups[r.config_key].append(r)
    rows = []
    for key in sorted(groups, key=_sort_key):
        times, memory = {}, {}
        fixed = [r for r in groups[key] if r.strategy in STRATEGY_ORDER and not r.auto_strategy]
        for strategy in STRATEGY_ORDER:
            best = _fastest([r for r in fixed if r.strategy == strategy])
            if best is not None:
                times[strategy], memory[strategy] = best.time_ms, best.peak_memory_bytes
        auto = _fastest([r for r in groups[key] if r.auto_strategy])
        if len(times) < 2:  # one strategy measured: nothing to compare
            continue
        if auto is not None:
            label = "auto" if auto.strategy in ("auto", "?") else f"auto ({auto.strategy})"
            times[label], memory[label] = auto.time_ms, auto.peak_memory_bytes
        rows.append(StrategyRow(key, times, memory))
    return rows


@dataclass(frozen=True)
class BestN:
    """Best fixed n at one token count of one series; ``violation`` if it is below the
    best n at the next smaller token count (best n should not decrease as tokens grow)."""

    series: tuple                  # (kind, model, world_size, device, dtype, strategy)
    tokens: int
    best_n: int
    best_ms: float
    candidates: int                # how many fixed n were measured
    violation: bool
    auto_n: int | None             # the n the online search chose (if an auto run logged it)
    auto_ms: float | None


def best_partitions(records: list[Record]) -> list[BestN]:
    """Per series and token count: the fastest fixed n, with monotonicity violations marked."""
    series = defaultdict(lambda: defaultdict(list))
    for r in records:
        if r.engine == ENGINE and r.tokens is not None and r.time_ms is not None:
            key = (r.kind, r.model, r.world_size, r.device, r.dtype, r.strategy)
            series[key][r.tokens].append(r)
    rows = []
    for key in sorted(series, key=_sort_key):
        previous = None
        for tokens in sorted(series[key]):
            group = series[key][tokens]
            grid = [r for r in group if not r.auto_partitions and r.partitions is not None]
            if len({r.partitions for r in grid}) < 2:
                continue
            # ties go to the smaller n
            best = min(grid, key=lambda r: (r.time_ms, r.partitions))
            auto = _fastest([r for r in group if r.auto_partitions])
            rows.append(BestN(key, tokens, best.partitions, best.time_ms, len({r.partitions for r in grid}),
                              previous is not None and best.partitions < previous,
                              auto.partitions if auto else None, auto.time_ms if auto else None))
            previous = best.partitions
    return rows


def memory_predictions(records: list[Record]) -> list[Record]:
    """Records with both a predicted and a measured peak memory."""
    return [r for r in records if r.predicted_memory_bytes and r.peak_memory_bytes]


# --------------------------------------------------------------------------- plots

def _figure(ncols: int = 1, width: float = 6.4):
    from matplotlib.figure import Figure  # no pyplot: no global figure state, Agg canvas

    figure = Figure(figsize=(width * ncols, 4.2), layout="constrained")
    axes = figure.subplots(1, ncols, squeeze=False)[0]
    return figure, axes


def _label(key: tuple) -> str:
    kind, model, _tokens, world, device, dtype = key
    return f"{kind}: {model}, {world} ranks, {device}/{dtype}"


def plot_baselines(rows: list[Comparison], path: Path) -> None:
    figure, (ax_time, ax_mem) = _figure(2)
    lines = defaultdict(list)
    for row in rows:
        kind, model, tokens, world, device, dtype = row.key
        lines[(kind, model, world, device, dtype, row.baseline)].append((tokens or 0, row.speedup, row.memory_ratio))
    for i, ((kind, model, world, device, dtype, baseline), points) in enumerate(
            sorted(lines.items(), key=lambda item: str(item[0]))):
        points.sort()
        style = {"marker": "o", "color": f"C{i % 10}", "label": f"vs {baseline}: {kind} {model} ({world} ranks, {device})"}
        ax_time.plot([p[0] for p in points], [p[1] for p in points], **style)
        mem = [p for p in points if p[2] is not None]
        if mem:
            ax_mem.plot([p[0] for p in mem], [p[2] for p in mem], **style)
    ax_time.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax_mem.axhline(1.0, color="gray", lw=0.8, ls="--")
    tokens = [row.key[2] or 0 for row in rows]
    ax_time.set(title="MPipeMoE speedup over baselines", xlabel="tokens per rank",
                ylabel="baseline time / MPipeMoE time")
    ax_mem.set(title="MPipeMoE peak memory relative to baselines", xlabel="tokens per rank",
               ylabel="MPipeMoE memory / baseline memory")
    for ax in (ax_time, ax_mem):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(set(tokens)), [str(t) for t in sorted(set(tokens))])
        ax.minorticks_off()
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    if not any(row.memory_ratio is not None for row in rows):
        ax_mem.text(0.5, 0.5, "peak memory not measured\n(measured on CUDA devices)", ha="center",
                    va="center", transform=ax_mem.transAxes)
    figure.savefig(path, dpi=100)


def _memory_reference(row: StrategyRow) -> float | None:
    """Keep-everything memory if measured, else the largest measured."""
    if row.memory.get("none"):
        return row.memory["none"]
    known = [v for v in row.memory.values() if v]
    return max(known) if known else None


def plot_strategies(rows: list[StrategyRow], path: Path) -> None:
    figure, (ax_time, ax_mem) = _figure(2, width=max(6.4, 0.9 * len(rows) + 2))
    labels = list(STRATEGY_ORDER) + ["auto"]
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        xs, times, mems = [], [], []
        for x, row in enumerate(rows):
            key = label if label != "auto" else row.auto_label
            if key not in row.time_ms:
                continue
            xs.append(x + (i - len(labels) / 2 + 0.5) * width)
            times.append(row.time_ms[key] / row.time_ms[row.fastest])
            reference = _memory_reference(row)
            mems.append(row.memory[key] / reference if reference and row.memory[key] else 0.0)
        if xs:
            ax_time.bar(xs, times, width, label=label)
            if any(mems):
                ax_mem.bar(xs, mems, width, label=label)
    ticks = [f"{row.key[0]} {row.key[1]}\n{row.key[2]} tok" for row in rows]
    for ax in (ax_time, ax_mem):
        ax.set_xticks(range(len(rows)), ticks, fontsize=7)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    ax_time.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax_time.set(title="time per strategy", ylabel="time / fastest fixed strategy")
    ax_mem.set(title="peak memory per strategy", ylabel="memory / keep-everything ('none')")
    if not any(v for row in rows for v in row.memory.values()):
        ax_mem.text(0.5, 0.5, "peak memory not measured\n(measured on CUDA devices)", ha="center",
                    va="center", transform=ax_mem.transAxes)
    figure.savefig(path, dpi=100)


def _integer_log2_axes(ax, xs, ys) -> None:
    """Log-2 axes labelled with the plain values measured (512, 1024 ...; 1, 2, 4 ...)."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(sorted(set(xs)), [str(x) for x in sorted(set(xs))])
    ax.set_yticks(sorted(set(ys)), [str(y) for y in sorted(set(ys))])
    ax.minorticks_off()


def plot_best_n(rows: list[BestN], path: Path) -> None:
    figure, (ax,) = _figure(1, width=7.5)
    series = defaultdict(list)
    for row in rows:
        series[row.series].append(row)
    styles = ("-", "--", ":", "-.")
    violation_labelled = False
    for i, (key, points) in enumerate(sorted(series.items(), key=lambda item: str(item[0]))):
        kind, model, world, device, dtype, strategy = key
        # overlapping series stay visible: line style and marker size vary by series
        line, = ax.plot([p.tokens for p in points], [p.best_n for p in points], marker="o",
                        ls=styles[i % len(styles)], ms=9 - 1.5 * (i % 4),
                        label=f"{kind} {model} ({world} ranks, {device}, {strategy})")
        auto = [p for p in points if p.auto_n is not None]
        if auto:
            ax.scatter([p.tokens for p in auto], [p.auto_n for p in auto], marker="s", s=90,
                       facecolors="none", edgecolors=line.get_color(), label=f"online n ({strategy})")
        bad = [p for p in points if p.violation]
        if bad:
            ax.scatter([p.tokens for p in bad], [p.best_n for p in bad], marker="x", s=140, color="red",
                       zorder=5, label=None if violation_labelled else "monotonicity violation")
            violation_labelled = True
    _integer_log2_axes(ax, [r.tokens for r in rows],
                       [r.best_n for r in rows] + [r.auto_n for r in rows if r.auto_n is not None])
    ax.set(title="best number of partitions n against tokens", xlabel="tokens per rank", ylabel="best n")
    ax.legend(fontsize=7)
    figure.savefig(path, dpi=100)


def plot_memory_predictions(records: list[Record], path: Path) -> None:
    figure, (ax,) = _figure(1)
    mib = 2 ** 20
    for engine in sorted({r.engine for r in records}):
        mine = [r for r in records if r.engine == engine]
        ax.scatter([r.predicted_memory_bytes / mib for r in mine], [r.peak_memory_bytes / mib for r in mine],
                   label=engine)
    values = [v / mib for r in records for v in (r.predicted_memory_bytes, r.peak_memory_bytes)]
    low, high = min(values) * 0.8, max(values) * 1.2
    ax.plot([low, high], [low, high], color="gray", lw=0.8, label="measured = predicted")
    ax.fill_between([low, high], [low * 0.9, high * 0.9], [low * 1.1, high * 1.1], color="gray", alpha=0.15,
                    label="±10%")
    ax.set(xscale="log", yscale="log", xlabel="predicted peak memory (MiB)", ylabel="measured peak memory (MiB)",
           title="predicted against measured peak memory")
    ax.legend(fontsize=7)
    figure.savefig(path, dpi=100)


# --------------------------------------------------------------------------- markdown

def _mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
           ["| " + " | ".join(row) + " |" for row in rows]


NO_DATA = "_No data: {what}._"


def section_baselines(records: list[Record], out: Path) -> list[str]:
    lines = ["## 1. Speedup and memory against the baselines", ""]
    rows = baseline_comparisons(records)
    if not rows:
        return lines + [NO_DATA.format(what="no configuration was measured with MPipeMoE and a baseline "
                                            "(run `mpipemoe sweep engines` or `mpipemoe bench`)"), ""]
    plot_baselines(rows, out / "speedup_memory.png")
    lines += ["![speedup and memory against the baselines](speedup_memory.png)", "",
              "Speedup = baseline time / MPipeMoE time; memory = MPipeMoE peak / baseline peak "
              "(below 1 saves memory). MPipeMoE at its automatic settings where measured, else its "
              "fastest setting."
              + (" CPU rows check the plumbing, not speed: on a few shared cores the pipeline's overlap "
                 "cannot pay off (docs/design.md §4.2); speed is measured on GPUs." if any(
                  row.key[4] == "cpu" for row in rows) else ""), ""]
    table = [[row.key[0], row.key[1], str(row.key[2]), str(row.key[3]), f"{row.key[4]}/{row.key[5]}",
              row.baseline, f"{row.engine_ms:.3f}", f"{row.baseline_ms:.3f}", f"{row.speedup:.2f}x",
              "-" if row.memory_ratio is None else f"{row.memory_ratio:.2f}"] for row in rows]
    return lines + _table(["kind", "model", "tokens", "ranks", "device", "baseline", "MPipeMoE time",
                           "baseline time", "speedup", "memory ratio"], table) + [""]


def section_strategies(records: list[Record], out: Path) -> list[str]:
    lines = ["## 2. Memory and time per strategy", ""]
    rows = strategy_rows(records)
    if not rows:
        return lines + [NO_DATA.format(what="no configuration was measured with two or more fixed "
                                            "strategies (run `mpipemoe sweep strategy`)"), ""]
    plot_strategies(rows, out / "strategies.png")
    lines += ["![time and memory per strategy](strategies.png)", "",
              "Time relative to the fastest fixed strategy; memory relative to keeping everything "
              "(`none`). `auto` is the performance model's choice.", ""]
    table = []
    for row in rows:
        cells = [f"{row.time_ms[k]:.3f} / {_mib(row.memory[k])}" for k in row.time_ms]
        slowdown = row.auto_slowdown()
        table.append([_label(row.key), str(row.key[2]), " · ".join(f"{k}: {c}" for k, c in zip(row.time_ms, cells)),
                      row.fastest, "-" if slowdown is None else f"{row.auto_label}: {slowdown:+.1%}"])
    return lines + _table(["configuration", "tokens", "ms / peak MiB per strategy", "fastest",
                           "auto vs fastest"], table) + [""]


def section_best_n(records: list[Record], out: Path) -> list[str]:
    lines = ["## 3. Best number of partitions n against tokens", ""]
    rows = best_partitions(records)
    if not rows:
        return lines + [NO_DATA.format(what="no token count was measured with two or more fixed n "
                                            "(run `mpipemoe sweep granularity`)"), ""]
    plot_best_n(rows, out / "best_n.png")
    violations = [r for r in rows if r.violation]
    lines += ["![best n against tokens](best_n.png)", "",
              "The online search assumes the best n never decreases as the token count grows. "
              + (f"**{len(violations)} violation(s)** (red crosses; marked ✗ below)."
                 if violations else "No violation in these measurements."), ""]
    table = [[f"{r.series[0]} {r.series[1]}", str(r.series[2]), r.series[5], str(r.tokens), str(r.best_n),
              f"{r.best_ms:.3f}", str(r.candidates), "✗ decreases" if r.violation else "ok",
              "-" if r.auto_ms is None else
              f"n={r.auto_n if r.auto_n is not None else '?'}, {r.auto_ms / r.best_ms - 1:+.1%}"]
             for r in rows]
    return lines + _table(["model", "ranks", "strategy", "tokens", "best n", "ms", "n tried", "monotone",
                           "online n vs best"], table) + [""]


def section_memory(records: list[Record], out: Path) -> list[str]:
    lines = ["## 4. Predicted against measured memory", ""]
    rows = memory_predictions(records)
    if not rows:
        return lines + [NO_DATA.format(what="no run logged both predicted_memory_bytes and "
                                            "peak_memory_bytes (run `mpipemoe bench`)"), ""]
    plot_memory_predictions(rows, out / "memory_prediction.png")
    errors = [abs(r.predicted_memory_bytes / r.peak_memory_bytes - 1) for r in rows]
    lines += ["![predicted against measured memory](memory_prediction.png)", "",
              f"{len(rows)} measurement(s); largest error {max(errors):.1%}, "
              f"{sum(e <= 0.10 for e in errors)} within 10%.", ""]
    table = [[r.engine, r.model, str(r.tokens), str(r.partitions), r.strategy, _mib(r.predicted_memory_bytes),
              _mib(r.peak_memory_bytes), f"{r.predicted_memory_bytes / r.peak_memory_bytes - 1:+.1%}"]
             for r in sorted(rows, key=lambda r: (r.model, r.tokens or 0, r.strategy))]
    return lines + _table(["engine", "model", "tokens", "n", "strategy", "predicted MiB", "measured MiB",
                           "error"], table) + [""]


def write_report(records: list[Record], out_dir: str | os.PathLike, *, source: str = "",
                 simulations: list[dict] | None = None, capacities: list[dict] | None = None,
                 emulated: tuple[list[dict], list[dict]] | None = None, training: list[dict] | None = None,
                 memory_time: list[dict] | None = None, steps: list[dict] | None = None,
                 studies: list[dict] | None = None) -> Path:
    """Write ``report.md`` and its PNG figures into ``out_dir``; returns the report's path.
    ``simulations``: rows of ``app.reports.simulate.load_simulations`` (section 5 when there are any);
    ``capacities``: rows of ``app.reports.capacity.load_capacity_runs`` (section 6 when there are any);
    ``emulated``: (summaries, records) of ``app.reports.emulated.load_emulated`` (section 7
    when there are any); ``training``: rows of ``app.reports.training.load_training_curves``
    (section 8 when there are any); ``memory_time``: rows of ``app.reports.memory_time.load_memory_time``
    (section 9 when a stack, or a layer with peak memory, was measured); ``steps``: rows of
    ``app.reports.step.load_steps`` (7b, the training steps of ``bench --step``, when there are any);
    ``studies``: ``app.reports.studies.load_studies`` (a section per sweep study, last). The sections
    present are numbered 1, 2, 3, ... in order (``number_sections``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.png"):  # figures of sections that now have no data must not linger
        old.unlink()
    kinds = defaultdict(int)
    for r in records:
        kinds[r.kind] += 1
    experiments = sorted({r.experiment for r in records})
    lines = ["# MPipeMoE report", "",
             f"Generated by `mpipemoe report` on {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} "
             f"from {len(records)} MLflow run(s): {kinds['bench']} layer benchmark(s), {kinds['train']} "
             f"training run(s){f' in {source}' if source else ''}; experiments: "
             f"{', '.join(experiments) if experiments else 'none'}.", "",
             "Time is the layer's forward+backward in ms for benchmarks (`bench`) and ms per 1000 tokens "
             "for training runs (`train`); the two kinds are never compared with each other. Where one "
             "configuration was measured several times, the fastest measurement counts.", ""]
    resumed = [r for r in records if r.segments]
    if resumed:  # their numbers are of their last segment, credited to its settings
        lines += ["Resumed with other settings (the numbers below are those of each run's last segment):", ""]
        lines += [f"- run `{r.run_id[:8]}` ({r.experiment}): {r.segments}" for r in resumed] + [""]
    for section in (section_baselines, section_strategies, section_best_n, section_memory):
        lines += section(records, out)
    if simulations:  # section 5 only where `mpipemoe simulate` logged something
        lines += section_simulations(simulations, str(out))
    if capacities:  # section 6 only where `mpipemoe capacity` logged something
        lines += section_capacity(capacities)
    if emulated and emulated[0]:  # section 7 only where `mpipemoe bench --emulate` logged something
        lines += section_emulated(*emulated, out)
    if steps:  # 7b only where `mpipemoe bench --step` logged something
        lines += section_steps(steps)
    if training:  # section 8 only where training runs logged a validation loss or load metrics
        lines += section_training(training, out, [s["study"] for s in studies or []])
    if memory_time:  # section 9 only where a bench point has memory figures, or is a stack
        lines += section_memory_time(memory_time, out)
    for index, study in enumerate(studies or []):  # one section per sweep study
        lines += section_study(study, index, out)
    path = out / "report.md"
    path.write_text("\n".join(number_sections(lines)))
    return path


def number_sections(lines: list[str]) -> list[str]:
    """Local. The report's ``## N.`` headings numbered 1, 2, 3, ... as they come (a section
    without data is left out, so fixed numbers would jump), and a ``### Nb.`` sub-heading
    after its section's number."""
    numbered, number = [], 0
    for line in lines:
        if re.match(r"## \d+\. ", line):
            number += 1
            line = re.sub(r"^## \d+\.", f"## {number}.", line)
        elif re.match(r"### \d+b\. ", line):
            line = re.sub(r"^### \d+b\.", f"### {number}b.", line)
        numbered.append(line)
    return numbered


def check_out(out: str | os.PathLike) -> None:
    """Raise ValueError naming ``--out`` and the fix unless the report can be written there:
    a folder (or a path whose nearest existing folder) this process may write."""
    path = Path(out).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {out}: {path} is a file, not a folder: give a folder (the report writes "
                         f"report.md and its figures into it)")
    existing = next(parent for parent in (path, *path.parents) if parent.exists())
    if not existing.is_dir():
        raise ValueError(f"--out {out}: {existing} is a file, not a folder: give another --out")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: folder {existing} is not writable (read-only or not yours): give a "
                         f"writable folder, e.g. --out {DEFAULT_OUT}")


def _write(records: list[Record], out: str, **sources) -> Path:
    """``write_report`` with a failing write (full disk, permissions) said in one line."""
    try:
        return write_report(records, out, **sources)
    except OSError as error:
        raise os_error(error, f"cannot write the report to {out}", "free space there or give another --out") from error


def report_from_store(out: str, experiments: list[str] | None, tracking_uri: str | None) -> int:
    """`mpipemoe report`: read the store (``tracking_uri``, default as ``resolve_tracking_uri``), write
    the report into ``out`` and say where; notes on stderr name missing experiments and unfinished runs."""
    check_out(out)  # before the store is read: nothing is done for a report that cannot be written
    tracking_uri = resolve_tracking_uri(tracking_uri)
    check_store(tracking_uri, write=False)  # a typo'd folder is an error, never a new empty store
    store = Path(tracking_uri[len("sqlite:///"):]) if tracking_uri.startswith("sqlite:///") else None
    if store is not None and not store.exists():  # nothing recorded yet: an empty report, no new store
        print(f"note: no MLflow store at {store} yet: train or sweep first, or check --tracking-uri",
              file=sys.stderr)
        path = _write([], out, source=tracking_uri)
        print(f"Wrote {path.resolve()} (0 run(s), figures: none)")
        return 0
    known = {e.name for e in client(tracking_uri).search_experiments()}
    missing = [name for name in experiments or [] if name not in known]
    if missing:
        print(f"note: no MLflow experiment {', '.join(map(repr, missing))} in {tracking_uri} "
              f"(there are: {', '.join(sorted(known)) or 'none'})", file=sys.stderr)
    records = load_records(tracking_uri, experiments)
    path = _write(records, out, source=tracking_uri,
                  simulations=load_simulations(tracking_uri, experiments),
                  capacities=load_capacity_runs(tracking_uri, experiments),
                  emulated=load_emulated(tracking_uri, experiments),
                  training=load_training_curves(tracking_uri, experiments),
                  memory_time=load_memory_time(tracking_uri, experiments),
                  steps=load_steps(tracking_uri, experiments),
                  studies=load_studies(tracking_uri, experiments))
    left_out = unfinished_runs(tracking_uri, experiments)
    if left_out:
        counts = ", ".join(f"{status} {count}" for status, count in sorted(left_out.items()))
        print(f"note: {sum(left_out.values())} run(s) did not finish and are left out ({counts}); "
              f"`{invocation()} ui` shows them with their error tags", file=sys.stderr)
    print(f"Wrote {path.resolve()} ({len(records)} run(s), figures: "
          f"{', '.join(sorted(p.name for p in path.parent.glob('*.png'))) or 'none'})")
    return 0
