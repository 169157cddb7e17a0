"""`mpipemoe report`'s section on how training runs learned and routed: the validation loss
(``mpipemoe train`` logs ``val_loss`` every ``--eval-every`` steps) and the per-expert load
(``moe_load/...`` every ``--log-every`` steps, workers/load.py) of every finished training run
that logged them, read back from MLflow; a table and two figures (validation loss over
steps, and the largest layer imbalance over steps)."""
from __future__ import annotations

import math
from pathlib import Path

from app.tracking.run_kinds import TRAIN
from app.tracking.store import finished_runs_of_kind, metric_history

VAL = "val_loss"
IMBALANCE = "moe_load/imbalance_max"
DROPPED = "/dropped_fraction"


def load_training_curves(tracking_uri: str, experiments: list[str] | None = None) -> list[dict]:
    """Per finished training run with a validation loss or load metrics: its name, preset,
    engine, study (tag; "" outside a sweep), ``val_loss`` and ``imbalance`` histories ([(step, value)]) and the largest
    dropped fraction over its layers at its last log step (None when dropless); oldest first."""
    rows = []
    for _, run in finished_runs_of_kind(tracking_uri, experiments, TRAIN):
        metrics, params = run.data.metrics, run.data.params
        if VAL not in metrics and IMBALANCE not in metrics:
            continue
        dropped = [value for key, value in metrics.items() if key.endswith(DROPPED)]
        rows.append({"name": run.info.run_name or run.info.run_id, "preset": params.get("preset", "?"),
                     "study": run.data.tags.get("study", ""),
                     "engine": params.get("engine", "?"), "start_time": run.info.start_time or 0,
                     "val_loss": metric_history(tracking_uri, run.info.run_id, VAL) if VAL in metrics else [],
                     "imbalance": metric_history(tracking_uri, run.info.run_id, IMBALANCE)
                     if IMBALANCE in metrics else [],
                     "dropped": max(dropped) if dropped else None})
    return sorted(rows, key=lambda r: r["start_time"])


def plot_curves(rows: list[dict], key: str, ylabel: str, path: Path, studies: list[str] | None = None) -> None:
    """The runs' ``key`` over steps: one colour per study (the report's ``studies`` order; runs
    outside a sweep grey), one line style per run within it; the legend, one entry per study
    and per run outside a sweep, to the right of the axes."""
    from matplotlib.figure import Figure  # no pyplot: no global figure state

    from app.reports.studies import study_colour

    order = list(studies or []) + sorted({r["study"] for r in rows if r["study"]} - set(studies or []))
    figure = Figure(figsize=(7.6, 4.0), layout="constrained")
    ax = figure.subplots()
    styles = ("-", "--", ":", "-.")
    seen: dict[str, int] = {}
    for row in rows:
        if not row[key]:
            continue
        steps, values = zip(*row[key])
        study = row["study"]
        nth = seen[study] = seen.get(study, -1) + 1
        if study:
            colour, label = study_colour(order.index(study)), f"study {study}" if nth == 0 else None
        else:
            colour, label = "0.45", f"{row['name']} ({row['engine']})"
        ax.plot(steps, values, styles[nth % len(styles)] if study else styles[0], color=colour, marker="o",
                markersize=2, linewidth=1, alpha=0.8, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    figure.savefig(path, dpi=120)


def section_training(rows: list[dict], out: Path, studies: list[str] | None = None) -> list[str]:
    """Markdown (and figures in ``out``) for `mpipemoe report`."""
    lines = ["## 8. Training: validation loss and expert load", ""]
    if not rows:
        return lines + ["_No data: no training run logged a validation loss or load metrics._", ""]
    lines += ["Validation loss: the exact mean over the run's fixed validation batches (docs/training.md); "
              "imbalance: tokens of the busiest expert / the mean over experts, the largest over the MoE layers, "
              "over the steps since the previous log step (1.0 is perfectly balanced).", "",
              "| run | study | preset | engine | first val loss | final val loss (ppl) | final imbalance | dropped |",
              "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["study"]):  # grouped per study, runs outside a sweep first
        val = r["val_loss"]
        first = f"{val[0][1]:.3f} (step {val[0][0]})" if val else "–"
        final = f"{val[-1][1]:.3f} ({math.exp(min(val[-1][1], 700.0)):,.1f}) at step {val[-1][0]}" if val else "–"
        imbalance = f"{r['imbalance'][-1][1]:.2f}" if r["imbalance"] else "–"
        dropped = f"{r['dropped']:.1%}" if r["dropped"] is not None else "dropless"
        lines.append(f"| {r['name']} | {r['study'] or '–'} | {r['preset']} | {r['engine']} | {first} | {final} | {imbalance} | {dropped} |")
    lines.append("")
    for key, ylabel, name in (("val_loss", "validation loss", "val_loss.png"),
                              ("imbalance", "expert imbalance (max / mean, worst layer)", "imbalance.png")):
        if any(r[key] for r in rows):
            plot_curves(rows, key, ylabel, out / name, studies)
            lines += [f"![{ylabel}]({name})", ""]
    return lines
