"""The layer bench's summaries (the targets of docs/design.md §7) and its Markdown, from the
records alone: auto against the fastest setting of every n x strategy, the strategy pick at its
n, the lean (memory-saving) setting, the overlap account and the targets' shares. Re-rendering
committed records (tools/render_records.py) runs only this."""
from __future__ import annotations

from app.bench.parts import engine_host_ms, markdown_head, not_measured_lines, setting_label, setting_n
from app.bench.peers import peer_summary, peer_table
from app.tracking.records import BenchResult, RecordMeta


def summarize(records: list) -> list:
    """Per (model, routing, tokens): auto vs grid best, strategy pick vs fastest, memory vs
    FastMoE, and the auto choice's time against its floor."""
    summaries = []
    keys = sorted({(r["model"], r.get("routing", "uniform"), r["tokens"]) for r in records})
    for model, routing, tokens in keys:
        point = [r for r in records if (r["model"], r.get("routing", "uniform"), r["tokens"]) == (model, routing, tokens)]
        by = lambda engine, chosen_by: [r for r in point if r["engine"] == engine and r["chosen_by"] == chosen_by]  # noqa
        fast, faster, auto, grid = by("fastmoe", "baseline"), by("fastermoe", "baseline"), by("mpipemoe", "auto"), \
            by("mpipemoe", "grid")
        if not (fast and auto):
            continue
        fast, auto = fast[0], auto[0]
        summary = {"model": model, "tokens": tokens, "routing": routing, "auto_partitions": auto["partitions"],
                   "auto_split": auto.get("split", "tokens"), "auto_strategy": auto["strategy"], "auto_fwd_bwd_ms": auto["fwd_bwd_ms"],
                   "fastmoe_fwd_bwd_ms": fast["fwd_bwd_ms"],
                   "speedup_vs_fastmoe": fast["fwd_bwd_ms"] / auto["fwd_bwd_ms"],
                   "expert_gemm_efficiency": auto.get("expert_gemm_efficiency")}
        if faster:
            summary["speedup_vs_fastermoe"] = faster[0]["fwd_bwd_ms"] / auto["fwd_bwd_ms"]
        if auto.get("all_to_all_ms") is not None:
            summary.update(all_to_all_ms=auto["all_to_all_ms"], expert_ms=auto["expert_ms"],
                           hot_expert_share=auto["hot_expert_share"])
        if auto.get("floor_ms"):  # its own pass's (add_overlap_account)
            summary.update(floor_ms=auto["floor_ms"], overlap_bound_ms=auto["overlap_bound_ms"],
                           bound_stages=auto["bound_stages"], auto_vs_floor=auto["fwd_bwd_ms"] / auto["floor_ms"] - 1,
                           overlap_efficiency=auto["floor_ms"] / auto["fwd_bwd_ms"],
                           **({"phase_floor_ms": auto["phase_floor_ms"]} if "phase_floor_ms" in auto else {}))
        if fast.get("peak_memory_bytes") and auto.get("peak_memory_bytes"):
            summary["memory_ratio_vs_fastmoe"] = auto["peak_memory_bytes"] / fast["peak_memory_bytes"]
            summary["predicted_memory_error"] = auto["predicted_memory_bytes"] / auto["peak_memory_bytes"] - 1
        if grid:
            # The best is the fastest of every setting measured: every n x strategy, auto included.
            best = min([auto, *grid], key=lambda r: r["fwd_bwd_ms"])
            summary.update(grid_best_partitions=best["partitions"], grid_best_strategy=best["strategy"],
                           grid_best_setting=setting_label(best),
                           grid_best_chosen_by=best["chosen_by"], grid_best_fwd_bwd_ms=best["fwd_bwd_ms"],
                           auto_vs_grid_best=auto["fwd_bwd_ms"] / best["fwd_bwd_ms"] - 1)
            shared = [r for r in grid if r["strategy"] != "none"]
            same_n = [r for r in grid if (r["partitions"], r.get("split", "tokens"))
                      == (auto["partitions"], auto.get("split", "tokens"))]
            if same_n:
                fastest = min(same_n, key=lambda r: r["fwd_bwd_ms"])
                picked = next((r for r in same_n if r["strategy"] == auto["strategy"]), None)
                if picked:
                    summary["strategy_pick_vs_fastest"] = picked["fwd_bwd_ms"] / fastest["fwd_bwd_ms"] - 1
                    summary["fastest_strategy_at_auto_n"] = fastest["strategy"]
            keep = [r for r in grid if r["strategy"] == "none"]
            cheapest = [r for r in shared if r.get("peak_memory_bytes")]
            if keep and cheapest and keep[0].get("peak_memory_bytes"):
                lean = min(cheapest, key=lambda r: r["peak_memory_bytes"])
                summary["leanest_memory_ratio_vs_none"] = lean["peak_memory_bytes"] / max(
                    r["peak_memory_bytes"] for r in keep)
            summary.update(memory_saving_setting(fast, [auto, *grid]))
        summary.update(overlap_summary(point, auto))
        summary.update(peer_summary(point))
        summaries.append(summary)
    return summaries


