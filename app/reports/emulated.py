"""Section 7 of ``mpipemoe report``: rank 0 of emulated clusters (``mpipemoe bench --emulate``).

Emulated records (tag ``measured_as=emulated``; docs/emulation.md) are the real engine's
times on one GPU against a modelled network. They never enter sections 1–4, which hold
measurements; here, per network:

- speedup over FastMoE and FasterMoE, and overlap efficiency (its floor / MPipeMoE's
  time at its automatic settings), against tokens per GPU;
- the best n of the grid and the online search's n against tokens;
- memory against time for every n × strategy of the grid, both relative to FastMoE.

matplotlib is imported where a figure is drawn, as in app/reports/report.py.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from moe_engine.config import STRATEGIES

from app.tracking.run_kinds import BENCH, BENCH_SUMMARY
from app.tracking.store import finished_runs_of_kind

STRATEGY_ORDER = STRATEGIES
STRATEGY_COLOURS = {"none": "black", "S1": "tab:blue", "S2": "tab:orange", "S3": "tab:green", "S4": "tab:red"}


def _row(run) -> dict:
    """A run's params and metrics as one dict (metrics win: they keep numbers numeric)."""
    return {**run.data.params, **run.data.metrics, "start_time": run.info.start_time}


def load_emulated(tracking_uri: str, experiments: list[str] | None = None) -> tuple[list[dict], list[dict]]:
    """(summaries, records) of the emulated bench runs."""
    emulated = "tags.measured_as = 'emulated'"
    summaries = [_row(run) for _, run in finished_runs_of_kind(tracking_uri, experiments, BENCH_SUMMARY, emulated)]
    records = [_row(run) for _, run in finished_runs_of_kind(tracking_uri, experiments, BENCH, emulated)]
    return summaries, records


def _key(row: dict) -> tuple:
    return (row.get("network", "?"), row.get("emulated_cluster", "?"), row["model"], row.get("routing", "uniform"))


def _latest(rows: list[dict]) -> dict:
    """One summary per (network, cluster, model, routing, tokens): the last logged."""
    latest = {}
    for row in sorted(rows, key=lambda r: r["start_time"]):
        latest[_key(row) + (int(row["tokens"]),)] = row  # (mypy 2.4 misreads `(*a, b)` in a subscript)
    return latest


def _series(summaries: list[dict]) -> dict:
    """(network, cluster) -> (model, routing) -> [summary sorted by tokens]."""
    series = defaultdict(lambda: defaultdict(list))
    for key, row in sorted(_latest(summaries).items()):
        series[key[:2]][key[2:4]].append(row)
    return series


def _figure(rows: int, cols: int):
    from matplotlib.figure import Figure  # no pyplot: no global figure state, Agg canvas

    figure = Figure(figsize=(6.0 * cols, 3.8 * rows), layout="constrained")
    return figure, figure.subplots(rows, cols, squeeze=False)


def plot_speedup(series: dict, path: Path) -> None:
    figure, axes = _figure(2, len(series))
    for col, (network, by_model) in enumerate(series.items()):
        top, bottom = axes[0][col], axes[1][col]
        for (model, routing), rows in by_model.items():
            tokens = [int(r["tokens"]) for r in rows]
            line, = top.plot(tokens, [r["speedup_vs_fastmoe"] for r in rows], marker="o",
                             label=f"{model} {routing} vs FastMoE")
            if all("speedup_vs_fastermoe" in r for r in rows):
                top.plot(tokens, [r["speedup_vs_fastermoe"] for r in rows], marker="x", linestyle="--",
                         color=line.get_color(), label=f"{model} {routing} vs FasterMoE")
            if all("overlap_efficiency" in r for r in rows):
                bottom.plot(tokens, [r["overlap_efficiency"] for r in rows], marker="o", color=line.get_color(),
                            label=f"{model} {routing}")
        top.axhline(1.0, color="grey", linewidth=0.8)
        bottom.axhline(1 / 1.15, color="grey", linewidth=0.8, linestyle=":")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tokens per GPU")
        top.set_ylabel("speedup (auto)")
        bottom.set_ylabel("floor / auto time")
        top.set_title(f"{network[0]}, {network[1]} (emulated)")
        top.legend(fontsize=6)
        bottom.legend(fontsize=6)
    figure.savefig(path, dpi=110)


def plot_best_n(series: dict, path: Path) -> None:
    figure, axes = _figure(1, len(series))
    for col, (network, by_model) in enumerate(series.items()):
        ax = axes[0][col]
        for (model, routing), rows in by_model.items():
            rows = [r for r in rows if "grid_best_partitions" in r]
            if not rows:
                continue
            tokens = [int(r["tokens"]) for r in rows]
            line, = ax.plot(tokens, [r["grid_best_partitions"] for r in rows], marker="o",
                            label=f"{model} {routing}: grid best")
            ax.plot(tokens, [r["auto_partitions"] for r in rows], marker="x", linestyle="--",
                    color=line.get_color(), label=f"{model} {routing}: online")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("tokens per GPU")
        ax.set_ylabel("n")
        ax.set_title(f"{network[0]}, {network[1]} (emulated)")
        ax.legend(fontsize=6)
    figure.savefig(path, dpi=110)


