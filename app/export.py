"""``mpipemoe export``: a trained run's newest checkpoint as safetensors, a config and its tokenizer.

    mpipemoe export --run NAME --out exported/NAME

Writes ``model.safetensors`` (every tensor of the model, experts whole, float32),
``config.json`` (Hugging Face-style names plus the preset that rebuilds the model) and
``tokenizer.json`` (the run's tokenizer as a ``tokenizers`` file). Load it back with
``workers.weights.load_exported(DIR)``; the folder layout is workers/weights.py's docstring.
"""
from __future__ import annotations

import argparse

from app.trained import trained_run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, metavar="NAME", help="a training run (mpipemoe train --name)")
    parser.add_argument("--out", required=True, metavar="DIR", help="folder to write (created if missing)")
    parser.add_argument("--storage-path", default=None, help="where the run is (default ./ray_results)")


def run(args: argparse.Namespace) -> int:
    from workers.weights import export

    trained = trained_run(args.run, args.storage_path)
    sizes = export(trained.model, args.out, trained.tokenizer, trained.source())
    files = ", ".join(f"{name} ({size / 2**20:,.1f} MiB)" for name, size in sizes.items())
    print(f"[mpipemoe] exported {args.run} at step {trained.meta.get('step')} to {args.out}: {files}")
    return 0
