"""What every result file carries besides its numbers: the command that made it, when,
on what hardware, with which code (docs/design.md §7: benchmark results are data). How the
user ran the command, for hints they can type again, is ``lm.errors.invocation``.
torch is imported only where the hardware is named: `mpipemoe simulate` and `report`
read this module without loading it (about a second).
"""
from __future__ import annotations

import platform
import re
import subprocess
import sys
import time
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

# Where commands write generated records unless told otherwise (`--out`): a folder that
# .gitignore ignores, never the committed results/.
DEFAULT_OUT_DIR = "out"


def check_out_path(path, flag: str = "--out") -> None:
    """Local. Raise ValueError naming ``flag`` unless the file ``path`` can be written: not a
    folder, not below a file (its missing parent folders can be made). Checked before the work
    starts (os.makedirs would answer only "File exists", minutes later)."""
    target = Path(path).expanduser().absolute()
    if target.is_dir():
        raise ValueError(f"{flag} {path}: {target} is a folder, not a file: give the path of a file to write")
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{flag} {path}: {parent} is a file, not a folder: give a path inside a folder")
            return


def command_line(subcommand: str) -> str:
    """The command as a user would retype it: ``mpipemoe <subcommand> <args>``."""
    if sys.argv[1:2] == [subcommand]:
        return " ".join(["mpipemoe", *sys.argv[1:]])
    return " ".join(sys.argv)


def utc_timestamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def hardware_name(use_gpu: bool) -> str:
    """``NVIDIA H200 (140 GiB)`` for GPU 0, or ``cpu (<processor>)``."""
    import torch

    if use_gpu and torch.cuda.is_available():
        memory_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
        return f"{torch.cuda.get_device_name(0)} ({memory_gib:.0f} GiB)"
    return f"cpu ({platform.processor() or platform.machine()})"


# The folder of the code that runs (app/..): a git checkout, or a copy of one (the GPU machine
# gets the working tree without .git), or an installed copy.
CHECKOUT = Path(__file__).resolve().parents[2]  # app/tracking/records.py -> the checkout
# Beside a copy without .git: the commit it was copied from, written before the copy is made
# (tools/stamp-commit.sh; ignored by git). "<40 hex digits>" or "<40 hex digits>+dirty".
COMMIT_STAMP = ".git-commit"


@dataclass(frozen=True)
class SourceCommit:
    """The commit of the code that runs, and whether its tracked files differed from it."""
    commit: str
    dirty: bool

    def short(self) -> str:
        """``d205063`` or ``d205063+dirty``: what a record's ``git_commit`` says."""
        return self.commit[:7] + ("+dirty" if self.dirty else "")

    def stamp(self) -> str:
        return self.commit + ("+dirty" if self.dirty else "")


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def source_commit(root: str | Path = CHECKOUT) -> SourceCommit | None:
    """The commit of the code in ``root`` (default: this package's own tree, never the working
    directory's): the COMMIT_STAMP file when the files it covers are still byte for byte what it
    was written over (a copy made right after ``write_commit_stamp``: the GPU machine's, whose
    own ``.git`` may be stale; measured: a copy reporting 101f46a+dirty ran the code of b0bd8da);
    else git when ``root`` is the top of a checkout (an installed copy inside some other
    repository counts as none), dirty when a tracked file differs from HEAD; None when neither
    says."""
    root = Path(root).resolve()
    stamped = _read_stamp(root)
    if stamped is not None:
        return stamped
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is not None and Path(top).resolve() == root:
        commit, status = _git(root, "rev-parse", "HEAD"), _git(root, "status", "--porcelain", "--untracked-files=no")
        if commit and status is not None:
            return SourceCommit(commit, bool(status))
    return None


