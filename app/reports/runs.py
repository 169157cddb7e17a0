"""What `mpipemoe report` reads and computes for its first four sections (app/reports/report.py):
a `Record` per layer-benchmark or training run in MLflow, and the comparisons, strategy rows,
best n per token count and memory predictions drawn from them (pure functions of the records)."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from moe_engine.config import STRATEGIES

from app.reports.memory_time import as_float as _float, as_int as _int
from app.tracking.run_kinds import BENCH, TRAIN, run_kind, run_segments
from app.tracking.store import finished_runs


ENGINE = "mpipemoe"
BASELINES = ("fastmoe", "fastermoe")
STRATEGY_ORDER = STRATEGIES


@dataclass(frozen=True)
class Record:
    """One measurement, normalised from an MLflow run of either kind."""

    kind: str                      # "bench" or "train"
    run_id: str
    experiment: str
    engine: str
    model: str
    tokens: int | None             # tokens per rank (batch x seq_len for training)
    world_size: int | None
    device: str
    dtype: str
    partitions: int | None         # the n used; None if "auto" and the chosen n was not logged
    strategy: str                  # the strategy used ("auto" if the chosen one was not logged)
    auto_partitions: bool          # n chosen by the engine (online search), not fixed by the caller
    auto_strategy: bool            # strategy chosen by the performance model, not fixed
    time_ms: float | None
    peak_memory_bytes: float | None
    predicted_memory_bytes: float | None
    segments: str = ""             # a resumed training run whose settings changed: its segments

    @property
    def config_key(self) -> tuple:
        """What must match for two records to be compared."""
        return (self.kind, self.model, self.tokens, self.world_size, self.device, self.dtype)


# --------------------------------------------------------------------------- loading

def to_record(run_id: str, experiment: str, params: dict, metrics: dict, tags: dict) -> Record | None:
    """A ``Record`` from one run's params/metrics/tags, or None for runs of no known kind."""
    if tags.get("measured_as") == "emulated":  # rank 0 of a modelled cluster: section 7 only
        return None
    kind = run_kind(tags) or \
        ("bench" if "fwd_bwd_ms" in metrics else "train" if "preset" in params else "")
    segments = run_segments(tags) if kind == TRAIN else []
    if segments:  # resumed with other settings: the summary metrics are those of the last segment
        params = {**params, **{k: str(v) for k, v in segments[-1].items() if k != "from_step" and v is not None}}
    engine = params.get("engine")
    if kind not in (BENCH, TRAIN) or not engine:
        return None
    model = params.get("model") or params.get("preset") or "?"
    if kind == BENCH and (_int(params.get("layers")) or 1) > 1:  # a stack of layers: section 9 only
        return None
    if kind == BENCH:  # mpipemoe bench: chosen_by=auto means the engine chose n and strategy
        if params.get("routing", "uniform") != "uniform":  # another routing than uniform: its own series
            model = f"{model}/{params['routing']}"
        auto_partitions = auto_strategy = params.get("chosen_by") == "auto"
        tokens = _int(params.get("tokens"))
        device, dtype = params.get("device", "?"), params.get("dtype", "?")
        time_ms = _float(metrics.get("fwd_bwd_ms"))
        peak = _float(metrics.get("peak_memory_bytes"))
    else:  # mpipemoe train (app.jobs.launch.run_job): TrainJob fields, resolved settings under "resolved."
        auto_partitions = params.get("partitions") == "auto"
        auto_strategy = params.get("strategy") == "auto"
        seq_len = _int(params.get("seq_len")) or _int(params.get("resolved.seq_len"))
        batch_size = _int(params.get("batch_size"))
        tokens = batch_size * seq_len if batch_size and seq_len else _int(params.get("tokens"))
        use_gpu = params.get("resolved.use_gpu", params.get("use_gpu"))
        device = {"True": "cuda", "False": "cpu"}.get(use_gpu, "?")
        dtype = params.get("resolved.dtype", params.get("dtype", "?"))
        # the run's median tokens/s and max peak (summary_*), else the last step's values
        tokens_per_s = _float(metrics.get("summary_tokens_per_s", metrics.get("tokens_per_s")))
        time_ms = 1e6 / tokens_per_s if tokens_per_s else None
        peak = _float(metrics.get("summary_peak_memory_bytes", metrics.get("peak_memory_bytes")))
    # what an "auto" run settled on, when logged (training runs tag it)
    partitions = _int(params.get("partitions"))
    if partitions is None:
        partitions = _int(tags.get("partitions", metrics.get("partitions")))
    strategy = params.get("strategy", "?")
    if strategy == "auto" and tags.get("strategy") in STRATEGIES:
        strategy = tags["strategy"]
    world_size = _int(params.get("world_size", params.get("num_workers")))
    return Record(kind=kind, run_id=run_id, experiment=experiment, engine=engine, model=model,
                  tokens=tokens, world_size=world_size, device=device, dtype=dtype,
                  partitions=partitions, strategy=strategy, auto_partitions=auto_partitions,
                  auto_strategy=auto_strategy, time_ms=time_ms, peak_memory_bytes=peak,
                  predicted_memory_bytes=_float(metrics.get("predicted_memory_bytes",
                                                            params.get("predicted_memory_bytes"))),
                  segments=describe_segments(segments))


