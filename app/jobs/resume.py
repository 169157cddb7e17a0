"""``mpipemoe train --resume NAME``: the job fields a recorded run continues with, or an error that
says how to continue it (its settings file lost, no checkpoints written)."""
from __future__ import annotations

import json
from pathlib import Path

from app.jobs.job import check_run_name
from app.jobs.launch import JOB_FILE, checkpoint_settings, continue_command
from app.tracking.store import resolve_tracking_uri
from lm.data import default_data_dir
from workers.reshard import resumed_settings


def resumed_job_fields(resume: str, given: dict) -> dict:
    """The fields of run ``resume``'s job, recorded in <storage-path>/<resume>/JOB_FILE, with the
    options ``given`` on the command line applied as workers/reshard.py allows."""
    check_run_name(resume, "--resume")
    run_dir = Path(given.get("storage_path") or "ray_results").expanduser().resolve() / resume
    if not (run_dir / JOB_FILE).exists():
        found = checkpoint_settings(run_dir)
        if found is not None:  # the settings file is gone, the checkpoints are not
            data_dir = str(Path(given["data_dir"]).expanduser().resolve()) if given.get("data_dir") \
                else str(default_data_dir())
            again = continue_command(resume, str(run_dir.parent), found,
                                     resolve_tracking_uri(given.get("tracking_uri")), data_dir)
            raise ValueError(f"--resume {resume}: {JOB_FILE} (its settings) is missing in {run_dir}, but "
                             f"{found['checkpoint']} is there: continue it with `{again}` and its other "
                             f"options (--batch-size, ...)")
        raise ValueError(f"--resume {resume}: no run recorded at {run_dir} ({JOB_FILE} missing); "
                         f"check the name and --storage-path")
    recorded = json.loads((run_dir / JOB_FILE).read_text())
    if recorded.get("checkpoint_every") == 0:
        raise ValueError(f"--resume {resume}: that run wrote no checkpoints (--checkpoint-every 0), "
                         f"so there is nothing to continue from; start a new run")
    # another --num-workers: the same global batch and data layout (workers/reshard.py)
    return {**resumed_settings(recorded, given, resume), "name": resume,
            "parent_run_id": recorded.get("parent_run_id")}