def overlap_summary(point: list, auto: dict) -> dict:
    """The point's fastest MPipeMoE setting (any strategy) and the share of the ideal saving
    over FastMoE it, auto and FasterMoE realize (`add_overlap_account`)."""
    settings = [r for r in point if r["engine"] == "mpipemoe" and r.get("floor_ms") is not None]
    if not settings:
        return {}
    best = min(settings, key=lambda r: r["fwd_bwd_ms"])
    summary = {"best_setting": setting_label(best), "best_fwd_bwd_ms": best["fwd_bwd_ms"],
               "best_floor_ms": best["floor_ms"], "best_realized_saving": best.get("realized_saving"),
               "auto_realized_saving": auto.get("realized_saving")}
    faster = [r for r in point if r["engine"] == "fastermoe" and r.get("realized_saving") is not None]
    if faster:
        summary["fastermoe_realized_saving"] = faster[0]["realized_saving"]
    return summary


LEAN_MEMORY_RATIO = 0.55  # a memory-saving setting: at most this share of FastMoE's activation peak


def memory_saving_setting(fastmoe: dict, settings: list) -> dict:
    """The fastest MPipeMoE setting peaking at <= LEAN_MEMORY_RATIO of FastMoE's memory,
    against the fastest setting of all (empty without memory figures, or when none is lean)."""
    measured = [r for r in settings if r.get("peak_memory_bytes")]
    if not fastmoe.get("peak_memory_bytes") or not measured:
        return {}
    lean = [r for r in measured if r["peak_memory_bytes"] <= LEAN_MEMORY_RATIO * fastmoe["peak_memory_bytes"]]
    if not lean:
        return {}
    best_lean = min(lean, key=lambda r: r["fwd_bwd_ms"])
    fastest = min(measured, key=lambda r: r["fwd_bwd_ms"])
    return {"lean_setting": setting_label(best_lean),
            "lean_memory_ratio_vs_fastmoe": best_lean["peak_memory_bytes"] / fastmoe["peak_memory_bytes"],
            "lean_vs_fastest": best_lean["fwd_bwd_ms"] / fastest["fwd_bwd_ms"] - 1,
            "fastest_setting": setting_label(fastest)}


def targets(summaries: list) -> dict:
    """docs/design.md §7's targets, checked on the summaries (None where the data cannot say)."""
    def share(values, limit):
        values = [v for v in values if v is not None]
        return (sum(v <= limit for v in values) / len(values)) if values else None

    best_n: dict[str, list] = {}
    for s in summaries:
        if "grid_best_partitions" in s:
            best_n.setdefault(f"{s['model']}/{s.get('routing', 'uniform')}", []).append((s["tokens"], s["grid_best_partitions"]))
    monotone = {key: all(a[1] <= b[1] for a, b in zip(sorted(ns), sorted(ns)[1:])) for key, ns in best_n.items()}
    return {
        "within_15pct_of_floor": share([s.get("auto_vs_floor") for s in summaries], 0.15),
        "best_realizes_90pct_of_ideal_saving": share(
            [None if s.get("best_realized_saving") is None else -s["best_realized_saving"] for s in summaries], -0.9),
        "auto_within_5pct_of_grid_best": share([s.get("auto_vs_grid_best") for s in summaries], 0.05),
        "strategy_pick_within_3pct": share([s.get("strategy_pick_vs_fastest") for s in summaries], 0.03),
        "memory_saving_within_5pct": share([s.get("lean_vs_fastest") for s in summaries], 0.05),
        "best_n_by_tokens": {key: [n for _, n in sorted(ns)] for key, ns in best_n.items()},
        "best_n_non_decreasing": monotone,
    }


