"""``mpipemoe report`` from synthetic MLflow runs in a temporary sqlite store (no Ray, fast).

The numbers are chosen so the expected ratios and best n can be worked out by hand.
"""
from __future__ import annotations


import pytest

pytest.importorskip("mlflow")
pytest.importorskip("matplotlib")

from app.reports import report  # noqa: E402
from app.tracking.store import RunLogger  # noqa: E402

MIB = 2 ** 20
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def bench(uri, engine, tokens, ms, mem_mib, *, partitions=2, strategy="none", chosen_by="grid",
          predicted_mib=None, status="FINISHED"):
    run = RunLogger.start(uri, "bench-synthetic", tags={"kind": "bench"})
    run.log_params({"engine": engine, "model": "gpt-s", "tokens": tokens, "world_size": 2, "device": "cuda",
                    "dtype": "bf16", "partitions": partitions, "strategy": strategy, "chosen_by": chosen_by})
    metrics = {"fwd_bwd_ms": ms, "peak_memory_bytes": mem_mib * MIB}
    if predicted_mib is not None:
        metrics["predicted_memory_bytes"] = predicted_mib * MIB
    run.log_metrics(metrics)
    run.finish(status)


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # tokens 4096: both baselines and MPipeMoE's automatic choice
    bench(uri, "fastmoe", 4096, 10.0, 1000)
    bench(uri, "fastmoe", 4096, 12.0, 1000)             # slower repeat: best-of keeps 10 ms
    bench(uri, "fastermoe", 4096, 8.0, 900)
    bench(uri, "mpipemoe", 4096, 4.0, 600, strategy="S1", chosen_by="auto", predicted_mib=580)
    # best n, strategy "none": 4096 -> n=2, 8192 -> n=4, 16384 -> n=2 (a violation)
    for tokens, times in {4096: (5.0, 4.5, 6.0), 8192: (9.0, 8.0, 7.0), 16384: (16.0, 14.0, 15.0)}.items():
        for n, ms in zip((1, 2, 4), times):
            bench(uri, "mpipemoe", tokens, ms, 800, partitions=n, predicted_mib=760 if n == 1 else None)
    # strategies at 8192 (n=2): none is 8 ms (from above), S1 and S3; auto chose S3
    bench(uri, "mpipemoe", 8192, 9.0, 500, strategy="S1")
    bench(uri, "mpipemoe", 8192, 7.5, 450, strategy="S3")
    bench(uri, "mpipemoe", 8192, 7.2, 450, strategy="S3", chosen_by="auto")
    # noise the report must ignore: a run still RUNNING, a study parent run
    bench(uri, "fastmoe", 8192, 1.0, 1, status="RUNNING")
    RunLogger.start(uri, "bench-synthetic", tags={"kind": "study"}).finish()
    # one training run as app.jobs.launch.run_job logs it: tokens = batch_size * resolved seq_len,
    # summary_* (median tokens/s, max peak) win over the last step's values
    run = RunLogger.start(uri, "smoke", run_name="smoke-run", tags={"mpipemoe.kind": "train", "strategy": "S2"})
    run.log_params({"engine": "mpipemoe", "preset": "tiny-gpt", "batch_size": 4, "num_workers": 2,
                    "partitions": 2, "strategy": "auto",
                    "resolved": {"seq_len": 64, "use_gpu": False, "dtype": "float32"}})
    run.log_metrics({"tokens_per_s": 1000.0, "summary_tokens_per_s": 2000.0, "peak_memory_bytes": 100 * MIB,
                     "summary_peak_memory_bytes": 120 * MIB})
    for step, (val, imbalance) in ((2, (3.5, 1.8)), (4, (3.0, 1.4))):  # section 8: every 2 steps
        run.log_metrics({"val_loss": val, "moe_load/imbalance_max": imbalance, "moe_load/l0/imbalance": imbalance,
                         "moe_load/l0/dropped_fraction": 0.2 / step}, step=step)
    run.finish()
    return uri


def test_records_are_normalised(store):
    records = report.load_records(store)
    assert len(records) == 17  # 16 finished bench runs + 1 training run
    train = [r for r in records if r.kind == "train"]
    assert len(train) == 1
    t = train[0]
    assert (t.model, t.tokens, t.world_size, t.device, t.dtype) == ("tiny-gpt", 256, 2, "cpu", "float32")
    assert t.time_ms == pytest.approx(500.0)  # 1e6 / 2000 tokens/s: ms per 1000 tokens
    assert t.peak_memory_bytes == 120 * MIB
    assert (t.partitions, t.auto_partitions, t.strategy, t.auto_strategy) == (2, False, "S2", True)
    assert report.load_records(store, ["smoke"]) == train


