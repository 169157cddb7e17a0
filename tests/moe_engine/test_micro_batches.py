"""Tier 1/2: several micro-batches in flight (two forwards, then two backwards) keep their
own host buffers; the pool reuses them on later steps."""
import pytest
import torch

from moe_engine import FastMoE, HostBufferPool, MoEConfig, MPipeMoE
from tests.distributed import run_on_ranks


def _two_in_flight(rank, world_size, strategy):
    config = MoEConfig(16, 24, 4, top_k=2, activation="swiglu")
    torch.manual_seed(0)
    reference = FastMoE(config, dtype=torch.float64)
    pool = HostBufferPool()
    layer = MPipeMoE(config, partitions=3, strategy=strategy, host_pool=pool, dtype=torch.float64)
    layer.load_state_dict(reference.state_dict())
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(10 + 3 * i, 16, dtype=torch.float64, generator=g) for i in range(2)]

    def grads(model):
        model.zero_grad()
        leaves = [x.clone().requires_grad_(True) for x in xs]
        outs = [model(x) for x in leaves]            # two forwards ...
        for (y, aux), w in zip(reversed(outs), (1.0, 2.0)):  # ... then two backwards, last first
            (w * y.square().sum() + aux).backward()
        return [x.grad for x in leaves] + [p.grad.clone() for p in model.parameters()]

    want = grads(reference)
    for step in range(2):
        got = grads(layer)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
        if step == 0:
            buffers_after_first_step = pool.bytes_allocated
    # step 2 reused step 1's host buffers instead of allocating new ones
    assert pool.bytes_allocated == buffers_after_first_step
    return pool.bytes_allocated


@pytest.mark.gloo
@pytest.mark.parametrize("strategy", ["S1", "S2", "S3"])
def test_two_micro_batches_in_flight_one_rank(strategy):
    assert run_on_ranks(1, _two_in_flight, strategy)[0] > 0


@pytest.mark.gloo
def test_two_micro_batches_in_flight_two_ranks():
    assert all(b > 0 for b in run_on_ranks(2, _two_in_flight, "S1"))


def test_pool_hands_out_distinct_buffers_and_reuses_returned_ones():
    pool = HostBufferPool()
    a = pool.take(1000, torch.float32, pin=False)
    b = pool.take(1000, torch.float32, pin=False)
    assert a.data_ptr() != b.data_ptr() and a.numel() >= 1000
    pool.give_back(a)
    assert pool.take(900, torch.float32, pin=False).data_ptr() == a.data_ptr()


# -- the overlapped micro-batch schedule (workers/schedules.py) --------------------------------
# Two micro-batches, the forward of the second beside the backward of the first (each on its
# lane: its own process group and streams), against the reference summed over both, for every
# engine x n x strategy of the reference matrix, on 2 and 4 gloo ranks (and one process).
SCHEDULE_SCENARIOS = ["k2_dropless_gelu", "empty_batch_on_some_ranks"]


@pytest.mark.gloo
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_overlapped_schedule_matches_reference(world_size):
    from tests.engine_cases import ENGINES, SCENARIOS, check_micro_batch_schedules, runs_on

    per_rank = run_on_ranks(world_size, check_micro_batch_schedules, SCHEDULE_SCENARIOS, ENGINES)
    failures = [f"rank {rank} {scenario} {engine}: {quantity} off by {error:.3g}"
                for rank, results in enumerate(per_rank) for (scenario, engine), errors in results.items()
                for quantity, error in errors.items() if not error <= 1e-9]
    # a peer split's n divides the world size; the capacity mode needs the same tokens on every rank
    runs = sum(runs_on(e, world_size, s) for e in ENGINES for s in SCENARIOS if s.name in SCHEDULE_SCENARIOS)
    assert all(len(results) == runs for results in per_rank)
    assert not failures, f"{len(failures)} mismatches, e.g.\n" + "\n".join(failures[:20])
