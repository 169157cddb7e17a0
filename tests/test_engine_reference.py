"""Tier 2 (gloo, CPU): every engine path against the brute-force reference, float64,
on 1, 2 and 4 ranks: outputs, aux loss, input gradients and every parameter gradient."""
import pytest

from tests.distributed import run_on_ranks
from tests.engine_cases import ENGINES, SCENARIOS, check_matrix

TOLERANCE = 1e-9
_results_by_world: dict = {}


def matrix_results(world_size: int) -> list:
    if world_size not in _results_by_world:
        names = [s.name for s in SCENARIOS]
        _results_by_world[world_size] = run_on_ranks(world_size, check_matrix, names, ENGINES)
    return _results_by_world[world_size]


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("scenario", [s.name for s in SCENARIOS])
def test_engines_match_reference(world_size, scenario):
    per_rank = matrix_results(world_size)
    failures = []
    for rank, results in enumerate(per_rank):
        for (scen, engine), errors in results.items():
            if scen != scenario:
                continue
            for quantity, error in errors.items():
                if not error <= TOLERANCE:
                    failures.append(f"rank {rank} {engine}: {quantity} off by {error:.3g}")
    checked = sum(1 for results in per_rank for (scen, _) in results if scen == scenario)
    assert checked == world_size * len(ENGINES), f"only {checked} engine runs reported"
    assert not failures, f"{len(failures)} mismatches, e.g.\n" + "\n".join(failures[:20])
