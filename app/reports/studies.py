"""`mpipemoe report`'s sections on sweeps: one per study (``mpipemoe sweep``), read back from the
MLflow runs its trials left (tag ``study``; every status: a pruned trial is KILLED, a refused or
failed one FAILED, and they are results too).

Each study gets its ranking, its pruned trials and the best run's curves, never mixed with another
study's. A study that varies the partitions, strategy or engine asks "which setting is fastest
for my memory": its ranking is app/tracking/sweep_rank.py's (tokens/s and settled peak memory, the
Pareto front marked) with a figure of time against memory. Any other study (learning rate, weight
decay, ...) asks "which setting learns best": its trials are ranked by the final validation loss
(the training loss where no trial logged one)."""
from __future__ import annotations

import math
from pathlib import Path

from app.tracking import sweep_rank
from app.tracking.run_kinds import STUDY, run_kind
from app.tracking.store import client, metric_history

# a trial's params that name the run, not its setting
NOT_SETTINGS = {"name", "storage_path", "tracking_uri", "experiment", "parent_run_id", "data_dir", "study",
                "description"}
SPEED_KEYS = {"partitions", "strategy", "engine", "moe_memory_gib"}
CURVES = ("loss", "val_loss")


def _trial(tracking_uri: str, run) -> dict:
    """One trial run: its setting (params), outcome, reason, pruned step, last metrics and status."""
    params, metrics, tags = run.data.params, run.data.metrics, run.data.tags
    outcome = tags.get("outcome") or (sweep_rank.PRUNED if "pruned_at_step" in tags else
                                      sweep_rank.OK if run.info.status == "FINISHED" else sweep_rank.FAILED)
    rank_metrics = {"outcome": outcome, "reason": tags.get("reason", ""),
                    sweep_rank.THROUGHPUT: metrics.get("summary_tokens_per_s", math.nan),
                    sweep_rank.SETTLED_PEAK: metrics.get("summary_settled_peak_memory_bytes",
                                                         metrics.get("summary_peak_memory_bytes"))}
    for key in ("partitions", "strategy"):
        if key in tags:
            rank_metrics[key] = tags[key]
    return {"run_id": run.info.run_id, "name": run.info.run_name or run.info.run_id, "status": run.info.status,
            "start_time": run.info.start_time or 0,
            "config": {k: v for k, v in params.items() if "." not in k and k not in NOT_SETTINGS},
            "metrics": rank_metrics, "outcome": outcome, "reason": tags.get("reason", ""),
            "pruned_at_step": tags.get("pruned_at_step"),
            "val_loss": metrics.get("val_loss"), "loss": metrics.get("loss"),
            "curves": {key: metric_history(tracking_uri, run.info.run_id, key) for key in CURVES if key in metrics}}


def load_studies(tracking_uri: str, experiments: list[str] | None = None) -> list[dict]:
    """Per study (experiment, study tag), oldest first: ``{"experiment", "study", "description",
    "trials": [...]}`` with every trial run of it, whatever its status."""
    mlflow_client = client(tracking_uri)
    names = {e.experiment_id: e.name for e in mlflow_client.search_experiments()
             if experiments is None or e.name in experiments}
    studies: dict[tuple[str, str], dict] = {}
    token = None
    while names:
        page = mlflow_client.search_runs(list(names), filter_string="tags.study LIKE '%'", max_results=1000,
                                         page_token=token)
        for run in page:
            key = (names[run.info.experiment_id], run.data.tags["study"])
            study = studies.setdefault(key, {"experiment": key[0], "study": key[1], "description": "", "trials": []})
            if run_kind(run.data.tags) == STUDY:  # the parent run: the study's description
                study["description"] = run.data.params.get("description", "")
            else:
                study["trials"].append(_trial(tracking_uri, run))
        token = page.token
        if not token:
            break
    made = [s for s in studies.values() if s["trials"]]
    for study in made:
        study["trials"].sort(key=lambda t: t["start_time"])
    return sorted(made, key=lambda s: s["trials"][0]["start_time"])


def asks_for_speed(study: dict) -> bool:
    """Whether the study varies the partitions, strategy or engine (a time/memory question)."""
    keys = sweep_rank.varying_keys([t["config"] for t in study["trials"]])
    return bool(SPEED_KEYS & set(keys))


def _setting(trial: dict, keys: list[str]) -> str:
    return " ".join(f"{k}={trial['config'].get(k)}" for k in keys) or trial["name"]


def learning_ranking(study: dict) -> tuple[str, list[dict]]:
    """(the metric, the trials best first): finished trials by that final value (lower is
    better), then pruned, refused and failed ones."""
    trials = study["trials"]
    metric = "val_loss" if any(t["val_loss"] is not None for t in trials) else "loss"
    order = {sweep_rank.OK: 0, sweep_rank.PRUNED: 1, sweep_rank.REFUSED: 2, sweep_rank.FAILED: 3}
    return metric, sorted(trials, key=lambda t: (order.get(t["outcome"], 4),
                                                 t[metric] if t[metric] is not None else math.inf))


