"""CPU processes of one machine share its cores (workers/distributed.py cpu_threads_per_process):
the gloo ranks of the tests, of `mpipemoe check` and of the CPU layer bench each take their
share, not torch's default of every core in every process."""
from __future__ import annotations

import os

import pytest
import torch

from tests.distributed import run_on_ranks
from workers.distributed import cpu_threads_per_process


@pytest.mark.parametrize("cores, processes, threads", [(8, 1, 8), (8, 4, 2), (8, 3, 2), (2, 4, 1), (2, 2, 1)])
def test_each_process_takes_its_share_of_the_cores_and_at_least_one(monkeypatch, cores, processes, threads):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert cpu_threads_per_process(processes) == threads


def _threads(rank: int, world_size: int) -> int:
    return torch.get_num_threads()


@pytest.mark.gloo
def test_gloo_ranks_run_with_their_share_of_the_cores():
    assert run_on_ranks(2, _threads) == [cpu_threads_per_process(2)] * 2