def describe_segments(segments: list[dict]) -> str:
    """``steps 1-25: engine mpipemoe, partitions 2; from step 26: engine fastmoe`` (the
    settings that differ from the segment before), "" for a run of one segment."""
    if len(segments) < 2:
        return ""
    parts = []
    for index, segment in enumerate(segments):
        before = segments[index - 1] if index else {}
        changed = ", ".join(f"{k} {v}" for k, v in segment.items()
                            if k != "from_step" and (not index and k in ("engine", "partitions", "strategy")
                                                     or index and before.get(k) != v))
        end = segments[index + 1]["from_step"] - 1 if index + 1 < len(segments) else None
        span = f"steps {segment['from_step']}-{end}" if end is not None else f"from step {segment['from_step']}"
        parts.append(f"{span}: {changed}")
    return "; ".join(parts)


def load_records(tracking_uri: str, experiments: list[str] | None = None) -> list[Record]:
    """Records of the FINISHED runs in ``experiments`` (default: every experiment)."""
    records = []
    for experiment, run in finished_runs(tracking_uri, experiments):
        record = to_record(run.info.run_id, experiment, run.data.params, run.data.metrics, run.data.tags)
        if record is not None:
            records.append(record)
    return records


# --------------------------------------------------------------------------- analysis

def _fastest(records: list[Record]) -> Record | None:
    timed = [r for r in records if r.time_ms is not None]
    return min(timed, key=lambda r: r.time_ms) if timed else None


def _sort_key(key: tuple) -> tuple:
    """Sort mixed tuples (numbers, strings, None): numbers ascending, then the rest by text."""
    return tuple((0, v, "") if isinstance(v, (int, float)) else (1, 0, str(v)) for v in key)


@dataclass(frozen=True)
class Comparison:
    """MPipeMoE against one baseline at one configuration."""

    key: tuple                     # Record.config_key
    baseline: str
    engine_ms: float
    baseline_ms: float
    engine_memory: float | None
    baseline_memory: float | None

    @property
    def speedup(self) -> float:
        return self.baseline_ms / self.engine_ms

    @property
    def memory_ratio(self) -> float | None:
        if self.engine_memory is None or not self.baseline_memory:
            return None
        return self.engine_memory / self.baseline_memory


def baseline_comparisons(records: list[Record]) -> list[Comparison]:
    """Per configuration: MPipeMoE (its own automatic choice if measured, else its fastest
    setting) against the fastest measurement of each baseline."""
    groups = defaultdict(list)
    for r in records:
        groups[r.config_key].append(r)
    rows = []
    for key in sorted(groups, key=_sort_key):
        group = groups[key]
        ours = [r for r in group if r.engine == ENGINE]
        engine = _fastest([r for r in ours if r.auto_partitions and r.auto_strategy]) or _fastest(ours)
        if engine is None:
            continue
        for baseline in BASELINES:
            base = _fastest([r for r in group if r.engine == baseline])
            if base is not None:
                rows.append(Comparison(key, baseline, engine.time_ms, base.time_ms,
                                       engine.peak_memory_bytes, base.peak_memory_bytes))
    return rows


