"""A sweep study's results as Ray Tune returns them (a ``ResultGrid``, app/jobs/sweep.py): the
trials counted (``Tally``: errored, failed, refused, pruned by the scheduler, finished), the best trial by the study's
metric, and the plain-text table ``mpipemoe sweep`` prints, one line per trial. The ranking of
settings over repeats is app/tracking/sweep_rank.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import tune_spaces
from app.tracking import sweep_rank


@dataclass(frozen=True)
class Tally:
    """How a study's trials ended. ``errored``: Tune recorded an error (the trial raised);
    ``failed`` and ``refused``: the trial reported that outcome (its training failed, or the job
    refused the setting; app/jobs/trial.py record_outcome); ``pruned``: the scheduler stopped it
    early; ``finished``: it reported the study's metric (pruned ones included); the rest were
    interrupted or never started. Failed and refused trials count as neither finished nor pruned."""

    trials: int
    errored: int
    failed: int
    refused: int
    pruned: int
    finished: int

    @property
    def unfinished(self) -> int:
        return self.trials - self.errored - self.failed - self.refused - self.finished

    @property
    def none_ran(self) -> bool:
        """Every trial ended, and every one failed, errored or was refused."""
        return self.trials > 0 and self.finished == 0 and self.unfinished == 0

    def summary(self) -> str:
        parts = [f"{count} {label}" for count, label in ((self.finished, "finished"), (self.pruned, "pruned"),
                                                         (self.refused, "refused"), (self.failed, "failed"),
                                                         (self.errored, "errored"), (self.unfinished, "unfinished"))
                 if count]
        return f"{self.trials} trials: {', '.join(parts) or 'none ran'}"


def _outcome(result) -> str | None:
    """"refused" or "failed" where the trial reported that outcome, else None."""
    outcome = (result.metrics or {}).get("outcome")
    return outcome if outcome in (sweep_rank.REFUSED, sweep_rank.FAILED) else None


def tally(results, metric: str = tune_spaces.METRIC, space: dict | None = None) -> Tally:
    """How the trials of a ResultGrid ended (``Tally``); ``space``: the study's param space, whose
    ``steps`` tell a pruned trial (without it none counts as pruned)."""
    results = list(results)
    errored = [r for r in results if r.error]
    ended = [r for r in results if not r.error and _outcome(r)]
    finished = [r for r in results if not r.error and not _outcome(r)
                and math.isfinite(_number((r.metrics or {}).get(metric)))]
    steps = (space or {}).get("steps")
    steps = steps if isinstance(steps, int) else None
    return Tally(trials=len(results), errored=len(errored),
                 failed=sum(1 for r in ended if _outcome(r) == sweep_rank.FAILED),
                 refused=sum(1 for r in ended if _outcome(r) == sweep_rank.REFUSED),
                 pruned=sum(1 for r in finished if _pruned(r, steps)), finished=len(finished))


def _number(value) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def first_reason(results) -> str | None:
    """The reason of the first refused or failed trial, or the first error's first line."""
    for r in results:
        if _outcome(r) and (r.metrics or {}).get("reason"):
            return str(r.metrics["reason"])
    for r in results:
        if r.error:
            return str(r.error).strip().splitlines()[0] if str(r.error).strip() else type(r.error).__name__
    return None


def _pruned(result, steps) -> bool:
    """Whether a trial stopped before the study's ``steps`` without an error or a refused or
    failed outcome (the scheduler's doing)."""
    metrics = result.metrics or {}
    return not result.error and not _outcome(result) and steps is not None and "steps" not in metrics \
        and metrics.get("step", steps) < steps


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
