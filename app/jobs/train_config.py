"""``mpipemoe train --config FILE.toml``: a training job's options from a TOML file.

    # run.toml: keys are `mpipemoe train` options, dashes or underscores
    preset = "tiny-gpt"
    steps = 200
    lr-schedule = "wsd"
    decay-fraction = 0.3

    mpipemoe train --config run.toml --steps 300    # options given on the command line win

Flat keys only, one per option; paths are read as on the command line (from the current
folder). Unknown keys are refused naming the key and the valid ones.
"""
from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any

from app.jobs.job import TrainJob

# TrainJob fields a file may not set: the driver's nesting of a run under a sweep's.
NOT_IN_FILES = ("parent_run_id",)


def config_keys() -> list[str]:
    """The keys a config file may hold, as its flags spell them (``lr-schedule``)."""
    return [f.name.replace("_", "-") for f in dataclasses.fields(TrainJob) if f.name not in NOT_IN_FILES]


def read_train_config(path: str | Path) -> dict[str, Any]:
    """Local. The TrainJob fields that the TOML file ``path`` sets (keys with dashes become
    underscores); errors name the file and the fix: a missing file, bad TOML, a table where an
    option's value goes, an unknown key (with the valid ones). The values are checked by TrainJob."""
    path = Path(path).expanduser()
    try:
        text = path.read_text()
    except OSError as error:
        raise ValueError(f"--config {path}: cannot read it ({error.strerror or error}): give an existing "
                         f"TOML file") from None
    try:  # the standard library's from Python 3.11
        toml = importlib.import_module("tomllib")
    except ImportError:
        raise ValueError(f"--config {path}: TOML files need Python 3.11 or later (tomllib): give the options "
                         f"as flags instead") from None
    try:
        data = toml.loads(text)
    except ValueError as error:  # tomllib.TOMLDecodeError
        raise ValueError(f"--config {path}: not valid TOML: {error}") from None
    valid = config_keys()
    fields = {}
    for key, value in data.items():
        if key.replace("_", "-") not in valid:
            raise ValueError(f"--config {path}: unknown key {key!r}: use the options of `mpipemoe train`: "
                             f"{', '.join(valid)}")
        if isinstance(value, (dict, list)):
            raise ValueError(f"--config {path}: {key} = {value!r} is invalid: give one value (a string, number "
                             f"or true/false), as its flag takes")
        fields[key.replace("-", "_")] = value
    return fields
