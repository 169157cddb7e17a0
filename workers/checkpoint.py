"""Per-rank checkpoints of the training loop (local file I/O only, no collectives).

A checkpoint directory holds, merged by Ray Train from every worker:

- ``rank_00000.pt`` ... one per rank: model state (replicated params and *this rank's*
  expert shard), optimizer state, RNG states;
- ``meta.json`` (rank 0): step, data position, world size, engine, preset, seed.

A checkpoint loads only with the world size that wrote it (the expert shards are split
by rank); it loads into any engine, since all engines share one parameter layout.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

META = "meta.json"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def save(directory: str | Path, rank: int, model, optimizer, meta: dict) -> None:
    """Write this rank's state (and, on rank 0, ``meta``) into ``directory``."""
    directory = Path(directory)
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": rng,
                "rank": rank}, directory / rank_file(rank))
    if rank == 0:
        (directory / META).write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")


def load(directory: str | Path, rank: int, world_size: int, model, optimizer, device,
         preset: dict | None = None) -> dict:
    """Restore this rank's state from ``directory``; returns the checkpoint's meta dict.

    ``preset`` (the model settings as a dict), when given, must match the checkpoint's.
    """
    directory = Path(directory)
    meta = json.loads((directory / META).read_text())
    if preset is not None and meta.get("preset") != preset:
        changed = sorted(k for k in preset if meta.get("preset", {}).get(k) != preset[k])
        raise ValueError(f"checkpoint in {directory} was written for another model ({', '.join(changed)} "
                         f"differ): resume with the model settings of that run")
    if meta["world_size"] != world_size:
        raise ValueError(f"checkpoint in {directory} was written by {meta['world_size']} workers "
                         f"(expert shards are split by rank): resume with --num-workers {meta['world_size']}")
    state = torch.load(directory / rank_file(rank), map_location=device, weights_only=True)
    missing, unexpected = model.load_state_dict(state["model"], strict=False)
    param_names = {name for name, _ in model.named_parameters()}
    if param_names & set(missing):
        raise ValueError(f"checkpoint in {directory} lacks parameters {sorted(param_names & set(missing))[:5]}")
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"].cpu())
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["rng"]["cuda"].cpu())
    return meta
