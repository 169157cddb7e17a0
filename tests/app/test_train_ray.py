"""Ray local-cluster tests of ``mpipemoe train`` (tier 3: real Ray Train, gloo, MLflow).

Short 2-worker runs on 2 cores; the first five are shared by the assertions:
- ``compared``: tiny-gpt for N steps with each engine under one parent MLflow run;
- ``resumed``: the mpipemoe job again as K steps, then ``mpipemoe train --resume`` up to N steps;
- a diverging run (huge lr) that must stop with an error naming the step;
- a NaN loss at one step, skipped under ``on_nonfinite_loss="skip"``;
- a run whose last worker dies mid-run and is restarted from its checkpoint;
- a run whose last worker stops participating: the job ends at the collective timeout;
- more workers than the cluster holds: refused before any worker starts.
Partitions and strategy are fixed so runs are deterministic: resumed and restarted runs
give the straight run's losses exactly.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import pytest

from app import cli
from app.jobs.job import TrainJob
from app.jobs.launch import run_job
from app.tracking.store import client, metric_history
from app.commands.train import add_arguments, run
from app.jobs.compare import compare_engines
from lm.data import prepare_dataset
from lm.model import ENGINES

pytestmark = pytest.mark.ray

N, K = 6, 3


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> TrainJob:
    root = tmp_path_factory.mktemp("train")
    prepare_dataset(root / "data", max_bytes=2**20)  # 1 MiB of stdlib sources
    return TrainJob(preset="tiny-gpt", steps=N, num_workers=2, use_gpu=False, batch_size=8,
                    seq_len=64, lr=3e-3, warmup_steps=1, checkpoint_every=K, seed=7, partitions=2, strategy="S1",
                    data_dir=str(root / "data"), storage_path=str(root / "ray_results"),
                    tracking_uri=f"sqlite:///{root / 'mlflow.db'}", name="cmp", experiment="test-train")


@pytest.fixture(scope="module")
def compared(ray_local, job):
    lines = []
    result = compare_engines(job, list(ENGINES), echo=lines.append)
    result["lines"] = lines
    return result


@pytest.fixture(scope="module")
def resumed(ray_local, job, tmp_path_factory):
    """K steps through the Python API, then the rest as a user would: ``mpipemoe train --resume``."""
    first = run_job(dataclasses.replace(job, name="resume", steps=K), echo=lambda line: None)
    summary_json = tmp_path_factory.mktemp("cli") / "summary.json"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--resume", "resume", "--storage-path", job.storage_path, "--steps", str(N),
                              "--summary-json", str(summary_json)])
    assert run(args) == 0
    return first, json.loads(summary_json.read_text())


def _losses(summary) -> list[float]:
    return [m["loss"] for m in summary["history"]]


def test_each_engine_logs_an_mlflow_run_with_loss_history(compared, job):
    mlflow = client(job.tracking_uri)
    for engine, summary in compared["summaries"].items():
        run = mlflow.get_run(summary["mlflow_run_id"])
        assert run.info.status == "FINISHED"
        assert run.data.tags["mlflow.parentRunId"] == compared["parent_run_id"]
        assert run.data.params["engine"] == engine
        history = metric_history(job.tracking_uri, summary["mlflow_run_id"], "loss")
        assert [step for step, _ in history] == list(range(1, N + 1))
        assert [value for _, value in history] == pytest.approx(_losses(summary))
        assert summary["tokens_per_s"] > 0 and summary["peak_memory_bytes"] > 0
    parent = mlflow.get_run(compared["parent_run_id"]).data.metrics
    assert parent["speedup_vs_fastmoe"] > 0 and parent["memory_ratio_vs_fastermoe"] > 0
    assert any(line.startswith("engine") for line in compared["lines"])  # the comparison table


def test_loss_falls_on_real_text(compared):
    losses = _losses(compared["summaries"]["mpipemoe"])
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.3, losses


def test_engines_give_the_same_loss_curve(compared):
    reference = _losses(compared["summaries"]["mpipemoe"])
    for engine in ("fastmoe", "fastermoe"):
        assert _losses(compared["summaries"][engine]) == pytest.approx(reference, rel=1e-3), engine


def test_resume_continues_step_count_and_data_position(compared, resumed, job):
    first, second = resumed
    assert [m["step"] for m in first["history"]] == list(range(1, K + 1))
    assert [m["step"] for m in second["history"]] == list(range(K + 1, N + 1))
    straight = _losses(compared["summaries"]["mpipemoe"])
    assert _losses(first) + _losses(second) == straight  # exactly: data position and RNG restored
    meta = json.loads((Path(second["checkpoint_path"]) / "meta.json").read_text())
    assert meta["step"] == N and meta["data_position"] == N and meta["world_size"] == 2
    # The resumed job continues the same MLflow run, whose history covers every step.
    assert second["mlflow_run_id"] == first["mlflow_run_id"]
    steps = [s for s, _ in metric_history(job.tracking_uri, second["mlflow_run_id"], "loss")]
    assert steps == list(range(1, N + 1))
    # --summary-json says what made it: the settings of the resumed job, when, on what.
    assert second["meta"]["job"]["steps"] == N and second["meta"]["job"]["name"] == "resume"
    assert second["meta"]["hardware"].startswith("cpu") and second["meta"]["date"].startswith("20")


def test_resume_on_one_worker_reshards_and_continues_the_data(resumed, job, tmp_path):
    """``--resume NAME --num-workers 1`` of a 2-worker run: one worker holds all experts (DCP
    reshards the checkpoint), reads both data streams' batches (global batch kept) and the loss
    goes on from where the 2-worker run stopped (tests/workers/test_reshard.py checks the
    losses against a run that never changed, on gloo without Ray)."""
    first, second = resumed
    summary_json = tmp_path / "summary.json"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--resume", "resume", "--storage-path", job.storage_path, "--steps", str(N + 1),
                              "--num-workers", "1", "--summary-json", str(summary_json)])
    assert run(args) == 0
    third = json.loads(summary_json.read_text())
    assert [m["step"] for m in third["history"]] == [N + 1]
    assert third["meta"]["job"]["num_workers"] == 1 and third["meta"]["job"]["batch_size"] == 2 * job.batch_size
    meta = json.loads((Path(third["checkpoint_path"]) / "meta.json").read_text())
    assert (meta["world_size"], meta["data_shards"], meta["step"]) == (1, 2, N + 1)
    before = _losses(second)
    assert third["history"][0]["loss"] < before[-1] + 0.1 < _losses(first)[0]  # continues; a fresh model is far above
    assert third["mlflow_run_id"] == first["mlflow_run_id"]


def test_a_wsd_run_extended_on_resume_keeps_its_decayed_rate(ray_local, job, tmp_path):
    """4 wsd steps decaying over the last half (steps 3-4 to --min-lr), then ``--resume --steps 8``:
    the rate stays at --min-lr (the decay is not started again from --lr) and the run's MLflow
    params show the new step target."""
    first = run_job(dataclasses.replace(job, name="wsd", steps=4, lr_schedule="wsd", decay_fraction=0.5,
                                        min_lr=3e-4), echo=lambda line: None)
    assert [m["lr"] for m in first["history"]] == pytest.approx([3e-3, 3e-3, 1.65e-3, 3e-4])
    summary_json = tmp_path / "summary.json"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args(["--resume", "wsd", "--storage-path", job.storage_path, "--steps", "8",
                                  "--summary-json", str(summary_json)])) == 0
    second = json.loads(summary_json.read_text())
    assert [m["lr"] for m in second["history"]] == pytest.approx([3e-4] * 4)
    meta = json.loads((Path(second["checkpoint_path"]) / "meta.json").read_text())
    assert meta["lr_decay_plan"] == {"decay_start": 4, "end": 8, "level": 0.0}
    params = client(job.tracking_uri).get_run(second["mlflow_run_id"]).data.params
    assert (params["steps"], params["segment.2.steps"]) == ("4", "8")


def test_non_finite_loss_fails_fast_naming_the_step(ray_local, job):
    bad = dataclasses.replace(job, name="nan", steps=4, lr=1e30, warmup_steps=0, grad_clip=0.0)
    # (the loss, or the MoE layers' input once the weights are NaN: named with its ranks)
    with pytest.raises(RuntimeError, match=r"(non-finite loss at step [23]|NaN or Inf in the MoE layer input of "
                                           r"rank\(s\) 0, 1 at step [23]|StepError: step [23] failed)"):
        run_job(bad, echo=lambda line: None)
    runs = client(job.tracking_uri).search_runs(
        [client(job.tracking_uri).get_experiment_by_name(job.experiment).experiment_id],
        filter_string="tags.ray_train_name = 'nan'")
    assert runs[0].info.status == "FAILED" and "step" in runs[0].data.tags["error"]


def _mlflow_run(job, name):
    mlflow = client(job.tracking_uri)
    experiment = mlflow.get_experiment_by_name(job.experiment).experiment_id
    (found,) = mlflow.search_runs([experiment], filter_string=f"tags.ray_train_name = '{name}'")
    return found


def test_nan_loss_is_skipped_under_the_skip_policy(ray_local, job):
    lines = []
    skip = dataclasses.replace(job, name="skip", steps=4, on_nonfinite_loss="skip")
    summary = run_job(skip, echo=lines.append, extra_config={"fault": {"kind": "nan_loss", "step": 2, "rank": 0}})
    assert summary["skipped_steps"] == [2] and summary["steps"] == 4
    assert [m["skipped"] for m in summary["history"]] == [0, 1, 0, 0]
    assert all(math.isfinite(m["loss"]) for m in summary["history"] if not m["skipped"])
    assert any("step 2 skipped: non-finite loss (lm_loss=nan" in line for line in lines)
    assert _mlflow_run(job, "skip").info.status == "FINISHED"


def test_killed_worker_is_restarted_from_the_last_checkpoint(ray_local, resumed, job):
    """docs/design.md §8: a worker dying mid-run (after the step-K checkpoint) is restarted by Ray
    Train (FailureConfig), resumes at step K+1 and finishes with the straight run's losses;
    the MLflow run records the restart."""
    lines = []
    summary = run_job(dataclasses.replace(job, name="fault", max_failures=1), echo=lines.append,
                      extra_config={"fault": {"kind": "exit", "step": K + 2}})
    assert summary["restarts"] == 1 and summary["steps"] == N
    assert [m["step"] for m in summary["history"]] == list(range(1, N + 1))
    straight = _losses(resumed[0]) + _losses(resumed[1])  # equal to N steps straight (tested above)
    assert _losses(summary) == straight
    assert any(f"restarted from a checkpoint (1 restart(s)); continuing at step {K + 1}" in line for line in lines)
    recorded = _mlflow_run(job, "fault")
    assert recorded.info.status == "FINISHED" and recorded.data.tags["restarts"] == "1"
    assert recorded.data.metrics["restarts"] == 1
    steps = [s for s, _ in metric_history(job.tracking_uri, summary["mlflow_run_id"], "loss")]
    assert steps == list(range(1, K + 2)) + list(range(K + 1, N + 1))  # steps K+1.. ran twice


def test_stalled_worker_ends_the_job_at_the_collective_timeout(ray_local, job):
    """A worker that stops participating (alive, silent) must not hang the job: the others'
    collectives time out and the job fails with an error naming the cause."""
    stall = dataclasses.replace(job, name="stall", steps=4, collective_timeout_s=3)
    started = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"training job stall failed: .*(stopped participating|timed out|Timed out)"):
        run_job(stall, echo=lambda line: None, extra_config={"fault": {"kind": "stall", "step": 2}})
    # ended by the 3-s collective timeout: the stalled worker sleeps 3600 s and gloo's default
    # timeout is 1800 s, so the bound is far from both and from a loaded machine's start-up
    # (127 s seen in CI for the whole job, workers' start included)
    assert time.perf_counter() - started < 600
    assert _mlflow_run(job, "stall").info.status == "FAILED"


def test_more_workers_than_the_cluster_holds_fail_fast(ray_local, job, capsys):
    """The session's Ray has 2 CPUs: 4 workers of 0.9 CPU never fit. Ray Train would wait
    forever; the job is refused at once, on the command line as one line and status 1."""
    started = time.perf_counter()
    status = cli.main(["train", "--num-workers", "4", "--no-gpu", "--data-dir", job.data_dir,
                       "--storage-path", job.storage_path, "--tracking-uri", "none", "--name", "big"])
    err = capsys.readouterr().err
    assert status == 1 and time.perf_counter() - started < 120  # not Ray Train's wait for resources
    assert err.strip().splitlines() == [
        "mpipemoe train: error: TrainJob.num_workers=4 is invalid: the Ray cluster (1 node(s), 2 CPU) holds "
        "2 worker(s) of 0.9 CPU each; use --num-workers 2 or a smaller --cpus-per-worker, or add nodes "
        "(--debug shows the traceback)"]
