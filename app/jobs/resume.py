"""Resuming a recorded run. Its settings file (``JOB_FILE``, written by ``save_job``; ``--resume NAME``
continues with its fields: ``resumed_job_fields``) and the copy of its data's manifest and
tokenizer (``RUN_DATA``); the checks that refuse, before anything is written, settings its
checkpoints cannot continue with (``check_continues``: the model, the worker count and data
layout, the tokenizer; where the settings file is gone, those of its newest checkpoint:
``checkpoint_settings``, ``continue_command``); the checkpoint it continues from
(``choose_checkpoint``); the segments of settings it trained with (``SEGMENT_FIELDS``,
``record_segment``); and the command that resumes it (``resume_command``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
from pathlib import Path

from app.jobs.job import TrainJob, base_preset, check_run_name
from app.tracking.run_kinds import SEGMENTS_TAG, run_segments
from app.tracking.store import resolve_tracking_uri
from lm import data as data_lib
from lm.errors import invocation, os_error
from lm.model import MODEL_OVERRIDES, PRESETS, ROUTING_OVERRIDES, get_preset
from workers import checkpoint as ckpt
from workers.reshard import check_worker_count, default_degree_known, resumed_settings


JOB_FILE = "mpipemoe_job.json"


def _read_job(job: TrainJob) -> dict:
    """The settings recorded in ``job``'s run directory ({} when there are none)."""
    try:
        return json.loads((job.run_dir / JOB_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _checkpoint_step(directory: str | Path) -> int:
    return json.loads((Path(directory) / ckpt.META).read_text()).get("step") or 0


# Settings a resumed run may change (its checkpoints load into any of them); each stretch of
# steps trained with one choice of them is a segment, recorded in the MLflow run.
SEGMENT_FIELDS = ("engine", "partitions", "strategy", "moe_memory_gib", "batch_size", "grad_accum", "lr", "dtype",
                  "param_dtype", "shard_dense", "use_gpu", "expert_parallel", "steps", "lr_schedule",
                  "decay_fraction")


def record_segment(run, job: TrainJob, recorded: dict, from_step: int, echo=print) -> list[dict]:
    """A resume of ``job`` from step ``from_step`` whose ``SEGMENT_FIELDS`` differ from the
    previous segment's (``recorded``, its settings file): MLflow params ``segment.<n>.<field>``
    for this segment, the tag ``mpipemoe.segments`` (JSON: every segment's first step and
    settings; the report reads it) and the tags ``engine``, ``partitions``, ``strategy`` of
    this segment. Returns the segments (unchanged when nothing changed)."""
    segments = run_segments(run.client.get_run(run.run_id).data.tags)
    if not segments and not recorded:  # the previous settings are unknown (settings file gone)
        return []
    if not segments:
        segments = [{"from_step": 1, **{k: recorded.get(k) for k in SEGMENT_FIELDS}}]
    current = {k: getattr(job, k) for k in SEGMENT_FIELDS}
    previous = {k: segments[-1].get(k) for k in SEGMENT_FIELDS}
    if current == previous:
        return segments
    segments.append({"from_step": from_step, **current})
    changed = ", ".join(f"{k} {previous[k]} -> {current[k]}" for k in SEGMENT_FIELDS if previous[k] != current[k])
    run.log_params({f"segment.{len(segments)}": {k: v for k, v in current.items() if v is not None}})
    run.set_tags({SEGMENTS_TAG: json.dumps(segments), "engine": job.engine, "partitions": job.partitions,
                  "strategy": job.strategy})
    echo(f"[mpipemoe] from step {from_step} {job.name} trains with {changed} (segment {len(segments)}, "
         f"recorded in MLflow)")
    return segments


def save_job(job: TrainJob) -> None:
    """Record the job's settings in its run directory (read back by ``--resume``)."""
    job.run_dir.mkdir(parents=True, exist_ok=True)
    partial = job.run_dir / f".{JOB_FILE}.partial"
    try:  # written whole or not at all (a full disk leaves the previous settings)
        partial.write_text(json.dumps(dataclasses.asdict(job), indent=1) + "\n")
        partial.replace(job.run_dir / JOB_FILE)
    except OSError as error:
        raise os_error(error, f"cannot write {job.run_dir / JOB_FILE}",
                       "free space there or choose another --storage-path") from error
    finally:
        partial.unlink(missing_ok=True)


def resume_command(job: TrainJob, steps: int | None = None) -> str:
    """The command that continues ``job`` (to ``steps``; None: its recorded steps), as the
    user can type it: with ``--storage-path`` where the checkpoints are not in ./ray_results."""
    more = f" --steps {steps}" if steps else ""
    return f"{invocation()} train --resume {shlex.quote(job.name)}{more}{_storage_flag(job.storage_path)}"


# Settings a run's checkpoints are tied to: the model's shape (its parameters and positions).
# The number of workers may change where each keeps whole experts and the data layout and
# global batch stay (workers/reshard.py; ``--resume`` with ``--num-workers`` sets them).
RUN_BOUND_FIELDS = ("preset",) + MODEL_OVERRIDES
# A run whose settings file is gone keeps its worker count too: the file holds the batch and
# data layout a resharded resume must keep (check_data_continues), so without it nothing
# shows that another count would continue the data at the same global sample.
ORPHAN_BOUND_FIELDS = RUN_BOUND_FIELDS + ("num_workers",)


def checkpoint_settings(run_dir: str | Path) -> dict | None:
    """Local. The run-bound settings (``RUN_BOUND_FIELDS``) that the newest complete checkpoint
    of ``run_dir`` was written with, read from its ``meta.json``, plus "checkpoint" (its folder
    name); None when the run has no complete checkpoint. "preset" is None when no preset has
    that model's shape."""
    chosen, _ = ckpt.choose(run_dir)
    if chosen is None:
        return None
    meta = json.loads((chosen / ckpt.META).read_text())
    model = meta.get("preset") or {}
    shape = {k: v for k, v in model.items() if k not in MODEL_OVERRIDES + ("vocab_size",)}
    preset = next((name for name, candidate in PRESETS.items()
                   if {k: v for k, v in dataclasses.asdict(candidate).items() if k in shape} == shape), None)
    return {"preset": preset, **{k: model.get(k) for k in MODEL_OVERRIDES}, "num_workers": meta.get("world_size"),
            "checkpoint": chosen.name}


def continue_command(name: str, storage_path: str, settings: dict, tracking_uri: str | None = None,
                     data_dir: str | None = None) -> str:
    """``mpipemoe train --name NAME`` with the run-bound ``settings`` (``checkpoint_settings``):
    how to continue a run whose settings file is gone. It names the store and the data
    (``tracking_uri``, ``data_dir``: those of the refused command, or, for the data, the run's
    kept copy's) as absolute paths, so that run from another folder it finds the same ones."""
    kept = Path(storage_path) / name / RUN_DATA / data_lib.MANIFEST
    try:
        data_dir = json.loads(kept.read_text()).get("data_dir") or data_dir
    except (OSError, ValueError):
        pass
    preset = dataclasses.asdict(get_preset(settings["preset"])) if settings.get("preset") in PRESETS else {}
    flags = "".join(f" --{k.replace('_', '-')} {shlex.quote(str(settings[k]))}" for k in ORPHAN_BOUND_FIELDS
                    if settings.get(k) is not None and not (k in ROUTING_OVERRIDES and settings[k] == preset.get(k)))
    flags += "".join(f" {flag} {shlex.quote(value)}" for flag, value in
                     (("--data-dir", data_dir), ("--tracking-uri", tracking_uri)) if value)
    return f"{invocation()} train --name {shlex.quote(name)}{flags}{_storage_flag(storage_path)}"


def _storage_flag(storage_path: str) -> str:
    """`` --storage-path PATH`` unless PATH is the default ./ray_results of this folder."""
    return "" if Path(storage_path) == Path("ray_results").resolve() else f" --storage-path {shlex.quote(storage_path)}"


def check_continues(job: TrainJob) -> None:
    """When ``job.name`` is an existing run (``--resume``, or ``--name`` of a recorded run),
    refuse, before anything is written, settings its checkpoints cannot continue with: those
    recorded in its settings file, or, where that file is gone, those of its newest complete
    checkpoint (so that no attempt rewrites the settings of a run it cannot continue)."""
    check_same_tokenizer(job)
    path = job.run_dir / JOB_FILE
    new = job.model_preset()
    asked = {"preset": job.preset, **{k: getattr(new, k) for k in MODEL_OVERRIDES}, "num_workers": job.num_workers}
    if not path.exists():
        try:
            was = checkpoint_settings(job.run_dir)
        except (OSError, ValueError) as error:
            raise ValueError(f"cannot read the newest checkpoint of run {job.name} in {job.run_dir} "
                             f"({type(error).__name__}: {error}): choose another --name") from None
        if was is None or all(was[k] == asked[k] for k in ORPHAN_BOUND_FIELDS):
            return
        changed = [k for k in ORPHAN_BOUND_FIELDS if was[k] != asked[k]]
        flags = ", ".join(f"--{k.replace('_', '-')} {asked[k]} (its {was['checkpoint']} has {was[k]})"
                          for k in changed)
        raise ValueError(f"run {job.name} cannot continue with {flags}: its checkpoints hold that model split over "
                         f"its workers (its {JOB_FILE} is missing); continue it with `"
                         f"{continue_command(job.name, job.storage_path, was, job.tracking_uri, job.data_dir)}`, or "
                         f"start a new run with another "
                         f"--name. Nothing was changed")
    try:
        recorded = json.loads(path.read_text())
        old = base_preset(recorded["preset"], recorded.get("init_from")).replace(
            **{k: recorded.get(k) for k in MODEL_OVERRIDES})
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"cannot read the settings of run {job.name} in {path} ({type(error).__name__}: {error}): "
                         f"choose another --name, or remove {job.run_dir} to start it afresh") from None
    was = {"preset": recorded["preset"], **{k: getattr(old, k) for k in MODEL_OVERRIDES}}
    if dataclasses.asdict(old) == dataclasses.asdict(new):
        check_data_continues(job, recorded)
        return
    changed = [k for k in RUN_BOUND_FIELDS if was[k] != asked[k]] or ["preset"]
    flags = ", ".join(f"--{k.replace('_', '-')} {asked[k]} (the run has {was[k]})" for k in changed)
    raise ValueError(f"run {job.name} cannot continue with {flags}: its checkpoints hold that model split over "
                     f"its workers; drop those options (`{resume_command(job)}`), or start a new run with "
                     f"another --name. Nothing was changed")


# A run keeps a copy of its prepared data's manifest and tokenizer in ``<run>/data/`` (written
# when its MLflow run starts): ``generate``/``export`` read the tokenizer from there, and a
# resume checks the data it is given against it.
RUN_DATA = "data"


def prepare_again_command(kept: Path, data_dir: str | Path) -> str:
    """``mpipemoe data prepare`` that prepares ``data_dir`` again with the tokenizer of a run's
    kept data (``kept``, a run's ``data/``): its tokenizer.json, or the byte tokenizer."""
    manifest = data_lib.Manifest.load(kept)
    tokenizer = str(kept / manifest.tokenizer_file) if manifest.tokenizer_file else "bytes"
    sources = [] if manifest.source.startswith("python stdlib sources") else manifest.source.split(", ")
    source = (" --source " + " ".join(shlex.quote(s) for s in sources)) if sources else ""
    return f"{invocation()} data prepare{source} --tokenizer {shlex.quote(tokenizer)} --out {shlex.quote(str(data_dir))}"


def check_same_tokenizer(job: TrainJob) -> None:
    """Refuse (before Ray starts, writing nothing) to continue run ``job.name`` on data whose
    token ids mean other text than those it trained on: another tokenizer than the one its
    ``data/`` copy records, or, for a run trained before it kept one, another vocabulary than
    its newest checkpoint's model."""
    if not (Path(job.data_dir) / data_lib.MANIFEST).exists():
        return  # ensure_data names the fix (with the run's tokenizer)
    now = data_lib.tokenizer_identity(job.data_dir, data_lib.Manifest.load(job.data_dir))
    kept = job.run_dir / RUN_DATA
    if (kept / data_lib.MANIFEST).exists():
        was = data_lib.tokenizer_identity(kept, data_lib.Manifest.load(kept))
        same = (was["vocab_size"], was["tokenizer_sha256"]) == (now["vocab_size"], now["tokenizer_sha256"])
        fix = f"prepare it again with the run's tokenizer (`{prepare_again_command(kept, job.data_dir)}`)"
    else:
        chosen, _ = ckpt.choose(job.run_dir)
        if chosen is None:
            return
        vocab = (json.loads((chosen / ckpt.META).read_text()).get("preset") or {}).get("vocab_size")
        was = {"tokenizer": "its checkpoints' tokenizer", "vocab_size": vocab}
        same = vocab in (None, now["vocab_size"])
        fix = "prepare it again with the tokenizer the run trained on"
    if not same:
        raise ValueError(f"run {job.name} trained on tokenizer {data_lib.describe_tokenizer(was)}, but "
                         f"{job.data_dir} now holds data of tokenizer {data_lib.describe_tokenizer(now)} (prepared "
                         f"again since): {fix}, give --data-dir of the run's data, or start a new run with another "
                         f"--name. Nothing was changed")


def check_data_continues(job: TrainJob, recorded: dict) -> None:
    """Refuse a worker count, data layout or global batch that would not continue the run
    ``recorded`` at the same global sample (``--resume`` derives them; ``--name`` of a
    recorded run with other options may not)."""
    workers, global_batch = recorded["num_workers"], recorded["batch_size"] * recorded["num_workers"]
    layout = recorded.get("data_shards") or workers  # data_shards: recorded since runs reshard
    if job.num_workers == workers and (job.data_shards or job.num_workers) == layout:
        return
    check_worker_count(job.model_preset().num_experts, global_batch, job.num_workers,
                       f"run {job.name} (trained on {workers} workers)", job.expert_parallel,
                       default_degree_known=default_degree_known(job.use_gpu))
    if (job.data_shards or job.num_workers) != layout or job.batch_size * job.num_workers != global_batch:
        raise ValueError(f"run {job.name} cannot continue with --num-workers {job.num_workers} and --batch-size "
                         f"{job.batch_size}: its data continues at the same global sample only with its global "
                         f"batch ({global_batch} sequences) read as {layout} rank stream(s); continue it with "
                         f"`{resume_command(job)} --num-workers {job.num_workers}`. Nothing was changed")


def choose_checkpoint(job: TrainJob, echo=print) -> str | None:
    """The checkpoint a resumed ``job`` continues from: the newest complete one in its run
    directory (None when it has none: a fresh start). Newer incomplete ones are named in one
    line each and moved to ``<run>/damaged/`` (the resumed run writes those steps again);
    Ray Train's own run snapshot, which may name them, is set aside, so Ray Train starts
    its bookkeeping afresh and the workers load the chosen checkpoint. Raises ValueError
    when checkpoints exist and none is complete (before MLflow or Ray Train is touched)."""
    present = ckpt.listed(job.run_dir)
    if not present and not ckpt.referenced_by_ray(job.run_dir):
        return None
    chosen, skipped = ckpt.choose(job.run_dir)  # with checksums, before Ray: a damaged shard is found here
    # No save ever finished (a full disk at the first checkpoint, a kill during it): nothing
    # was reached that a restart could lose, so the run trains again from step 1.
    unfinished = bool(present) and all(not (path / ckpt.META).exists() for _, path in present)
    if chosen is None and not unfinished:
        found = "; ".join(f"{name}: {why}" for name, why in skipped)
        raise ValueError(f"--resume {job.name}: no complete checkpoint in {job.run_dir} ({found}), so the run "
                         f"cannot continue; start a new run (another --name), or move {job.run_dir} away to train "
                         f"{job.name} again from step 1; nothing was deleted")
    then = f"resuming from {chosen.name}" if chosen is not None else "no save finished: training again from step 1"
    for name, why in skipped:
        try:
            moved = ckpt.set_aside(job.run_dir, name)
        except OSError as error:
            raise os_error(error, f"--resume {job.name}: {name} is damaged ({why}) and cannot be moved out of "
                                  f"{job.run_dir}", "move it away yourself and resume again"
                                                    + (f"; {chosen.name} is intact" if chosen else "")) from error
        where = f"; moved to {moved.relative_to(job.run_dir)}/" if moved else ""
        echo(f"[mpipemoe] skipped {name}: {why}{where}; {then}")
    snapshot = job.run_dir / ckpt.RAY_SNAPSHOT
    if snapshot.exists():
        os.replace(snapshot, snapshot.with_name(snapshot.name + ".previous"))
    return str(chosen) if chosen is not None else None


def resumed_job_fields(resume: str, given: dict) -> dict:
    """The fields of run ``resume``'s job, recorded in <storage-path>/<resume>/JOB_FILE, with the
    options ``given`` on the command line applied as workers/reshard.py allows."""
    check_run_name(resume, "--resume")
    run_dir = Path(given.get("storage_path") or "ray_results").expanduser().resolve() / resume
    if not (run_dir / JOB_FILE).exists():
        found = checkpoint_settings(run_dir)
        if found is not None:  # the settings file is gone, the checkpoints are not
            data_dir = str(Path(given["data_dir"]).expanduser().resolve()) if given.get("data_dir") \
                else str(data_lib.default_data_dir())
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
