"""A trained run loaded into this process: the newest complete checkpoint's model (every
expert) and the tokenizer of the data it trained on. Shared by ``mpipemoe generate``
(app/generate.py) and ``mpipemoe export`` (app/export.py)."""
from __future__ import annotations

import json
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
    tokenizer: Any    # lm.tokenizer ByteTokenizer or HFTokenizer, from the run's prepared data

    def source(self) -> dict:
        return {"run": self.name, "checkpoint": str(self.checkpoint), "step": self.meta.get("step"),
                "engine": self.meta.get("engine"), "world_size": self.meta.get("world_size")}


def trained_run(name: str, storage_path: str | None = None) -> TrainedRun:
    """Run ``name`` under ``storage_path`` (default ./ray_results): its newest complete
    checkpoint loaded into one process, and the tokenizer of the data it trained on.
    Raises ValueError naming the fix when the run, a checkpoint or its data is missing."""
    from app.jobs import JOB_FILE
    from lm.data import Manifest
    from lm.errors import invocation
    from lm.tokenizer import load_prepared
    from workers import checkpoint as ckpt
    from workers.weights import load_checkpoint_model

    run_dir = Path(storage_path or DEFAULT_STORAGE).expanduser().resolve() / name
    if not (run_dir / JOB_FILE).exists():
        raise ValueError(f"--run {name}: no run recorded at {run_dir} ({JOB_FILE} missing); check the name and "
                         f"--storage-path")
    chosen, skipped = ckpt.choose(run_dir)
    if chosen is None:
        found = f" ({'; '.join(f'{n}: {why}' for n, why in skipped)})" if skipped else ""
        raise ValueError(f"--run {name}: no complete checkpoint in {run_dir}{found}; train it with checkpoints "
                         f"(`{invocation()} train --resume {name}` continues it)")
    data_dir = json.loads((run_dir / JOB_FILE).read_text()).get("data_dir")
    manifest = Manifest.load(data_dir)  # raises naming the fix
    model, meta = load_checkpoint_model(chosen)
    return TrainedRun(name, chosen, meta, model, load_prepared(data_dir, manifest.tokenizer_file))
