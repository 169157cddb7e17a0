"""``mpipemoe train --engines``: one training job per engine on the same data and seed, as sibling
MLflow runs under one parent run that carries their ratios, and the table the command prints."""
from __future__ import annotations

import dataclasses

from app.jobs.job import TrainJob
from app.jobs.launch import run_job
from app.tracking.run_kinds import COMPARE, kind_tags
from app.tracking.store import NO_TRACKING, NullRun, RunLogger
from moe_engine.config import ENGINES


def compare_engines(job: TrainJob, engines: list[str], address: str | None = None, echo=print,
                    verbose: bool = False) -> dict:
    """Run ``job`` once per engine (same data and seed) as sibling MLflow runs under one parent.

    The parent run carries, for the first engine R against each other engine X,
    ``speedup_vs_X`` = tokens/s(R) / tokens/s(X), ``memory_ratio_vs_X`` = peak(R) / peak(X)
    over the whole run and ``settled_memory_ratio_vs_X`` over its second half.
    Returns {"parent_run_id", "summaries": {engine: summary}, "ratios": {...}}.
    """
    for engine in engines:
        if engine not in ENGINES:
            raise ValueError(f"--engines: {engine!r} is unknown: choose from {', '.join(ENGINES)}")
    base = job.name
    if job.tracking_uri == NO_TRACKING:
        parent = NullRun()
    else:
        parent = RunLogger.start(job.tracking_uri, job.experiment, run_name=f"{base}-compare",
                                 parent_run_id=job.parent_run_id,
                                 tags={**kind_tags(COMPARE), "engines": ",".join(engines),
                                       "preset": job.preset})
    parent.log_params({"engines": ",".join(engines), **{k: v for k, v in dataclasses.asdict(job).items()
                                                        if v is not None and k not in ("engine", "name")}})
    summaries = {}
    try:
        for engine in engines:
            summaries[engine] = run_job(dataclasses.replace(job, engine=engine, name=f"{base}-{engine}",
                                                            parent_run_id=parent.run_id),
                                        address=address, echo=echo, verbose=verbose)
    except BaseException as caught:
        parent.finish("KILLED" if isinstance(caught, KeyboardInterrupt) else "FAILED")
        raise
    reference = engines[0]
    ratios = {}
    for other in engines[1:]:
        ratios[f"speedup_vs_{other}"] = summaries[reference]["tokens_per_s"] / summaries[other]["tokens_per_s"]
        for key, name in (("peak_memory_bytes", "memory_ratio"), ("settled_peak_memory_bytes", "settled_memory_ratio")):
            ratios[f"{name}_vs_{other}"] = summaries[reference][key] / summaries[other][key]
        ratios[f"final_loss_diff_vs_{other}"] = summaries[reference]["final_loss"] - summaries[other]["final_loss"]
    parent.log_metrics(ratios)
    for engine, summary in summaries.items():
        parent.log_metrics({f"{engine}.{k}": summary[k]
                            for k in ("tokens_per_s", "peak_memory_bytes", "settled_peak_memory_bytes", "final_loss",
                                      "mfu") if k in summary})
    parent.finish()
    echo(comparison_table(summaries, reference))
    return {"parent_run_id": parent.run_id, "summaries": summaries, "ratios": ratios}


def comparison_table(summaries: dict, reference: str) -> str:
    """A plain-text table: engine, final loss, tokens/s, peak memory over the run and over its
    second half (settled), and the ratios of ``reference`` to each engine."""
    ref = summaries[reference]
    lines = [f"{'engine':<10} {'final loss':>10} {'tokens/s':>10} {'peak MiB':>9} {'settled':>9} "
             f"{'speed x':>8} {'memory x':>8} {'settled x':>9}  (x = {reference} / engine)"]
    for engine, s in summaries.items():
        lines.append(f"{engine:<10} {s['final_loss']:>10.4f} {s['tokens_per_s']:>10,.0f} "
                     f"{s['peak_memory_bytes'] / 2**20:>9,.0f} {s['settled_peak_memory_bytes'] / 2**20:>9,.0f} "
                     f"{ref['tokens_per_s'] / s['tokens_per_s']:>8.2f} "
                     f"{ref['peak_memory_bytes'] / s['peak_memory_bytes']:>8.2f} "
                     f"{ref['settled_peak_memory_bytes'] / s['settled_peak_memory_bytes']:>9.2f}")
    return "\n".join(lines)
