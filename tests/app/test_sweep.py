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
    metric, mode = tune_spaces.ranking(module, module.param_space())
    assert (metric, mode) == (("val_loss", "min") if study == "lr" else ("tokens_per_s", "max"))
    fields = {f.name for f in dataclasses.fields(TrainJob)}
    points = list(_grid_points(module.param_space()))
    assert len(points) == {"smoke": 3, "lr": 7, "granularity": 60, "strategy": 72, "engines": 36}[study]
    for point in points:
        assert set(point) <= fields
        TrainJob(**point, storage_path=str(tmp_path), data_dir=str(tmp_path), tracking_uri="sqlite:////x.db")


def test_unknown_study_names_the_choices():
    with pytest.raises(ValueError, match="choose one of smoke, lr, granularity, strategy, engines"):
        tune_spaces.load("nope")


def test_results_table_shows_the_validation_loss_where_trials_have_one():
    from types import SimpleNamespace

    from app.sweep import format_results

    results = [SimpleNamespace(config={"lr": lr}, metrics=metrics, error=None) for lr, metrics in (
        (1e-3, {"tokens_per_s": 10.0, "final_loss": 3.0, "final_val_loss": 2.5}),
        (3e-3, {"tokens_per_s": 20.0, "final_loss": 2.0}))]  # data without a validation split
    header, *rows = [line.split() for line in format_results(results).splitlines()]
    assert header[:4] == ["lr", "final_val_loss", "tokens/s", "loss"]
    assert [row[1:4] for row in rows] == [["2.5000", "10", "3.0000"], ["-", "20", "2.0000"]]


def test_optuna_search_and_asha_on_the_lr_study():
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search.optuna import OptunaSearch

    module = tune_spaces.load("lr")
    space = module.param_space("optuna")
    assert space["lr"].lower == 1e-4 and space["lr"].upper == 1e-1  # a log-uniform distribution, not a grid
    config = tune_spaces.tune_config(num_samples=12, max_concurrent_trials=2, metric="loss", mode="min",
                                     search="optuna", scheduler="asha", steps=space["steps"])
    assert isinstance(config.search_alg, OptunaSearch) and isinstance(config.scheduler, ASHAScheduler)
    assert (config.metric, config.mode, config.num_samples) == ("loss", "min", 12)
    assert [t for t, _ in config.scheduler._brackets[0]._rungs] == [30, 10]  # steps where ASHA may stop a trial
    assert config.reuse_actors  # a finished trial's process runs the next trial
    plain = tune_spaces.tune_config()
    assert plain.search_alg is None and plain.scheduler is None and plain.metric == "tokens_per_s"


def test_grid_studies_refuse_optuna_before_ray_is_touched(tmp_path):
    with pytest.raises(ValueError, match=r"--search optuna: study 'smoke' supports grid, random \(its space is a "
                                         r"grid of categorical choices\)"):
        sweep.run_study("smoke", storage_path=str(tmp_path), tracking_uri="none", search="optuna")
    with pytest.raises(ValueError, match="scheduler='x' is invalid: choose one of fifo, asha"):
        tune_spaces.tune_config(scheduler="x")


def test_loss_studies_rank_by_validation_loss_where_the_jobs_evaluate():
    from app.jobs import TrainJob

    assert TrainJob().eval_every > 0   # what loss_metric assumes of a study that does not set it
    assert tune_spaces.loss_metric({}) == tune_spaces.VAL_LOSS == "val_loss"
    assert tune_spaces.loss_metric({"eval_every": 10}) == "val_loss"
    assert tune_spaces.loss_metric({"eval_every": 0}) == tune_spaces.TRAIN_LOSS == "loss"
    assert tune_spaces.ranking(tune_spaces.load("lr"), tune_spaces.load("lr").param_space()) == ("val_loss", "min")