def _tree_digest(root: Path, paths: list[str]) -> str | None:
    """sha256 over ``paths`` (relative to ``root``) and their bytes; None when one is missing."""
    import hashlib

    digest = hashlib.sha256()
    for path in paths:
        try:
            data = (root / path).read_bytes()
        except OSError:
            return None
        digest.update(path.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    return digest.hexdigest()


def _read_stamp(root: Path) -> SourceCommit | None:
    """COMMIT_STAMP's commit when the files it lists still hash to its digest, else None.
    Its lines: the commit (``+dirty`` when the tracked files differed from it), ``sha256:HEX``,
    then the tracked files' paths."""
    try:
        lines = (root / COMMIT_STAMP).read_text().splitlines()
    except OSError:
        return None
    match = re.fullmatch(r"([0-9a-f]{7,40})(\+dirty)?", lines[0].strip()) if lines else None
    if match is None or len(lines) < 3 or not lines[1].startswith("sha256:"):
        return None
    if _tree_digest(root, lines[2:]) != lines[1].removeprefix("sha256:"):
        return None  # written over other files: the code has moved on since
    return SourceCommit(match.group(1), bool(match.group(2)))


def write_commit_stamp(root: str | Path = CHECKOUT) -> str:
    """Writes COMMIT_STAMP in ``root`` from its git checkout, for a copy of the tree made next
    (tools/stamp-commit.sh): the commit, the digest of the tracked files as they are now and
    their paths (`_read_stamp`); returns the commit it wrote."""
    root = Path(root).resolve()
    top = _git(root, "rev-parse", "--show-toplevel")
    listed = _git(root, "ls-files", "-z")
    if top is None or Path(top).resolve() != root or listed is None:
        raise ValueError(f"{root} is not the top of a git checkout: stamp the commit in the checkout the copy is "
                         f"made from")
    (root / COMMIT_STAMP).unlink(missing_ok=True)  # git's answer, not an earlier stamp's
    found = source_commit(root)
    if found is None:
        raise ValueError(f"{root}: git names no commit (a repository without one?): commit first, then stamp")
    paths = sorted(p for p in listed.split("\0") if p and (root / p).is_file())
    (root / COMMIT_STAMP).write_text("\n".join([found.stamp(), f"sha256:{_tree_digest(root, paths)}", *paths]) + "\n")
    return found.stamp()


def git_commit(root: str | Path = CHECKOUT) -> str:
    """The short commit of the code that runs (`source_commit`), ``+dirty`` when its tracked
    files differ from it, or ``?`` when neither git nor a stamp says."""
    found = source_commit(root)
    return "?" if found is None else found.short()


def record_meta(subcommand: str, use_gpu: bool) -> dict:
    """command, date, hardware, git commit, torch and Python versions."""
    import torch

    return {"command": command_line(subcommand), "date": utc_timestamp(), "hardware": hardware_name(use_gpu),
            "git_commit": git_commit(), "torch": torch.__version__, "python": platform.python_version()}


# -- typed result files: bench and capacity ------------------------------------------------------
# Each record names the keys every file has as fields and keeps the rest, as written, in
# ``extra``: so ``X.from_json(d).to_json() == d`` for every committed results/ file, old ones too.
# A field whose JSON key older files lack defaults to None and is left out when None.

def _known_and_extra(cls, data: dict, name: str) -> tuple[dict, dict]:
    """Split a JSON object into the fields of ``cls`` and the rest (its ``extra``)."""
    names = {f.name for f in fields(cls)} - {"extra"}
    required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING} - {"extra"}
    missing = sorted(required - data.keys())
    if missing:
        raise ValueError(f"{name} lacks {', '.join(missing)}: is this a {name} from `mpipemoe`? "
                         "Regenerate it with the command in its meta")
    return ({k: v for k, v in data.items() if k in names}, {k: v for k, v in data.items() if k not in names})


def _known_only(cls, data: dict, name: str) -> None:
    """Refuse a JSON object with keys that ``cls`` does not name (it has no ``extra``)."""
    _, extra = _known_and_extra(cls, data, name)
    if extra:
        raise ValueError(f"{name} has unknown keys {sorted(extra)}: expected only "
                         f"{', '.join(f.name for f in fields(cls))}")


def _fields_as_json(record, omit_when_none: tuple[str, ...]) -> dict:
    """The record's fields then its ``extra``; the optional keys of ``omit_when_none`` only when set."""
    data = {f.name: getattr(record, f.name) for f in fields(record) if f.name != "extra"}
    return {**{k: v for k, v in data.items() if not (k in omit_when_none and v is None)}, **record.extra}


