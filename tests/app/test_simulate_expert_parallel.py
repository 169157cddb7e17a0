"""`mpipemoe simulate --expert-parallel`: the degrees are checked against the cluster and the
experts before anything is simulated (the side-by-side records themselves are re-made by
tests/test_doc_figures.py)."""
from __future__ import annotations

import pytest

from app.bench.simulate_settings import SimulateSettings


def test_a_degree_the_cluster_cannot_group_is_refused_naming_the_valid_ones():
    with pytest.raises(ValueError, match=r"--expert-parallel '3' is invalid: on 8 node\(s\) x 8 GPUs .* choose "
                                         r"from 1, 2, 4, 8, 16, 32, 64$"):
        SimulateSettings(model="gpt-s", tokens=(8192,), nodes=(8,), expert_parallel=(3,))


def test_degrees_none_of_which_divide_the_experts_are_refused():
    with pytest.raises(ValueError, match=r"no degree divides the 8 experts per layer: give one of 1, 2, 4, 8"):
        SimulateSettings(model="gpt-s", tokens=(8192,), nodes=(8,), experts=8, expert_parallel=(16, 64))


def test_fewer_experts_than_gpus_are_accepted_with_a_degree_that_divides_them():
    settings = SimulateSettings(model="gpt-s", tokens=(8192,), nodes=(8,), experts=8, expert_parallel=(8, 64))
    assert settings.expert_parallel == (8, 64)
    with pytest.raises(ValueError, match=r"--experts 8 is invalid: it must be a multiple of the 64 GPUs"):
        SimulateSettings(model="gpt-s", tokens=(8192,), nodes=(8,), experts=8)