def memory_time_points(records: list[dict]) -> dict:
    """(network, cluster) -> strategy -> [(time / FastMoE's, peak / FastMoE's)] of every
    grid record whose point has a FastMoE record with memory."""
    fastmoe = {}
    for r in records:
        if r["engine"] == "fastmoe" and r.get("peak_memory_bytes"):
            fastmoe[_key(r) + (int(r["tokens"]),)] = r
    points = defaultdict(lambda: defaultdict(list))
    for r in records:
        base = fastmoe.get((*_key(r), int(r["tokens"])))
        if r["engine"] == "mpipemoe" and r.get("chosen_by") == "grid" and base and r.get("peak_memory_bytes"):
            points[_key(r)[:2]][r["strategy"]].append((r["fwd_bwd_ms"] / base["fwd_bwd_ms"],
                                                      r["peak_memory_bytes"] / base["peak_memory_bytes"]))
    return points


def plot_memory_time(points: dict, path: Path) -> None:
    figure, axes = _figure(1, len(points))
    for col, (network, by_strategy) in enumerate(sorted(points.items())):
        ax = axes[0][col]
        for strategy in STRATEGY_ORDER:
            if by_strategy.get(strategy):
                times, memory = zip(*by_strategy[strategy])
                ax.scatter(times, memory, s=10, color=STRATEGY_COLOURS[strategy], label=strategy)
        ax.axvline(1.0, color="grey", linewidth=0.8)
        ax.axhline(0.55, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xlabel("time / FastMoE's")
        ax.set_ylabel("peak memory / FastMoE's")
        ax.set_title(f"{network[0]}, {network[1]}: every n × strategy (emulated)")
        ax.legend(fontsize=7)
    figure.savefig(path, dpi=110)


def _fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def section_emulated(summaries: list[dict], records: list[dict], out: Path) -> list[str]:
    lines = ["## 7. Emulated clusters (rank 0 on one GPU, modelled network)", ""]
    series = _series(summaries)
    if not series:
        return lines + ["_No data: no emulated benchmark was logged (run `mpipemoe bench --emulate 8x8 ...`, "
                        "docs/emulation.md)._", ""]
    out = Path(out)
    plot_speedup(series, out / "emulated_speedup.png")
    plot_best_n(series, out / "emulated_best_n.png")
    lines += ["The real engine on one GPU as rank 0 of the cluster, with the network's delays modelled "
              "(docs/emulation.md): **emulated**, not measured on a cluster. Overlap efficiency = floor / "
              "MPipeMoE's time at its automatic settings, the floor that no pass beats (docs/engine.md, "
              "\"Reading a timeline\"; records before b0bd8da: the pipeline model max(All-to-All, expert FFN) + "
              "the shorter / n). The dotted line: 15% above the floor.", "",
              "![speedup and overlap efficiency against tokens](emulated_speedup.png)", "",
              "![best n against tokens](emulated_best_n.png)", ""]
    points = memory_time_points(records)
    if points:
        plot_memory_time(points, out / "emulated_memory_time.png")
        lines += ["![memory against time per strategy](emulated_memory_time.png)", ""]
    table = []
    for network, by_model in series.items():
        for (model, routing), rows in by_model.items():
            for r in rows:
                table.append([f"{network[0]} {network[1]}", model, routing, str(int(r["tokens"])),
                              f"{int(r['auto_partitions'])}/{r['auto_strategy']}",
                              _fmt(r.get("speedup_vs_fastmoe"), ".2f"), _fmt(r.get("speedup_vs_fastermoe"), ".2f"),
                              _fmt(r.get("overlap_efficiency"), ".0%"),
                              _fmt(r.get("memory_ratio_vs_fastmoe"), ".2f"),
                              f"{_fmt(r.get('grid_best_partitions'), '.0f')}/{r.get('grid_best_strategy', '–')}",
                              _fmt(r.get("auto_vs_grid_best"), "+.1%"),
                              f"{r['lean_setting']}: {r['lean_vs_fastest']:+.1%}" if "lean_setting" in r else "–"])
    header = ["network", "model", "routing", "tokens", "auto n/strategy", "vs FastMoE", "vs FasterMoE",
              "overlap eff.", "memory vs FastMoE", "grid best", "auto vs grid best",
              "≤0.55x memory: vs fastest"]
    return lines + ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(row) + " |" for row in table] + [""]
