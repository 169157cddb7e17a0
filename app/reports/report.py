"""The report of ``mpipemoe report`` (app/commands/report.py): Markdown with PNG plots, generated
from MLflow runs.

Reads two kinds of runs (tag ``kind``): layer benchmarks (``kind=bench``, from
``mpipemoe bench``: fwd_bwd_ms, peak/predicted memory) and training runs
(``kind=train``, from ``mpipemoe train`` and sweeps: tokens_per_s, peak memory).
Each becomes a ``Record``; the sections are pure functions of the records:

1. speedup and memory of MPipeMoE against the FastMoE/FasterMoE-style baselines,
   per (model, tokens);
2. time and memory per memory-reuse strategy;
3. the best number of partitions n against tokens, with every violation of the
   assumed monotonicity (best n non-decreasing in tokens) marked;
4. predicted against measured peak memory;
5. simulated clusters (``mpipemoe simulate`` runs, tag ``kind=simulate``; app/reports/simulate.py).
6. the largest batch under a memory cap (``mpipemoe capacity`` runs; app/reports/capacity.py).
7. emulated clusters (``mpipemoe bench --emulate`` runs, tag ``measured_as=emulated``;
   app/reports/emulated.py), and 7b their training steps (``mpipemoe bench --step``;
   app/reports/step.py). Emulated runs never enter sections 1–4.
8. training runs' validation loss and per-expert load over steps (app/reports/training.py).
9. memory against time: every setting of a bench point, time and memory relative to the
   peer (torchtitan) or FastMoE (app/reports/memory_time.py); stacks of layers (``mpipemoe bench
   --layers L``) appear only here, single layers where peak memory was measured.
10. one section per sweep study (``mpipemoe sweep``): its ranking, pruned trials and the best run's
   curves (app/reports/studies.py).

The sections present are numbered 1, 2, 3, ... in this order: the numbers above are those of a
report with every kind of data.

Runs of the two kinds are never compared with each other. Time is the layer's
forward+backward in ms for benchmarks and ms per 1000 tokens (1e6 / tokens_per_s)
for training runs. Where one configuration was measured several times, the
fastest measurement counts (best-of). A section without data says so.

matplotlib (the ``ray`` extra) is imported where a figure is drawn: a report without
figures, and the tests of its tables, need none.
"""
from __future__ import annotations

import datetime
import os
import re
import sys
from collections import defaultdict
from pathlib import Path

from app.reports.capacity import load_capacity_runs, section_capacity
from app.reports.plots import (plot_baselines, plot_best_n, plot_memory_predictions, plot_strategies,
                               point_label)
from app.reports.runs import (Record, baseline_comparisons, best_partitions, load_records, memory_predictions,
                              strategy_rows)
from app.reports.emulated import load_emulated, section_emulated
from app.reports.step import load_steps, section_steps
from app.reports.memory_time import load_memory_time, section_memory_time
from app.reports.simulate import load_simulations, section_simulations
from app.tracking.store import check_store, client, resolve_tracking_uri, unfinished_runs
from app.reports.studies import load_studies, section_study
from app.reports.training import load_training_curves, section_training
from lm.errors import invocation, os_error

DEFAULT_OUT = "out/report"  # an ignored folder, never the committed results/

# --------------------------------------------------------------------------- markdown

def _mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
           ["| " + " | ".join(row) + " |" for row in rows]


NO_DATA = "_No data: {what}._"


