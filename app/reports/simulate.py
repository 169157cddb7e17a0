"""Section 5 of ``mpipemoe report``: simulated clusters (``mpipemoe simulate``, app/bench/simulate.py).

The simulate command logs one MLflow run per engine and point (tag ``kind=simulate``);
here they are read back, and each engine's simulated layer time, and MPipeMoE's speedup
and memory against FasterMoE, are drawn and tabled as the cluster grows.

matplotlib is imported where a figure is drawn, as in app/reports/report.py.
"""
from __future__ import annotations

import os

from app.tracking.run_kinds import SIMULATE
from app.tracking.store import finished_runs_of_kind


def load_simulations(tracking_uri: str, experiments: list[str] | None = None) -> list[dict]:
    """Every finished kind=simulate run (in `experiments`, default all) as a flat dict of
    params and metrics, oldest first (for the report)."""
    rows = [{**run.data.metrics, **run.data.params, "run_id": run.info.run_id, "start_time": run.info.start_time}
            for _, run in finished_runs_of_kind(tracking_uri, experiments, SIMULATE)]
    return sorted(rows, key=lambda r: r["start_time"] or 0)


def _series_key(row: dict) -> tuple:
    return (row.get("model"), str(row.get("tokens")), row.get("network"), row.get("routing"),
            str(row.get("gpus_per_node")))


def section_simulations(rows: list[dict], out) -> list[str]:
    """Markdown (and simulate.png) for `mpipemoe report`: each engine's simulated layer time
    and MPipeMoE's speedup and memory against FasterMoE as the cluster grows."""
    lines = ["## 5. Simulated clusters (`mpipemoe simulate`)", ""]
    rows = [r for r in rows if r.get("label") in ("fastmoe", "fastermoe", "mpipemoe") and "fwd_bwd_ms" in r]
    if not rows:
        return lines + ["_No data: no simulation was logged (run `mpipemoe simulate --sweep-nodes 1,2,4,8,16,32,64`)._",
                        ""]
    latest = {}
    for r in rows:  # rows come oldest first: the newest run of each (series, ranks, engine) counts
        key = (_series_key(r), int(float(r["ranks"])), r["label"])
        latest[key] = r
    series = sorted({k[0] for k in latest}, key=str)
    from matplotlib.figure import Figure  # no pyplot: no global figure state, Agg canvas

    figure = Figure(figsize=(12.8, 4.2), layout="constrained")
    ax_time, ax_ratio = figure.subplots(1, 2)
    table = []
    for i, key in enumerate(series):
        model, tokens, network, routing, gpus = key
        ranks = sorted({k[1] for k in latest if k[0] == key})
        for j, label in enumerate(("fastmoe", "fastermoe", "mpipemoe")):
            points = [(r, latest[(key, r, label)]["fwd_bwd_ms"]) for r in ranks if (key, r, label) in latest]
            ax_time.plot([p[0] for p in points], [float(p[1]) for p in points], marker="o", color=f"C{j}",
                         ls=("-", "--", ":", "-.")[i % 4], label=f"{label}: {model} {tokens} tok, {network}, {routing}")
        ours = [(r, latest[(key, r, "mpipemoe")]) for r in ranks if (key, r, "mpipemoe") in latest]
        ax_ratio.plot([r for r, _ in ours], [float(row["speedup_vs_fastermoe"]) for _, row in ours], marker="o",
                      color="C2", ls=("-", "--", ":", "-.")[i % 4], label=f"speedup: {model} {tokens} tok, {network}")
        ax_ratio.plot([r for r, _ in ours], [float(row["memory_ratio_vs_fastermoe"]) for _, row in ours], marker="s",
                      color="C4", ls=("-", "--", ":", "-.")[i % 4], label=f"memory ratio: {model} {tokens} tok")
        for r, row in ours:
            table.append([model, tokens, network, routing, str(r),
                          f"{float(latest[(key, r, 'fastmoe')]['fwd_bwd_ms']):.2f}" if (key, r, "fastmoe") in latest else "-",
                          f"{float(latest[(key, r, 'fastermoe')]['fwd_bwd_ms']):.2f}" if (key, r, "fastermoe") in latest else "-",
                          f"{float(row['fwd_bwd_ms']):.2f}", f"{row.get('partitions', '?')}/{row.get('strategy', '?')}",
                          f"{float(row['speedup_vs_fastermoe']):.2f}x", f"{float(row['memory_ratio_vs_fastermoe']):.2f}"])
    for ax in (ax_time, ax_ratio):
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
    ax_time.set(title="simulated MoE layer fwd+bwd", xlabel="GPUs", ylabel="ms")
    ax_ratio.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax_ratio.set(title="MPipeMoE against FasterMoE (simulated)", xlabel="GPUs",
                 ylabel="speedup (o) / memory ratio (s)")
    figure.savefig(os.path.join(out, "simulate.png"), dpi=100)
    lines += ["![simulated clusters](simulate.png)", "",
              "Predictions, not measurements: the schedule simulator from parts measured on one GPU and a "
              "network profile (docs/simulate.md). MPipeMoE at the n and strategy its search and performance "
              "model would pick.", "",
              "| model | tokens | network | routing | GPUs | FastMoE ms | FasterMoE ms | MPipeMoE ms | n/strategy | "
              "speedup vs FasterMoE | memory vs FasterMoE |", "|" + "---|" * 11]
    lines += ["| " + " | ".join(row) + " |" for row in table]
    return lines + [""]
