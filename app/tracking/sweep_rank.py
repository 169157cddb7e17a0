"""Ranking the settings of a partition/strategy study: repeats merged into one point each,
the time/memory Pareto front, and the fastest setting under a memory cap.

Pure functions of trial rows ``(config, metrics, error)``: ``app/jobs/sweep.py`` passes Ray Tune's
results, the report (``app/reports/report.py``) passes the study's MLflow runs. A point's time is the
median of its repeats' throughputs (``tokens_per_s``, the run's median step) with their
range; its memory is the settled peak (``settled_peak_memory_bytes``: the second half of the
run, after an ``auto`` setting's online choice; the whole run's peak where a run lacks it),
the largest over its repeats. Refused and failed settings (an out-of-memory one included)
stay in the ranking with their reason: they are results too.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

THROUGHPUT = "tokens_per_s"
SETTLED_PEAK = "settled_peak_memory_bytes"
PEAK = "peak_memory_bytes"
OK, PRUNED, REFUSED, FAILED = "ok", "pruned", "refused", "failed"


@dataclass(frozen=True)
class Point:
    """One setting of the study (its varying config), over its repeats."""

    setting: tuple[tuple[str, str], ...]   # (key, value) of the varying config, sorted by key
    outcome: str                           # ok | pruned | refused | failed
    samples: int                           # repeats that measured a throughput
    tokens_per_s: float                    # median over the repeats (nan: none measured)
    tokens_per_s_low: float
    tokens_per_s_high: float
    peak_bytes: float | None               # settled peak, largest over the repeats
    chosen: str = ""                       # n and strategy an auto setting settled on
    reason: str = ""                       # why a setting was refused or failed

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.setting) or "(one setting)"

    @property
    def measured(self) -> bool:
        return self.outcome == OK and math.isfinite(self.tokens_per_s) and self.peak_bytes is not None


def _value(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def varying_keys(configs: list[dict]) -> list[str]:
    """Config keys whose value differs between the trials."""
    return sorted({k for c in configs for k in c if len({str(cc.get(k)) for cc in configs}) > 1})


def _outcome(metrics: dict, error) -> str:
    if error:
        return FAILED
    if metrics.get("outcome") in (REFUSED, FAILED, PRUNED):
        return str(metrics["outcome"])
    return OK if math.isfinite(float(metrics.get(THROUGHPUT, math.nan))) else FAILED


def points(rows: list[tuple[dict, dict, object]], keys: list[str] | None = None) -> list[Point]:
    """The settings of ``rows`` (config, metrics, error) merged over repeats, in the order first seen.

    ``keys``: the config keys that tell settings apart (default: those that vary). A setting with
    one repeat ok and one failed counts its measured repeats and is ok."""
    keys = varying_keys([c for c, _, _ in rows]) if keys is None else keys
    groups: dict[tuple, list[tuple[dict, object]]] = {}
    for config, metrics, error in rows:
        groups.setdefault(tuple((k, _value(config.get(k))) for k in keys), []).append((metrics or {}, error))
    made = []
    for setting, members in groups.items():
        outcomes = [_outcome(m, e) for m, e in members]
        measured = [m for m, o in zip([m for m, _ in members], outcomes) if o == OK]
        rates = [float(m[THROUGHPUT]) for m in measured]
        peaks = [float(peak) for m in measured if (peak := m.get(SETTLED_PEAK, m.get(PEAK))) is not None]
        outcome = OK if measured else next((o for o in (REFUSED, FAILED, PRUNED) if o in outcomes), FAILED)
        chosen = sorted({f"n={m['partitions']}{':peers' if m.get('split') == 'peers' else ''} {m['strategy']}"
                         for m in measured
                         if m.get("partitions") is not None and m.get("strategy") is not None})
        reasons = sorted({str(m.get("reason") or e) for (m, e), o in zip(members, outcomes)
                          if o in (REFUSED, FAILED) and (m.get("reason") or e)})
        made.append(Point(setting, outcome, len(rates),
                          statistics.median(rates) if rates else math.nan,
                          min(rates) if rates else math.nan, max(rates) if rates else math.nan,
                          max(peaks) if peaks else None, "; ".join(chosen), "; ".join(reasons)))
    return made


def pareto_front(candidates: list[Point]) -> list[Point]:
    """The measured points no other measured point beats on both time and memory (at least as
    fast and as lean, better in one), fastest first."""
    measured = [p for p in candidates if p.measured]

    def beaten(p: Point) -> bool:
        return any(q.tokens_per_s >= p.tokens_per_s and q.peak_bytes <= p.peak_bytes  # type: ignore[operator]
                   and (q.tokens_per_s > p.tokens_per_s or q.peak_bytes < p.peak_bytes)  # type: ignore[operator]
                   for q in measured)
    return sorted((p for p in measured if not beaten(p)), key=lambda p: -p.tokens_per_s)


def fastest_under(candidates: list[Point], cap_bytes: float) -> Point | None:
    """The fastest measured point whose settled peak is at most ``cap_bytes``; None if none fits."""
    fitting = [p for p in candidates if p.measured and p.peak_bytes <= cap_bytes]  # type: ignore[operator]
    return max(fitting, key=lambda p: p.tokens_per_s) if fitting else None


def ranked(candidates: list[Point]) -> list[Point]:
    """Measured points fastest first, then pruned, refused and failed ones."""
    order = {OK: 0, PRUNED: 1, REFUSED: 2, FAILED: 3}
    return sorted(candidates, key=lambda p: (order.get(p.outcome, 4),
                                             -p.tokens_per_s if math.isfinite(p.tokens_per_s) else 0.0))


def table_rows(candidates: list[Point], front: list[Point]) -> list[list[str]]:
    """One row per point, ranked: setting, tokens/s median [low-high] (repeats), settled peak MiB,
    on the front, chosen n/strategy, outcome and reason."""
    on_front = {p.setting for p in front}
    rows = []
    for p in ranked(candidates):
        rate = (f"{p.tokens_per_s:,.0f} [{p.tokens_per_s_low:,.0f}-{p.tokens_per_s_high:,.0f}] x{p.samples}"
                if p.samples else "-")
        rows.append([p.label, rate, f"{p.peak_bytes / 2**20:,.1f}" if p.peak_bytes is not None else "-",
                     "*" if p.setting in on_front else "", p.chosen or "-",
                     p.outcome + (f": {p.reason[:160]}" if p.reason else "")])
    return rows


HEADER = ["setting", "tokens/s median [range] xN", "settled peak MiB", "front", "chosen", "outcome"]


def format_ranking(candidates: list[Point], cap_gib: float | None = None) -> str:
    """The printed ranking: the table, the Pareto front, the fastest setting under ``cap_gib``."""
    front = pareto_front(candidates)
    lines = [HEADER, *table_rows(candidates, front)]
    widths = [max(len(row[i]) for row in lines) for i in range(len(HEADER))]
    text = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in lines]
    text.append("Pareto front (time against settled peak memory, fastest first): "
                + (", ".join(p.label for p in front) if front else "no setting measured"))
    if cap_gib is not None:
        best = fastest_under(candidates, cap_gib * 2**30)
        text.append(f"Fastest under {cap_gib:g} GiB: " + (
            f"{best.label} ({best.tokens_per_s:,.0f} tokens/s, settled peak {best.peak_bytes / 2**20:,.1f} MiB)"
            if best is not None and best.peak_bytes is not None else "no setting fits"))
    return "\n".join(text)
