"""Rewrites the Markdown beside each committed layer-benchmark record (results/bench-*.json)
from its JSON with today's code: the summaries, targets and overlap accounts are derived
from the records again, so a yardstick changed in app/bench/layer_bound.py or layer_summary.py reaches every committed
table. The measurements themselves (the JSON) are not touched.

    python3 tools/render_records.py            # rewrite results/bench-*.md
    python3 tools/render_records.py --check    # exit 1 naming the files that would change

tests/test_doc_figures.py runs the check, so docs quoting these tables stay current.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from app.bench.layer_bound import add_overlap_account  # noqa: E402
from app.bench.layer_summary import markdown_table, summarize  # noqa: E402


def layer_records(root: Path = ROOT) -> list[Path]:
    """The committed layer-benchmark JSON files (those with per-point records)."""
    return sorted(path for path in (root / "results").glob("bench-*.json")
                  if "records" in json.loads(path.read_text()))


def render(path: Path, derived_only: bool = False):
    """The Markdown of ``path``'s JSON, each point's overlap account and the summaries derived
    again from its records (as the bench derives them after measuring a point); with
    ``derived_only``, those summaries."""
    result = json.loads(path.read_text())
    records = result["records"]
    points: dict[tuple, list] = {}
    for record in records:
        points.setdefault((record["model"], record.get("routing", "uniform"), record["tokens"]), []).append(record)
    for point in points.values():
        add_overlap_account(point)
    summaries = summarize(records)
    if derived_only:
        return summaries
    return markdown_table({**result, "records": records, "summaries": summaries})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file would change")
    args = parser.parse_args(argv)
    stale = []
    for path in layer_records():
        markdown, target = render(path), path.with_suffix(".md")
        if target.exists() and target.read_text() == markdown:
            continue
        stale.append(target.relative_to(ROOT))
        if not args.check:
            target.write_text(markdown)
    verb = "would change" if args.check else "rewrote"
    print(f"{verb}: {', '.join(map(str, stale))}" if stale else "every record's Markdown is current")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