def section_baselines(records: list[Record], out: Path) -> list[str]:
    lines = ["## 1. Speedup and memory against the baselines", ""]
    rows = baseline_comparisons(records)
    if not rows:
        return lines + [NO_DATA.format(what="no configuration was measured with MPipeMoE and a baseline "
                                            "(run `mpipemoe sweep engines` or `mpipemoe bench`)"), ""]
    plot_baselines(rows, out / "speedup_memory.png")
    lines += ["![speedup and memory against the baselines](speedup_memory.png)", "",
              "Speedup = baseline time / MPipeMoE time; memory = MPipeMoE peak / baseline peak "
              "(below 1 saves memory). MPipeMoE at its automatic settings where measured, else its "
              "fastest setting."
              + (" CPU rows check the plumbing, not speed: on a few shared cores the pipeline's overlap "
                 "cannot pay off (docs/design.md §4.2); speed is measured on GPUs." if any(
                  row.key[4] == "cpu" for row in rows) else ""), ""]
    table = [[row.key[0], row.key[1], str(row.key[2]), str(row.key[3]), f"{row.key[4]}/{row.key[5]}",
              row.baseline, f"{row.engine_ms:.3f}", f"{row.baseline_ms:.3f}", f"{row.speedup:.2f}x",
              "-" if row.memory_ratio is None else f"{row.memory_ratio:.2f}"] for row in rows]
    return lines + _table(["kind", "model", "tokens", "ranks", "device", "baseline", "MPipeMoE time",
                           "baseline time", "speedup", "memory ratio"], table) + [""]


def section_strategies(records: list[Record], out: Path) -> list[str]:
    lines = ["## 2. Memory and time per strategy", ""]
    rows = strategy_rows(records)
    if not rows:
        return lines + [NO_DATA.format(what="no configuration was measured with two or more fixed "
                                            "strategies (run `mpipemoe sweep strategy`)"), ""]
    plot_strategies(rows, out / "strategies.png")
    lines += ["![time and memory per strategy](strategies.png)", "",
              "Time relative to the fastest fixed strategy; memory relative to keeping everything "
              "(`none`). `auto` is the performance model's choice.", ""]
    table = []
    for row in rows:
        cells = [f"{row.time_ms[k]:.3f} / {_mib(row.memory[k])}" for k in row.time_ms]
        slowdown = row.auto_slowdown()
        table.append([point_label(row.key), str(row.key[2]), " · ".join(f"{k}: {c}" for k, c in zip(row.time_ms, cells)),
                      row.fastest, "-" if slowdown is None else f"{row.auto_label}: {slowdown:+.1%}"])
    return lines + _table(["configuration", "tokens", "ms / peak MiB per strategy", "fastest",
                           "auto vs fastest"], table) + [""]


def section_best_n(records: list[Record], out: Path) -> list[str]:
    lines = ["## 3. Best number of partitions n against tokens", ""]
    rows = best_partitions(records)
    if not rows:
        return lines + [NO_DATA.format(what="no token count was measured with two or more fixed n "
                                            "(run `mpipemoe sweep granularity`)"), ""]
    plot_best_n(rows, out / "best_n.png")
    violations = [r for r in rows if r.violation]
    lines += ["![best n against tokens](best_n.png)", "",
              "The online search assumes the best n never decreases as the token count grows. "
              + (f"**{len(violations)} violation(s)** (red crosses; marked ✗ below)."
                 if violations else "No violation in these measurements."), ""]
    table = [[f"{r.series[0]} {r.series[1]}", str(r.series[2]), r.series[5], str(r.tokens), str(r.best_n),
              f"{r.best_ms:.3f}", str(r.candidates), "✗ decreases" if r.violation else "ok",
              "-" if r.auto_ms is None else
              f"n={r.auto_n if r.auto_n is not None else '?'}, {r.auto_ms / r.best_ms - 1:+.1%}"]
             for r in rows]
    return lines + _table(["model", "ranks", "strategy", "tokens", "best n", "ms", "n tried", "monotone",
                           "online n vs best"], table) + [""]


def section_memory(records: list[Record], out: Path) -> list[str]:
    lines = ["## 4. Predicted against measured memory", ""]
    rows = memory_predictions(records)
    if not rows:
        return lines + [NO_DATA.format(what="no run logged both predicted_memory_bytes and "
                                            "peak_memory_bytes (run `mpipemoe bench`)"), ""]
    plot_memory_predictions(rows, out / "memory_prediction.png")
    errors = [abs(r.predicted_memory_bytes / r.peak_memory_bytes - 1) for r in rows]
    lines += ["![predicted against measured memory](memory_prediction.png)", "",
              f"{len(rows)} measurement(s); largest error {max(errors):.1%}, "
              f"{sum(e <= 0.10 for e in errors)} within 10%.", ""]
    table = [[r.engine, r.model, str(r.tokens), str(r.partitions), r.strategy, _mib(r.predicted_memory_bytes),
              _mib(r.peak_memory_bytes), f"{r.predicted_memory_bytes / r.peak_memory_bytes - 1:+.1%}"]
             for r in sorted(rows, key=lambda r: (r.model, r.tokens or 0, r.strategy))]
    return lines + _table(["engine", "model", "tokens", "n", "strategy", "predicted MiB", "measured MiB",
                           "error"], table) + [""]


