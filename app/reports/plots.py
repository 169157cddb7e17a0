"""The figures of `mpipemoe report`'s first four sections (app/reports/report.py), one PNG each:
speedup and memory against the baselines, time and memory per strategy, the best n against
tokens, predicted against measured memory. matplotlib (the ``ray`` extra) is imported where a
figure is drawn."""
from __future__ import annotations

from app.reports.runs import STRATEGY_ORDER, BestN, Comparison, Record, StrategyRow

from collections import defaultdict
from pathlib import Path



def _figure(ncols: int = 1, width: float = 6.4):
    from matplotlib.figure import Figure  # no pyplot: no global figure state, Agg canvas

    figure = Figure(figsize=(width * ncols, 4.2), layout="constrained")
    axes = figure.subplots(1, ncols, squeeze=False)[0]
    return figure, axes


def point_label(key: tuple) -> str:
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
