"""Damaged checkpoints on resume (issue 21, item 1; tier 3: Ray Train, gloo, MLflow).

One run of N steps with a checkpoint after every step; then the five newest checkpoints
are damaged, one way each, and the run is resumed with ``mpipemoe train --resume``:
  - checkpoint 6 (the latest): its folder deleted (Ray Train's run snapshot still names it);
  - checkpoint 5: ``meta.json`` (the completeness marker) emptied;
  - checkpoint 4: rank 1's shard truncated;
  - checkpoint 3: rank 1's shard corrupted in place, its size unchanged (issue 28);
  - checkpoint 2: ``meta.json`` unreadable (a folder in its place; issue 28).
The resume must name each in one line, move the damaged folders to ``damaged/`` (nothing
deleted), continue from the intact checkpoint 1 with the straight run's losses, exit 0,
and log no step twice to MLflow. Last, with every checkpoint damaged, the resume must fail
at once (status 1, one line, no advice to delete) and leave the MLflow run FINISHED.
Two fits in all, to keep the suite short.
"""
from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from pathlib import Path

import pytest

from app import cli
from app.jobs.job import TrainJob
from app.jobs.launch import run_job
from app.tracking.store import client, metric_history
from lm.data import prepare_dataset
from workers import checkpoint as ckpt

pytestmark = [pytest.mark.ray, pytest.mark.faults]

N = 6  # steps; a checkpoint after every step


def _resume(job: TrainJob, summary_json: Path) -> tuple[int, list[str], list[str]]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(["train", "--resume", job.name, "--storage-path", job.storage_path, "--steps", str(N),
                           "--summary-json", str(summary_json)])
    return status, out.getvalue().splitlines(), err.getvalue().splitlines()


def _folder(job: TrainJob, step: int) -> Path:
    return job.run_dir / f"checkpoint_{step:06d}"


@pytest.fixture(scope="module")
def faults(ray_local, tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    prepare_dataset(root / "data", max_bytes=2**19)
    job = TrainJob(preset="tiny-gpt", steps=N, num_workers=2, use_gpu=False, batch_size=4, seq_len=64,
                   lr=3e-3, warmup_steps=1, checkpoint_every=1, keep_checkpoints=N, seed=5, partitions=2,
                   strategy="S1", data_dir=str(root / "data"), storage_path=str(root / "ray_results"),
                   tracking_uri=f"sqlite:///{root / 'mlflow.db'}", name="faulty", experiment="test-faults")
    straight = run_job(job, echo=lambda line: None)
    # Damage the five newest checkpoints, one way each; checkpoint 1 stays intact.
    shutil.rmtree(_folder(job, 6))                                # deleted (Ray's snapshot names it)
    (_folder(job, 5) / "meta.json").write_text("")                # emptied completeness marker
    shard = _folder(job, 4) / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])                  # rank 1's shard truncated
    shard = _folder(job, 3) / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2:len(data) // 2 + 512] = bytes(range(256)) * 2  # same size, other bytes
    shard.write_bytes(bytes(data))
    (_folder(job, 2) / "meta.json").unlink()
    (_folder(job, 2) / "meta.json").mkdir()                       # a marker that cannot be read
    status, out, err = _resume(job, root / "resumed.json")
    resumed = {"status": status, "out": out, "err": err,
               "run_dir": sorted(p.name for p in job.run_dir.iterdir()),
               "damaged": sorted(p.name for p in (job.run_dir / "damaged").iterdir()),
               "losses": [m["loss"] for m in json.loads((root / "resumed.json").read_text())["history"]]}
    for _, folder in ckpt.listed(job.run_dir):
        (folder / "meta.json").write_text("")                    # now every checkpoint is damaged
    status, out, err = _resume(job, root / "none_left.json")
    return {"job": job, "straight": [m["loss"] for m in straight["history"]], "run_id": straight["mlflow_run_id"],
            "resumed": resumed, "none_left": {"status": status, "out": out, "err": err}}


def test_damaged_checkpoints_are_skipped_naming_each(faults):
    seen = faults["resumed"]
    assert seen["status"] == 0 and seen["err"] == [], seen["err"]
    skipped = [line for line in seen["out"] if "skipped" in line]
    expected = [
        r"\[mpipemoe\] skipped checkpoint_000006: its folder is missing; resuming from checkpoint_000001",
        r"\[mpipemoe\] skipped checkpoint_000005: meta\.json is empty; moved to damaged/checkpoint_000005/; "
        r"resuming from checkpoint_000001",
        r"\[mpipemoe\] skipped checkpoint_000004: __1_0\.distcp is truncated \(1,000 of [\d,]+ bytes\); "
        r"moved to damaged/checkpoint_000004/; resuming from checkpoint_000001",
        r"\[mpipemoe\] skipped checkpoint_000003: __1_0\.distcp is damaged \(its bytes differ from those written: "
        r"CRC-32 mismatch\); moved to damaged/checkpoint_000003/; resuming from checkpoint_000001",
        r"\[mpipemoe\] skipped checkpoint_000002: meta\.json cannot be read \(Is a directory\); moved to "
        r"damaged/checkpoint_000002/; resuming from checkpoint_000001",
    ]
    assert len(skipped) == 5 and all(re.fullmatch(e, line) for e, line in zip(expected, skipped)), skipped
    assert not any("delete" in line for line in skipped)


def test_resume_from_the_intact_checkpoint_replays_the_straight_run(faults):
    seen = faults["resumed"]
    assert seen["losses"] == faults["straight"][1:]  # steps 2..N, exactly
    assert [name for name in seen["run_dir"] if name.startswith("checkpoint_0")] == \
        [f"checkpoint_{s:06d}" for s in range(1, N + 1)]  # written again, complete


def test_damaged_checkpoints_are_kept_aside_not_deleted(faults):
    assert faults["resumed"]["damaged"] == [f"checkpoint_{s:06d}" for s in (2, 3, 4, 5)]
    folder = faults["job"].run_dir / "damaged"
    assert (folder / "checkpoint_000004" / "__1_0.distcp").stat().st_size == 1000  # left as found
    assert (folder / "checkpoint_000005" / "meta.json").read_text() == ""
    assert (folder / "checkpoint_000002" / "meta.json").is_dir()


def test_no_step_is_logged_twice_to_mlflow(faults):
    job = faults["job"]
    history = metric_history(job.tracking_uri, faults["run_id"], "loss")
    assert [step for step, _ in history] == list(range(1, N + 1))
    assert [value for _, value in history] == pytest.approx(faults["straight"])


def test_no_complete_checkpoint_fails_at_once_and_keeps_the_run_finished(faults):
    seen, job = faults["none_left"], faults["job"]
    assert seen["status"] == 1
    assert len(seen["err"]) == 1 and seen["err"][0].startswith(
        f"mpipemoe train: error: --resume {job.name}: no complete checkpoint in {job.run_dir} "
        f"(checkpoint_000006: meta.json is empty; checkpoint_000005: meta.json is empty; "), seen["err"]
    assert "nothing was deleted" in seen["err"][0]
    assert not any("] step " in line for line in seen["out"])
    assert client(job.tracking_uri).get_run(faults["run_id"]).info.status == "FINISHED"
    assert [path.name for _, path in ckpt.listed(job.run_dir)] == [f"checkpoint_{s:06d}" for s in range(N, 0, -1)]
