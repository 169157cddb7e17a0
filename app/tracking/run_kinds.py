"""The MLflow tag that says what made a run, and the kinds it takes.

Every writer tags its runs with ``kind_tags(KIND)``; every reader asks ``run_kind(tags)``
or filters with ``kind_filters(KIND)``.
"""
from __future__ import annotations

KIND_TAG = "mpipemoe.kind"
# Before issue 19, bench, simulate and sweep runs carried the kind as the tag "kind":
# readers accept it too, so the runs of existing local MLflow stores still report.
OLD_KIND_TAG = "kind"

TRAIN = "train"                  # mpipemoe train, and each sweep trial (app/jobs/launch.py)
COMPARE = "compare"              # the parent of mpipemoe train --engines (app/commands/train.py)
CAPACITY = "capacity"            # one engine's batch-size search (app/commands/capacity.py)
BENCH = "bench"                  # one measured layer configuration (app/bench/layer.py)
BENCH_SUMMARY = "bench-summary"  # one model and token count of a bench, over engines (app/bench/layer.py)
BENCH_STEP = "bench-step"        # one engine's training step on an emulated cluster (app/bench/step.py)
SIMULATE = "simulate"            # one simulated configuration (app/bench/simulate.py)
STUDY = "study"                  # the parent run of a sweep (app/jobs/sweep.py)


def kind_tags(kind: str) -> dict:
    """The tags a writer puts on a run of ``kind``."""
    return {KIND_TAG: kind}


def run_kind(tags: dict) -> str | None:
    """The kind of a run with ``tags`` (either tag name), or None."""
    return tags.get(KIND_TAG) or tags.get(OLD_KIND_TAG)


def kind_filters(kind: str) -> tuple[str, str]:
    """MLflow filters for runs of ``kind`` under the tag and under the old one (MLflow
    filters have no OR, so a reader runs both: ``app.tracking.store.finished_runs_of_kind``)."""
    return f"tags.`{KIND_TAG}` = '{kind}'", f"tags.{OLD_KIND_TAG} = '{kind}'"


# A training run resumed with other settings (engine, partitions, strategy, ...): the tag holds
# JSON, one object per segment: {"from_step": first step, the segment's settings}; written
# by app/jobs/resume.py (record_segment), read by the report.
SEGMENTS_TAG = "mpipemoe.segments"


def run_segments(tags: dict) -> list[dict]:
    """The segments of a training run (``SEGMENTS_TAG``), [] for a run of one segment."""
    import json

    try:
        segments = json.loads(tags.get(SEGMENTS_TAG) or "[]")
    except ValueError:
        return []
    return [s for s in segments if isinstance(s, dict)] if isinstance(segments, list) else []

