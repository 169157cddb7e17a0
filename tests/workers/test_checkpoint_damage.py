"""Damaged and unwritable checkpoints, checked without Ray (issue 28; tier 1, marker ``faults``).

Checkpoint folders here are built by hand (a few small files and the ``meta.json`` that
``write_meta`` writes for one rank), so the checks run in milliseconds: a same-size
corruption is found by the CRC-32 in ``meta.json`` and the resume falls back to the
newest intact checkpoint, naming the file; an unreadable marker is a skipped checkpoint,
not a raw ``PermissionError``; a full disk while a checkpoint is written is one line naming
the checkpoint, the file and the fix. The end-to-end resume (Ray Train, real shards) is
tests/workers/test_faults_checkpoint.py.
"""
from __future__ import annotations

import errno
import json
import os
import resource
import signal
import tempfile
from pathlib import Path

import pytest

from app.jobs.job import TrainJob
from app.jobs.resume import choose_checkpoint
from workers import checkpoint as ckpt

pytestmark = pytest.mark.faults


def _checkpoint(run_dir: Path, step: int, shard_bytes: int = 4096) -> Path:
    """A complete one-rank checkpoint folder: two shard files and meta.json (as write_meta writes it)."""
    folder = run_dir / ckpt.checkpoint_name(step)
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(bytes((step * 31 + i) % 251 for i in range(shard_bytes)))
    (folder / ".metadata").write_bytes(b"index of step %d" % step)
    ckpt.write_meta(folder, rank=0, world_size=1, meta={"step": step, "world_size": 1})
    return folder


