"""The checks a job passes before Ray starts, within seconds and writing nothing: its data is
prepared (the default dataset is, when missing), readable and holds a batch per worker
(``ensure_data``); its sizes fit this machine when Ray runs embedded on it (``check_sizes``:
workers per core, the time of a step on CPU, memory). Those against a recorded run are
app/jobs/resume.py (``check_continues``).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from app.jobs.job import TrainJob, _fail
from app.jobs.resume import RUN_DATA, prepare_again_command
from lm import data as data_lib
from lm.errors import invocation
from lm.tokenizer import KNOWN_SPECIALS

KNOWN_EOS = KNOWN_SPECIALS["eos"]
from lm.model import estimate_step_flops, estimate_worker_bytes


def ensure_data(job: TrainJob, echo=print) -> None:
    """Prepare the default dataset when it is missing; a custom data_dir must be prepared.
    Then check, before any worker starts, that it is readable and holds a batch per worker."""
    kept = job.run_dir / RUN_DATA
    if not (Path(job.data_dir) / data_lib.MANIFEST).exists() and (kept / data_lib.MANIFEST).exists():
        raise FileNotFoundError(f"no prepared data at {job.data_dir} ({data_lib.MANIFEST} missing), which run "
                                f"{job.name} trained on: prepare it again with the run's tokenizer: "
                                f"`{prepare_again_command(kept, job.data_dir)}` (or give --data-dir)")
    if job.init_from:
        check_init_from_data(job)
    if Path(job.data_dir) == data_lib.default_data_dir():
        data_lib.ensure_default_data(job.data_dir, echo=echo)
    manifest = data_lib.Manifest.load(job.data_dir)  # raises naming the fix
    preset = job.model_preset(vocab_size=manifest.vocab_size)
    window = preset.seq_len + 1 if preset.kind == "gpt" else preset.seq_len
    streams = job.data_shards or job.num_workers  # a resharded run reads its first layout
    manifest.check_fits(job.data_dir, streams, job.batch_size * job.num_workers // streams, window)
    if job.eval_every and not manifest.has_validation:
        echo(f"[mpipemoe] note: {job.data_dir} has no validation split (prepared before there was one, or with "
             f"--val-fraction 0), so no validation loss is reported; to get one, run its `{invocation()} data "
             f"prepare ... --out {job.data_dir}` again (it holds out --val-fraction {data_lib.DEFAULT_VAL_FRACTION} "
             f"of the rows by default)")
    elif job.eval_every and manifest.val_rows * manifest.row_len // window < job.num_workers:
        echo(f"[mpipemoe] note: the validation split of {job.data_dir} holds fewer windows of {window} tokens "
             f"than the {job.num_workers} workers, so no validation loss is reported; prepare it with a larger "
             f"--val-fraction")


def check_init_from_data(job: TrainJob) -> None:
    """--init-from DIR: the data must be prepared with DIR's tokenizer.json (the same token ids
    for the same text: the same vocabulary), and its ids must fit the checkpoint's embedding
    (``vocab_size`` of config.json; the end-of-text, mask and padding tokens that ``data prepare``
    adds to a tokenizer lacking them lie beyond it, and only end-of-text occurs in a decoder's
    data). Raises naming the command that prepares it."""
    from lm.tokenizer import TOKENIZER_FILE, HFTokenizer, load_prepared

    assert job.init_from is not None
    folder = Path(job.init_from)
    prepare = (f"prepare it with `{invocation()} data prepare --source YOUR_TEXT --tokenizer {folder} --out "
               f"data/{folder.name}` and give --data-dir data/{folder.name}")
    if not (folder / TOKENIZER_FILE).is_file():
        raise ValueError(f"--init-from {folder}: no {TOKENIZER_FILE} there: the run's data must be tokenized as the "
                         f"checkpoint was trained; copy the model's {TOKENIZER_FILE} into {folder}")
    if not (Path(job.data_dir) / data_lib.MANIFEST).exists():
        raise FileNotFoundError(f"--init-from {folder}: no prepared data at {job.data_dir}: {prepare}")
    manifest = data_lib.Manifest.load(job.data_dir)
    theirs = HFTokenizer.load(folder / TOKENIZER_FILE)
    ours = load_prepared(job.data_dir, manifest.tokenizer_file)
    if not isinstance(ours, HFTokenizer) or \
            ours.tokenizer.get_vocab(with_added_tokens=True) != theirs.tokenizer.get_vocab(with_added_tokens=True):
        raise ValueError(f"--init-from {folder}: the data at {job.data_dir} was prepared with tokenizer "
                         f"{manifest.tokenizer} (vocabulary {manifest.vocab_size:,}), not {folder}'s {TOKENIZER_FILE}: "
                         f"{prepare}")
    vocab = job.base_preset().vocab_size
    if manifest.eos_id >= vocab:
        raise ValueError(f"--init-from {folder}: the data's end-of-text id {manifest.eos_id} lies outside the "
                         f"checkpoint's vocab_size {vocab} (config.json): give a tokenizer.json whose end-of-text "
                         f"token ({', '.join(KNOWN_EOS)}) is one of the model's")


# Embedded local Ray on this machine: workers are whole PyTorch processes; beyond two per
# core none makes a step in minutes (measured: 64 workers on 2 cores made no step in 150 s
# and held 64 processes), so more are refused rather than started.
WORKERS_PER_CORE = 2
# One CPU worker's process before the model: torch, Ray and gloo loaded (make train's
# tiny-gpt workers peak at 636 MiB in all, README).
WORKER_BASE_BYTES = 500 * 2**20
# CPU speed assumed when refusing steps that would take too long: 5x the 1.9e10 FLOP/s per
# core that make train's tiny-gpt reaches (14,564 tokens/s on 2 cores x 6 x 426k active
# parameters per token), so only settings that are surely too slow are refused.
CPU_FLOPS_PER_CORE = 1e11
MAX_LOCAL_STEP_S = 300  # on this machine's CPUs; a step slower than this looks like a hang


def available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), else None (the memory check is then skipped)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_sizes(job: TrainJob, local: bool, use_gpu: bool | None = None) -> None:
    """Before Ray starts: refuse sizes this machine cannot run (``local``: embedded Ray, so
    all workers share this machine). Workers beyond ``WORKERS_PER_CORE`` per core, and a
    memory estimate (``lm.model.estimate_worker_bytes``) above the free host memory of
    all workers (CPU) or one GPU's memory (GPU, when this machine has the GPUs)."""
    preset = job.model_preset()
    cores = os.cpu_count() or 1
    if local and not use_gpu and job.num_workers > WORKERS_PER_CORE * cores:
        _fail("num_workers", job.num_workers,
              f"this machine has {cores} CPU core(s) and embedded Ray runs at most {WORKERS_PER_CORE * cores} "
              f"workers on them ({WORKERS_PER_CORE} per core; each is a whole PyTorch process): use "
              f"--num-workers {WORKERS_PER_CORE * cores} or fewer (and --num-experts to match), or a cluster "
              f"(--address, docs/cluster.md)")
    base = job.base_preset()
    longer = preset.seq_len > base.seq_len
    field, value = ("seq_len", preset.seq_len) if longer else ("batch_size", job.batch_size)
    positions = f"; --seq-len {preset.seq_len} also grows {job.preset}'s {base.seq_len} learned positions" \
        if longer else ""
    fix = f"lower --seq-len (the preset's is {base.seq_len}) or --batch-size"
    if local and not use_gpu:
        flops = estimate_step_flops(preset, job.batch_size)
        step_s = flops * job.num_workers / (min(job.num_workers, cores) * CPU_FLOPS_PER_CORE)
        if step_s > MAX_LOCAL_STEP_S:
            _fail(field, value,
                  f"one step of {job.model_label} with batch {job.batch_size} x seq_len {preset.seq_len} is about "
                  f"{flops:.1e} FLOPs per worker (attention grows with seq_len squared), over "
                  f"{step_s / 60:,.0f} min per step on this machine's {cores} core(s){positions}: {fix}, "
                  f"or train on GPUs")
    dtype_bytes = 4 if job.dtype in ("float32",) or (job.dtype == "auto" and not use_gpu) else 2
    estimate = estimate_worker_bytes(preset, job.batch_size, job.num_workers, dtype_bytes,
                                     0 if use_gpu else WORKER_BASE_BYTES, job.activation_checkpointing)
    if use_gpu:
        if not (local and torch.cuda.is_available()):
            return
        have, workers, where = torch.cuda.get_device_properties(0).total_memory, 1, "one GPU's"
    else:
        have, workers, where = available_host_bytes(), job.num_workers if local else 1, "this machine's free"
        if have is None or not local:
            return
    need = estimate["total"] * workers
    if need <= have:
        return
    gib = 2**30
    if estimate["params"] > estimate["activations"]:  # the model itself is too large
        field, value = ("num_experts", preset.num_experts) if job.num_experts else ("preset", job.preset)
        fix = "use fewer --num-experts or --num-layers, or a smaller --preset"
    _fail(field, value,
          f"{workers} worker(s) of {job.model_label} with batch {job.batch_size} x seq_len {preset.seq_len} need about "
          f"{need / gib:.1f} GiB (per worker {estimate['activations'] / gib:.1f} GiB activations, "
          f"{estimate['params'] / gib:.1f} GiB parameters and optimizer state), more than {where} "
          f"{have / gib:.1f} GiB{positions}: {fix}, or use fewer workers")
