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
from app.commands import sweep as sweep_command
from app.jobs import ray_start, study_results, sweep, trial
from app.tracking.run_kinds import run_kind

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
    from app.jobs.job import TrainJob

    module = tune_spaces.load(study)
    assert module.DESCRIPTION
    metric, mode = tune_spaces.ranking(module, module.param_space())
    assert (metric, mode) == (("val_loss", "min") if study == "lr" else ("tokens_per_s", "max"))
    fields = {f.name for f in dataclasses.fields(TrainJob)}
    points = list(_grid_points(module.param_space()))
    assert len(points) == {"smoke": 3, "lr": 7, "granularity": 30, "strategy": 24, "engines": 36}[study]
    for point in points:
        assert set(point) <= fields
        TrainJob(**point, storage_path=str(tmp_path), data_dir=str(tmp_path), tracking_uri="sqlite:////x.db")
    # a sweep writes no checkpoints unless its space asks (lr's and the GPU studies' say 0 themselves)
    assert sweep.study_space(module, "grid")["checkpoint_every"] == 0


def test_unknown_study_names_the_choices():
    with pytest.raises(ValueError, match="choose one of smoke, lr, granularity, strategy, engines, or give a "
                                         "study file"):
        tune_spaces.load("nope")
    with pytest.raises(ValueError, match="no such file"):
        tune_spaces.load("/nonexistent/space.toml")


def test_results_table_shows_the_validation_loss_where_trials_have_one():
    from types import SimpleNamespace

    from app.jobs.study_results import format_results

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
    assert tune_spaces.asha_rungs(space["steps"]) == [10, 30]  # the same, where the trials' workers wait
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
    from app.jobs.job import TrainJob

    assert TrainJob().eval_every > 0   # what loss_metric assumes of a study that does not set it
    assert tune_spaces.loss_metric({}) == tune_spaces.VAL_LOSS == "val_loss"
    assert tune_spaces.loss_metric({"eval_every": 10}) == "val_loss"
    assert tune_spaces.loss_metric({"eval_every": 0}) == tune_spaces.TRAIN_LOSS == "loss"
    assert tune_spaces.ranking(tune_spaces.load("lr"), tune_spaces.load("lr").param_space()) == ("val_loss", "min")


def test_trial_reports_every_step_carrying_the_metric_and_stops_its_job_when_pruned(tmp_path, monkeypatch):
    import ray.tune

    from app.jobs.job import TrainJob
    from app.jobs.launch import STOP_JOB

    job = TrainJob(name="lr-trial", steps=40, storage_path=str(tmp_path), data_dir=str(tmp_path), tracking_uri="none")
    settings = trial.TrialSettings(study="lr", tracking_uri="none", train_storage_path=str(tmp_path),
                                   data_dir=str(tmp_path), parent_run_id=None, use_gpu=False,
                                   cpus_per_worker=None, metric="val_loss")
    reported = []

    def report(metrics):
        if metrics["step"] == 4:
            raise SystemExit(0)  # what Tune's report does once the scheduler stopped the trial
        reported.append(metrics)

    monkeypatch.setattr(ray.tune, "report", report)
    reporter = trial.StepReporter(settings, job)
    assert reporter({"step": 1, "loss": 5.0, "attempt": "ab12"}) is None  # no val_loss at this step: not reported
    assert reporter({"step": 2, "loss": 4.0, "val_loss": 4.5, "attempt": "ab12"}) is None
    assert reported == [{"step": 2, "loss": 4.0, "val_loss": 4.5}] and reporter.pruned_tags() == {}
    assert reporter({"step": 4, "loss": 3.0, "val_loss": 3.9}) == STOP_JOB  # the job stops after this step
    assert reporter({"step": 5, "loss": 2.9, "val_loss": 3.8}) is None and len(reported) == 1  # nothing more
    assert reporter.pruned_tags() == {"pruned_at_step": 4}  # the step whose report Tune stopped it at
    # the end-of-trial report: the summary, the newest val_loss, the steps as ASHA's time axis
    final = trial.trial_metrics({"steps": 40, "final_loss": 3.1, "tokens_per_s": 9.0, "name": "x"}, "val_loss",
                                {"step": 40, "val_loss": 3.3, "loss": 3.0})
    assert (final["val_loss"], final["step"], final["final_loss"]) == (3.3, 40, 3.1)
    assert trial.trial_metrics({"steps": 40, "final_loss": 3.1}, "loss")["loss"] == 3.1
    with pytest.raises(RuntimeError, match="reported no val_loss"):
        trial.trial_metrics({"steps": 40, "final_loss": 3.1, "name": "x"}, "val_loss")


