"""Tier 2 (gloo, CPU): every engine path against the brute-force reference (float64),
on 1, 2 and 4 ranks: outputs, aux loss, input gradients and every parameter gradient.
The engines run in float64 (per-expert loop) and float32 (the grouped kernel). On 4 ranks
also with expert-parallel degrees 1 and 2 (expert groups of that many ranks; 4: the world),
in float64 only: the grouped kernel sees the same per-rank shapes as in the 4-rank group."""
import functools

import pytest
import torch

from tests.distributed import run_on_ranks
from tests.engine_cases import ENGINES, SCENARIOS, check_layouts, runs_on

pytestmark = pytest.mark.gloo

TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-5}
SCENARIO_BY_NAME = {s.name: s for s in SCENARIOS}

LAYOUTS = [pytest.param(w, None, dtype, id=f"W{w}-{name}") for w in (1, 2, 4)
           for dtype, name in ((torch.float64, "float64"), (torch.float32, "float32-grouped"))] \
    + [pytest.param(4, p, torch.float64, id=f"W4-P{p}-float64") for p in (2, 1)]


@functools.cache
def world_results(world_size: int) -> list:
    """Every layout of ``world_size`` ranks checked in one process group (check_layouts), by rank."""
    layouts = [(dtype, degree) for w, degree, dtype in (p.values for p in LAYOUTS) if w == world_size]
    return run_on_ranks(world_size, check_layouts, [s.name for s in SCENARIOS], ENGINES, layouts, timeout=1200.0)


def matrix_results(world_size: int, dtype: torch.dtype, degree: int | None = None) -> list:
    return [per_rank[dtype, degree] for per_rank in world_results(world_size)]


@pytest.mark.parametrize("world_size,degree,dtype", LAYOUTS)
@pytest.mark.parametrize("scenario", [s.name for s in SCENARIOS])
def test_engines_match_reference(world_size, degree, scenario, dtype):
    per_rank = matrix_results(world_size, dtype, degree)
    failures = []
    for rank, results in enumerate(per_rank):
        for (scen, engine), errors in results.items():
            if scen != scenario:
                continue
            for quantity, error in errors.items():
                if not error <= TOLERANCE[dtype]:
                    failures.append(f"rank {rank} {engine}: {quantity} off by {error:.3g}")
    checked = sum(1 for results in per_rank for (scen, _) in results if scen == scenario)
    expected = world_size * sum(runs_on(e, degree or world_size, SCENARIO_BY_NAME[scenario]) for e in ENGINES)
    assert checked == expected, f"{checked} engine runs reported, {expected} expected"
    assert not failures, f"{len(failures)} mismatches, e.g.\n" + "\n".join(failures[:20])