def overlap_table(summaries: list) -> list:
    """The overlap account per point (Markdown lines; none without stage timings)."""
    rows = [s for s in summaries if "best_setting" in s]
    if not rows:
        return []
    fmt = lambda v, f: "–" if v is None else format(v, f)  # noqa: E731
    lines = ["## Overlap account", "",
             "Realized = (FastMoE − t) / (FastMoE − floor): the share of the ideal saving a setting realizes "
             "(docs/engine.md, \"Reading a timeline\"). Best = the fastest MPipeMoE setting, any strategy.", "",
             "| model | routing | tokens | FastMoE ms | best setting | best ms | its floor ms | best realized | "
             "auto realized | FasterMoE realized |", "|" + "---|" * 10]
    for s in rows:
        lines.append(f"| {s['model']} | {s.get('routing', 'uniform')} | {s['tokens']} | {s['fastmoe_fwd_bwd_ms']:.2f} | "
                     f"{s['best_setting']} | {s['best_fwd_bwd_ms']:.2f} | {s['best_floor_ms']:.2f} | "
                     f"{fmt(s['best_realized_saving'], '.0%')} | {fmt(s.get('auto_realized_saving'), '.0%')} | "
                     f"{fmt(s.get('fastermoe_realized_saving'), '.0%')} |")
    return lines + [""]


