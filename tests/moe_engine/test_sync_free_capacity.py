"""Tiers 1 and 2: the sync-free capacity mode (layers' ``sync_free_capacity``) beyond the
reference matrix (tests/engine_cases.py runs it against the float64 reference where nothing
overflows): its settings are checked when given; on gloo ranks a pass reads the device
zero times, every rank calls collectives of the same sizes whatever its routing, and the
pairs past a capacity are counted (not raised, not read) while every rank runs the pass to
its end; a NaN in one rank's input is counted on that rank."""
import functools

import pytest
import torch
import torch.distributed as dist

from moe_engine import FastMoE, FasterMoE, MoEConfig, MPipeMoE, predict_memory
from moe_engine.dispatcher import capacity_slots, chunk_by_tokens, tokens_of_partition
from tests.distributed import run_on_ranks
from tests.moe_engine.test_host_reads import _waits_per_pass

CONFIG = MoEConfig(d_model=16, d_hidden=32, num_experts=8, top_k=2)


@pytest.mark.parametrize("build,match", [
    (lambda: MPipeMoE(CONFIG, partitions=2, strategy="none", sync_free_capacity=0), r"sync_free_capacity=0 .*> 0"),
    (lambda: MPipeMoE(CONFIG, partitions=2, strategy="none", sync_free_capacity=float("inf")), r"> 0"),
    (lambda: MPipeMoE(CONFIG, partitions=2, strategy="none", sync_free_capacity=True), r"> 0"),
    (lambda: MPipeMoE(CONFIG, partitions=2, strategy="none", sync_free_capacity="1.5"),  # type: ignore[arg-type]  # (the wrong type on purpose)
     r"> 0"),
    (lambda: MPipeMoE(CONFIG, partitions="auto", strategy="none", sync_free_capacity=1.5),
     r"needs a fixed partitions.*partitions=N"),
    (lambda: MPipeMoE(CONFIG, partitions=2, strategy="auto", sync_free_capacity=1.5),
     r"needs a fixed strategy.*strategy='none'"),
    (lambda: MPipeMoE(CONFIG, partitions=1, strategy="none", split="peers", sync_free_capacity=1.5),
     r"needs split='tokens'"),
    (lambda: FasterMoE(CONFIG, sync_free_capacity=1.5), r"not supported by FasterMoE.*FastMoE or MPipeMoE"),
])
def test_settings_the_mode_cannot_run_are_refused_naming_the_fix(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_the_mode_is_switched_off_and_on_again():
    layer = MPipeMoE(CONFIG, partitions=2, strategy="S4", sync_free_capacity=2)
    assert layer.sync_free_capacity == 2.0
    with layer.dropless():
        assert layer.sync_free_capacity is None
    assert layer.sync_free_capacity == 2.0
    layer.sync_free_capacity = None
    assert layer.sync_free_capacity is None
    with pytest.raises(ValueError, match="sync_free_capacity=-1"):
        layer.sync_free_capacity = -1
    assert FastMoE(CONFIG, sync_free_capacity=1.25).sync_free_capacity == 1.25
    assert int(layer.overflowed) == 0 and int(layer.nonfinite_inputs) == 0  # before any pass


def test_memory_model_counts_the_padded_rows():
    # 2 partitions of 50 tokens, K = 2, E = 8, f = 1.5: C = ceil(1.5 * 2 * 50 / 8) = 19 slots,
    # 8 * 19 = 152 rows each: R = N = 304 (dropless balanced: 200)
    padded = predict_memory(CONFIG, 100, world_size=2, partitions=2, strategy="none", sync_free_capacity=1.5)
    exact = predict_memory(CONFIG, 100, world_size=2, partitions=2, strategy="none", rows_sent=304,
                           rows_received=304, largest_partition_received=152)
    assert padded == exact
    assert padded.peak_bytes > predict_memory(CONFIG, 100, world_size=2, partitions=2, strategy="none").peak_bytes
    one_rank = predict_memory(CONFIG, 100, world_size=1, partitions=2, sync_free_capacity=1.5)
    assert one_rank == predict_memory(CONFIG, 100, world_size=1, partitions=2)  # one rank: no padding
    with pytest.raises(ValueError, match="give no rows_sent"):
        predict_memory(CONFIG, 100, world_size=2, rows_sent=10, sync_free_capacity=1.5)


def _expected_overflow(layer, x) -> int:
    """Host arithmetic on the layer's routing: per partition and expert, the kept pairs past
    the capacity."""
    n = layer.planner.partitions
    with torch.no_grad():
        routing = layer.router(x)
    partition_P = chunk_by_tokens(x.shape[0], layer.config.top_k, n, None)
    expert_P, keep_P = routing.expert_ids_TK.flatten(), routing.keep_TK.flatten()
    overflow = 0
    for i in range(n):
        slots = capacity_slots(layer.sync_free_capacity, layer.config.top_k,
                               tokens_of_partition(x.shape[0], n, i), layer.config.num_experts)
        counts = torch.bincount(expert_P[(partition_P == i) & keep_P], minlength=layer.config.num_experts)
        overflow += int((counts - slots).clamp(min=0).sum())
    return overflow


def _on_rank(rank, world_size):
    """Everything the gloo tests check, in one process group (a start of the ranks costs more
    than the checks): device reads, collective sizes, overflow, a NaN input."""
    results = {}
    # 1. device reads of a steady pass (FastMoE, MPipeMoE with and without an offload)
    builds = {"fastmoe": lambda: FastMoE(CONFIG, sync_free_capacity=4.0),
              "mpipemoe-n3-S1": lambda: MPipeMoE(CONFIG, partitions=3, strategy="S1", sync_free_capacity=4.0),
              "mpipemoe-n2-S4": lambda: MPipeMoE(CONFIG, partitions=2, strategy="S4", sync_free_capacity=1.0)}
    results["waits"] = {}
    for name, build in builds.items():
        torch.manual_seed(0)
        results["waits"][name] = _waits_per_pass(build(), torch.randn(48, 16, generator=torch.Generator()
                                                                           .manual_seed(rank)))

    # 2. the collectives' sizes, with a routing that differs by rank (rank 1's tokens all
    # pick expert 0 first: it overflows, rank 0 does not)
    calls: list[tuple] = []
    real_all_to_all, real_all_reduce = dist.all_to_all_single, dist.all_reduce

    def all_to_all(output, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
        calls.append(("all_to_all", tuple(output.shape), tuple(input.shape), output_split_sizes, input_split_sizes))
        return real_all_to_all(output, input, output_split_sizes, input_split_sizes, **kwargs)

    def all_reduce(tensor, *args, **kwargs):
        calls.append(("all_reduce", tuple(tensor.shape)))
        return real_all_reduce(tensor, *args, **kwargs)

    torch.manual_seed(0)
    layer = MPipeMoE(CONFIG, partitions=2, strategy="S4", sync_free_capacity=1.0, dtype=torch.float64)
    with torch.no_grad():
        layer.router.weight[0, 0] = 8.0
    x = torch.randn(40, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    if rank == 1:
        x[:, 0] = 5.0
    dist.all_to_all_single, dist.all_reduce = all_to_all, all_reduce
    try:
        xi = x.clone().requires_grad_(True)
        y, aux = layer(xi)
        (y.square().sum() + aux).backward()
    finally:
        dist.all_to_all_single, dist.all_reduce = real_all_to_all, real_all_reduce
    results["calls"] = calls
    grads = [xi.grad] + [p.grad for p in layer.parameters()]
    results["finite"] = bool(torch.isfinite(y).all()) and all(g is not None and bool(torch.isfinite(g).all())
                                                              for g in grads)

    # 3. overflow: counted on the device, as the host arithmetic says; summed over passes;
    # not by a dropless rerun; zero after a reset
    results["overflowed"] = int(layer.overflowed)
    results["expected_overflow"] = _expected_overflow(layer, x)
    layer(x)
    results["overflowed_two_passes"] = int(layer.overflowed)
    with layer.dropless():
        layer(x)
    results["overflowed_after_dropless"] = int(layer.overflowed)
    layer.reset_capacity_counters()
    results["overflowed_after_reset"] = int(layer.overflowed)

    # 4. a NaN in rank 1's input: no error, counted on rank 1 only
    x_nan = x.clone()
    if rank == 1:
        x_nan[3, 5] = float("nan")
    layer(x_nan)
    results["nonfinite_inputs"] = int(layer.nonfinite_inputs)
    return results


@functools.cache
def gloo_results() -> list:
    return run_on_ranks(2, _on_rank)


@pytest.mark.gloo
def test_a_pass_on_several_ranks_reads_the_device_zero_times():
    for rank_results in gloo_results():
        assert rank_results["waits"] and all(w == [] for w in rank_results["waits"].values()), rank_results["waits"]


@pytest.mark.gloo
def test_every_rank_calls_collectives_of_the_same_sizes_and_no_count_exchange():
    calls = [r["calls"] for r in gloo_results()]
    assert calls[0] == calls[1]
    # forward: a dispatch and a combine per partition; backward (S4): dy, the re-dispatch and dx
    assert [c[0] for c in calls[0]] == ["all_to_all"] * 10
    for _, out_shape, in_shape, out_splits, in_splits in calls[0]:
        assert out_splits == in_splits and len(set(out_splits)) == 1, (out_splits, in_splits)
        assert out_shape == in_shape


@pytest.mark.gloo
def test_overflow_is_counted_on_the_device_and_every_rank_finishes_the_pass():
    per_rank = gloo_results()
    assert all(r["finite"] for r in per_rank)
    assert per_rank[0]["overflowed"] == per_rank[0]["expected_overflow"]
    assert per_rank[1]["overflowed"] == per_rank[1]["expected_overflow"] > 0  # the skewed rank
    for r in per_rank:
        assert r["overflowed_two_passes"] == 2 * r["overflowed"]
        assert r["overflowed_after_dropless"] == r["overflowed_two_passes"]
        assert r["overflowed_after_reset"] == 0


@pytest.mark.gloo
def test_a_nan_input_is_counted_on_its_rank_not_raised():
    assert [r["nonfinite_inputs"] for r in gloo_results()] == [0, 1]
