"""The TrainJob that `mpipemoe train` builds from its flags (and an optional `--config` file's
text), without running it: for the tests of train options."""
from __future__ import annotations

import argparse
from pathlib import Path

from app.commands.train import add_arguments, job_from_args
from app.jobs.job import TrainJob


def train_job(tmp_path: Path, *flags: str, config: str | None = None) -> TrainJob:
    """`mpipemoe train FLAGS` under `tmp_path` (no MLflow); `config`: a TOML file's text, given
    as `--config`."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    given = ["--storage-path", str(tmp_path), "--tracking-uri", "none", *flags]
    if config is not None:
        (tmp_path / "run.toml").write_text(config)
        given += ["--config", str(tmp_path / "run.toml")]
    return job_from_args(parser.parse_args(given))
