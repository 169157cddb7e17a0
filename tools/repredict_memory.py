"""Re-make a bench record's memory predictions from the rows its measured pass moved.

`mpipemoe bench` before commit 'bench: rows of the measured pass' took each probed layer's
rows from its last pass, the 64-token host probe, so every probed record was priced for
64 tokens (the unprobed auto layer's were right). Every layer of a point routes the same
input with the same weights, so all moved the rows the auto record holds: this puts those
rows in each record of the point, re-prices it with `predict_memory`, re-makes the
summaries and targets, notes the fix in `meta`, and rewrites the JSON and its Markdown.

    python tools/repredict_memory.py results/bench-h200-emulated-8x8-dgx-h200.json ...

With ``--own-rows`` it instead re-prices every record with today's model from the record's
own fields and rows (`rows_sent`, `rows_received`, `largest_partition_received` where
recorded; tools/memory_accuracy.py prices the same way), notes the model in `meta.notes`,
and rewrites the JSON and its Markdown: the records then state which model priced them.

    python tools/repredict_memory.py --own-rows --model "..." results/bench-h200*.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's engine, not an installed one

from app.bench.layer_summary import markdown_table, summarize, targets
from moe_engine import MoEConfig
from moe_engine.memory import predict_memory

NOTE = ("predicted_memory_bytes, rows_sent and rows_received re-made by tools/repredict_memory.py from the "
        "auto record's rows of the same point (the bench had taken probed layers' rows from the 64-token host probe); "
        "the fullest partition's rows were not recorded then, so under skewed routing the predictions assume "
        "even partitions and fall short (the bench records them since)")


def repredict(data: dict) -> int:
    """Fix ``data`` (a bench JSON) in place; returns the records changed."""
    rows = {(r["model"], r["tokens"], r["routing"]): (r["rows_sent"], r["rows_received"])
            for r in data["records"] if r["chosen_by"] == "auto" and r.get("rows_sent") is not None}
    changed = 0
    for r in data["records"]:
        point = rows.get((r["model"], r["tokens"], r["routing"]))
        if point is None or r.get("predicted_memory_bytes") is None or r["chosen_by"] == "auto":
            continue
        config = MoEConfig(r["d_model"], r["d_hidden"], r["num_experts"], top_k=r["top_k"],
                           activation=r["activation"], bias=r.get("bias", True))
        n = r["partitions"] if r["engine"] != "fastmoe" else 1
        r["rows_sent"], r["rows_received"] = point
        r["predicted_memory_bytes"] = predict_memory(
            config, r["tokens"], r["world_size"], n, r["strategy"], engine=r["engine"],
            dtype=getattr(torch, r["dtype"]), rows_sent=point[0], rows_received=point[1]).peak_bytes
        changed += 1
    data["summaries"] = summarize(data["records"])
    data["targets"] = targets(data["summaries"])
    data["meta"]["notes"] = [*data["meta"].get("notes", []), NOTE]
    return changed


def reprice_own_rows(data: dict, model: str) -> int:
    """Re-price every priced record of ``data`` (a bench JSON) in place with today's
    `predict_memory` from its own rows; notes ``model`` (which model priced them) in `meta`.
    Returns the records whose prediction changed."""
    from memory_accuracy import priced_records, reprice  # tools/memory_accuracy.py
    changed = 0
    for r in priced_records(data):
        predicted = reprice(r)
        changed += predicted != r["predicted_memory_bytes"]
        r["predicted_memory_bytes"] = predicted
    data["summaries"] = summarize(data["records"])
    data["targets"] = targets(data["summaries"])
    data["meta"]["notes"] = [*data["meta"].get("notes", []),
                             f"predicted_memory_bytes re-priced by tools/repredict_memory.py --own-rows from each "
                             f"record's own rows with {model}"]
    return changed


def main(args: list[str]) -> None:
    own_rows = "--own-rows" in args
    model = ""
    if "--model" in args:
        at = args.index("--model")
        model = args[at + 1]
        args = args[:at] + args[at + 2:]
    paths = [a for a in args if a != "--own-rows"]
    if own_rows and not model:
        raise SystemExit("--own-rows needs --model TEXT: which memory model prices the records (e.g. its commit)")
    for path in map(Path, paths):
        data = json.loads(path.read_text())
        changed = reprice_own_rows(data, model) if own_rows else repredict(data)
        path.write_text(json.dumps(data, indent=1, default=str))
        path.with_suffix(".md").write_text(markdown_table(data))
        print(f"{path}: {changed} records re-priced")


if __name__ == "__main__":
    main(sys.argv[1:])
