"""What ``mpipemoe sweep`` checks before Ray starts (app/jobs/sweep.py): the study's name (one
folder inside ``--storage-path``, not a training run's), its values (every value of the param
space must make a valid training job somewhere in the grid: ``check_space_values``), and, when
the study resumes, that its search space and ranking are those it was started with (the study
record ``STUDY_FILE`` beside Tune's state: ``check_resumable``, ``write_study_record``).

Ray Tune's own restore keeps the param space, search, scheduler and ranking it was started
with and ignores any new ones; refusing a changed one is what lets a user trust that the study
they resumed is the one they asked for.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
from pathlib import Path
from typing import Any

STUDY_FILE = "mpipemoe_study.json"  # in <storage-path>/<name>: what the study was started with
# Grids larger than this are not enumerated before Ray starts (their trials still refuse bad
# values one by one); the built-in studies have at most 36 points.
MAX_CHECKED_POINTS = 4096


def check_study_name(name: str, storage_path: str) -> None:
    """Raise ValueError unless ``name`` is one folder name (as ``train --name``) and not the
    folder of a training run in ``storage_path`` (Tune's files would mix into the run's)."""
    from app.jobs.job import check_run_name
    from app.jobs.resume import JOB_FILE

    check_run_name(name, "--name")
    folder = Path(storage_path).expanduser().resolve() / name
    if (folder / JOB_FILE).is_file():
        raise ValueError(f"--name {name!r} is the training run in {folder}: give the study another --name "
                         f"(a study's folder holds Tune's state, a run's its checkpoints)")


def _checked_values(value) -> list | None:
    """The values of one param-space entry that can be checked before Ray starts: a constant,
    a grid's or a choice's values, a numeric range's bounds; None for a domain without them
    (``tune.sample_from``)."""
    from ray.tune.search.sample import Categorical, Float, Integer

    if isinstance(value, dict) and set(value) == {"grid_search"}:
        return list(value["grid_search"])
    if isinstance(value, Categorical):
        return list(value.categories)
    if isinstance(value, Float):
        return [value.lower, value.upper]
    if isinstance(value, Integer):
        return [value.lower, value.upper - 1]  # randint's upper bound is exclusive
    if isinstance(value, dict) or hasattr(value, "sample"):
        return None
    return [value]


def check_space_values(space: dict, storage_path: str) -> None:
    """Before Ray starts: build the training job of every point of ``space``'s grid (constants,
    grid and choice values, range bounds) and raise ValueError for a value that no point can
    run, naming it and the job's reason (``--set strategy=S9``, ``lr = "fast"``,
    ``partitions=0``; also a setting every trial would refuse). A value refused at some points
    only (more partitions than one batch size's tokens) stays: those trials are results."""
    from app.jobs.job import TrainJob

    choices = {key: values for key, value in space.items() if (values := _checked_values(value)) is not None}
    if math.prod(len(values) for values in choices.values()) > MAX_CHECKED_POINTS:
        return
    common = dict(storage_path=str(Path(storage_path).expanduser().resolve()), name="study-check",
                  data_dir=os.getcwd(), tracking_uri="none")
    keys = list(choices)
    runs: dict[tuple[str, str], bool] = {}  # (key, repr(value)) -> some point with it is a valid job
    reasons: dict[tuple[str, str], str] = {}
    for point in itertools.product(*(choices[k] for k in keys)):
        try:
            TrainJob(**{**dict(zip(keys, point)), **common})
            reason = None
        except (ValueError, TypeError) as error:
            reason = str(error)
        for key, value in zip(keys, point):
            slot = (key, repr(value))
            runs[slot] = runs.get(slot, False) or reason is None
            if reason is not None:
                reasons.setdefault(slot, reason)
    never = [slot for slot, ran in runs.items() if not ran]
    if not never:
        return
    # name the value the job's reason is about (TrainJob says "TrainJob.<field>=...")
    key, value = next((s for s in never if reasons[s].startswith(f"TrainJob.{s[0]}=")), never[0])
    every = all(not ran for ran in runs.values())
    where = "every trial" if every and len(choices.get(key, [])) == 1 else f"every trial with {key}={value}"
    raise ValueError(f"{where} would be refused: {reasons[(key, value)]}")


def describe(value) -> Any:
    """A param-space entry as JSON: constants and grids as they are, Tune domains by their kind
    and bounds (a function domain by its name), so that two runs of a study compare equal."""
    from ray.tune.search.sample import Domain, Function

    if isinstance(value, dict):
        return {str(k): describe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [describe(v) for v in value]
    if isinstance(value, Function):
        return {"domain": "sample_from", "func": getattr(value.func, "__qualname__", repr(value.func))}
    if isinstance(value, Domain):
        sampler = getattr(value, "sampler", None)
        inner = getattr(sampler, "sampler", sampler)  # Quantized wraps the sampler
        return {"domain": type(value).__name__,
                **{a: describe(getattr(value, a)) for a in ("lower", "upper", "categories") if hasattr(value, a)},
                "sampler": type(inner).__name__.lstrip("_"), "q": getattr(sampler, "q", None)}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)


@dataclasses.dataclass(frozen=True)
class StudyRecord:
    """What a study was started with; a resume must ask for the same."""

    space: dict
    search: str
    scheduler: str
    metric: str
    mode: str
    num_samples: int

    @classmethod
    def of(cls, space: dict, **fields) -> "StudyRecord":
        return cls(space=describe(space), **fields)


def write_study_record(experiment_path: str, record: StudyRecord) -> None:
    os.makedirs(experiment_path, exist_ok=True)
    Path(experiment_path, STUDY_FILE).write_text(json.dumps(dataclasses.asdict(record), indent=1, sort_keys=True))


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."


def check_resumable(experiment_path: str, record: StudyRecord, name: str) -> None:
    """Raise ValueError, in one line naming what changed, when the study recorded in
    ``experiment_path`` was started with another space, search, scheduler, ranking or number
    of samples than ``record``. A study without a record (started by an older version) passes."""
    path = Path(experiment_path, STUDY_FILE)
    if not path.is_file():
        return
    old = json.loads(path.read_text())
    new = json.loads(json.dumps(dataclasses.asdict(record), sort_keys=True))
    changes = [f"{key}: {_short(old['space'].get(key))} -> {_short(new['space'].get(key))}"
               for key in sorted(set(old["space"]) | set(new["space"]))
               if old["space"].get(key) != new["space"].get(key)]
    changes += [f"{field}: {_short(old.get(field))} -> {_short(new[field])}" for field in
                ("search", "scheduler", "metric", "mode", "num_samples") if old.get(field) != new[field]]
    if changes:
        raise ValueError(f"study {name!r} in {experiment_path} was started with another search space or ranking "
                         f"({'; '.join(changes)}): a resume keeps the old one; give a new --name for this one, or "
                         f"run it as it was started to resume it")