def test_a_stopped_trial_waits_for_its_function_to_return():
    """Tune's ``stop`` of a trial runs ``cleanup``: ours waits (up to the grace) for the trial
    function, which stops its Train job, instead of letting the process exit under it."""
    import threading

    from ray.train._internal import session as train_session

    ended = threading.Event()
    cls = trial.stopping_trainable(lambda config: None, stop_grace_s=5)

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
    cls = trial.stopping_trainable(lambda config: None, stop_grace_s=30)
    fake = Session()
    fake.training_thread.start()
    try:
        train_session._session = fake
        reused = cls.reset_config(object.__new__(cls), {})
    finally:
        train_session._session = None
    assert reused == "reset by Ray Tune" and not fake.training_thread.is_alive()
    assert fake.finished and set(fake.finished) == {trial.REUSE_POLL_S}


def test_local_ray_train_settings_leave_the_users_own_alone():
    assert ray_start.local_train_env({}) == ray_start.LOCAL_RAY_TRAIN_ENV
    assert set(ray_start.LOCAL_RAY_TRAIN_ENV) <= _ray_train_propagated()  # Ray Train hands them on to its workers
    mine = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "3"}
    assert ray_start.local_train_env(mine) == {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}


def test_a_training_run_on_embedded_ray_gets_the_local_settings_and_a_cluster_keeps_its_own(monkeypatch):
    """`mpipemoe train` starting its own local Ray gives its Train job the settings a sweep's
    trials get (each job start, checkpoint report and end waits for the controller's check);
    joining a cluster (--address) leaves Ray's defaults."""
    ray = pytest.importorskip("ray")
    from app.jobs.job import TrainJob

    calls: list[dict] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.delenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", raising=False)
    monkeypatch.setenv("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "1")  # the user's own: kept
    assert ray_start.init_ray(TrainJob(), address=None) is True
    assert ray_start.init_ray(TrainJob(), address="10.0.0.1:6379") is True
    embedded, cluster = calls
    assert embedded["runtime_env"] == {"env_vars": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}}
    assert "runtime_env" not in cluster


def _ray_train_propagated() -> set:
    from ray.train.v2._internal.constants import ENV_VARS_TO_PROPAGATE

    return set(ENV_VARS_TO_PROPAGATE)


def test_pruned_trials_and_the_best_one_are_named(tmp_path):
    from types import SimpleNamespace as Result

    results = [Result(config={"lr": 1e-3, "steps": 40}, metrics={"step": 40, "steps": 40, "loss": 3.0}, error=None),
               Result(config={"lr": 1e-1, "steps": 40}, metrics={"step": 10, "loss": 5.5}, error=None),
               Result(config={"lr": 3e-3, "steps": 40}, metrics={"step": 40, "steps": 40, "loss": 2.5}, error=None),
               Result(config={"lr": 3e-2, "steps": 40}, metrics={}, error=RuntimeError("x"))]
    counts = study_results.tally(results, "loss", {"steps": 40})
    assert (counts.pruned, counts.errored, counts.finished, counts.unfinished) == (1, 1, 3, 0)
    assert study_results.best_trial(results, "loss", "min").config["lr"] == 3e-3
    assert study_results.best_trial(results, "loss", "max").config["lr"] == 1e-1
    table = study_results.format_results(results, "loss", 40).splitlines()
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
    from app.reports import report
    from app.tracking.store import client

    parser = argparse.ArgumentParser()
    sweep_command.add_arguments(parser)  # every option's default, as `mpipemoe sweep smoke` gets them
    args = parser.parse_args(["smoke", "--search", "grid", "--scheduler", "fifo"])
    vars(args).update({k: sweep_dirs[k] for k in ("storage_path", "tracking_uri", "data_dir")})
    assert sweep_command.run(args) == 0
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
    assert report.report_from_store(str(out), ["smoke"], sweep_dirs["tracking_uri"]) == 0
    assert str(out / "report.md") in capsys.readouterr().out
    text = (out / "report.md").read_text()
    png = out / "speedup_memory.png"
    assert png.read_bytes().startswith(PNG_MAGIC) and png.stat().st_size > 1000
    assert "](speedup_memory.png)" in text
    assert "| train | tiny-gpt | 256 | 2 | cpu/float32 | fastmoe |" in text
    # the study's own section: an engine study is ranked by time and memory
    assert "Study `smoke` (experiment smoke)" in text and "Ranking (fastest first; `*`: on the time/memory" in text
    assert "| engine=fastmoe |" in text and (out / "study_smoke_smoke_front.png").read_bytes().startswith(PNG_MAGIC)


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
    counts = study_results.tally(first)
    assert (counts.errored, counts.finished) == (0, 1) and counts.unfinished >= 1  # only mpipemoe finished
    assert log.read_text().split() == ["mpipemoe", "fastmoe"]

    second = sweep.run_study("smoke", **common)  # same storage path: Tuner.restore
    assert len(second) == 3 and not any(r.error for r in second)
    assert all(r.metrics["tokens_per_s"] == 1.0 for r in second)
    starts = log.read_text().split()
    assert starts.count("mpipemoe") == 1  # finished before the interruption: not run again
    assert starts.count("fastmoe") == 2 and starts.count("fastermoe") == 1
    assert study_results.tally(second).finished == 3 and not study_results.tally(second).errored

    from app.tracking.store import client  # one parent run, reopened by the resume and closed again

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
    log = (study_results.format_results(results, "val_loss", 40)
           + "\nBest trial (lowest val_loss): lr=0.003 val_loss 2.51; 1 of 2 trials pruned by asha\n")
    made = tool.record(log, command="mpipemoe sweep lr")
    assert (made["trials"], made["pruned"], made["finished"], made["pruned_at"]) == (2, 1, 1, {"pruned@10": 1})
    assert made["best"] == {"lr": 3e-3, "val_loss": 2.51, "status": "ok"}
    assert [t["status"] for t in made["per_trial"]] == ["ok", "pruned@10"]