def test_trial_reports_every_step_carrying_the_metric_and_stops_its_job_when_pruned(tmp_path, monkeypatch):
    import ray.tune

    from app.jobs import STOP_JOB, TrainJob

    job = TrainJob(name="lr-trial", steps=40, storage_path=str(tmp_path), data_dir=str(tmp_path), tracking_uri="none")
    settings = sweep.TrialSettings(study="lr", tracking_uri="none", train_storage_path=str(tmp_path),
                                   data_dir=str(tmp_path), parent_run_id=None, use_gpu=False,
                                   cpus_per_worker=None, metric="val_loss")
    reported = []

    def report(metrics):
        if metrics["step"] == 4:
            raise SystemExit(0)  # what Tune's report does once the scheduler stopped the trial
        reported.append(metrics)

    monkeypatch.setattr(ray.tune, "report", report)
    reporter = sweep.StepReporter(settings, job)
    assert reporter({"step": 1, "loss": 5.0, "attempt": "ab12"}) is None  # no val_loss at this step: not reported
    assert reporter({"step": 2, "loss": 4.0, "val_loss": 4.5, "attempt": "ab12"}) is None
    assert reported == [{"step": 2, "loss": 4.0, "val_loss": 4.5}] and reporter.pruned_tags() == {}
    assert reporter({"step": 4, "loss": 3.0, "val_loss": 3.9}) == STOP_JOB  # the job stops after this step
    assert reporter({"step": 5, "loss": 2.9, "val_loss": 3.8}) is None and len(reported) == 1  # nothing more
    assert reporter.pruned_tags() == {"pruned_at_step": 2}  # the last step Tune saw
    # the end-of-trial report: the summary, the newest val_loss, the steps as ASHA's time axis
    final = sweep.trial_metrics({"steps": 40, "final_loss": 3.1, "tokens_per_s": 9.0, "name": "x"}, "val_loss",
                                {"step": 40, "val_loss": 3.3, "loss": 3.0})
    assert (final["val_loss"], final["step"], final["final_loss"]) == (3.3, 40, 3.1)
    assert sweep.trial_metrics({"steps": 40, "final_loss": 3.1}, "loss")["loss"] == 3.1
    with pytest.raises(RuntimeError, match="reported no val_loss"):
        sweep.trial_metrics({"steps": 40, "final_loss": 3.1, "name": "x"}, "val_loss")


def test_a_stopped_trial_waits_for_its_function_to_return():
    """Tune's ``stop`` of a trial runs ``cleanup``: ours waits (up to the grace) for the trial
    function, which stops its Train job, instead of letting the process exit under it."""
    import threading

    from ray.train._internal import session as train_session

    ended = threading.Event()
    cls = sweep.stopping_trainable(lambda config: None, stop_grace_s=5)

    class Session:
        def finish(self, timeout):
            ended.wait(timeout)
            self.waited = timeout

        def _report_thread_runner_error(self):
            pass

    fake = Session()
    threading.Timer(0.2, ended.set).start()
    original = train_session.get_session
    try:
        train_session._session = fake
        cls.cleanup(object.__new__(cls))
    finally:
        train_session._session = None
    assert fake.waited == 5 and ended.is_set() and original() is None


def test_a_reused_trial_process_waits_for_the_previous_trial_function(monkeypatch):
    """Tune reuses a trial's process for the next trial (``reset_config``). The previous
    trial's function may still be stopping its Train job (ASHA pruned it), and Tune's wrapper
    of it then reports once more and waits; ours lets that report through, drops it, and only
    then resets (Ray Tune's own reset waits 2 s, after which the process is given up)."""
    import queue
    import threading

    from ray.train._internal import session as train_session
    from ray.tune.trainable.function_trainable import FunctionTrainable

    class Session:
        def __init__(self):
            self.result_queue: queue.Queue = queue.Queue(1)
            self.continue_lock = threading.Semaphore(0)
            self.training_thread = threading.Thread(target=self.trial_function)
            self.finished: list = []

        def trial_function(self):
            threading.Event().wait(0.3)            # the function stops its Train job
            self.result_queue.put({"done": True})  # Tune's wrapper reports once more ...
            self.continue_lock.acquire()           # ... and waits for Tune's answer

        def finish(self, timeout):
            self.finished.append(timeout)
            self.continue_lock.release()
            self.training_thread.join(timeout)

    monkeypatch.setattr(FunctionTrainable, "reset_config", lambda self, config: "reset by Ray Tune")
    cls = sweep.stopping_trainable(lambda config: None, stop_grace_s=30)
    fake = Session()
    fake.training_thread.start()
    try:
        train_session._session = fake
        reused = cls.reset_config(object.__new__(cls), {})
    finally:
        train_session._session = None
    assert reused == "reset by Ray Tune" and not fake.training_thread.is_alive()
    assert fake.finished and set(fake.finished) == {sweep.REUSE_POLL_S}