def test_baseline_ratios(store):
    rows = {(r.key[2], r.baseline): r for r in report.baseline_comparisons(report.load_records(store))}
    # 4096 tokens: MPipeMoE auto 4 ms / 600 MiB against fastmoe 10 ms / 1000 MiB, fastermoe 8 ms / 900 MiB
    assert rows[(4096, "fastmoe")].speedup == pytest.approx(2.5)
    assert rows[(4096, "fastmoe")].memory_ratio == pytest.approx(0.6)
    assert rows[(4096, "fastermoe")].speedup == pytest.approx(2.0)
    assert rows[(4096, "fastermoe")].memory_ratio == pytest.approx(600 / 900)
    assert {k[0] for k in rows} == {4096}  # no baseline measured at other token counts


def test_best_n_and_monotonicity(store):
    rows = report.best_partitions(report.load_records(store))
    none = [r for r in rows if r.series[5] == "none"]
    assert [(r.tokens, r.best_n, r.violation) for r in none] == [
        (4096, 2, False), (8192, 4, False), (16384, 2, True)]
    assert none[1].best_ms == pytest.approx(7.0)
    assert all(r.series[5] == "none" for r in rows)  # S1/S3 have one n each: no best-n row


def test_strategy_rows(store):
    rows = report.strategy_rows(report.load_records(store))
    assert [r.key[2] for r in rows] == [8192]
    row = rows[0]
    # "none" best over n is 7 ms (n=4); S1 9 ms; S3 7.5 ms; auto (S3) 7.2 ms
    assert row.time_ms == {"none": 7.0, "S1": 9.0, "S3": 7.5, "auto (S3)": 7.2}
    assert row.fastest == "none"
    assert row.auto_slowdown() == pytest.approx(7.2 / 7.0 - 1)


def test_report_files(store, tmp_path, capsys):
    out = tmp_path / "report"
    assert report.report_from_store(str(out), None, store) == 0
    assert str(out / "report.md") in capsys.readouterr().out
    text = (out / "report.md").read_text()
    pngs = ["speedup_memory.png", "strategies.png", "best_n.png", "memory_prediction.png", "val_loss.png",
            "imbalance.png"]
    for name in pngs:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000, name
        assert f"]({name})" in text
    assert "No data" not in text
    assert "**1 violation(s)**" in text
    assert "2.50x" in text and "0.60" in text
    # predicted against measured: 580 vs 600 (-3.3%) and 760 vs 800 three times (-5.0%)
    assert "largest error 5.0%, 4 within 10%" in text
    # section 8: the training run's validation loss and load, first and last logged
    assert "| smoke-run | – | tiny-gpt | mpipemoe | 3.500 (step 2) | 3.000 (20.1) at step 4 | 1.40 | 5.0% |" in text