# ---------------------------------------------------------------- study files, overrides, ranking

WSD_SPACE_TOML = """
description = "lr x weight decay over wsd"
metric = "val_loss"
mode = "min"
search = "random"
scheduler = "asha"
num_samples = 4

[space]
lr = {loguniform = [1e-4, 1e-2]}
weight_decay = {choice = [0.0, 0.1]}
lr_schedule = "wsd"
steps = 8
num_workers = 1
"""


def test_a_toml_study_file_gives_tune_domains_metric_search_and_scheduler(tmp_path):
    from ray.tune.search.sample import Categorical, Float

    path = tmp_path / "lr_wd.toml"
    path.write_text(WSD_SPACE_TOML)
    study = tune_spaces.load(str(path))
    space = sweep.study_space(study, study.SEARCH)
    assert isinstance(space["lr"], Float) and (space["lr"].lower, space["lr"].upper) == (1e-4, 1e-2)
    assert isinstance(space["weight_decay"], Categorical) and space["weight_decay"].categories == [0.0, 0.1]
    assert (space["lr_schedule"], space["checkpoint_every"]) == ("wsd", 0)
    assert tune_spaces.ranking(study, space) == ("val_loss", "min")
    assert (study.SEARCH, study.SCHEDULER, study.NUM_SAMPLES) == ("random", "asha", 4)
    assert "optuna" in study.SEARCHES and tune_spaces.study_name(str(path)) == "lr_wd"
    yaml_path = tmp_path / "grid.yaml"
    yaml_path.write_text("description: d\nspace:\n  partitions: {grid: [1, 2]}\n  steps: 4\n")
    grid = tune_spaces.load(str(yaml_path))
    assert grid.param_space()["partitions"] == {"grid_search": [1, 2]} and grid.SEARCHES == ("grid", "random")
    assert tune_spaces.ranking(grid, grid.param_space()) == ("tokens_per_s", "max")


