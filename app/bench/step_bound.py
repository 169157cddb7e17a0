"""The training-step bench's bound and its check (app/bench/step.py, `mpipemoe bench --step`):
a step record's floor (`step_bound_ms`: the longer of its compute alone and its modelled link
time), the account added to each record (`add_bound_account`) and the check that fails the run
when a record beats its floor (`check_bounds`, BoundViolation)."""
from __future__ import annotations

from app.bench.parts import setting_label

BOUND_SLACK = 0.98             # a record faster than this share of its bound fails the run


class BoundViolation(RuntimeError):
    """A step record ran faster than BOUND_SLACK of its own floor: the instrument is wrong."""


def step_bound_ms(compute_ms: float, all_to_all_ms: float, reduction_ms: float) -> float:
    """The step's floor: the longer of its compute alone and its modelled link time (the
    All-to-Alls and the reduction, one after another on the link)."""
    return max(compute_ms, all_to_all_ms + reduction_ms)


def check_bounds(records: list[dict], slack: float = BOUND_SLACK) -> None:
    """Raise BoundViolation naming every record whose step beats ``slack`` x its bound."""
    bad = [r for r in records if r.get("step_bound_ms") and r["step_ms"] < slack * r["step_bound_ms"]]
    if bad:
        names = "; ".join(f"{r['model']} {r['tokens']} tok K={r['micro_batches']} {r['routing']} {r['engine']} "
                          f"{r['chosen_by']} n={setting_label(r)}: {r['step_ms']:.2f} ms < "
                          f"{slack} x bound {r['step_bound_ms']:.2f} ms" for r in bad)
        raise BoundViolation(f"{len(bad)} step record(s) beat their floor, so the emulation or the bound is "
                             f"wrong (the records are written, marked below_bound): {names}")


def add_bound_account(record: dict) -> None:
    """In place: the bound, the link time, the exposed All-to-All and whether the record is
    below its bound (for records with the compute-alone timing)."""
    if "compute_ms" not in record:
        return
    record["communication_ms"] = record["all_to_all_ms"] + record["reduction_ms"]
    record["step_bound_ms"] = step_bound_ms(record["compute_ms"], record["all_to_all_ms"], record["reduction_ms"])
    record["step_vs_bound"] = record["step_ms"] / record["step_bound_ms"] - 1
    record["exposed_all_to_all_ms"] = max(0.0, record["step_ms"] - record["no_all_to_all_ms"])
    record["below_bound"] = record["step_ms"] < BOUND_SLACK * record["step_bound_ms"]
