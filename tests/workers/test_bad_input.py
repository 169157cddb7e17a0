"""Tier 1 (no Ray): bad input and bad settings are refused with a message that names the
problem and the fix (docs/design.md §8, issue 7 item 4); on the command line as one line on
stderr, exit status 1, no traceback unless ``--debug``.

The Ray-side cases (NaN/Inf losses in a real run, a cluster too small for the workers,
killed and stalled workers) are in tests/app/test_train_ray.py.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from app import cli
from app.jobs.job import TrainJob
from app.jobs.progress import _MetricsPump, summarize
from app.jobs.preflight import ensure_data
from app.jobs.ray_start import build_trainer, check_resources
from app.commands.train import add_arguments, job_from_args
from lm.data import MANIFEST, Manifest, load_rank_tokens, prepare_dataset
from lm.model import MoETransformer, get_preset
from workers.loop import MAX_SKIPPED_IN_A_ROW, StepError, check_nonfinite_loss


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "small"
    prepare_dataset(out, max_bytes=40_000, row_len=1000)   # 40 rows of 1000 tokens
    return out


def _copy(data_dir: Path, to: Path) -> Path:
    to.mkdir()
    for path in data_dir.iterdir():
        (to / path.name).write_bytes(path.read_bytes())
    return to


def _run_cli(argv: list[str], capsys) -> tuple[int, str]:
    status = cli.main(argv)
    captured = capsys.readouterr()
    return status, captured.err


# ---- unknown names ---------------------------------------------------------------------

@pytest.mark.parametrize("change, message", [
    ({"preset": "gpt-zz"}, "preset='gpt-zz' is unknown: choose one of gpt-s, gpt-xl, bert-l, tiny-gpt"),
    ({"engine": "tutel"}, "TrainJob.engine='tutel' is invalid: choose one of mpipemoe, fastmoe, fastermoe"),
    ({"on_nonfinite_loss": "ignore"}, "TrainJob.on_nonfinite_loss='ignore' is invalid: choose halt or skip"),
])
def test_unknown_names_list_the_choices(change, message):
    with pytest.raises(ValueError, match=message):
        TrainJob(**change)


def test_cli_user_error_is_one_line_without_traceback(capsys, tmp_path):
    status, err = _run_cli(["train", "--preset", "gpt-zz", "--storage-path", str(tmp_path)], capsys)
    assert status == 1
    assert err.strip().splitlines() == [
        "mpipemoe train: error: preset='gpt-zz' is unknown: choose one of gpt-s, gpt-xl, bert-l, tiny-gpt, "
        "tiny-bert, mixtral-s, tiny-mixtral (--debug shows the traceback)"]
    status, err = _run_cli(["train", "--preset", "gpt-zz", "--storage-path", str(tmp_path), "--debug"], capsys)
    assert status == 1 and "Traceback (most recent call last)" in err and "get_preset" in err


def test_cli_unknown_engine_and_space_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--engine", "tutel"])
    assert exit_info.value.code == 2 and "invalid choice: 'tutel'" in capsys.readouterr().err
    # a study is a built-in name or a file (issue 41): an unknown one is refused before Ray starts
    assert cli.main(["sweep", "nope"]) == 2
    assert "unknown study 'nope': choose one of smoke" in capsys.readouterr().err


# ---- data: missing, unreadable, empty, too small, outside the vocabulary -----------------

def test_missing_data_dir_fails_before_ray_starts(capsys, tmp_path):
    missing = tmp_path / "nowhere"
    status, err = _run_cli(["train", "--data-dir", str(missing), "--storage-path", str(tmp_path),
                            "--tracking-uri", "none"], capsys)
    assert status == 1
    assert f"no prepared data at {missing} (manifest.json missing): run `mpipemoe data prepare --out" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / MANIFEST).write_text("{not json"), r"cannot read the prepared data's .*manifest.json"),
    (lambda d: ((d / MANIFEST).unlink(), (d / MANIFEST).mkdir()), r"cannot read the prepared data's .*IsADirectory"),
    (lambda d: (d / "shard-00000.parquet").write_bytes(b"garbage"), r"cannot read data shard .*shard-00000.parquet"),
    (lambda d: (d / "shard-00000.parquet").unlink(), r"cannot read data shard .*shard-00000.parquet"),
])
def test_unreadable_data_names_the_file_and_the_fix(data_dir, tmp_path, damage, message):
    broken = _copy(data_dir, tmp_path / "broken")
    damage(broken)
    job = TrainJob(data_dir=str(broken), storage_path=str(tmp_path), seq_len=64)
    with pytest.raises(ValueError, match=message) as error:
        ensure_data(job)
    assert "mpipemoe data prepare --out" in str(error.value)


def test_empty_sources_are_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no input files found"):
        prepare_dataset(tmp_path / "out", [tmp_path / "empty"])
    (tmp_path / "empty.txt").write_text("")  # issue 28: said as empty, not as "1 tokens"
    with pytest.raises(ValueError, match=r"no text in .*empty\.txt: it holds only 1 null or empty text\(s\)"):
        prepare_dataset(tmp_path / "out", [tmp_path / "empty.txt"])
    (tmp_path / "short.txt").write_text("abc")
    with pytest.raises(ValueError, match="gives 4 tokens, fewer than one row of 8192"):
        prepare_dataset(tmp_path / "out", [tmp_path / "short.txt"])


def test_too_little_data_for_the_workers_fails_before_ray_starts(data_dir, tmp_path):
    job = TrainJob(data_dir=str(data_dir), storage_path=str(tmp_path), seq_len=64, batch_size=400)
    with pytest.raises(ValueError, match=r"307 windows of 65 tokens per worker \(2 workers\), fewer than "
                                         r"batch_size=400: prepare more data"):
        ensure_data(job)
    ensure_data(TrainJob(data_dir=str(data_dir), storage_path=str(tmp_path), seq_len=64, batch_size=8))


def test_token_ids_outside_the_vocabulary(data_dir, tmp_path):
    tokens_file = tmp_path / "tokens.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"tokens": [[1, 2, 300]]}), tokens_file)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 259\); found 1..300"):
        prepare_dataset(tmp_path / "out", [tokens_file])
    # A prepared directory whose manifest declares a smaller vocabulary than its ids need.
    shrunk = _copy(data_dir, tmp_path / "shrunk")
    manifest = json.loads((shrunk / MANIFEST).read_text())
    (shrunk / MANIFEST).write_text(json.dumps(dict(manifest, vocab_size=100)))
    with pytest.raises(ValueError, match=r"rank 0's rows hold token id \d+, outside the vocabulary of 100"):
        load_rank_tokens(shrunk, 0, 2)
    # The model itself refuses ids it has no embedding for (CUDA would hit a device-side assert).
    model = MoETransformer(get_preset("tiny-gpt"), engine="fastmoe")
    with pytest.raises(ValueError, match=r"token ids outside the vocabulary in the batch: found 0..259, "
                                         r"the model has vocab_size=259 \(ids 0..258\)"):
        model(torch.tensor([[0, 259]]))
    with pytest.raises(ValueError, match=r"found -1..3"):
        model(torch.tensor([[-1, 3]]))


# ---- NaN/Inf loss policy ------------------------------------------------------------------

def test_nonfinite_loss_halts_or_skips_naming_the_step():
    config = SimpleNamespace(engine="mpipemoe", lr=1e-3)  # the fields it names
    with pytest.raises(StepError, match=r"non-finite loss at step 7 \(lm_loss=nan.*--on-nonfinite-loss skip"):
        check_nonfinite_loss(7, float("nan"), 1.0, "halt", 1, config)
    check_nonfinite_loss(7, float("inf"), 1.0, "skip", 1, config)   # returns: the caller skips the update
    with pytest.raises(StepError, match=rf"step 9 .*{MAX_SKIPPED_IN_A_ROW} non-finite steps in a row"):
        check_nonfinite_loss(9, float("nan"), 1.0, "skip", MAX_SKIPPED_IN_A_ROW, config)
    # NaN/Inf met in some ranks' MoE layer input (reduced over every rank): named, whatever the loss
    with pytest.raises(StepError, match=r"NaN or Inf in the MoE layer input of rank\(s\) 0, 3 at step 4 "):
        check_nonfinite_loss(4, 2.5, 1.0, "halt", 1, config, [0, 3])
    reason = check_nonfinite_loss(4, 2.5, 1.0, "skip", 1, config, [2])
    assert reason.startswith("NaN or Inf in the MoE layer input of rank(s) 2 (lm_loss=2.5")


class _RecordingRun:
    def __init__(self):
        self.tags, self.metrics = {}, []

    def set_tags(self, tags):
        self.tags.update(tags)

    def log_metrics(self, metrics, step=None):
        self.metrics.append((step, metrics))

    def flush(self):
        pass


def _metrics(step, attempt, loss=3.0, skipped=0):
    return {"step": step, "loss": loss, "lm_loss": loss, "aux_loss": 1.0, "tokens_per_s": 1.0,
            "step_time_s": 1.0, "peak_memory_bytes": 1, "skipped": skipped, "attempt": attempt,
            "lr": 1e-3, "grad_norm": 1.0}   # a worker's step metrics carry the lr and grad norm


def test_driver_records_restarts_and_skipped_steps():
    run, lines = _RecordingRun(), []
    pump = _MetricsPump(None, run, TrainJob(steps=5, log_every=100), lines.append, None)
    for metrics in (_metrics(1, "a"), _metrics(2, "a", float("nan"), skipped=1),
                    {**_metrics(3, "a", skipped=1), "skip_reason": "NaN or Inf in the MoE layer input of rank(s) 1"},
                    _metrics(4, "b"),       # restarted after the step-3 checkpoint: no step replayed
                    _metrics(5, "b")):
        pump._handle(metrics)
    assert pump.restarts == 1 and run.tags == {"restarts": 1} and (4, {"restarts": 1}) in run.metrics
    assert any("step 2 skipped: non-finite loss" in line for line in lines)
    assert any("step 3 skipped: NaN or Inf in the MoE layer input of rank(s) 1; no update" in line for line in lines)
    assert any("workers restarted from a checkpoint (1 restart(s)); continuing at step 4" in line for line in lines)
    summary = summarize(pump.history)
    assert summary["skipped_steps"] == [2, 3] and summary["steps"] == 5 and summary["final_loss"] == 3.0


# ---- invalid combinations -------------------------------------------------------------------

def _parse(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_resume_and_engines_cannot_be_combined(tmp_path):
    with pytest.raises(ValueError, match="--resume r and --engines cannot be combined"):
        job_from_args(_parse(["--resume", "r", "--engines", "mpipemoe,fastmoe", "--storage-path", str(tmp_path)]))


class _Scaling:
    def __init__(self, num_workers, resources):
        self.num_workers, self.resources_per_worker = num_workers, resources


def test_more_workers_than_the_cluster_holds_is_refused():
    two_cores = [{"CPU": 2.0, "memory": 1e9}]
    check_resources(_Scaling(2, {"CPU": 0.9}), two_cores)
    check_resources(_Scaling(4, {"CPU": 0.45}), two_cores)
    with pytest.raises(ValueError, match=r"num_workers=4 is invalid: the Ray cluster \(1 node\(s\), 2 CPU\) holds "
                                         r"2 worker\(s\) of 0.9 CPU each; use --num-workers 2 or a smaller "
                                         r"--cpus-per-worker"):
        check_resources(_Scaling(4, {"CPU": 0.9}), two_cores)
    gpu_nodes = [{"CPU": 96, "GPU": 8}, {"CPU": 96, "GPU": 8}]
    check_resources(_Scaling(16, {"CPU": 1, "GPU": 1}), gpu_nodes)
    with pytest.raises(ValueError, match=r"holds 16 worker\(s\) of 1 CPU, 1 GPU each; use --num-workers 16 or --no-gpu"):
        check_resources(_Scaling(17, {"CPU": 1, "GPU": 1}), gpu_nodes)
    # Per node: two nodes with 0.5 GPU each do not make one whole GPU.
    with pytest.raises(ValueError, match=r"holds 0 worker\(s\)"):
        check_resources(_Scaling(1, {"CPU": 1, "GPU": 1}), [{"CPU": 4, "GPU": 0.5}] * 2)


def test_fault_options_reach_ray_train(data_dir, tmp_path):
    pytest.importorskip("ray")
    job = job_from_args(_parse(["--max-failures", "3", "--collective-timeout-s", "7", "--on-nonfinite-loss",
                                "skip", "--no-gpu", "--data-dir", str(data_dir), "--storage-path", str(tmp_path)]))
    assert (job.max_failures, job.collective_timeout_s, job.on_nonfinite_loss) == (3, 7, "skip")
    trainer = build_trainer(job)
    assert trainer.run_config.failure_config.max_failures == 3
    assert trainer.backend_config.timeout_s == 7
    assert trainer.train_loop_config.on_nonfinite_loss == "skip"
