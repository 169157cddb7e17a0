"""A trained run loaded into this process: the newest intact checkpoint's model (every expert)
and the tokenizer the run trained with. Shared by ``mpipemoe generate`` (app/commands/generate.py) and
``mpipemoe export`` (app/commands/export.py).

The checkpoint is chosen as ``train --resume`` chooses it (``workers.checkpoint.choose``:
sizes and CRC-32 checksums against its ``meta.json``; newer damaged ones are named and
skipped). The tokenizer is the copy the run keeps in ``<run>/data/`` (app/jobs/resume.py,
``RUN_DATA``); a run trained before runs kept one uses its data folder's, if that still has
the model's vocabulary.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_STORAGE = "ray_results"


@dataclass
class TrainedRun:
    name: str
    checkpoint: Path
    meta: dict        # the checkpoint's meta.json (step, preset, world size ...)
    model: Any        # lm.model.MoETransformer in eval mode, every expert in this process
    tokenizer: Any    # lm.tokenizer ByteTokenizer or HFTokenizer, the one the run trained with

    def source(self) -> dict:
        return {"run": self.name, "checkpoint": str(self.checkpoint), "step": self.meta.get("step"),
                "engine": self.meta.get("engine"), "world_size": self.meta.get("world_size")}


def trained_run(name: str, storage_path: str | None = None, echo=None) -> TrainedRun:
    """Run ``name`` under ``storage_path`` (default ./ray_results): its newest intact checkpoint
    loaded into one process, and the run's tokenizer. ``echo`` (default: stderr) gets one line
    per newer checkpoint skipped as damaged. Raises ValueError naming the fix when the run, a
    checkpoint or its tokenizer is missing, or the tokenizer does not fit the model."""
    from app.jobs.job import check_run_name
    from app.jobs.resume import JOB_FILE, RUN_DATA
    from lm.data import MANIFEST, Manifest
    from lm.errors import invocation
    from lm.tokenizer import load_prepared
    from workers import checkpoint as ckpt
    from workers.weights import load_checkpoint_model

    echo = echo or (lambda line: print(line, file=sys.stderr))
    check_run_name(name, "--run")
    run_dir = Path(storage_path or DEFAULT_STORAGE).expanduser().resolve() / name
    if not (run_dir / JOB_FILE).exists():
        raise ValueError(f"--run {name}: no run recorded at {run_dir} ({JOB_FILE} missing); check the name and "
                         f"--storage-path")
    recorded = json.loads((run_dir / JOB_FILE).read_text())
    chosen, skipped = ckpt.choose(run_dir)
    if chosen is None:
        found = f" ({'; '.join(f'{n}: {why}' for n, why in skipped)})" if skipped else ""
        if recorded.get("checkpoint_every") == 0 and not skipped:
            raise ValueError(f"--run {name}: it was trained with --checkpoint-every 0, so it has no checkpoint "
                             f"to load; train a new run with checkpoints (the default --checkpoint-every "
                             f"writes one at the last step)")
        if skipped:  # every checkpoint damaged: a resume has nothing to continue from either
            raise ValueError(f"--run {name}: no intact checkpoint in {run_dir}{found}; none can be loaded, nor "
                             f"resumed: train a new run (another --name), or move {run_dir} away and train "
                             f"{name} again from step 1; nothing was deleted")
        raise ValueError(f"--run {name}: no intact checkpoint in {run_dir}{found}; continue its training "
                         f"(`{invocation()} train --resume {name}`) or train a new run")
    for skipped_name, why in skipped:
        echo(f"[mpipemoe] skipped {skipped_name}: {why}; using {chosen.name}")
    kept = run_dir / RUN_DATA
    data_dir = kept if (kept / MANIFEST).exists() else recorded.get("data_dir")
    if data_dir != kept and not (Path(data_dir) / MANIFEST).exists():
        vocab = (json.loads((chosen / ckpt.META).read_text()).get("preset") or {}).get("vocab_size")
        raise ValueError(f"--run {name}: no prepared data at {data_dir}, whose tokenizer the run needs (it was "
                         f"trained before runs kept a copy of theirs): prepare that folder again as before, with the "
                         f"same --source and --tokenizer (the model has a vocabulary of {vocab})")
    manifest = Manifest.load(data_dir)  # raises naming the fix
    tokenizer = load_prepared(data_dir, manifest.tokenizer_file)
    model, meta = load_checkpoint_model(chosen)
    # --init-from: the checkpoint's embedding fixes the vocabulary; the mask and padding tokens that
    # `data prepare` adds to a tokenizer lacking them lie beyond it (app/jobs/preflight.py)
    pretrained = bool(recorded.get("init_from")) and tokenizer.eos_id < model.preset.vocab_size
    if model.preset.vocab_size != tokenizer.vocab_size and not pretrained:
        raise ValueError(f"--run {name}: its model has a vocabulary of {model.preset.vocab_size} tokens, but the "
                         f"tokenizer of {data_dir} ({manifest.tokenizer}) has {tokenizer.vocab_size}: that data was "
                         f"prepared again with another tokenizer since the run trained; prepare it again with the "
                         f"run's tokenizer (the same --source and --tokenizer as before)")
    return TrainedRun(name, chosen, meta, model, tokenizer)
