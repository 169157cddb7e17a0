"""Sharded checkpoints of the training loop (``torch.distributed.checkpoint``).

A checkpoint directory ``checkpoint_NNNNNN/`` holds, merged by Ray Train from every worker:

- ``__R_0.distcp`` ... one per rank R, written by that rank: its shard of the model and
  AdamW state (dense parameters once, or sharded under FSDP2; *this rank's* experts, saved
  as slices of the global ``[E, ...]`` expert tensors) and its RNG state;
- ``.metadata`` (rank 0): DCP's index of the tensors in the shards;
- ``meta.json`` (rank 0), the completeness marker, written last (write, then rename):
  step, data position, world size, engine, preset, seed, and every file of the checkpoint
  with its size in bytes and its CRC-32, gathered from all ranks after they wrote.

``validate`` checks a directory against its ``meta.json`` (plain file I/O, no collectives):
a checkpoint whose marker is missing, empty or unreadable, or one of whose files is missing,
unreadable or shorter/longer than recorded (with ``checksums``: or whose bytes changed), is
incomplete; ``choose`` picks the newest complete one.
A checkpoint loads on another world size or expert-parallel degree that keeps whole experts
per rank, and into any engine and either dense mode, since DCP reshards (workers/reshard.py: the rules, and how the
data continues at the same global sample).

DCP and DTensor (``torch.distributed.checkpoint``, ``.tensor``) are imported where a
checkpoint is saved or loaded: importing them costs about 0.5 s, which the driver (it reads
this module to choose a checkpoint) and runs without checkpoints need not pay.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import zlib
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from lm.errors import os_error
from workers.distributed import DenseParallel, expert_param_names
from workers.reshard import check_checkpoint_layout

META = "meta.json"
DAMAGED = "damaged"            # incomplete checkpoints are moved here (never deleted)
RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"
_NAME = re.compile(r"^checkpoint_(\d{6})$")
_EXPERT_MOMENTS = ("exp_avg", "exp_avg_sq")


def checkpoint_name(step: int) -> str:
    return f"checkpoint_{step:06d}"


# ---- collective: save and load --------------------------------------------------------------

def _state(parallel: DenseParallel, optimizer: torch.optim.Optimizer, rank: int, world_size: int) -> dict[str, Any]:
    """Collective when W > 1 (DeviceMesh). The DCP state dict: model and optimizer by fully
    qualified name, expert tensors as DTensors of the global expert tensor (DCP would otherwise
    keep one rank's copy of a name), and this rank's RNG state.

    The expert tensors are ``Shard(0)`` over the P ranks of an expert group and, with W / P > 1
    expert groups (``parallel.replicas``), ``Replicate()`` across the groups: a (W / P, P) mesh
    whose rows are the expert groups of consecutive ranks (workers/distributed.py). DCP writes
    a replicated chunk once (its save planner keeps one of the ranks holding it), and any
    layout of ranks reads its own slices back."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    # (DCP types the values as a union of every state kind; these are nested dicts of tensors)
    model_sd, optim_sd = cast(tuple[dict[str, Any], dict[str, Any]], get_state_dict(parallel.model, optimizer))
    if world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from torch.distributed.tensor.placement_types import Placement

        replicas = parallel.replicas
        placements: list[Placement] = [Shard(0)] if replicas == 1 else [Replicate(), Shard(0)]
        mesh = parallel.checkpoint_mesh or init_device_mesh(
            parallel.device.type, (world_size,) if replicas == 1 else (replicas, world_size // replicas))
        parallel.checkpoint_mesh = mesh  # (a mesh of two dimensions creates process groups: once per run)
        for name in expert_param_names(parallel.model):
            model_sd[name] = DTensor.from_local(model_sd[name], mesh, placements, run_check=False)
            if name in optim_sd["state"]:  # a new dict: the optimizer's own must stay plain tensors
                optim_sd["state"][name] = {key: DTensor.from_local(value, mesh, placements, run_check=False)
                                           if key in _EXPERT_MOMENTS else value
                                           for key, value in optim_sd["state"][name].items()}
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    return {"model": model_sd, "optim": optim_sd, f"rng_rank{rank:05d}": rng}


def _unshard_experts(state: dict[str, Any], parallel: DenseParallel) -> tuple[dict[str, Any], dict[str, Any]]:
    """Local. The model and optimizer state dicts of ``_state`` with the expert DTensors
    made local again (FSDP2's own DTensors stay as they are)."""
    from torch.distributed.tensor import DTensor

    model_sd, optim_sd = dict(state["model"]), state["optim"]
    for name in expert_param_names(parallel.model):
        if isinstance(model_sd[name], DTensor):
            model_sd[name] = model_sd[name].to_local()
        moments = optim_sd["state"].get(name, {})
        for key in _EXPERT_MOMENTS:
            if isinstance(moments.get(key), DTensor):
                moments[key] = moments[key].to_local()
    return model_sd, optim_sd


def drop_absent_expert_bias(model_sd: dict[str, Any], directory: str | Path) -> None:
    """Local. Leave out of ``model_sd`` (a model state dict that DCP loads under "model") the
    routers' expert biases that the checkpoint in ``directory`` lacks: it was written before
    routers had one, and the model keeps its zero bias, which selects as that model did."""
    import torch.distributed.checkpoint as dcp

    present = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    for name in [n for n in model_sd if n.endswith("router.expert_bias") and f"model.{n}" not in present]:
        del model_sd[name]


def save(directory: str | Path, rank: int, world_size: int, parallel: DenseParallel, optimizer: torch.optim.Optimizer,
         meta: dict[str, Any]) -> None:
    """Collective: every rank writes its shard into its ``directory`` (a local folder that
    Ray Train merges into the run's checkpoint); rank 0 then writes ``meta.json`` listing
    all ranks' files with their sizes."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(parallel, optimizer, rank, world_size), storage_writer=dcp.FileSystemWriter(directory))
    write_meta(directory, rank, world_size, meta)


def save_async(directory: str | Path, rank: int, world_size: int, parallel: DenseParallel,
               optimizer: torch.optim.Optimizer, group: dist.ProcessGroup | None = None) -> Future[Any]:
    """Collective: copies this rank's state to host memory now (training may go on at once)
    and writes the shards in a background thread, whose collectives run on ``group`` (a
    gloo group of its own: the training collectives must not interleave with them).
    Returns the future; after ``future.result()`` call ``write_meta`` (collective)."""
    import torch.distributed.checkpoint as dcp

    # (a Future without the staging options that make it return an AsyncSaveResponse)
    return cast("Future[Any]", dcp.async_save(_state(parallel, optimizer, rank, world_size),
                                              storage_writer=dcp.FileSystemWriter(directory),
                                              process_group=group))


def _os_error_in(error: BaseException) -> OSError | None:
    """The first OSError with an errno in ``error``: itself, its causes and contexts, or one
    of DCP's per-rank failures (``CheckpointException.failures``: rank -> (error, trace))."""
    todo: list[BaseException | None] = [error]
    seen: set[int] = set()
    while todo:
        found = todo.pop(0)
        if found is None or id(found) in seen:
            continue
        seen.add(id(found))
        if isinstance(found, OSError) and found.errno:
            return found
        todo += [found.__cause__, found.__context__]
        failures = getattr(found, "failures", None)
        if isinstance(failures, dict):
            todo += [pair[0] if isinstance(pair, tuple) else pair for pair in failures.values()]
    return None


@contextlib.contextmanager
def write_errors_explained(step: int) -> Iterator[None]:
    """Local (wraps collective saves): an OSError while checkpoint ``step`` is written (a full
    disk, a quota, a read-only folder; also inside DCP's ``CheckpointException``) becomes one
    line naming the checkpoint, the file and the fix. Other errors pass unchanged."""
    try:
        yield
    except BaseException as error:
        found = None if isinstance(error, (KeyboardInterrupt, SystemExit)) else _os_error_in(error)
        if found is None:
            raise
        where = "there" if found.filename else \
            f"in the workers' temporary folder ({tempfile.gettempdir()}) and the storage path"
        at = f" at {found.filename}" if found.filename else ""
        raise os_error(found, f"cannot write {checkpoint_name(step)}{at}",
                       f"free space {where} (or lower --keep-checkpoints) and resume: the run continues from its "
                       f"newest complete checkpoint") from None


def write_meta(directory: str | Path, rank: int, world_size: int, meta: dict[str, Any]) -> None:
    """Collective: gathers every rank's file sizes; rank 0 writes ``meta.json`` (the
    completeness marker) under a temporary name, then renames it."""
    directory = Path(directory)
    names = sorted(os.listdir(directory))
    mine = ({name: (directory / name).stat().st_size for name in names},
            {name: file_crc32(directory / name) for name in names})  # read back from the page cache
    every: list[Any] = [mine]
    if world_size > 1:
        every = [None] * world_size
        dist.all_gather_object(every, mine)
    if rank == 0:
        files: dict[str, int] = {}
        crc32: dict[str, str] = {}
        for sizes, sums in every:
            files.update(sizes)
            crc32.update(sums)
        temporary = directory / (META + ".tmp")
        temporary.write_text(json.dumps({**meta, "files": files, "crc32": crc32}, indent=1, sort_keys=True) + "\n")
        os.replace(temporary, directory / META)


CRC_BLOCK = 8 * 2**20
# The driver reads a checkpoint this large in seconds: zlib's CRC-32 ran at 0.45-0.6 GB/s on
# the 2-core CI machine while a test suite loaded it (load average 26), about 8 s for 4 GiB;
# larger checkpoints are left to the workers' load, which names a damaged one.
CHECKSUM_MAX_BYTES = 4 * 2**30


def file_crc32(path: str | Path) -> str:
    """Local. The CRC-32 of a file's bytes as 8 hex digits (see CHECKSUM_MAX_BYTES for its speed)."""
    crc = 0
    with open(path, "rb") as handle:
        while block := handle.read(CRC_BLOCK):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def load(directory: str | Path, rank: int, world_size: int, parallel: DenseParallel, optimizer: torch.optim.Optimizer,
         preset: dict[str, Any] | None = None, data_shards: int | None = None) -> dict[str, Any]:
    """Collective: restore this rank's state from ``directory``; returns its meta dict.

    ``preset`` (the model settings as a dict), when given, must match the checkpoint's.
    ``world_size`` and the expert-parallel degree (``parallel``'s) may differ from the
    checkpoint's when every rank keeps whole experts;
    ``data_shards`` (the run's data layout, None: one stream per rank) must be the
    checkpoint's (workers/reshard.py). Resharded, the RNG state starts afresh (it was per rank).
    Raises ValueError naming the file and the fix for an incomplete checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_state_dict

    directory = Path(directory)
    problem = validate(directory, checksums=False)  # sizes: the driver chose it with checksums (``choose``)
    if problem:
        raise ValueError(f"checkpoint {directory} is incomplete: {problem}; resume picks the newest "
                         f"complete checkpoint (mpipemoe train --resume NAME)")
    meta: dict[str, Any] = json.loads((directory / META).read_text())
    if preset is not None and meta.get("preset") != preset:
        changed = sorted(k for k in preset if meta.get("preset", {}).get(k) != preset[k])
        raise ValueError(f"checkpoint in {directory} was written for another model ({', '.join(changed)} "
                         f"differ): resume with the model settings of that run")
    check_checkpoint_layout(meta, world_size, data_shards, directory, world_size // parallel.replicas)
    state = _state(parallel, optimizer, rank, world_size)
    drop_absent_expert_bias(state["model"], directory)
    resharding = meta["world_size"] != world_size
    if resharding:  # DCP cuts the global tensors for W ranks; the RNG states were per rank
        state = {key: value for key, value in state.items() if not key.startswith("rng_rank")}
    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(directory))
    except (Exception, CheckpointException) as error:  # DCP's own words (e.g. miniz's) name no file, no fix
        lines = str(error).strip().splitlines()
        raise ValueError(f"checkpoint {directory} cannot be read ({type(error).__name__}: "
                         f"{lines[-1][:200] if lines else ''}): it is damaged; move it out of the run folder and "
                         f"resume (mpipemoe train --resume NAME), which continues from the newest intact "
                         f"checkpoint") from None
    model_sd, optim_sd = _unshard_experts(state, parallel)
    set_state_dict(parallel.model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    if not resharding:
        rng = state[f"rng_rank{rank:05d}"]
        torch.set_rng_state(rng["torch"].cpu())
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"].cpu())
    return meta


# ---- local: validation, choice, pruning ------------------------------------------------------

def _unreadable(error: OSError) -> str:
    return os.strerror(error.errno) if error.errno else type(error).__name__


def validate(directory: str | Path, checksums: bool = True) -> str | None:
    """Local. None if ``directory`` is a complete checkpoint, else what is wrong (one phrase).
    ``checksums`` (default): also read every file and compare its CRC-32 with ``meta.json``'s (a
    same-size corruption), for checkpoints up to ``CHECKSUM_MAX_BYTES``; larger ones and those
    written before checksums are checked by size only. The one verifier of every reader of a
    checkpoint: ``train --resume`` (through ``choose``), ``generate`` and ``export``
    (``choose``, then ``workers.weights.load_checkpoint_model``); the workers' ``load`` and
    ``prune`` check sizes only (the driver checked the checkpoint it resumes from)."""
    directory = Path(directory)
    if not directory.is_dir():
        return "its folder is missing"
    try:
        text = (directory / META).read_text()
    except FileNotFoundError:
        return f"{META} (the completeness marker, written last) is missing: the save did not finish"
    except (OSError, UnicodeDecodeError) as error:  # no permission, a folder, bytes that are no text
        why = _unreadable(error) if isinstance(error, OSError) else "not text"
        return f"{META} cannot be read ({why})"
    try:
        meta = json.loads(text)
    except json.JSONDecodeError:
        return f"{META} is {'empty' if not text.strip() else 'not valid JSON'}"
    files = meta.get("files") if isinstance(meta, dict) else None
    if not isinstance(files, dict) or not files:
        return f"{META} lists no files (written before sharded checkpoints, or damaged)"
    sums = meta.get("crc32") if checksums and isinstance(meta.get("crc32"), dict) else {}
    if sum(size for size in files.values() if isinstance(size, int)) > CHECKSUM_MAX_BYTES:
        sums = {}  # reading it all would hold the resume up; the workers' load names a damaged file
    for name, size in sorted(files.items()):
        path = directory / name
        try:
            if not path.is_file():
                return f"{name} is missing"
            actual = path.stat().st_size
            if actual != size:
                return f"{name} is {'truncated' if actual < size else 'damaged'} ({actual:,} of {size:,} bytes)"
            if name in sums and file_crc32(path) != sums[name]:
                return f"{name} is damaged (its bytes differ from those written: CRC-32 mismatch)"
        except OSError as error:
            return f"{name} cannot be read ({_unreadable(error)})"
    return None


def listed(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Local. (step, path) of the checkpoint folders in ``run_dir``, newest first."""
    run_dir = Path(run_dir)
    found = [(int(m.group(1)), path) for path in run_dir.iterdir() if (m := _NAME.match(path.name))] \
        if run_dir.is_dir() else []
    return sorted(found, reverse=True)


def referenced_by_ray(run_dir: str | Path) -> set[str]:
    """Local. Checkpoint folder names that Ray Train's run snapshot refers to."""
    try:
        return set(re.findall(r"checkpoint_\d{6}", (Path(run_dir) / RAY_SNAPSHOT).read_text()))
    except (FileNotFoundError, UnicodeDecodeError):
        return set()


def choose(run_dir: str | Path, checksums: bool = True) -> tuple[Path | None, list[tuple[str, str]]]:
    """Local. The newest complete checkpoint of ``run_dir`` (None if there is none) and the
    newer ones skipped, as (folder name, what is wrong): incomplete folders, and folders Ray
    Train's snapshot names that are gone. ``checksums``: see ``validate`` (reads the files of
    the checkpoints it looks at, newest first, until one is intact)."""
    present = listed(run_dir)
    names = {path.name for _, path in present}
    skipped = [(name, "its folder is missing") for name in sorted(referenced_by_ray(run_dir) - names, reverse=True)]
    for step, path in present:
        problem = validate(path, checksums)
        if problem is None:
            newest = step
            skipped = [(n, why) for n, why in skipped if _NAME.match(n) and int(n[11:]) > newest]
            return path, skipped
        skipped.append((path.name, problem))
    return None, skipped


def set_aside(run_dir: str | Path, name: str) -> Path | None:
    """Local. Move an incomplete checkpoint folder to ``run_dir/damaged/`` (a resumed run
    writes a folder of the same name again); returns where it went, None if it is gone."""
    source = Path(run_dir) / name
    if not source.exists():
        return None
    target = Path(run_dir) / DAMAGED / name
    suffix = 1
    while target.exists():
        target = Path(run_dir) / DAMAGED / f"{name}.{suffix}"
        suffix += 1
    target.parent.mkdir(exist_ok=True)
    try:
        os.replace(source, target)
    except PermissionError:  # moving a folder we may not write (its ".." entry) to another parent
        target = Path(run_dir) / f"{DAMAGED}-{target.name}"  # a rename in place needs no such right
        os.replace(source, target)
    return target


def prune(run_dir: str | Path, keep: int) -> list[Path]:
    """Local. Delete all but the ``keep`` newest complete checkpoints (``keep`` 0: keep all);
    incomplete folders are left alone. Returns the deleted folders."""
    if keep <= 0:
        return []
    complete = [path for _, path in listed(run_dir) if validate(path, checksums=False) is None]
    for path in complete[keep:]:
        shutil.rmtree(path, ignore_errors=True)
    return complete[keep:]