def test_empty_store_says_no_data(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    uri = f"sqlite:///{tmp_path / 'empty.db'}"
    path = report.write_report(report.load_records(uri), tmp_path / "out", source=uri)
    text = path.read_text()
    assert text.count("_No data:") == 4
    assert not list((tmp_path / "out").glob("*.png"))


def test_emulated_runs_get_section_7_and_stay_out_of_sections_1_to_4(tmp_path, monkeypatch):
    """Emulated bench runs (tag measured_as=emulated) are not measurements: sections 1-4
    ignore them; section 7 shows speedup, overlap efficiency, best n and memory vs time."""
    from app.bench.layer import log_to_mlflow
    from app.reports.emulated import load_emulated

    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"

    def record(engine, tokens, ms, mib, chosen_by="grid", n=1, strategy="none"):
        return {"engine": engine, "model": "gpt-xl", "tokens": tokens, "routing": "uniform", "chosen_by": chosen_by,
                "partitions": n, "strategy": strategy, "fwd_bwd_ms": ms, "peak_memory_bytes": mib * MIB,
                "measured_as": "emulated", "network": "dgx-a100"}

    records, summaries = [], []
    for tokens, scale in ((4096, 1.0), (16384, 4.0)):
        records += [record("fastmoe", tokens, 10 * scale, 1000 * scale, "baseline"),
                    record("mpipemoe", tokens, 8 * scale, 400 * scale, "auto", 4, "S3"),
                    record("mpipemoe", tokens, 8.5 * scale, 400 * scale, "grid", 4, "S3"),
                    record("mpipemoe", tokens, 7.5 * scale, 700 * scale, "grid", 2, "none")]
        summaries.append({"model": "gpt-xl", "routing": "uniform", "tokens": tokens, "auto_partitions": 4,
                          "auto_strategy": "S3", "speedup_vs_fastmoe": 1.25, "speedup_vs_fastermoe": 1.1,
                          "overlap_efficiency": 0.9, "grid_best_partitions": 2 if tokens == 4096 else 4,
                          "grid_best_strategy": "S3", "auto_vs_grid_best": -0.05, "memory_ratio_vs_fastmoe": 0.4,
                          "lean_setting": "4/S3", "lean_vs_fastest": 8.5 / 7.5 - 1})
    meta = {"device": "NVIDIA H200", "command": "mpipemoe bench --emulate 8x8", "world_size": 64,
            "date": "2026-12-03", "torch": "2.11", "measured_as": "emulated", "network": "dgx-a100",
            "emulated_cluster": "8x8"}
    assert log_to_mlflow({"meta": meta, "records": records, "summaries": summaries}, uri, "emu",
                         printer=lambda *_: None) == 10
    assert report.load_records(uri) == []  # sections 1-4: no measurement among them
    loaded = load_emulated(uri)
    assert len(loaded[0]) == 2 and len(loaded[1]) == 8
    path = report.write_report([], tmp_path / "out", emulated=loaded)
    text = path.read_text()
    assert "## 5. Emulated clusters" in text  # sections 5 and 6 have no data: numbers stay contiguous
    assert "| dgx-a100 8x8 | gpt-xl | uniform | 16384 | 4/S3 | 1.25 | 1.10 | 90% | 0.40 | 4/S3 | -5.0% | 4/S3: +13.3% |" \
        in text
    for figure in ("emulated_speedup.png", "emulated_best_n.png", "emulated_memory_time.png"):
        assert (tmp_path / "out" / figure).read_bytes().startswith(PNG_MAGIC)


def test_stacked_runs_get_section_9_and_stay_out_of_sections_1_to_4(tmp_path, monkeypatch):
    """`mpipemoe bench --layers L` records (logged to MLflow as bench runs with `layers`)
    time stacks, not single layers: only section 9, memory against time, shows them,
    relative to the peer without checkpointing; single-layer runs with peak memory too."""
    from app.bench.layer import log_to_mlflow
    from app.reports.memory_time import load_memory_time

    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"

    def record(setting, engine, chosen_by, ms, gib):
        return {"setting": setting, "engine": engine, "chosen_by": chosen_by, "checkpointed": setting.endswith("+ckpt"),
                "model": "gpt-xl", "tokens": 32768, "routing": "uniform", "layers": 8, "world_size": 1,
                "device": "NVIDIA H200", "dtype": "bfloat16", "partitions": 4, "strategy": "S4",
                "fwd_bwd_ms": ms, "fwd_bwd_ms_std": 0.5, "activation_bytes": gib * 2**30, "measured_as": "measured"}
    records = [record("torchtitan", "torchtitan", "peer", 200.0, 40), record("torchtitan+ckpt", "torchtitan", "peer",
                                                                             260.0, 6),
               record("mpipemoe:4:S4", "mpipemoe", "grid", 240.0, 10), record("auto@budget", "mpipemoe", "budget",
                                                                              250.0, 5)]
    meta = {"device": "NVIDIA H200", "command": "mpipemoe bench --layers 8", "world_size": 1, "date": "2026-12-04",
            "torch": "2.13", "measured_as": "measured"}
    assert log_to_mlflow({"meta": meta, "records": records, "summaries": []}, uri, "stacked",
                         printer=lambda *_: None) == 4
    bench(uri, "fastmoe", 4096, 10.0, 1000, chosen_by="baseline")
    bench(uri, "mpipemoe", 4096, 12.0, 400, strategy="S3")
    assert [r.engine for r in report.load_records(uri)] == ["mpipemoe", "fastmoe"]  # sections 1-4: no stack
    path = report.write_report(report.load_records(uri), tmp_path / "out", memory_time=load_memory_time(uri))
    text = path.read_text()
    assert "## 5. Memory against time" in text and "![memory against time](memory_time.png)" in text
    assert "### gpt-xl, 32768 tokens, 8 layers, uniform routing, 1 × NVIDIA H200, bfloat16 — against torchtitan" \
        in text
    assert "| auto@budget | 4/S4 | 250.00 | 0.50 | 5120 | 1.25 | 0.12 |" in text
    assert "| mpipemoe:2:S3 | 2/S3 | 12.00 | – | 1000 | 1.20 | 0.40 |" not in text  # (the fixture's MiB)
    assert "| mpipemoe:2:S3 | 2/S3 | 12.00 | – | 400 | 1.20 | 0.40 |" in text
    assert "### gpt-s, 4096 tokens, 1 layer, uniform routing, 2 × cuda, bf16 — against fastmoe" in text
    assert (tmp_path / "out" / "memory_time.png").read_bytes().startswith(PNG_MAGIC)


def _trial(uri, experiment, study, setting, *, outcome=None, losses=(), tokens_per_s=None, peak_mib=None,
           pruned_at=None, status="FINISHED", reason=None):
    """A sweep trial's MLflow run as app/jobs/sweep.py leaves it (tags study/outcome/reason/pruned_at_step)."""
    tags = {"mpipemoe.kind": "train", "study": study, "trial_id": f"t{len(setting)}"}
    tags.update({k: v for k, v in (("outcome", outcome), ("reason", reason), ("pruned_at_step", pruned_at)) if v})
    run = RunLogger.start(uri, experiment, run_name=f"{study}-" + "-".join(map(str, setting.values())), tags=tags)
    run.log_params({"engine": "mpipemoe", "preset": "tiny-gpt", "batch_size": 4, "steps": 20, **setting,
                    "resolved": {"seq_len": 64, "use_gpu": False, "dtype": "float32"}})
    for step, (loss, val) in enumerate(losses, 1):
        run.log_metrics({"loss": loss, "val_loss": val}, step=step * 5)
    if tokens_per_s:
        run.log_metrics({"summary_tokens_per_s": tokens_per_s, "summary_settled_peak_memory_bytes": peak_mib * MIB})
    run.finish(status)


def test_each_sweep_study_gets_its_own_section_with_ranking_pruned_trials_and_best_curves(store, tmp_path):
    from app.reports.studies import load_studies
    from app.reports.training import load_training_curves

    RunLogger.start(store, "sweeps", tags={"mpipemoe.kind": "study", "study": "lr"}).log_params(
        {"study": "lr", "description": "lr x weight decay over wsd"})
    _trial(store, "sweeps", "lr", {"lr": 1e-3}, outcome="ok", losses=[(4.0, 4.1), (3.0, 3.2)])
    _trial(store, "sweeps", "lr", {"lr": 3e-3}, outcome="ok", losses=[(3.5, 3.6), (2.5, 2.7)])
    _trial(store, "sweeps", "lr", {"lr": 1e-2}, outcome="pruned", losses=[(5.0, 5.5)], pruned_at="5",
           status="KILLED")
    _trial(store, "sweeps", "lr", {"lr": 1.0}, outcome="refused", status="FAILED", reason="TrainJob.lr=1 is x")
    for n, rate, mib in ((1, 1000.0, 300), (2, 1500.0, 200), (4, 1400.0, 250)):
        _trial(store, "sweeps", "granularity", {"partitions": n}, outcome="ok", tokens_per_s=rate, peak_mib=mib)
    studies = load_studies(store)
    assert [(s["study"], len(s["trials"])) for s in studies] == [("lr", 4), ("granularity", 3)]
    path = report.write_report(report.load_records(store), tmp_path / "out", studies=studies,
                               training=load_training_curves(store))
    text = path.read_text()
    headings = [line.split(".")[0] for line in text.splitlines() if line.startswith("## ")]
    assert headings == [f"## {n}" for n in range(1, len(headings) + 1)]  # contiguous
    assert "## 6. Study `lr` (experiment sweeps)\n\nlr x weight decay over wsd" in text  # after 1-4 and training
    assert "| 1 | lr=0.003 | 2.7000 | 2.5000 | ok |\n| 2 | lr=0.001 | 3.2000 | 3.0000 | ok |\n" \
           "| 3 | lr=0.01 | 5.5000 | 5.0000 | pruned at step 5 |\n| 4 | lr=1.0 | – | – | refused: TrainJob.lr=1 is x |" \
        in text
    assert "Pruned trials: lr=0.01 at step 5." in text
    assert "The best run, lr-0.003 (lr=0.003):" in text
    assert "## 7. Study `granularity` (experiment sweeps)" in text
    assert "| partitions=2 | 1,500 [1,500-1,500] x1 | 200.0 | * | - | ok |" in text  # fastest, on the front
    assert "| partitions=4 | 1,400 [1,400-1,400] x1 | 250.0 |  | - | ok |" in text  # beaten by n=2 on both
    for figure in ("study_sweeps_lr_best.png", "study_sweeps_granularity_front.png", "val_loss.png"):
        assert (tmp_path / "out" / figure).read_bytes().startswith(PNG_MAGIC)
    assert "| lr-0.003 | lr | tiny-gpt |" in text  # section 8's table names each run's study
