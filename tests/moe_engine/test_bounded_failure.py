"""Tier 2 (gloo): a rank that stops participating ends the others' collectives in bounded
time with a clear error, and ranks with different batch sizes never hang the All-to-All
(docs/design.md §8). Fixed n and strategies with uneven batches are in the reference matrix
(tests/engine_cases.py); here: the choices the layer makes itself (calibration, auto
strategy under a memory budget), which must use values every rank agrees on.
"""
import time

import pytest
import torch

from moe_engine import FastMoE, MoEConfig, MPipeMoE
from moe_engine.comm import CollectiveError
from moe_engine.memory import predict_memory
from moe_engine.config import STRATEGIES
from tests.distributed import run_on_ranks

pytestmark = pytest.mark.gloo

CONFIG = MoEConfig(d_model=8, d_hidden=16, num_experts=4, top_k=2)
TIMEOUT_S = 2


def _silent_rank(rank, world_size):
    """Rank 1 never calls the layer (alive, but stuck elsewhere); rank 0 must fail fast."""
    if rank == 1:
        time.sleep(5 * TIMEOUT_S)  # well after the bound below: its exit must not be what ends rank 0's wait
        return None
    layer = MPipeMoE(CONFIG, partitions=2, strategy="S1")
    started = time.perf_counter()
    try:
        layer(torch.randn(6, 8))
    except CollectiveError as error:
        return str(error), time.perf_counter() - started
    return "no error", time.perf_counter() - started


def test_a_silent_rank_ends_the_collective_within_the_timeout():
    (message, elapsed), _ = run_on_ranks(2, _silent_rank, collective_timeout_s=TIMEOUT_S, timeout=60)
    assert elapsed < 2 * TIMEOUT_S + 4, elapsed
    assert "failed on rank 0 of 2: another rank died or stopped participating" in message
    assert "timeout" in message


UNEVEN_TOKENS = (40, 3)


def _uneven_auto(rank, world_size):
    """Different token counts per rank, every choice left to the layer (a fresh profile is
    calibrated on the first pass, by all ranks together); outputs equal FastMoE's."""
    torch.manual_seed(0)
    layer = MPipeMoE(CONFIG, partitions="auto", strategy="auto")
    torch.manual_seed(0)
    reference = FastMoE(CONFIG)
    reference.load_state_dict(layer.state_dict())
    for step in range(3):
        x = torch.randn(UNEVEN_TOKENS[rank] + step, 8, generator=torch.Generator().manual_seed(rank * 10 + step))
        y, aux = layer(x)
        y_ref, _ = reference(x)
        (y.sum() + aux).backward()
        torch.testing.assert_close(y, y_ref)
    return layer.last_strategy


def test_uneven_batches_with_automatic_choices_do_not_hang():
    strategies = run_on_ranks(2, _uneven_auto, collective_timeout_s=30, timeout=120)
    assert strategies[0] == strategies[1]


def _peak(tokens: int) -> int:
    """The leanest predicted peak at n=16 (the largest partition candidate)."""
    return min(predict_memory(CONFIG, tokens, 2, 16, s, dtype=torch.float32).peak_bytes for s in STRATEGIES)


def _uneven_budget(rank, world_size, budget):
    """The budget fits rank 1's few tokens but not rank 0's many: every rank must refuse
    (a rank deciding alone would run on into an All-to-All its peer never joins)."""
    layer = MPipeMoE(CONFIG, partitions="auto", strategy="auto", memory_budget=budget)
    with pytest.raises(ValueError, match="memory_budget=.* is too small"):
        layer(torch.randn(UNEVEN_TOKENS[rank] * 10, 8))
    return True


def test_uneven_batches_over_a_memory_budget_fail_on_every_rank():
    budget = (_peak(UNEVEN_TOKENS[0] * 10) + _peak(UNEVEN_TOKENS[1] * 10)) // 2
    assert run_on_ranks(2, _uneven_budget, budget, collective_timeout_s=10, timeout=120) == [True, True]