def test_a_python_study_file_outside_the_package(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text("DESCRIPTION = 'mine'\nRANK_BY = 'loss'\n"
                    "def param_space(search='grid'):\n    return {'lr': 0.01, 'eval_every': 0, 'steps': 3}\n")
    study = tune_spaces.load(str(path))
    assert tune_spaces.ranking(study, study.param_space()) == ("loss", "min")
    (tmp_path / "empty.py").write_text("X = 1\n")
    with pytest.raises(ValueError, match="defines no DESCRIPTION"):
        tune_spaces.load(str(tmp_path / "empty.py"))


@pytest.mark.parametrize("text, match", [
    ("space = {lr = {normal = [0, 1]}}", r"space.lr = \{'normal': \[0, 1\]\} is invalid: give a constant or one of"),
    ("description = 'x'", "has no \\[space\\] table"),
    ("metrc = 'x'\n[space]\nlr = 1", r"unknown top-level key\(s\) \['metrc'\]"),
    ("[space\nlr = 1", "not valid TOML"),
])
def test_bad_study_files_are_refused_naming_the_entry(tmp_path, text, match):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        tune_spaces.load(str(path))


def test_overrides_set_any_train_option_as_a_constant_or_a_grid():
    assert sweep.parse_overrides(["partitions=1,2,auto", "lr=3e-3", "shard-dense=true", "strategy=none"]) == {
        "partitions": {"grid_search": [1, 2, "auto"]}, "lr": 3e-3, "shard_dense": True, "strategy": "none"}
    with pytest.raises(ValueError, match="'partition' is not a train option: use one of"):
        sweep.parse_overrides(["partition=2"])
    with pytest.raises(ValueError, match="the sweep sets name itself"):
        sweep.parse_overrides(["name=x"])
    with pytest.raises(ValueError, match="give KEY=VALUE"):
        sweep.parse_overrides(["lr"])
    module = tune_spaces.load("granularity")
    space = sweep.study_space(module, "grid", {"preset": "tiny-gpt", "num_workers": 2, "steps": 6,
                                               "partitions": {"grid_search": [1, "auto"]}})
    assert (space["preset"], space["num_workers"], space["partitions"]) == ("tiny-gpt", 2, {"grid_search": [1, "auto"]})
    assert space["strategy"] == {"grid_search": ["none", "S1", "S2", "S3", "S4", "auto"]}  # jointly with n
    with pytest.raises(ValueError, match="num_workers' must be a constant"):
        sweep.study_space(module, "grid", {"num_workers": {"grid_search": [1, 2]}})


def test_the_command_line_overrides_reach_the_space():
    import argparse as argparse_lib

    parser = argparse_lib.ArgumentParser()
    sweep_command.add_arguments(parser)
    args = parser.parse_args(["granularity", "--preset", "tiny-gpt", "--num-workers", "2", "--steps", "6",
                              "--batch-size", "4", "--set", "partitions=1,auto", "--memory-cap-gib", "1.5"])
    assert sweep_command.overrides_of(args) == {"preset": "tiny-gpt", "num_workers": 2, "steps": 6, "batch_size": 4,
                                        "partitions": {"grid_search": [1, "auto"]}}
    assert (args.space, args.space_file, args.memory_cap_gib, args.search) == ("granularity", None, 1.5, None)


def _row(n, strategy, rate, peak_mib, **extra):
    return ({"partitions": n, "strategy": strategy, "steps": 6},
            {"tokens_per_s": rate, "settled_peak_memory_bytes": peak_mib * 2**20, **extra}, None)


def test_settings_merge_their_repeats_and_rank_on_the_time_memory_front():
    from app.tracking import sweep_rank

    nan = float("nan")
    rows = [_row(1, "none", 100.0, 500), _row(1, "none", 120.0, 510),   # two repeats: median 110
            _row(2, "none", 150.0, 600), _row(2, "none", 130.0, 590),   # median 140, the fastest
            _row(2, "S1", 90.0, 400), _row(2, "S1", 95.0, 400),         # leanest
            _row(4, "S1", 80.0, 450), _row(4, "S1", 85.0, 450),         # slower and fatter than (2, S1)
            ({"partitions": 1000, "strategy": "none", "steps": 6},
             {"tokens_per_s": nan, "outcome": "refused", "reason": "partitions: too many"}, None),
            ({"partitions": 8, "strategy": "none", "steps": 6}, {}, "RuntimeError: out of memory")]
    points = sweep_rank.points(rows)
    assert [p.label for p in points][:2] == ["partitions=1 strategy=none", "partitions=2 strategy=none"]
    first = points[0]
    assert (first.samples, first.tokens_per_s, first.tokens_per_s_low, first.tokens_per_s_high) == (2, 110.0, 100.0, 120.0)
    assert first.peak_bytes == 510 * 2**20  # the largest settled peak of the repeats
    front = sweep_rank.pareto_front(points)
    assert [p.label for p in front] == ["partitions=2 strategy=none", "partitions=1 strategy=none",
                                        "partitions=2 strategy=S1"]
    assert sweep_rank.fastest_under(points, 550 * 2**20).label == "partitions=1 strategy=none"
    assert sweep_rank.fastest_under(points, 420 * 2**20).label == "partitions=2 strategy=S1"
    assert sweep_rank.fastest_under(points, 100 * 2**20) is None
    assert [p.outcome for p in points[-2:]] == ["refused", "failed"]
    text = sweep_rank.format_ranking(points, cap_gib=550 / 1024).splitlines()
    assert text[1].split()[:2] == ["partitions=2", "strategy=none"] and "140 [130-150] x2" in text[1]
    assert text[-4].startswith("partitions=1000") and text[-4].endswith("refused: partitions: too many")
    assert text[-3].startswith("partitions=8") and text[-3].endswith("failed: RuntimeError: out of memory")
    assert text[-2] == ("Pareto front (time against settled peak memory, fastest first): partitions=2 strategy=none, "
                        "partitions=1 strategy=none, partitions=2 strategy=S1")
    assert text[-1] == "Fastest under 0.537109 GiB: partitions=1 strategy=none (110 tokens/s, settled peak 510.0 MiB)"


def test_the_final_table_is_sorted_by_the_metric_and_shows_refusals():
    from types import SimpleNamespace as Result

    results = [Result(config={"lr": 1e-3}, metrics={"val_loss": 3.0, "tokens_per_s": 1.0, "step": 8, "steps": 8},
                      error=None),
               Result(config={"lr": 1e-1}, metrics={"val_loss": float("nan"), "outcome": "refused", "step": 0},
                      error=None),
               Result(config={"lr": 3e-3}, metrics={"val_loss": 2.5, "tokens_per_s": 1.0, "step": 8, "steps": 8},
                      error=None)]
    rows = [line.split() for line in study_results.format_results(results, "val_loss", 8, "min").splitlines()[1:]]
    assert [(row[0], row[-1]) for row in rows] == [("0.003", "ok"), ("0.001", "ok"), ("0.1", "refused")]
    rows = [line.split() for line in study_results.format_results(results, "val_loss", 8, "max").splitlines()[1:]]
    assert [row[0] for row in rows] == ["0.001", "0.003", "0.1"]


def test_step_reports_put_the_metric_first_for_tunes_live_table():
    reported = trial.metric_first({"loss": 3.0, "lm_loss": 2.9, "aux_loss": 0.1, "lr": 1e-3, "val_loss": 3.1,
                                   "step": 10, "tokens_per_s": 9.0}, "val_loss")
    assert list(reported)[:3] == ["val_loss", "step", "tokens_per_s"] and len(reported) == 7


# ---------------------------------------------------------------- tier 3: local Ray, light trials

def _erroring_trial(log: Path, fail_marker: Path):
    """A light trainable (no Ray Train): logs its start and end times; errors while
    ``fail_marker`` exists, else reports a throughput."""

    def trial(config: dict, *, settings) -> None:
        from ray import tune

        with open(log, "a") as f:
            f.write(f"start {time.time()} {config['engine']}\n")
        time.sleep(1.0)
        with open(log, "a") as f:
            f.write(f"end {time.time()} {config['engine']}\n")
        if fail_marker.exists():
            raise RuntimeError("this trial errs")
        tune.report({"tokens_per_s": 1.0})

    return trial


def _most_at_once(log: Path) -> int:
    events = sorted((float(t), 1 if kind == "start" else -1) for kind, t, _ in
                    (line.split() for line in log.read_text().splitlines()))
    running = most = 0
    for _, change in events:
        running += change
        most = max(most, running)
    return most


@pytest.mark.ray
def test_a_study_with_three_errored_trials_resumes_under_its_cap_and_ends(ray_local, sweep_dirs, tmp_path):
    """Tuner.restore(resume_errored=True) starts every errored trial at once; the trial gate
    keeps the plan's cap (here 1), so the resumed study runs them one by one and ends."""
    log, marker = tmp_path / "starts.txt", tmp_path / "fail"
    marker.touch()
    common = dict(storage_path=sweep_dirs["storage_path"], tracking_uri=sweep_dirs["tracking_uri"],
                  data_dir=sweep_dirs["data_dir"], max_concurrent=1, trainable=_erroring_trial(log, marker),
                  stop_grace_s=0)
    first = sweep.run_study("smoke", **common)
    assert (study_results.tally(first).errored, study_results.tally(first).finished) == (3, 0)
    marker.unlink()
    log.write_text("")
    second = sweep.run_study("smoke", **common)  # Tuner.restore with the errored trials
    assert (study_results.tally(second).errored, study_results.tally(second).finished) == (0, 3)
    assert sorted(line.split()[2] for line in log.read_text().splitlines() if line.startswith("start")) == [
        "fastermoe", "fastmoe", "mpipemoe"]
    assert _most_at_once(log) == 1

    from app.tracking.store import client

    mlflow = client(sweep_dirs["tracking_uri"])
    parents = mlflow.search_runs([mlflow.get_experiment_by_name("smoke").experiment_id])
    assert [(r.info.status, r.data.metrics["trials_at_once"]) for r in parents] == [("FINISHED", 1.0)]


@pytest.mark.ray
def test_refused_settings_are_results_with_mlflow_runs(ray_local, sweep_dirs, capsys):
    """`mpipemoe sweep granularity` from the command line alone on CPU, every setting refused
    by its trial before any Train job starts (partitions split by peers must divide the 2
    workers, known once Ray says the trials run on CPU): each is a FAILED MLflow run with the
    study's tags, outcome and reason, and the ranking lists it. None ran, so the study FAILED:
    exit 1, its tally and first reason printed, its MLflow run FAILED, no trial counted
    finished or pruned."""
    from app.tracking.store import client

    parser = argparse.ArgumentParser()
    sweep_command.add_arguments(parser)
    args = parser.parse_args(["granularity", "--preset", "tiny-gpt", "--num-workers", "2", "--steps", "2",
                              "--batch-size", "1", "--set", "partitions=3", "--set", "split=peers",
                              "--set", "strategy=none,S1", "--num-samples", "1", "--name", "gran-cpu",
                              "--experiment", "mine", "--memory-cap-gib", "1",
                              *[f"--{k.replace('_', '-')}={sweep_dirs[k]}" for k in ("storage_path", "tracking_uri",
                                                                                    "data_dir")]])
    assert sweep_command.run(args) == 1
    out, err = capsys.readouterr()
    assert re.search(r"^strategy=none +- +- +- +refused: TrainJob.partitions=3 is invalid", out, flags=re.M), out
    assert "Pareto front (time against settled peak memory, fastest first): no setting measured" in out
    assert "Fastest under 1 GiB: no setting fits" in out
    assert "Study 'gran-cpu': 2 trials: 2 refused" in out
    assert re.search(r"study 'gran-cpu' FAILED: none of its 2 trials ran \(2 trials: 2 refused\); first reason: "
                     r"TrainJob.partitions=3 is invalid", err), err
    mlflow = client(sweep_dirs["tracking_uri"])
    runs = mlflow.search_runs([mlflow.get_experiment_by_name("mine").experiment_id])
    trials = sorted((r for r in runs if run_kind(r.data.tags) == "train"), key=lambda r: r.data.params["strategy"])
    assert [(r.info.status, r.data.params["strategy"], r.data.tags["study"], r.data.tags["outcome"])
            for r in trials] == [("FAILED", "S1", "gran-cpu", "refused"), ("FAILED", "none", "gran-cpu", "refused")]
    assert all(r.data.tags["trial_id"] and "divisor" in r.data.tags["reason"] for r in trials)
    assert all(r.data.tags["mlflow.parentRunId"] for r in trials)
    (parent,) = [r for r in runs if run_kind(r.data.tags) == "study"]
    assert parent.info.status == "FAILED"
    assert {k: parent.data.metrics[k] for k in ("trials", "trials_refused", "trials_failed", "trials_finished",
                                                "trials_pruned")} == {"trials": 2, "trials_refused": 2,
                                                                      "trials_failed": 0, "trials_finished": 0,
                                                                      "trials_pruned": 0}
    assert os.path.isdir(os.path.join(sweep_dirs["storage_path"], "gran-cpu"))


def test_hold_steps_are_the_first_metric_steps_at_each_rung():
    assert tune_spaces.asha_rungs(8) == [2, 6] and tune_spaces.asha_rungs(3) == [1, 3]
    assert tune_spaces.hold_steps([1, 3], 3, "loss", 0) == (1,)  # the last step needs no wait
    assert tune_spaces.hold_steps([10, 30], 40, "val_loss", 10) == (10, 30)
    assert tune_spaces.hold_steps([10, 30], 40, "val_loss", 4) == (12, 32)   # evaluations at 12 and 32
    assert tune_spaces.hold_steps([10, 30], 40, "val_loss", 25) == (25,)     # 50 is past the end
    assert tune_spaces.hold_steps([10, 30], 40, "val_loss", 0) == ()         # no validation loss
    assert tune_spaces.hold_steps([2, 6], 8, "loss", 0) == (2, 6)


def test_the_stop_flag_answers_a_held_step():
    import asyncio

    from workers.control import StopFlag

    async def scenario():
        flag = StopFlag()
        waiting = asyncio.ensure_future(flag.verdict(3, timeout_s=5))
        await asyncio.sleep(0.05)
        assert not waiting.done()              # rank 0 waits for the driver's decision
        await flag.decide(3, False)
        go_on = await waiting
        silent = await flag.verdict(6, timeout_s=0.05)   # no answer yet (the ranks ask again, then go on)
        await flag.decide(6, True)
        return go_on, silent, await flag.verdict(6), await flag.wait()

    assert asyncio.run(scenario()) == (False, None, True, True)


@pytest.mark.ray
def test_a_pruned_trial_ends_at_its_rung_and_its_mlflow_run_is_killed(ray_local, sweep_dirs, monkeypatch):
    """A trial ASHA stops at its rung (step 3 here) trains no further step: its workers wait at
    the rung for Tune's decision (which takes a while: 1 s here) instead of training on. Its
    MLflow run ends KILLED with ``pruned_at_step``."""
    import ray.tune

    from app.tracking.store import client, metric_history

    seen = []

    def report(metrics):
        seen.append(metrics["step"])
        if metrics["step"] == 3:
            time.sleep(1.0)        # Tune's controller deciding (tiny-gpt steps take milliseconds)
            raise SystemExit(0)    # the scheduler stopped the trial

    monkeypatch.setattr(ray.tune, "report", report)
    monkeypatch.setattr(ray.tune, "get_context", lambda: type("Context", (), {"get_trial_id": lambda self: "t0"})())
    settings = trial.TrialSettings(study="held", tracking_uri=sweep_dirs["tracking_uri"],
                                   train_storage_path=sweep_dirs["storage_path"], data_dir=sweep_dirs["data_dir"],
                                   parent_run_id=None, use_gpu=False, cpus_per_worker=0.9, metric="loss",
                                   rungs=(2, 3))
    trial.train_trial({"preset": "tiny-gpt", "steps": 8, "num_workers": 1, "batch_size": 2, "seq_len": 32,
                       "eval_every": 0, "checkpoint_every": 0, "log_every": 1}, settings=settings)
    assert seen == [1, 2, 3]
    mlflow = client(sweep_dirs["tracking_uri"])
    [run] = mlflow.search_runs([mlflow.get_experiment_by_name("held").experiment_id])
    assert (run.info.status, run.data.tags["pruned_at_step"], run.data.tags["outcome"]) == ("KILLED", "3", "pruned")
    assert [step for step, _ in metric_history(sweep_dirs["tracking_uri"], run.info.run_id, "loss")] == [1, 2, 3]


def test_an_auto_setting_names_the_split_it_settled_on():
    from app.tracking import sweep_rank

    auto = {"partitions": "auto", "strategy": "none", "steps": 6}
    rows: list[tuple[dict, dict, object]] = [
        (auto, {"tokens_per_s": 100.0, "peak_memory_bytes": 2**20, "partitions": 8, "strategy": "none",
                "split": "peers"}, None),
        (auto, {"tokens_per_s": 90.0, "peak_memory_bytes": 2**20, "partitions": 4, "strategy": "none",
                "split": "tokens"}, None)]
    point, = sweep_rank.points(rows)
    assert point.chosen == "n=4 none; n=8:peers none"


# ---------------------------------------------------------------- checked before Ray starts

def _sweep_cli(argv: list[str], tmp_path, capsys, monkeypatch) -> tuple[int, str]:
    """`mpipemoe sweep ARGV` whose study may not start (run_study raises if reached): (rc, stderr)."""
    def no_study(*args, **kwargs):
        raise AssertionError("the study started")

    monkeypatch.setattr(sweep, "run_study", no_study)
    parser = argparse.ArgumentParser()
    sweep_command.add_arguments(parser)
    args = parser.parse_args([*argv, "--storage-path", str(tmp_path / "results"), "--tracking-uri", "none"])
    status = sweep_command.run(args)
    return status, capsys.readouterr().err.strip()


@pytest.mark.parametrize("argv, message", [
    (["granularity", "--set", "partitions=0"],
     "every trial would be refused: TrainJob.partitions=0 is invalid: give 'auto' or an integer >= 1"),
    (["granularity", "--set", "strategy=S9"], "every trial would be refused: TrainJob.strategy='S9' is invalid: "
                                              "choose one of auto, none, S1, S2, S3, S4"),
    (["granularity", "--set", "strategy=S1,S9"], "every trial with strategy='S9' would be refused: "
                                                 "TrainJob.strategy='S9' is invalid"),
    (["granularity", "--preset", "tiny-gpt", "--batch-size", "1", "--set", "partitions=100000"],
     "every trial would be refused: TrainJob.partitions=100000 is invalid: a worker's micro-batch has 512 tokens"),
    (["lr", "--num-samples", "0"], "--num-samples 0 is invalid: give an integer >= 1"),
    (["smoke", "--memory-cap-gib", "-1"], "--memory-cap-gib -1.0 is invalid: give a number of GiB > 0"),
    (["smoke", "--memory-cap-gib", "nan"], "--memory-cap-gib nan is invalid"),
    (["smoke", "--memory-cap-gib", "0"], "--memory-cap-gib 0.0 is invalid"),
    (["smoke", "--set", "data_shards=2"], "data_shards is set by a resume from a recorded run, not an option"),
    (["smoke", "--name", "../escape"], "--name '../escape' is not a run name: it is a path"),
])
def test_bad_values_and_names_are_refused_before_ray_starts(argv, message, tmp_path, capsys, monkeypatch):
    status, err = _sweep_cli(argv, tmp_path, capsys, monkeypatch)
    (line,) = err.splitlines()
    assert status == 2 and message in line, line
    assert not (tmp_path / "escape").exists() and not (tmp_path / "results").exists()


@pytest.mark.parametrize("top_level, lr, message", [
    ("", '"fast"', "every trial would be refused: TrainJob.lr='fast' is invalid: give a finite number > 0"),
    ('num_samples = "many"', "1e-3", "num_samples = 'many' is invalid: give an integer >= 1"),
    ('metric = "bogus"', "1e-3", "metric='bogus' is not a number the trials report: choose one of loss,"),
    ('metric = "loss"\nmode = "up"', "1e-3", "mode='up' is invalid: choose min or max"),
])
def test_a_study_files_bad_values_metric_and_mode_are_refused_before_ray_starts(top_level, lr, message, tmp_path,
                                                                                capsys, monkeypatch):
    study = tmp_path / "mine.toml"
    study.write_text(f'description = "x"\n{top_level}\n[space]\nlr = {lr}\nnum_workers = 1\nsteps = 2\n')
    status, err = _sweep_cli(["--space", str(study)], tmp_path, capsys, monkeypatch)
    (line,) = err.splitlines()
    assert status == 2 and message in line, line


def test_a_python_study_file_that_fails_names_the_file_in_one_line(tmp_path, capsys, monkeypatch):
    broken = tmp_path / "broken.py"
    broken.write_text('DESCRIPTION = "x"\nimport no_such_module_here\n')
    status, err = _sweep_cli(["--space", str(broken)], tmp_path, capsys, monkeypatch)
    assert status == 2 and err == (f"mpipemoe sweep {broken}: --space {broken}: the study file failed to import "
                                   f"(line 2): ModuleNotFoundError: No module named 'no_such_module_here': fix the "
                                   f"file (python {broken} shows the traceback)")
    failing = tmp_path / "failing.py"
    failing.write_text('DESCRIPTION = "x"\n\ndef param_space(search="grid"):\n    return {"lr": 1 / 0}\n')
    status, err = _sweep_cli(["--space", str(failing)], tmp_path, capsys, monkeypatch)
    (line,) = err.splitlines()
    assert status == 2 and f"{failing}: param_space('grid') failed: ZeroDivisionError: division by zero" in line


def test_a_study_named_like_a_training_run_is_refused(tmp_path, capsys, monkeypatch):
    run = tmp_path / "results" / "my-run"
    run.mkdir(parents=True)
    (run / "mpipemoe_job.json").write_text("{}")
    status, err = _sweep_cli(["smoke", "--name", "my-run"], tmp_path, capsys, monkeypatch)
    assert status == 2 and f"--name 'my-run' is the training run in {run}: give the study another --name" in err
    assert sorted(p.name for p in run.iterdir()) == ["mpipemoe_job.json"]


def test_a_resume_with_another_space_or_ranking_is_refused_naming_the_change(tmp_path, capsys, monkeypatch):
    """The study's record beside Tune's state: a run of the same --name with another space (a --set,
    another study file) is refused in one line; the same space resumes."""
    from app.jobs.study_checks import write_study_record

    storage = tmp_path / "results"
    first = sweep.prepare_study("granularity", storage_path=str(storage))
    assert not first.resumes
    write_study_record(first.experiment_path, first.record)
    (Path(first.experiment_path) / "tuner.pkl").write_bytes(b"")  # what Tuner.can_restore looks for
    again = sweep.prepare_study("granularity", storage_path=str(storage))
    assert again.resumes and again.record == first.record
    status, err = _sweep_cli(["granularity", "--set", "strategy=S9"], tmp_path, capsys, monkeypatch)
    (line,) = err.splitlines()
    assert status == 2 and line.startswith(f"mpipemoe sweep granularity: study 'granularity' in "
                                           f"{first.experiment_path} was started with another search space or "
                                           f"ranking (strategy: ")
    assert '-> "S9"' in line and line.endswith("give a new --name for this one, or run it as it was started to "
                                               "resume it")
    other = tmp_path / "other.toml"
    other.write_text('description = "x"\nrank_by = "loss"\n[space]\nlr = 1e-3\nnum_workers = 1\nsteps = 2\n')
    status, err = _sweep_cli(["--space", str(other), "--name", "granularity"], tmp_path, capsys, monkeypatch)
    assert status == 2 and "metric: \"tokens_per_s\" -> \"val_loss\"; mode: \"max\" -> \"min\"" in err, err


def test_a_grid_study_runs_its_grid_once_unless_asked_and_sampling_searches_draw_more():
    lr = tune_spaces.load("lr")
    assert tune_spaces.num_samples(lr, "grid") == 1  # the 7 lrs once, not 7 x 12
    assert tune_spaces.num_samples(lr, "optuna") == 12 and tune_spaces.num_samples(lr, "random") == 12
    assert tune_spaces.num_samples(tune_spaces.load("granularity"), "grid") == 2  # repeats: the spread
    assert sweep.prepare_study("lr", storage_path="/nonexistent").record.num_samples == 1
    assert sweep.prepare_study("lr", storage_path="/nonexistent", search="optuna").record.num_samples == 12
    assert sweep.prepare_study("lr", storage_path="/nonexistent", num_samples=3).record.num_samples == 3


def test_failed_and_refused_trials_count_as_neither_finished_nor_pruned_and_fail_a_study_where_none_ran():
    from types import SimpleNamespace as Result

    refused = {"tokens_per_s": float("nan"), "step": 0, "outcome": "refused", "reason": "TrainJob.lr='fast' is bad"}
    failed = {"tokens_per_s": float("nan"), "step": 0, "outcome": "failed", "reason": "non-finite loss"}
    none_ran = [Result(config={"lr": 1e30}, metrics=failed, error=None),
                Result(config={"lr": "fast"}, metrics=refused, error=None)]
    counts = study_results.tally(none_ran, space={"steps": 40})
    assert (counts.finished, counts.pruned, counts.failed, counts.refused, counts.unfinished) == (0, 0, 1, 1, 0)
    assert counts.none_ran and sweep.study_status(counts) == "FAILED"
    assert counts.summary() == "2 trials: 1 refused, 1 failed"
    assert study_results.first_reason(none_ran) == "non-finite loss"
    ok = Result(config={"lr": 1e-3}, metrics={"tokens_per_s": 5.0, "step": 40, "steps": 40}, error=None)
    some = study_results.tally([ok, *none_ran], space={"steps": 40})
    assert not some.none_ran and sweep.study_status(some) == "FINISHED"  # refusals beside a result are results
    interrupted = study_results.tally([ok, Result(config={}, metrics={}, error=None)])
    assert sweep.study_status(interrupted) == "KILLED"