@dataclass(frozen=True)
class StrategyRow:
    """Time and memory of each strategy (and the automatic choice) at one configuration."""

    key: tuple
    time_ms: dict                  # label -> ms; labels: none, S1..S4, "auto (S3)"
    memory: dict                   # label -> peak bytes (None if not measured)

    @property
    def fastest(self) -> str:
        fixed = {k: v for k, v in self.time_ms.items() if not k.startswith("auto")}
        return min(fixed, key=fixed.get)

    @property
    def auto_label(self) -> str | None:
        return next((k for k in self.time_ms if k.startswith("auto")), None)

    def auto_slowdown(self) -> float | None:
        """Time of the automatic choice over the fastest fixed strategy, minus 1."""
        auto = self.auto_label
        if auto is None:
            return None
        return self.time_ms[auto] / self.time_ms[self.fastest] - 1


def strategy_rows(records: list[Record]) -> list[StrategyRow]:
    groups = defaultdict(list)
    for r in records:
        if r.engine == ENGINE and r.time_ms is not None:
            groups[r.config_key].append(r)
    rows = []
    for key in sorted(groups, key=_sort_key):
        times, memory = {}, {}
        fixed = [r for r in groups[key] if r.strategy in STRATEGY_ORDER and not r.auto_strategy]
        for strategy in STRATEGY_ORDER:
            best = _fastest([r for r in fixed if r.strategy == strategy])
            if best is not None:
                times[strategy], memory[strategy] = best.time_ms, best.peak_memory_bytes
        auto = _fastest([r for r in groups[key] if r.auto_strategy])
        if len(times) < 2:  # one strategy measured: nothing to compare
            continue
        if auto is not None:
            label = "auto" if auto.strategy in ("auto", "?") else f"auto ({auto.strategy})"
            times[label], memory[label] = auto.time_ms, auto.peak_memory_bytes
        rows.append(StrategyRow(key, times, memory))
    return rows


@dataclass(frozen=True)
class BestN:
    """Best fixed n at one token count of one series; ``violation`` if it is below the
    best n at the next smaller token count (best n should not decrease as tokens grow)."""

    series: tuple                  # (kind, model, world_size, device, dtype, strategy)
    tokens: int
    best_n: int
    best_ms: float
    candidates: int                # how many fixed n were measured
    violation: bool
    auto_n: int | None             # the n the online search chose (if an auto run logged it)
    auto_ms: float | None


def best_partitions(records: list[Record]) -> list[BestN]:
    """Per series and token count: the fastest fixed n, with monotonicity violations marked."""
    series = defaultdict(lambda: defaultdict(list))
    for r in records:
        if r.engine == ENGINE and r.tokens is not None and r.time_ms is not None:
            key = (r.kind, r.model, r.world_size, r.device, r.dtype, r.strategy)
            series[key][r.tokens].append(r)
    rows = []
    for key in sorted(series, key=_sort_key):
        previous = None
        for tokens in sorted(series[key]):
            group = series[key][tokens]
            grid = [r for r in group if not r.auto_partitions and r.partitions is not None]
            if len({r.partitions for r in grid}) < 2:
                continue
            # ties go to the smaller n
            best = min(grid, key=lambda r: (r.time_ms, r.partitions))
            auto = _fastest([r for r in group if r.auto_partitions])
            rows.append(BestN(key, tokens, best.partitions, best.time_ms, len({r.partitions for r in grid}),
                              previous is not None and best.partitions < previous,
                              auto.partitions if auto else None, auto.time_ms if auto else None))
            previous = best.partitions
    return rows


def memory_predictions(records: list[Record]) -> list[Record]:
    """Records with both a predicted and a measured peak memory."""
    return [r for r in records if r.predicted_memory_bytes and r.peak_memory_bytes]
