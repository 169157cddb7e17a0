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

from app.jobs.job import RESUME_OWNED, TrainJob

# TrainJob fields a file may not set: the driver's nesting of a run under a sweep's, and what a
# resume takes from the recorded run (the data's rank streams).
NOT_IN_FILES = ("parent_run_id", *RESUME_OWNED)


# Formats a config file is sometimes written in; train reads TOML only.
OTHER_FORMATS = (".yaml", ".yml", ".json", ".ini")
EXAMPLE = "one `option = value` line per option of `mpipemoe train`, e.g. steps = 200"


def config_keys() -> list[str]:
    """The keys a config file may hold, as its flags spell them (``lr-schedule``)."""
    return [f.name.replace("_", "-") for f in dataclasses.fields(TrainJob) if f.name not in NOT_IN_FILES]


def read_train_config(path: str | Path) -> dict[str, Any]:
    """Local. The TrainJob fields that the TOML file ``path`` sets (keys with dashes become
    underscores); errors name the file and the fix: a missing file, bad TOML, a table where an
    option's value goes, an unknown key (with the valid ones). The values are checked by TrainJob."""
    path = Path(path).expanduser()
    if path.suffix.lower() in OTHER_FORMATS:
        raise ValueError(f"--config {path}: train reads TOML files only ({EXAMPLE}): write the options as "
                         f"FILE.toml")
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
        raise ValueError(f"--config {path}: not valid TOML ({EXAMPLE}): {error}") from None
    valid = config_keys()
    fields = {}
    for key, value in data.items():
        if key.replace("-", "_") in RESUME_OWNED:
            raise ValueError(f"--config {path}: {key} is set by a resume from the recorded run, not by a file: "
                             f"drop it (valid keys: {', '.join(valid)})")
        if key.replace("_", "-") not in valid:
            raise ValueError(f"--config {path}: unknown key {key!r}: use the options of `mpipemoe train`: "
                             f"{', '.join(valid)}")
        if isinstance(value, (dict, list)):
            raise ValueError(f"--config {path}: {key} = {value!r} is invalid: give one value (a string, number "
                             f"or true/false), as its flag takes")
        fields[key.replace("-", "_")] = value
    return fields
