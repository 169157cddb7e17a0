"""Write a results record of one `mpipemoe sweep lr` run from its printed output.

    python tools/sweep_record.py --log results/sweep-lr-optuna-asha-cpu.log --wall-s 300 \
        --command "mpipemoe sweep lr ..." --date 2026-12-04T15:22:45Z --commit abc1234 \
        --hardware "2-core CPU" --load "..." --out results/sweep-lr-optuna-asha-cpu.json

The record holds the command, when and where it ran, its wall time (measured around the
command), and what the command printed: one row per trial (lr, val_loss, status), the
pruned count and the best trial (lowest val_loss).
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

BEST = re.compile(r"Best trial \(lowest val_loss\): lr=(\S+) val_loss (\S+); (\d+) of (\d+) trials pruned")


def trials_from_log(text: str) -> list[dict]:
    """The results table the sweep prints: a header line starting with "lr", one line per trial."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["lr", "val_loss"])
    trials = []
    for line in lines[start + 1:]:
        cells = line.split()
        if not cells or not re.match(r"^[0-9.e-]+$", cells[0]):
            break
        lr, val_loss, tokens_per_s, loss, peak_mib, status = cells
        trials.append({"lr": float(lr), "val_loss": float(val_loss), "loss": float(loss),
                       "tokens_per_s": float(tokens_per_s), "peak_mib": float(peak_mib), "status": status})
    return trials


def record(log: str, **meta) -> dict:
    trials = trials_from_log(log)
    found = BEST.search(log)
    if found is None:
        raise ValueError("no 'Best trial (lowest val_loss): ...' line in the log")
    best_lr, _, pruned, total = found.groups()
    best = min(trials, key=lambda t: t["val_loss"])  # the table's 4 decimals, not the line's 4 digits
    if f"{best['lr']:.3g}" != f"{float(best_lr):.3g}":
        raise ValueError(f"the best line names lr={best_lr}, the table's lowest val_loss is lr={best['lr']}")
    return {"meta": meta, "trials": int(total), "pruned": int(pruned),
            "pruned_at": {s: sum(t["status"] == s for t in trials)
                          for s in sorted({t["status"] for t in trials if t["status"].startswith("pruned@")})},
            "finished": sum(t["status"] == "ok" for t in trials),
            "best": {"lr": best["lr"], "val_loss": best["val_loss"], "status": best["status"]},
            "per_trial": trials}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", required=True)
    parser.add_argument("--wall-s", type=float, required=True)
    parser.add_argument("--command", required=True)
    parser.add_argument("--date", required=True)
    parser.add_argument("--commit", required=True)
    parser.add_argument("--hardware", required=True)
    parser.add_argument("--load", default="", help="uptime's load averages before and after")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    data = record(Path(args.log).read_text(), command=args.command, date=args.date, git_commit=args.commit,
                  hardware=args.hardware, load=args.load, wall_time_s=round(args.wall_s, 1),
                  made_by="tools/sweep_record.py from the command's printed output (the .log beside this file)")
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
