"""Section 7's training steps in ``mpipemoe report``: the step records of ``mpipemoe bench
--step`` (tag ``mpipemoe.kind=bench-step``; app/bench/step.py, docs/emulation.md "The training
step"), one row per (network, cluster, model, layers, routing, tokens, micro-batches):
the engines' step times, the best MPipeMoE setting (of any micro-batch schedule, named in
the schedule column) against both baselines' sequential (plain) step, the automatic one
against FasterMoE (flagged where slower), the best setting's step against its bound, its
exposed share of the All-to-All and its MFU."""
from __future__ import annotations

from app.tracking.run_kinds import BENCH_STEP
from app.tracking.store import finished_runs_of_kind

POINT = ("network", "emulated_cluster", "model", "layers", "routing", "tokens", "micro_batches")


def load_steps(tracking_uri: str, experiments: list[str] | None = None) -> list[dict]:
    """Every finished step run's params and metrics (metrics win: they stay numbers), oldest first."""
    rows = [{**run.data.params, **run.data.metrics, "start_time": run.info.start_time}
            for _, run in finished_runs_of_kind(tracking_uri, experiments, BENCH_STEP)]
    return sorted(rows, key=lambda r: r["start_time"] or 0)


def _point(row: dict) -> tuple:
    return tuple(int(float(row[k])) if k in ("layers", "tokens", "micro_batches") else str(row.get(k, "?"))
                 for k in POINT)


def _schedule(row: dict) -> str:
    return str(row.get("schedule", "sequential"))  # records from before the schedule setting ran it


def _plain_first(rows: list[dict]) -> list[dict]:
    """``rows`` with the sequential (plain) schedule's first."""
    return sorted(rows, key=lambda r: _schedule(r) != "sequential")


def _auto_first(rows: list[dict]) -> list[dict]:
    """``rows`` with the one the automatic schedule chose first (``schedule_asked`` names
    "auto"), else the plain one's."""
    return sorted(_plain_first(rows), key=lambda r: "auto" not in str(r.get("schedule_asked", "")).split(","))


def step_summaries(rows: list[dict]) -> list[dict]:
    """One summary per point: the last logged record of each engine, setting and schedule
    counts; the baselines by their sequential (plain) step, `auto` under the schedule it chose."""
    latest: dict[tuple, dict[tuple, dict]] = {}
    for row in rows:
        setting = (row["engine"], row["chosen_by"], int(float(row["partitions"])), row["strategy"],
                   row.get("split") or "tokens", _schedule(row))
        latest.setdefault(_point(row), {})[setting] = row
    summaries = []
    for point, settings in sorted(latest.items()):
        by = lambda engine, chosen_by: [r for (e, c, *_), r in settings.items()  # noqa: E731
                                        if (e, c) == (engine, chosen_by)]
        fast, faster = _plain_first(by("fastmoe", "baseline")), _plain_first(by("fastermoe", "baseline"))
        auto = _auto_first(by("mpipemoe", "auto"))
        ours = by("mpipemoe", "grid") + auto
        if not ours:
            continue
        best = min(ours, key=lambda r: float(r["step_ms"]))
        peers = best["engine"] == "mpipemoe" and best.get("split") == "peers"
        summary = dict(zip(POINT, point),
                       best_setting=f"{int(float(best['partitions']))}{':peers' if peers else ''}/{best['strategy']}",
                       best_schedule=_schedule(best), best_step_ms=float(best["step_ms"]), best_mfu=best.get("mfu"))
        if fast:
            summary["fastmoe_step_ms"] = float(fast[0]["step_ms"])
            summary["best_vs_fastmoe"] = summary["fastmoe_step_ms"] / summary["best_step_ms"]
        if faster:
            summary["fastermoe_step_ms"] = float(faster[0]["step_ms"])
            summary["best_vs_fastermoe"] = summary["fastermoe_step_ms"] / summary["best_step_ms"]
        if auto:
            summary["auto_step_ms"], summary["auto_schedule"] = float(auto[0]["step_ms"]), _schedule(auto[0])
            if faster:
                summary["auto_vs_fastermoe"] = summary["fastermoe_step_ms"] / summary["auto_step_ms"]
        if best.get("step_bound_ms"):
            summary["best_vs_bound"] = summary["best_step_ms"] / float(best["step_bound_ms"])
        if best.get("exposed_all_to_all_ms") is not None and float(best.get("all_to_all_ms") or 0) > 0:
            summary["best_exposed_share"] = float(best["exposed_all_to_all_ms"]) / float(best["all_to_all_ms"])
        summaries.append(summary)
    return summaries


def section_steps(rows: list[dict]) -> list[str]:
    """Markdown for `mpipemoe report` (after section 7's layers)."""
    lines = ["### 7b. The training step on emulated clusters", ""]
    summaries = step_summaries(rows)
    if not summaries:
        return lines + ["_No data: no `mpipemoe bench --step` run logged a step._", ""]
    fmt = lambda v, f: "–" if v is None else format(float(v), f)  # noqa: E731
    lines += ["The whole step (attention, every MoE layer, head, loss, the data-parallel reduction, AdamW) on one "
              "GPU as rank 0 of the emulated cluster (docs/emulation.md, \"The training step\"). Best = the "
              "fastest MPipeMoE setting of the run under any micro-batch schedule (schedule: the one it ran; "
              "FastMoE and FasterMoE: their sequential step; auto: the schedule it chose); vs bound = its step / max(compute alone, All-to-Alls + "
              "reduction); exposed = the share of its All-to-All time the step did not hide. **bold**: `auto` "
              "slower than FasterMoE.", "",
              "| network | cluster | model | layers | routing | tokens | K | FastMoE ms | FasterMoE ms | auto ms | "
              "best (n/strategy) ms | schedule | best vs FastMoE | best vs FasterMoE | auto vs FasterMoE | "
              "best vs bound | exposed A2A | MFU |", "|" + "---|" * 18]
    for s in summaries:
        auto_vs = s.get("auto_vs_fastermoe")
        flag = "**" if auto_vs is not None and auto_vs < 1 else ""
        lines.append(
            f"| {s['network']} | {s['emulated_cluster']} | {s['model']} | {s['layers']} | {s['routing']} | "
            f"{s['tokens']} | {s['micro_batches']} | {fmt(s.get('fastmoe_step_ms'), '.1f')} | "
            f"{fmt(s.get('fastermoe_step_ms'), '.1f')} | {fmt(s.get('auto_step_ms'), '.1f')} | "
            f"{s['best_step_ms']:.1f} ({s['best_setting']}) | {s['best_schedule']} | "
            f"{fmt(s.get('best_vs_fastmoe'), '.2f')}x | "
            f"{fmt(s.get('best_vs_fastermoe'), '.2f')}x | {flag}{fmt(auto_vs, '.2f')}x{flag} | "
            f"{fmt(s.get('best_vs_bound'), '.2f')} | {fmt(s.get('best_exposed_share'), '.0%')} | "
            f"{fmt(s.get('best_mfu'), '.1%')} |")
    return lines + [""]