def write_report(records: list[Record], out_dir: str | os.PathLike, *, source: str = "",
                 simulations: list[dict] | None = None, capacities: list[dict] | None = None,
                 emulated: tuple[list[dict], list[dict]] | None = None, training: list[dict] | None = None,
                 memory_time: list[dict] | None = None, steps: list[dict] | None = None,
                 studies: list[dict] | None = None) -> Path:
    """Write ``report.md`` and its PNG figures into ``out_dir``; returns the report's path.
    ``simulations``: rows of ``app.reports.simulate.load_simulations`` (section 5 when there are any);
    ``capacities``: rows of ``app.reports.capacity.load_capacity_runs`` (section 6 when there are any);
    ``emulated``: (summaries, records) of ``app.reports.emulated.load_emulated`` (section 7
    when there are any); ``training``: rows of ``app.reports.training.load_training_curves``
    (section 8 when there are any); ``memory_time``: rows of ``app.reports.memory_time.load_memory_time``
    (section 9 when a stack, or a layer with peak memory, was measured); ``steps``: rows of
    ``app.reports.step.load_steps`` (7b, the training steps of ``bench --step``, when there are any);
    ``studies``: ``app.reports.studies.load_studies`` (a section per sweep study, last). The sections
    present are numbered 1, 2, 3, ... in order (``number_sections``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.png"):  # figures of sections that now have no data must not linger
        old.unlink()
    kinds = defaultdict(int)
    for r in records:
        kinds[r.kind] += 1
    experiments = sorted({r.experiment for r in records})
    lines = ["# MPipeMoE report", "",
             f"Generated by `mpipemoe report` on {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} "
             f"from {len(records)} MLflow run(s): {kinds['bench']} layer benchmark(s), {kinds['train']} "
             f"training run(s){f' in {source}' if source else ''}; experiments: "
             f"{', '.join(experiments) if experiments else 'none'}.", "",
             "Time is the layer's forward+backward in ms for benchmarks (`bench`) and ms per 1000 tokens "
             "for training runs (`train`); the two kinds are never compared with each other. Where one "
             "configuration was measured several times, the fastest measurement counts.", ""]
    resumed = [r for r in records if r.segments]
    if resumed:  # their numbers are of their last segment, credited to its settings
        lines += ["Resumed with other settings (the numbers below are those of each run's last segment):", ""]
        lines += [f"- run `{r.run_id[:8]}` ({r.experiment}): {r.segments}" for r in resumed] + [""]
    for section in (section_baselines, section_strategies, section_best_n, section_memory):
        lines += section(records, out)
    if simulations:  # section 5 only where `mpipemoe simulate` logged something
        lines += section_simulations(simulations, str(out))
    if capacities:  # section 6 only where `mpipemoe capacity` logged something
        lines += section_capacity(capacities)
    if emulated and emulated[0]:  # section 7 only where `mpipemoe bench --emulate` logged something
        lines += section_emulated(*emulated, out)
    if steps:  # 7b only where `mpipemoe bench --step` logged something
        lines += section_steps(steps)
    if training:  # section 8 only where training runs logged a validation loss or load metrics
        lines += section_training(training, out, [s["study"] for s in studies or []])
    if memory_time:  # section 9 only where a bench point has memory figures, or is a stack
        lines += section_memory_time(memory_time, out)
    for index, study in enumerate(studies or []):  # one section per sweep study
        lines += section_study(study, index, out)
    path = out / "report.md"
    path.write_text("\n".join(number_sections(lines)))
    return path


def number_sections(lines: list[str]) -> list[str]:
    """Local. The report's ``## N.`` headings numbered 1, 2, 3, ... as they come (a section
    without data is left out, so fixed numbers would jump), and a ``### Nb.`` sub-heading
    after its section's number."""
    numbered, number = [], 0
    for line in lines:
        if re.match(r"## \d+\. ", line):
            number += 1
            line = re.sub(r"^## \d+\.", f"## {number}.", line)
        elif re.match(r"### \d+b\. ", line):
            line = re.sub(r"^### \d+b\.", f"### {number}b.", line)
        numbered.append(line)
    return numbered