class _FieldsAndExtra:
    """from_json/to_json for a dataclass of JSON fields plus ``extra``; ``OPTIONAL`` keys are
    left out when None, ``KIND`` names it in errors."""
    OPTIONAL: tuple[str, ...] = ()
    KIND = "record"

    @classmethod
    def from_json(cls, data: dict):
        known, extra = _known_and_extra(cls, data, cls.KIND)
        return cls(**known, extra=extra)

    def to_json(self) -> dict:
        return _fields_as_json(self, self.OPTIONAL)


@dataclass(frozen=True)
class RecordMeta(_FieldsAndExtra):
    """A result file's ``meta``: what `record_meta` writes, plus the command's own keys in ``extra``
    (bench: device, world_size, settings, complete ...; capacity: preset, search ...)."""
    command: str
    date: str
    hardware: str | None = None     # absent in the earliest bench file
    git_commit: str | None = None   # these three absent in the earliest capacity file
    torch: str | None = None
    python: str | None = None
    extra: dict = field(default_factory=dict)

    OPTIONAL = ("hardware", "git_commit", "torch", "python")
    KIND = "result meta"


@dataclass
class BenchPoint(_FieldsAndExtra):
    """One engine at one model, token count and routing (app/bench/layer.py `bench_point`): the keys
    every committed point has; the rest (routing, stage times, probes, emulation ...) in ``extra``."""
    engine: str
    model: str
    tokens: int
    world_size: int
    device: str
    dtype: str
    partitions: int
    strategy: str
    chosen_by: str
    fwd_bwd_ms: float
    fwd_bwd_ms_std: float
    peak_memory_bytes: int | None
    predicted_memory_bytes: int | None
    d_model: int
    d_hidden: int
    num_experts: int
    top_k: int
    activation: str
    expert_ffn_ms: float
    dense_ffn_ms: float
    expert_tflops: float
    dense_tflops: float
    expert_gemm_efficiency: float
    extra: dict = field(default_factory=dict)
    KIND = "bench point"

    @property
    def routing(self) -> str:
        """The token routing; points written before routing was a choice were uniform."""
        return self.extra.get("routing", "uniform")


@dataclass
class BenchResult:
    """`mpipemoe bench`'s JSON: meta, every point, one summary per model, routing and token count
    (dicts: their keys vary with the engines run), and the design targets (absent in the earliest file)."""
    meta: RecordMeta
    records: list[BenchPoint]
    summaries: list[dict]
    targets: dict | None = None

    @classmethod
    def from_json(cls, data: dict) -> BenchResult:
        _known_only(cls, data, "bench result")
        return cls(meta=RecordMeta.from_json(data["meta"]),
                   records=[BenchPoint.from_json(r) for r in data["records"]],
                   summaries=data["summaries"], targets=data.get("targets"))

    def to_json(self) -> dict:
        data = {"meta": self.meta.to_json(), "records": [r.to_json() for r in self.records],
                "summaries": self.summaries}
        return data if self.targets is None else {**data, "targets": self.targets}


@dataclass
class EngineCapacity(_FieldsAndExtra):
    """One engine's capacity search (app/commands/capacity.py `find_capacity`): the largest batch that fit,
    the trial at it (None when none fit), and every trial."""
    engine: str
    largest_batch_size: int | None
    at_largest: dict | None
    trials: list[dict]
    extra: dict = field(default_factory=dict)
    KIND = "capacity result"


@dataclass
class CapacityResult:
    """`mpipemoe capacity`'s JSON: meta and one search per engine."""
    meta: RecordMeta
    results: list[EngineCapacity]

    @classmethod
    def from_json(cls, data: dict) -> CapacityResult:
        _known_only(cls, data, "capacity record")
        return cls(meta=RecordMeta.from_json(data["meta"]),
                   results=[EngineCapacity.from_json(r) for r in data["results"]])

    def to_json(self) -> dict:
        return {"meta": self.meta.to_json(), "results": [r.to_json() for r in self.results]}
