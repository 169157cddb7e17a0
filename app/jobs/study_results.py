"""A sweep study's results as Ray Tune returns them (a ``ResultGrid``, app/jobs/sweep.py): the
trials counted (errored, finished, pruned by the scheduler), the best trial by the study's
metric, and the plain-text table ``mpipemoe sweep`` prints, one line per trial. The ranking of
settings over repeats is app/tracking/sweep_rank.py.
"""
from __future__ import annotations

import math

import tune_spaces


def count_trials(results, metric: str = tune_spaces.METRIC) -> tuple[int, int]:
    """(errored, finished) trials of a ResultGrid; the rest were interrupted or never started.
    A trial stopped early by the scheduler (pruned) counts as finished: it reported ``metric``."""
    failed = sum(1 for r in results if r.error)
    finished = sum(1 for r in results if not r.error and metric in (r.metrics or {}))
    return failed, finished


def _pruned(result, steps) -> bool:
    """Whether a trial stopped before the study's ``steps`` without an error (the scheduler's doing)."""
    metrics = result.metrics or {}
    return not result.error and steps is not None and "steps" not in metrics and metrics.get("step", steps) < steps


def count_pruned(results, space: dict) -> int:
    """Trials the scheduler stopped early: their last report is a step's, not the summary."""
    steps = space.get("steps") if not isinstance(space.get("steps"), dict) else None
    return sum(1 for r in results if _pruned(r, steps))


def best_trial(results, metric: str, mode: str):
    """The trial with the best last reported ``metric`` (lowest for mode "min"), None if none reported it."""
    scored = [r for r in results if not r.error and math.isfinite((r.metrics or {}).get(metric, math.nan))]
    if not scored:
        return None
    return (min if mode == "min" else max)(scored, key=lambda r: r.metrics[metric])


def _varying(results) -> list[str]:
    configs = [r.config or {} for r in results]
    return sorted({k for c in configs for k in c if len({str(cc.get(k)) for cc in configs}) > 1})


FINAL_VAL_LOSS = "final_val_loss"  # run_job's summary: the validation loss at the last step


def format_results(results, metric: str = tune_spaces.METRIC, steps: int | None = None,
                   mode: str | None = None) -> str:
    """A plain-text table: one line per trial, the varying config and the key metrics; a
    trial the scheduler stopped early shows "pruned@STEP", a refused or failed setting its
    outcome. ``mode`` ("min"/"max"): trials sorted best first by ``metric`` (those without
    it last); None: in Tune's order."""
    rows = [(r.config or {}, r.metrics or {}, r.error, _pruned(r, steps)) for r in results]
    if mode is not None:
        def key(row):
            value = row[1].get(metric, math.nan)
            scored = isinstance(value, (int, float)) and math.isfinite(value)
            return (0, value if mode == "min" else -value) if scored else (1, 0.0)
        rows.sort(key=key)
    varying = _varying(results)
    ranked = [metric] if metric not in (tune_spaces.METRIC, tune_spaces.TRAIN_LOSS) else []
    if metric != tune_spaces.VAL_LOSS and any(FINAL_VAL_LOSS in m for _, m, _, _ in rows):
        ranked.append(FINAL_VAL_LOSS)  # a throughput study on data with a validation split
    header = varying + ranked + ["tokens/s", "loss", "peak MiB", "status"]
    lines = [header]
    for config, metrics, error, pruned in rows:
        peak = metrics.get("peak_memory_bytes")
        loss = metrics.get("final_loss", metrics.get("loss"))
        status = "ERROR" if error else str(metrics["outcome"]) if metrics.get("outcome") else \
            f"pruned@{metrics.get('step')}" if pruned else "ok" if metric in metrics else "unfinished"
        lines.append([_cell(config.get(k)) for k in varying]
                     + [f"{metrics[m]:.4f}" if m in metrics else "-" for m in ranked] + [
            f"{metrics.get(tune_spaces.METRIC, float('nan')):.0f}",
            f"{loss:.4f}" if isinstance(loss, (int, float)) else "-",
            f"{peak / 2**20:.1f}" if isinstance(peak, (int, float)) else "-", status])
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in lines)


def _cell(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