def check_out(out: str | os.PathLike) -> None:
    """Raise ValueError naming ``--out`` and the fix unless the report can be written there:
    a folder (or a path whose nearest existing folder) this process may write."""
    path = Path(out).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {out}: {path} is a file, not a folder: give a folder (the report writes "
                         f"report.md and its figures into it)")
    existing = next(parent for parent in (path, *path.parents) if parent.exists())
    if not existing.is_dir():
        raise ValueError(f"--out {out}: {existing} is a file, not a folder: give another --out")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: folder {existing} is not writable (read-only or not yours): give a "
                         f"writable folder, e.g. --out {DEFAULT_OUT}")


def _write(records: list[Record], out: str, **sources) -> Path:
    """``write_report`` with a failing write (full disk, permissions) said in one line."""
    try:
        return write_report(records, out, **sources)
    except OSError as error:
        raise os_error(error, f"cannot write the report to {out}", "free space there or give another --out") from error


def report_from_store(out: str, experiments: list[str] | None, tracking_uri: str | None) -> int:
    """`mpipemoe report`: read the store (``tracking_uri``, default as ``resolve_tracking_uri``), write
    the report into ``out`` and say where; notes on stderr name missing experiments and unfinished runs."""
    check_out(out)  # before the store is read: nothing is done for a report that cannot be written
    tracking_uri = resolve_tracking_uri(tracking_uri)
    check_store(tracking_uri, write=False)  # a typo'd folder is an error, never a new empty store
    store = Path(tracking_uri[len("sqlite:///"):]) if tracking_uri.startswith("sqlite:///") else None
    if store is not None and not store.exists():  # nothing recorded yet: an empty report, no new store
        print(f"note: no MLflow store at {store} yet: train or sweep first, or check --tracking-uri",
              file=sys.stderr)
        path = _write([], out, source=tracking_uri)
        print(f"Wrote {path.resolve()} (0 run(s), figures: none)")
        return 0
    known = {e.name for e in client(tracking_uri).search_experiments()}
    missing = [name for name in experiments or [] if name not in known]
    if missing:
        print(f"note: no MLflow experiment {', '.join(map(repr, missing))} in {tracking_uri} "
              f"(there are: {', '.join(sorted(known)) or 'none'})", file=sys.stderr)
    records = load_records(tracking_uri, experiments)
    path = _write(records, out, source=tracking_uri,
                  simulations=load_simulations(tracking_uri, experiments),
                  capacities=load_capacity_runs(tracking_uri, experiments),
                  emulated=load_emulated(tracking_uri, experiments),
                  training=load_training_curves(tracking_uri, experiments),
                  memory_time=load_memory_time(tracking_uri, experiments),
                  steps=load_steps(tracking_uri, experiments),
                  studies=load_studies(tracking_uri, experiments))
    left_out = unfinished_runs(tracking_uri, experiments)
    if left_out:
        counts = ", ".join(f"{status} {count}" for status, count in sorted(left_out.items()))
        print(f"note: {sum(left_out.values())} run(s) did not finish and are left out ({counts}); "
              f"`{invocation()} ui` shows them with their error tags", file=sys.stderr)
    print(f"Wrote {path.resolve()} ({len(records)} run(s), figures: "
          f"{', '.join(sorted(p.name for p in path.parent.glob('*.png'))) or 'none'})")
    return 0
