"""`mpipemoe report`'s section on the capacity searches (``mpipemoe capacity``, app/commands/capacity.py):
their MLflow runs, read back, and the Markdown table of each engine's largest batch."""
from __future__ import annotations

from app.tracking.run_kinds import CAPACITY
from app.tracking.store import finished_runs_of_kind


def load_capacity_runs(tracking_uri: str, experiments: list[str] | None = None) -> list[dict]:
    """Every finished capacity run (one per engine and search) as a flat dict, oldest first."""
    rows = [{**run.data.params, **run.data.metrics, **run.data.tags, "start_time": run.info.start_time}
            for _, run in finished_runs_of_kind(tracking_uri, experiments, CAPACITY)]
    return sorted(rows, key=lambda r: r["start_time"] or 0)


def section_capacity(rows: list[dict]) -> list[str]:
    """Markdown for `mpipemoe report`: per preset, hardware, cap and worker count, each
    engine's largest batch and its tokens/s there (the newest search of each engine)."""
    lines = ["## 6. Largest batch under a memory cap (`mpipemoe capacity`)", ""]
    latest = {}
    for r in rows:  # oldest first: the newest run of each (setting, engine) counts
        setting = (r.get("preset", "?"), r.get("device", "?"), r.get("memory_cap_gib", "?"), r.get("num_workers", "?"))
        latest.setdefault(setting, {})[r.get("engine", "?")] = r
    if not latest:
        return lines + ["_No data: no capacity search was logged (run `mpipemoe capacity --use-gpu`)._", ""]
    lines += ["Tokens/s at each engine's own largest batch; ratios against MPipeMoE's row.", "",
              "| preset | hardware | cap GiB | workers | engine | largest batch | tokens/s | peak GiB | "
              "batch vs mpipemoe | tokens/s vs mpipemoe |", "|" + "---|" * 10]
    for (preset, device, cap, workers), engines in sorted(latest.items()):
        ref = engines.get("mpipemoe")
        for engine, r in sorted(engines.items(), key=lambda item: item[0] != "mpipemoe"):
            ratio = lambda key: f"{r[key] / ref[key]:.2f}" if ref and ref.get(key) else "–"  # noqa: E731
            lines.append(f"| {preset} | {device} | {cap} | {workers} | {engine} | {r['largest_batch_size']:.0f} | "
                         f"{r['tokens_per_s']:,.0f} | {r['peak_memory_bytes'] / 2**30:.2f} | "
                         f"{ratio('largest_batch_size')} | {ratio('tokens_per_s')} |")
    return lines + [""]