def _number(value) -> str:
    return f"{value:.4f}" if isinstance(value, float) and math.isfinite(value) else "–"


def _legend_outside(ax) -> None:
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)


def plot_best_curves(trial: dict, colour, path: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global figure state

    figure = Figure(figsize=(7.2, 3.8), layout="constrained")
    ax = figure.subplots()
    for key, style in zip(CURVES, ("-", "--")):
        if trial["curves"].get(key):
            steps, values = zip(*trial["curves"][key])
            ax.plot(steps, values, style, color=colour, marker="o", markersize=2, label=key.replace("_", " "))
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(trial["name"], fontsize=9)
    ax.grid(alpha=0.3)
    _legend_outside(ax)
    figure.savefig(path, dpi=120)


def plot_front(candidates: list[sweep_rank.Point], front: list[sweep_rank.Point], colour, path: Path) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7.2, 3.8), layout="constrained")
    ax = figure.subplots()
    measured = [p for p in candidates if p.measured]
    ax.scatter([p.peak_bytes / 2**20 for p in measured], [1e3 / p.tokens_per_s for p in measured],  # type: ignore[operator]
               color=colour, alpha=0.5, label="setting")
    if front:
        ordered = sorted(front, key=lambda p: p.peak_bytes)  # type: ignore[arg-type,return-value]
        ax.plot([p.peak_bytes / 2**20 for p in ordered], [1e3 / p.tokens_per_s for p in ordered],  # type: ignore[operator]
                "-o", color=colour, label="Pareto front")
        for p in ordered:
            ax.annotate(p.label, (p.peak_bytes / 2**20, 1e3 / p.tokens_per_s), fontsize=6,  # type: ignore[operator]
                        xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("settled peak memory (MiB)")
    ax.set_ylabel("ms per 1000 tokens")
    ax.grid(alpha=0.3)
    _legend_outside(ax)
    figure.savefig(path, dpi=120)


def study_colour(index: int):
    """The colour of the ``index``-th study, in every figure of the report."""
    from matplotlib import colormaps

    return colormaps["tab10"](index % 10)


def section_study(study: dict, index: int, out: Path) -> list[str]:
    """Markdown (and figures in ``out``) for one study; the heading's number is set by the report."""
    trials, colour = study["trials"], study_colour(index)
    counts: dict[str, int] = {}
    for t in trials:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    lines = [f"## 0. Study `{study['study']}` (experiment {study['experiment']})", ""]
    if study["description"]:
        lines += [study["description"], ""]
    lines += [f"{len(trials)} trial run(s): " + ", ".join(f"{n} {o}" for o, n in sorted(counts.items())) + ".", ""]
    keys = sweep_rank.varying_keys([t["config"] for t in trials])
    slug = "".join(c if c.isalnum() else "_" for c in f"{study['experiment']}_{study['study']}")
    if asks_for_speed(study):
        candidates = sweep_rank.points([(t["config"], t["metrics"], None) for t in trials], keys)
        front = sweep_rank.pareto_front(candidates)
        lines += ["Ranking (fastest first; `*`: on the time/memory Pareto front):", "",
                  "| " + " | ".join(sweep_rank.HEADER) + " |", "|" + "---|" * len(sweep_rank.HEADER)]
        lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |"
                  for row in sweep_rank.table_rows(candidates, front)]
        lines.append("")
        if front:
            plot_front(candidates, front, colour, out / f"study_{slug}_front.png")
            lines += [f"![{study['study']}: time against memory](study_{slug}_front.png)", ""]
        best = next((t for t in trials if front and _setting(t, keys) == front[0].label), None)
    else:
        metric, ordered = learning_ranking(study)
        lines += [f"Ranking (final {metric.replace('_', ' ')}, lowest first; then pruned, refused, failed):", "",
                  "| rank | setting | final val loss | final loss | outcome |", "|---|---|---|---|---|"]
        for rank, t in enumerate(ordered, 1):
            outcome = t["outcome"] + (f" at step {t['pruned_at_step']}" if t["pruned_at_step"] else "") + \
                (f": {t['reason'][:160]}" if t["reason"] else "")
            lines.append(f"| {rank} | {_setting(t, keys)} | {_number(t['val_loss'])} | {_number(t['loss'])} | "
                         f"{outcome.replace('|', '/')} |")
        lines.append("")
        best = ordered[0] if ordered and ordered[0]["outcome"] == sweep_rank.OK else None
    pruned = [t for t in trials if t["outcome"] == sweep_rank.PRUNED]
    lines += ["Pruned trials: " + ("; ".join(f"{_setting(t, keys)} at step {t['pruned_at_step'] or '?'}"
                                            for t in pruned) if pruned else "none") + ".", ""]
    if best is not None and best["curves"]:
        plot_best_curves(best, colour, out / f"study_{slug}_best.png")
        lines += [f"The best run, {best['name']} ({_setting(best, keys)}):", "",
                  f"![{study['study']}: the best run's curves](study_{slug}_best.png)", ""]
    return lines
