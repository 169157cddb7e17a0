"""``mpipemoe sweep``: the resource plan and the study spaces (no Ray), then on the shared
local Ray instance the smoke study end to end (MLflow runs + report) and the resume of an
interrupted study.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import re
import signal
import time
from pathlib import Path

import pytest

import tune_spaces
from app import sweep
from app.run_kinds import run_kind

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- tier 1: no Ray cluster

def test_plan_on_two_cpu_cores():
    plan = sweep.plan_resources({"CPU": 2.0}, num_workers=2)
    # one trial at a time: 0.01 (trial) + 2 x 0.99 (workers) <= 2 CPUs
    assert (plan.use_gpu, plan.max_concurrent_trials, plan.cpus_per_worker) == (False, 1, 0.99)
    assert plan.trial_resources == {"CPU": 0.01, "node:__internal_head__": 0.001}
    # two at once if asked: 2 x 0.01 + 4 x 0.49 = 1.98 <= 2
    assert sweep.plan_resources({"CPU": 2.0}, num_workers=2, max_concurrent=2).cpus_per_worker == 0.49


def test_plan_on_gpu_cluster():
    plan = sweep.plan_resources({"CPU": 768.0, "GPU": 64.0}, num_workers=8)
    assert (plan.use_gpu, plan.max_concurrent_trials, plan.cpus_per_worker) == (True, 8, None)
    assert sweep.plan_resources({"CPU": 32.0}, num_workers=8).max_concurrent_trials == 3
    with pytest.raises(ValueError, match="needs 8 GPUs"):
        sweep.plan_resources({"CPU": 96.0, "GPU": 4.0}, num_workers=8, use_gpu=True)
    with pytest.raises(ValueError, match="max_concurrent"):
        sweep.plan_resources({"CPU": 2.0}, num_workers=2, max_concurrent=0)


def _grid_points(space: dict):
    keys = list(space)
    choices = [v["grid_search"] if isinstance(v, dict) and "grid_search" in v else [v] for v in space.values()]
    for values in itertools.product(*choices):
        yield dict(zip(keys, values))


@pytest.mark.parametrize("study", tune_spaces.STUDIES)
def test_every_trial_of_every_study_is_a_valid_train_job(study, tmp_path):
    from app.jobs import TrainJob

    module = tune_spaces.load(study)
    assert module.DESCRIPTION
    config = module.tune_config(num_samples=1, max_concurrent_trials=2)
    assert (config.metric, config.mode, config.max_concurrent_trials) == ("tokens_per_s", "max", 2)
    fields = {f.name for f in dataclasses.fields(TrainJob)}
    points = list(_grid_points(module.param_space()))
    assert len(points) == {"smoke": 3, "granularity": 60, "strategy": 72, "engines": 36}[study]
    for point in points:
        assert set(point) <= fields
        TrainJob(**point, storage_path=str(tmp_path), data_dir=str(tmp_path), tracking_uri="sqlite:////x.db")


def test_unknown_study_names_the_choices():
    with pytest.raises(ValueError, match="choose one of smoke, granularity, strategy, engines"):
        tune_spaces.load("nope")


def test_results_table_shows_the_validation_loss_where_trials_have_one():
    from types import SimpleNamespace

    from app.sweep import format_results

    results = [SimpleNamespace(config={"lr": lr}, metrics=metrics, error=None) for lr, metrics in (
        (1e-3, {"tokens_per_s": 10.0, "final_loss": 3.0, "final_val_loss": 2.5}),
        (3e-3, {"tokens_per_s": 20.0, "final_loss": 2.0}))]  # data without a validation split
    rows = [line.split() for line in format_results(results).splitlines()[1:]]
    assert [row[2] for row in rows] == ["2.5000", "2.0000"]


# ---------------------------------------------------------------- tier 3: local Ray

@pytest.fixture
def sweep_dirs(tmp_path, monkeypatch):
    from lm.data import ensure_default_data

    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    data_dir = ensure_default_data(tmp_path / "data", echo=lambda *_: None)
    return {"storage_path": str(tmp_path / "results"), "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
            "data_dir": str(data_dir), "out": tmp_path / "report"}


@pytest.mark.ray
def test_smoke_sweep_end_to_end(ray_local, sweep_dirs, capsys):
    """`mpipemoe sweep smoke`: 3 real training trials (one per engine), logged to MLflow;
    then `mpipemoe report`."""
    from app import report
    from app.tracking import client

    args = argparse.Namespace(space="smoke", address=None, num_samples=1, max_concurrent=None,
                              verbose=False, **{k: sweep_dirs[k] for k in ("storage_path", "tracking_uri",
                                                                           "data_dir")})
    assert sweep.run(args) == 0
    table = capsys.readouterr().out
    assert "0.99 CPU per worker" in table
    for engine in ("mpipemoe", "fastmoe", "fastermoe"):
        assert re.search(rf"^{engine} +\d+ +\d+\.\d+ +\d+\.\d +ok", table, flags=re.M), table

    mlflow = client(sweep_dirs["tracking_uri"])
    experiment = mlflow.get_experiment_by_name("smoke")
    runs = mlflow.search_runs([experiment.experiment_id])
    parents = [r for r in runs if run_kind(r.data.tags) == "study"]
    trials = [r for r in runs if run_kind(r.data.tags) == "train"]
    assert len(parents) == 1 and len(trials) == 3  # one run per trial, no duplicates
    assert parents[0].info.status == "FINISHED"
    assert sorted(r.data.params["engine"] for r in trials) == ["fastermoe", "fastmoe", "mpipemoe"]
    for run in trials:
        assert run.info.status == "FINISHED"
        assert run.data.tags["mlflow.parentRunId"] == parents[0].info.run_id
        assert run.data.tags["study"] == "smoke" and run.data.tags["trial_id"]

    out = sweep_dirs["out"]
    assert report.run(argparse.Namespace(out=str(out), experiment=["smoke"],
                                         tracking_uri=sweep_dirs["tracking_uri"])) == 0
    assert str(out / "report.md") in capsys.readouterr().out
    text = (out / "report.md").read_text()
    png = out / "speedup_memory.png"
    assert png.read_bytes().startswith(PNG_MAGIC) and png.stat().st_size > 1000
    assert "](speedup_memory.png)" in text
    assert "| train | tiny-gpt | 256 | 2 | cpu/float32 | fastmoe |" in text


def _interrupting_trial(log: Path, driver_pid: int):
    """A light trainable (no Ray Train): logs each start; the first 'fastmoe' start sends the
    driver SIGUSR1, which Tune handles like Ctrl+C: save the state, stop the study."""

    def trial(config: dict, *, settings) -> None:
        from ray import tune

        with open(log, "a") as f:
            f.write(config["engine"] + "\n")
        if config["engine"] == "fastmoe" and log.read_text().count("fastmoe") == 1:
            os.kill(driver_pid, signal.SIGUSR1)
            time.sleep(60)  # killed when Tune stops the study
        tune.report({"tokens_per_s": 1.0})

    return trial


@pytest.mark.ray
def test_interrupted_study_resumes_without_rerunning_finished_trials(ray_local, sweep_dirs, tmp_path):
    log = tmp_path / "starts.txt"
    trial = _interrupting_trial(log, os.getpid())
    common = dict(storage_path=sweep_dirs["storage_path"], tracking_uri=sweep_dirs["tracking_uri"],
                  data_dir=sweep_dirs["data_dir"], max_concurrent=1, trainable=trial)

    first = sweep.run_study("smoke", **common)
    assert sweep.count_trials(first) == (0, 1)  # only mpipemoe finished
    assert log.read_text().split() == ["mpipemoe", "fastmoe"]

    second = sweep.run_study("smoke", **common)  # same storage path: Tuner.restore
    assert len(second) == 3 and not any(r.error for r in second)
    assert all(r.metrics["tokens_per_s"] == 1.0 for r in second)
    starts = log.read_text().split()
    assert starts.count("mpipemoe") == 1  # finished before the interruption: not run again
    assert starts.count("fastmoe") == 2 and starts.count("fastermoe") == 1
    assert sweep.count_trials(second) == (0, 3)

    from app.tracking import client  # one parent run, reopened by the resume and closed again

    mlflow = client(sweep_dirs["tracking_uri"])
    parents = mlflow.search_runs([mlflow.get_experiment_by_name("smoke").experiment_id])
    assert [(run_kind(r.data.tags), r.info.status) for r in parents] == [("study", "FINISHED")]