def _corrupt_in_place(path: Path) -> None:
    """Random-looking bytes in the middle of ``path``, its size unchanged."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes((b ^ 0x5A) for b in data[middle:middle + 64])
    path.write_bytes(bytes(data))


def test_meta_records_each_files_size_and_crc32(tmp_path):
    folder = _checkpoint(tmp_path, 1)
    meta = json.loads((folder / ckpt.META).read_text())
    assert meta["files"] == {".metadata": 15, "__0_0.distcp": 4096}
    assert meta["crc32"] == {name: ckpt.file_crc32(folder / name) for name in (".metadata", "__0_0.distcp")}
    assert ckpt.validate(folder, checksums=True) is None


def test_same_size_corruption_is_found_by_its_checksum(tmp_path):
    folder = _checkpoint(tmp_path, 1)
    _corrupt_in_place(folder / "__0_0.distcp")
    assert ckpt.validate(folder, checksums=False) is None  # sizes alone cannot see it
    assert ckpt.validate(folder, checksums=True) == \
        "__0_0.distcp is damaged (its bytes differ from those written: CRC-32 mismatch)"


def test_checkpoints_written_before_checksums_are_checked_by_size(tmp_path):
    folder = _checkpoint(tmp_path, 1)
    meta = json.loads((folder / ckpt.META).read_text())
    del meta["crc32"]
    (folder / ckpt.META).write_text(json.dumps(meta))
    _corrupt_in_place(folder / "__0_0.distcp")
    assert ckpt.validate(folder, checksums=True) is None


def test_resume_falls_back_from_a_corrupted_shard_to_the_newest_intact_checkpoint(tmp_path):
    job = TrainJob(storage_path=str(tmp_path), name="run", tracking_uri="none")
    for step in (5, 10, 15):
        _checkpoint(job.run_dir, step)
    _corrupt_in_place(job.run_dir / "checkpoint_000015" / "__0_0.distcp")
    lines = []
    chosen = choose_checkpoint(job, echo=lines.append)
    assert chosen == str(job.run_dir / "checkpoint_000010")
    assert lines == ["[mpipemoe] skipped checkpoint_000015: __0_0.distcp is damaged (its bytes differ from those "
                     "written: CRC-32 mismatch); moved to damaged/checkpoint_000015/; resuming from checkpoint_000010"]
    assert (job.run_dir / "damaged" / "checkpoint_000015" / "__0_0.distcp").stat().st_size == 4096  # kept


def test_an_export_of_a_run_whose_every_checkpoint_is_damaged_does_not_advise_a_resume(tmp_path):
    """Neither export nor a resume can load anything: the advice is a new run, or the folder moved
    away (the resume itself refuses such a run); each damaged checkpoint is named."""
    from app.jobs.resume import JOB_FILE
    from app.jobs.trained import trained_run

    job = TrainJob(storage_path=str(tmp_path), name="run", tracking_uri="none")
    for step in (5, 10):
        _corrupt_in_place(_checkpoint(job.run_dir, step) / "__0_0.distcp")
    (job.run_dir / JOB_FILE).write_text(json.dumps({"checkpoint_every": 5}))
    with pytest.raises(ValueError) as refused:
        trained_run("run", str(tmp_path))
    message = str(refused.value)
    assert "checkpoint_000010: __0_0.distcp is damaged" in message and "checkpoint_000005" in message
    assert "--resume" not in message and "train a new run (another --name)" in message
    with pytest.raises(ValueError, match="so the run cannot continue"):
        choose_checkpoint(job, echo=lambda line: None)


def test_an_unreadable_marker_is_a_skipped_checkpoint_not_a_crash(tmp_path):
    """meta.json that cannot be read (here a folder in its place; as another user, no permission)."""
    run_dir = tmp_path / "run"
    _checkpoint(run_dir, 1)
    newest = _checkpoint(run_dir, 2)
    (newest / ckpt.META).unlink()
    (newest / ckpt.META).mkdir()
    assert ckpt.validate(newest) == "meta.json cannot be read (Is a directory)"
    chosen, skipped = ckpt.choose(run_dir, checksums=True)
    assert chosen == run_dir / "checkpoint_000001"
    assert skipped == [("checkpoint_000002", "meta.json cannot be read (Is a directory)")]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file: no permission to take away")
def test_a_folder_without_read_permission_is_skipped(tmp_path):
    run_dir = tmp_path / "run"
    _checkpoint(run_dir, 1)
    newest = _checkpoint(run_dir, 2)
    newest.chmod(0)
    try:
        chosen, skipped = ckpt.choose(run_dir, checksums=True)
        assert chosen == run_dir / "checkpoint_000001"
        assert skipped == [("checkpoint_000002", "meta.json cannot be read (Permission denied)")]
    finally:
        newest.chmod(0o755)


def test_a_shard_that_cannot_be_read_is_named(tmp_path, monkeypatch):
    folder = _checkpoint(tmp_path, 1)

    def refuse(path):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(ckpt, "file_crc32", refuse)
    assert ckpt.validate(folder, checksums=True) == ".metadata cannot be read (Permission denied)"


def test_a_full_disk_while_checkpointing_names_the_checkpoint_the_file_and_the_fix(tmp_path):
    """A real failing write: meta.json of checkpoint 7 under a file-size limit of 0 bytes
    (what a quota gives: EFBIG; a full disk gives ENOSPC the same way)."""
    folder = tmp_path / "checkpoint_000007"
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(b"x" * 100)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))
    try:
        with pytest.raises(OSError) as caught, ckpt.write_errors_explained(7):
            ckpt.write_meta(folder, rank=0, world_size=1, meta={"step": 7})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert str(caught.value) == (f"cannot write checkpoint_000007 (File too large): free space in the workers' "
                                 f"temporary folder ({tempfile.gettempdir()}) and the storage path (or lower "
                                 f"--keep-checkpoints) and resume: the run continues from its newest complete "
                                 f"checkpoint")
    assert caught.value.errno == errno.EFBIG and caught.value.__cause__ is None  # the driver shows this line


class _CheckpointException(BaseException):
    """Like DCP's: a BaseException carrying each rank's (error, trace)."""

    def __init__(self, failures):
        super().__init__("CheckpointException ranks:dict_keys([1])\nTraceback ...")
        self.failures = failures


def test_a_full_disk_on_another_rank_inside_dcps_exception_is_named():
    full = OSError(errno.ENOSPC, "No space left on device", "/tmp/tmpab12/__1_0.distcp")
    with pytest.raises(OSError) as caught, ckpt.write_errors_explained(12):
        raise _CheckpointException({1: (full, None)})
    assert str(caught.value).startswith("cannot write checkpoint_000012 at /tmp/tmpab12/__1_0.distcp (No space "
                                        "left on device): free space there")
    with pytest.raises(ValueError, match="not a disk problem"), ckpt.write_errors_explained(12):
        raise ValueError("not a disk problem")  # other errors pass unchanged


def test_checkpoints_above_the_checksum_budget_are_checked_by_size(tmp_path, monkeypatch):
    """The driver does not read a huge checkpoint through before Ray starts; the workers' load does."""
    folder = _checkpoint(tmp_path, 1)
    _corrupt_in_place(folder / "__0_0.distcp")
    monkeypatch.setattr(ckpt, "CHECKSUM_MAX_BYTES", 4096)  # below this checkpoint's 4,111 bytes
    assert ckpt.validate(folder, checksums=True) is None
    monkeypatch.setattr(ckpt, "CHECKSUM_MAX_BYTES", 4111)
    assert ckpt.validate(folder, checksums=True).endswith("CRC-32 mismatch)")