def markdown_table(result: BenchResult | dict) -> str:
    """The Markdown beside a bench JSON: a BenchResult, or its JSON form (tests build partial points)."""
    if isinstance(result, BenchResult):
        meta, summaries, records = result.meta, result.summaries, [point.to_json() for point in result.records]
    else:
        meta, summaries, records = RecordMeta.from_json(result["meta"]), result["summaries"], result["records"]
    run = meta.extra
    lines = markdown_head("MoE layer benchmark", meta)
    if run.get("complete") is False:
        lines += [f"**Incomplete**: the run was stopped; these are the {len(records)} records of the "
                  "points it finished.", ""]
    lines += not_measured_lines(run.get("not_measured") or [])
    if run.get("measured_as") == "emulated":
        lines += [f"**Emulated**: one {run['device']} ran the real engine as rank 0 of a {run['emulated_cluster']} "
                  f"cluster on the {run['network']} network, whose delays are modelled (docs/emulation.md). "
                  "These are not measurements of a real cluster, and the layers' outputs are not meaningful.", ""]
    elif run["world_size"] == 1:
        lines += ["With one GPU the All-to-All is a local copy, so there is nothing to overlap: "
                  "speedups over the baselines need several GPUs and are not claimed here.", ""]
    fmt = lambda v, f: "–" if v is None else format(v, f)  # noqa: E731
    checks = targets(summaries)
    lines += ["## Targets", "",
              f"- auto within 15% of its floor: {fmt(checks['within_15pct_of_floor'], '.0%')} "
              "of the points",
              f"- auto within 5% of the fastest setting (every n × strategy, auto included): {fmt(checks['auto_within_5pct_of_grid_best'], '.0%')} of the points",
              f"- strategy pick within 3% of the fastest at its n: {fmt(checks['strategy_pick_within_3pct'], '.0%')} "
              "of the points (target ≥ 90%)",
              f"- a memory-saving setting (≤ {LEAN_MEMORY_RATIO:.2f}x FastMoE's peak) within 5% of the fastest "
              f"setting: {fmt(checks['memory_saving_within_5pct'], '.0%')} of the points",
              f"- the fastest setting realizes ≥ 90% of the ideal saving: "
              f"{fmt(checks.get('best_realizes_90pct_of_ideal_saving'), '.0%')} of the points"]
    for key, ns in checks["best_n_by_tokens"].items():
        verdict = "non-decreasing" if checks["best_n_non_decreasing"][key] else "NOT monotone"
        lines.append(f"- best n by token count, {key}: {', '.join(map(str, ns))} ({verdict})")
    lines += ["", "## Per model, routing and token count", "",
              "Floor = max(C, K) of the forward plus that of the backward, C the All-to-All time and K the compute, "
              "from each record's own pass on an emulated cluster (the transfers' priced time; the pass with its "
              "transfers free), else max(A, E) of the point's two stages timed alone (All-to-All ms, expert ms). "
              "No pass beats it; the pipeline model max(C, K) + min(C, K) / n can be beaten (docs/engine.md).", "",
              "| model | routing | tokens | auto n | auto strategy | auto ms | FastMoE ms | speedup vs FastMoE | "
              "speedup vs FasterMoE | memory vs FastMoE | All-to-All ms | expert ms | auto vs floor | grid best | "
              "auto vs grid best | strategy pick vs fastest at n | lean setting (memory vs FastMoE) | lean vs fastest | "
              "expert GEMM eff. |", "|" + "---|" * 19]
    for s in summaries:
        lines.append(
            f"| {s['model']} | {s.get('routing', 'uniform')} | {s['tokens']} | "
            f"{setting_n({'engine': 'mpipemoe', 'partitions': s['auto_partitions'], 'split': s.get('auto_split')})} | "
            f"{s['auto_strategy']} | "
            f"{s['auto_fwd_bwd_ms']:.2f} | {s['fastmoe_fwd_bwd_ms']:.2f} | {fmt(s['speedup_vs_fastmoe'], '.2f')} | "
            f"{fmt(s.get('speedup_vs_fastermoe'), '.2f')} | {fmt(s.get('memory_ratio_vs_fastmoe'), '.2f')} | "
            f"{fmt(s.get('all_to_all_ms'), '.2f')} | {fmt(s.get('expert_ms'), '.2f')} | "
            f"{fmt(s.get('auto_vs_floor'), '+.1%')} | "
            f"{s.get('grid_best_setting', '–/–')} | "
            f"{fmt(s.get('auto_vs_grid_best'), '+.1%')} | {fmt(s.get('strategy_pick_vs_fastest'), '+.1%')} | "
            + (f"{s['lean_setting']} ({fmt(s.get('lean_memory_ratio_vs_fastmoe'), '.2f')}) | {fmt(s.get('lean_vs_fastest'), '+.1%')} | "
               if "lean_setting" in s else "– | – | ")
            + f"{fmt(s.get('expert_gemm_efficiency'), '.0%')} |")
    lines += [""] + overlap_table(summaries)
    lines += [""] + peer_table(summaries)
    lines += ["## Every measurement", "",
              "Model = the pipeline model max(C, K) + min(C, K) / n at the record's n (not a floor); floor = max(C, K) "
              "of the forward plus that of the backward (own pass; max(A, E) timed alone); t / floor below 0.98 on a "
              "GPU fails the bench. Engine host = the host's time to issue the pass (until it returned, unsynchronized: "
              "a host read inside waits for the device) less the emulator's own host work, which a real rank does not "
              "pay; compute busy = the device's busy time in the pass with its transfers free (CUDA).", "",
              "| model | routing | tokens | engine | chosen by | n | strategy | fwd+bwd ms | ± | engine host ms "
              "| emulator host ms | compute busy ms | peak MiB | predicted MiB "
              "| model ms | floor ms | t / floor | realized | comm idle ms | compute idle ms |",
              "|" + "---|" * 20]
    for r in records:
        peak = r.get("peak_memory_bytes")
        lines.append(f"| {r['model']} | {r.get('routing', 'uniform')} | {r['tokens']} | {r['engine']} | "
                     f"{r['chosen_by']} | {setting_n(r)} | "
                     f"{r['strategy']} | {r['fwd_bwd_ms']:.2f} | {r['fwd_bwd_ms_std']:.2f} | "
                     f"{fmt(engine_host_ms(r), '.2f')} | {fmt(r.get('emulator_host_ms'), '.2f')} | "
                     f"{fmt(r.get('compute_device_busy_ms'), '.2f')} | "
                     f"{'–' if peak is None else f'{peak / 2**20:.0f}'} | "
                     f"{fmt(r.get('predicted_memory_bytes') and r['predicted_memory_bytes'] / 2**20, '.0f')} | "
                     f"{fmt(r.get('overlap_bound_ms'), '.2f')} | {fmt(r.get('floor_ms'), '.2f')} | "
                     f"{fmt(r.get('bound_ratio'), '.2f')} | {fmt(r.get('realized_saving'), '.0%')} | {fmt(r.get('timeline', {}).get('comm_idle_ms'), '.1f')} | "
                     f"{fmt(r.get('timeline', {}).get('compute_idle_ms'), '.1f')} |")
    return "\n".join(lines) + "\n"
