"""``mpipemoe export``: a trained run's newest checkpoint as safetensors, a config and its tokenizer.

    mpipemoe export --run NAME --out exported/NAME

Writes ``model.safetensors`` (every tensor of the model, experts whole, float32),
``config.json`` (Hugging Face-style names, the whole architecture, and the preset that
rebuilds the model) and ``tokenizer.json`` (the run's tokenizer as a ``tokenizers`` file).
Load it back with ``workers.weights.load_exported(DIR)``; the folder layout is
workers/weights.py's docstring. A Mixtral-style run (``--preset tiny-mixtral``, ``mixtral-s``)
exports as a transformers ``MixtralForCausalLM`` (workers/hf_mixtral.py):
``AutoModelForCausalLM.from_pretrained(DIR)`` loads it, no remote code.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from app.jobs.trained import trained_run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, metavar="NAME", help="a training run (mpipemoe train --name)")
    parser.add_argument("--out", required=True, metavar="DIR", help="folder to write (created if missing)")
    parser.add_argument("--storage-path", default=None, help="where the run is (default ./ray_results)")


def check_out(out: str, run: str) -> Path:
    """The folder ``--out`` names, made absolute; raises ValueError naming the fix unless it is
    new, empty, or an earlier export of run ``run`` (which is replaced)."""
    from workers.weights import CONFIG_FILE

    if not out.strip():
        raise ValueError(f"--out {out!r} is empty: give the folder to write, e.g. --out exported/{run}")
    path = Path(out).expanduser().resolve()
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder: give a new or empty folder, e.g. --out exported/{run}")
    if path.is_dir() and any(path.iterdir()):
        try:
            source = json.loads((path / CONFIG_FILE).read_text())["mpipemoe_source"]["run"]
        except (OSError, ValueError, KeyError, TypeError):
            source = None
        if source != run:
            held = f"an export of run {source}" if source else "other files"
            raise ValueError(f"--out {out} already holds {held}: give a new or empty folder (an export of run {run} "
                             f"itself is replaced), or remove that one first")
    return path


def run(args: argparse.Namespace) -> int:
    from lm.errors import os_error
    from workers.weights import export

    out = check_out(args.out, args.run)  # before the model loads
    trained = trained_run(args.run, args.storage_path)
    try:
        sizes = export(trained.model, out, trained.tokenizer, trained.source())
    except OSError as error:
        raise os_error(error, f"cannot write the export to {out}", "choose a folder you can write (--out) with "
                                                                   "free space; nothing there was changed") from error
    files = ", ".join(f"{name} ({size / 2**20:,.1f} MiB)" for name, size in sizes.items())
    print(f"[mpipemoe] exported {args.run} at step {trained.meta.get('step')} to {args.out}: {files}")
    return 0