def test_local_ray_train_settings_leave_the_users_own_alone():
    assert sweep.local_train_env({}) == sweep.LOCAL_RAY_TRAIN_ENV
    assert set(sweep.LOCAL_RAY_TRAIN_ENV) <= _ray_train_propagated()  # Ray Train hands them on to its workers
    mine = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "3"}
    assert sweep.local_train_env(mine) == {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}


def _ray_train_propagated() -> set:
    from ray.train.v2._internal.constants import ENV_VARS_TO_PROPAGATE

    return set(ENV_VARS_TO_PROPAGATE)


def test_pruned_trials_and_the_best_one_are_named(tmp_path):
    from types import SimpleNamespace as Result

    results = [Result(config={"lr": 1e-3, "steps": 40}, metrics={"step": 40, "steps": 40, "loss": 3.0}, error=None),
               Result(config={"lr": 1e-1, "steps": 40}, metrics={"step": 10, "loss": 5.5}, error=None),
               Result(config={"lr": 3e-3, "steps": 40}, metrics={"step": 40, "steps": 40, "loss": 2.5}, error=None),
               Result(config={"lr": 3e-2, "steps": 40}, metrics={}, error=RuntimeError("x"))]
    assert sweep.count_pruned(results, {"steps": 40}) == 1
    assert sweep.best_trial(results, "loss", "min").config["lr"] == 3e-3
    assert sweep.best_trial(results, "loss", "max").config["lr"] == 1e-1
    assert sweep.count_trials(results, "loss") == (1, 3)
    table = sweep.format_results(results, "loss", 40).splitlines()
    assert table[0].split() == ["lr", "tokens/s", "loss", "peak", "MiB", "status"]
    assert table[2].split()[0] == "0.1" and table[2].split()[-1] == "pruned@10"
    assert table[3].split()[-1] == "ok" and table[4].split()[-1] == "ERROR"


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

    args = argparse.Namespace(space="smoke", address=None, num_samples=None, max_concurrent=None,
                              verbose=False, search="grid", scheduler="fifo", max_failures=0, seed=0, **{k: sweep_dirs[k] for k in ("storage_path", "tracking_uri",
                                                                           "data_dir")})
    assert sweep.run(args) == 0
    table = capsys.readouterr().out
    assert "0.99 CPU per worker" in table
    for engine in ("mpipemoe", "fastmoe", "fastermoe"):
        # engine, the final validation loss (the data has a split), tokens/s, loss, peak MiB, status
        assert re.search(rf"^{engine} +\d+\.\d{{4}} +\d+ +\d+\.\d+ +\d+\.\d +ok", table, flags=re.M), table

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
                  data_dir=sweep_dirs["data_dir"], max_concurrent=1, trainable=trial,
                  stop_grace_s=0)  # a light trainable runs no Train job to wait for

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


def test_the_sweep_record_tool_reads_the_printed_table():
    """tools/sweep_record.py (results/sweep-lr-*.json) reads what ``mpipemoe sweep lr`` prints."""
    import importlib.util
    from pathlib import Path
    from types import SimpleNamespace as Result

    path = Path(__file__).resolve().parents[2] / "tools" / "sweep_record.py"
    spec = importlib.util.spec_from_file_location("sweep_record", path)
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    results = [Result(config={"lr": 3e-3}, metrics={"step": 40, "steps": 40, "val_loss": 2.51, "loss": 2.7,
                                                    "tokens_per_s": 9e3, "peak_memory_bytes": 2**29}, error=None),
               Result(config={"lr": 1e-1}, metrics={"step": 10, "val_loss": 4.6, "loss": 4.8, "tokens_per_s": 8e3,
                                                    "peak_memory_bytes": 2**29}, error=None)]
    log = (sweep.format_results(results, "val_loss", 40)
           + "\nBest trial (lowest val_loss): lr=0.003 val_loss 2.51; 1 of 2 trials pruned by asha\n")
    made = tool.record(log, command="mpipemoe sweep lr")
    assert (made["trials"], made["pruned"], made["finished"], made["pruned_at"]) == (2, 1, 1, {"pruned@10": 1})
    assert made["best"] == {"lr": 3e-3, "val_loss": 2.51, "status": "ok"}
    assert [t["status"] for t in made["per_trial"]] == ["ok", "pruned@10"]
