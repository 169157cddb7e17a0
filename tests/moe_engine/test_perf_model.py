"""Tier 1/2: calibration produces one shared profile; the model's predictions move the
right way with each cost; the choice honours a memory budget."""
import dataclasses

import pytest
import torch

from moe_engine import MemoryBudget, MoEConfig
from moe_engine.comm import ExpertGroup
from moe_engine.memory import predict_memory
from moe_engine.perf_model import SAVING_SLACK, HardwareProfile, PerformanceModel, ProfileStore, calibrate
from tests.distributed import run_on_ranks

GPT_XL = MoEConfig(2048, 8192, 8, top_k=2)


def profile(**overrides):
    base = HardwareProfile(device="test", dtype="bfloat16", world_size=8, gemm_flops=600e12,
                           a2a_latency_s=50e-6, a2a_bytes_per_s=20e9, d2h_bytes_per_s=50e9,
                           h2d_bytes_per_s=50e9, partition_overhead_s=30e-6,
                           slowdown={"compute|comm": 1.1, "comm|compute": 1.2})
    return dataclasses.replace(base, **overrides)


def predict(p, n, strategy, tokens=16384):
    return PerformanceModel(p).predict(GPT_XL, tokens, 8, n, strategy, torch.bfloat16)


def test_recomputation_and_recommunication_cost_time():
    p = profile(a2a_bytes_per_s=1e15, d2h_bytes_per_s=1e15, h2d_bytes_per_s=1e15)  # free comm/copies
    # only compute matters: S3/S4 recompute GEMM1 in backward, S1/S2 do not
    assert predict(p, 1, "S4").backward_s > predict(p, 1, "S1").backward_s
    slow_net = profile(d2h_bytes_per_s=1e15, h2d_bytes_per_s=1e15, gemm_flops=1e18)
    assert predict(slow_net, 1, "S2").backward_s > predict(slow_net, 1, "S1").backward_s


def test_slow_copies_favour_recomputation_fast_copies_favour_offload():
    slow_pcie = profile(d2h_bytes_per_s=5e9, h2d_bytes_per_s=5e9)
    fast_pcie = profile(d2h_bytes_per_s=5e13, h2d_bytes_per_s=5e13, gemm_flops=50e12)
    # (any slack: the choice among the restore strategies)
    m = lambda p: PerformanceModel(p).choose(GPT_XL, 16384, 8, torch.bfloat16, [4], saving_slack=10.0)  # noqa: E731
    assert m(slow_pcie).strategy == "S4"
    assert m(fast_pcie).strategy == "S1"


def test_auto_keeps_everything_when_sharing_saves_nothing_or_costs_time():
    model = PerformanceModel(profile())
    # one partition: nothing to share, the restore buffers cost as much as they save
    assert model.choose(GPT_XL, 16384, 8, torch.bfloat16, [1]).strategy == "none"
    # four partitions: a restore strategy that lowers the peak for at most the slack is chosen
    none = predict(profile(), 4, "none")
    chosen = model.choose(GPT_XL, 16384, 8, torch.bfloat16, [4])
    assert chosen.strategy != "none" and chosen.total_s <= (1 + SAVING_SLACK) * none.total_s
    assert chosen.peak_bytes < predict_memory(GPT_XL, 16384, 8, 4, "none").peak_bytes
    # ... and where every saving costs more than the slack (copies over a slow link, and
    # recomputation that cannot hide behind fast communication), the fastest: "none"
    slow = profile(d2h_bytes_per_s=5e9, h2d_bytes_per_s=5e9, a2a_bytes_per_s=1e12)
    costs = {s: predict(slow, 4, s).total_s / predict(slow, 4, "none").total_s for s in ("S1", "S2", "S3", "S4")}
    assert min(costs.values()) > 1 + SAVING_SLACK, costs
    assert PerformanceModel(slow).choose(GPT_XL, 16384, 8, torch.bfloat16, [4]).strategy == "none"
    assert PerformanceModel(slow).choose(GPT_XL, 16384, 8, torch.bfloat16, [4], saving_slack=10.0).strategy != "none"


def test_pipelining_hides_communication():
    p = profile()
    assert predict(p, 4, "S4").total_s < predict(p, 1, "S4").total_s
    # with a huge per-partition overhead, splitting stops paying
    costly = profile(partition_overhead_s=1.0)
    assert predict(costly, 8, "S4").total_s > predict(costly, 1, "S4").total_s


def test_memory_budget():
    model = PerformanceModel(profile())
    roomy = model.choose(GPT_XL, 16384, 8, torch.bfloat16, [1, 2, 4], memory_budget=10 ** 12)
    assert roomy.strategy == "none"   # everything fits: keeping everything is fastest
    need_s4 = predict_memory(GPT_XL, 16384, 8, 4, "S4").peak_bytes
    tight = model.choose(GPT_XL, 16384, 8, torch.bfloat16, [1, 2, 4], memory_budget=need_s4)
    assert tight.peak_bytes <= need_s4
    with pytest.raises(ValueError, match="memory_budget=1000 bytes is too small"):
        model.choose(GPT_XL, 16384, 8, torch.bfloat16, [1, 2, 4], memory_budget=1000)


def test_memory_budget_of_a_stack_counts_saved_tensors_per_layer():
    model = PerformanceModel(profile())
    choices = [(n, s) for n in (1, 2, 4, 8) for s in ("none", "S1", "S2", "S3", "S4")]
    estimates = {c: predict_memory(GPT_XL, 16384, 8, *c) for c in choices}
    layers = 8
    stack_need = {c: layers * e.saved_bytes + e.peak_bytes - e.saved_bytes for c, e in estimates.items()}
    # a budget for 8 layers that only the leaner choices meet
    budget = MemoryBudget(bytes=sorted(stack_need.values())[3], layers=layers)
    chosen = model.choose(GPT_XL, 16384, 8, torch.bfloat16, [1, 2, 4, 8], memory_budget=budget)
    assert stack_need[(chosen.partitions, chosen.strategy)] <= budget.bytes
    assert chosen.need(budget) == stack_need[(chosen.partitions, chosen.strategy)]
    # the same bytes as one layer's peak budget admit more (working sets do not add up)
    one = model.choose(GPT_XL, 16384, 8, torch.bfloat16, [1, 2, 4, 8], memory_budget=budget.bytes)
    assert one.total_s <= chosen.total_s
    assert model.choose(GPT_XL, 16384, 8, torch.bfloat16, [1, 2, 4, 8],
                        memory_budget=MemoryBudget(budget.bytes)) == one
    with pytest.raises(ValueError, match=r"memory_budget=1000 bytes for 8 layers is too small: the leanest choice"):
        model.choose(GPT_XL, 16384, 8, torch.bfloat16, [1, 2, 4, 8], memory_budget=MemoryBudget(1000, layers=8))


@pytest.mark.parametrize("bad, field", [(dict(bytes=0), "bytes"), (dict(bytes=10, layers=0), "layers"),
                                        (dict(bytes=1.5), "bytes"), (dict(bytes=10, layers=True), "layers")])
def test_memory_budget_names_the_bad_field(bad, field):
    with pytest.raises(ValueError, match=rf"MemoryBudget.{field}=.* is invalid: give an integer >= 1"):
        MemoryBudget(**bad)
    with pytest.raises(ValueError, match=r"memory_budget=-3 is invalid: give a positive number of bytes"):
        MemoryBudget.of(-3)


def test_profile_store_round_trip(tmp_path):
    store = ProfileStore(str(tmp_path / "profiles.json"))
    assert store.get("x") is None
    p = profile()
    store.put(p)
    assert store.get(p.key) == p


def _shared_cache(rank, world_size, store_path):
    from moe_engine import MPipeMoE, ProfileCache, ProfileStore

    config = MoEConfig(16, 32, 2 * world_size, top_k=2)
    cache = ProfileCache(ProfileStore(store_path))
    layers = [MPipeMoE(config, partitions=2, strategy="auto", profile=cache) for _ in range(3)]
    x = torch.randn(16, 16)
    for layer in layers:
        layer(x)[0].sum().backward()
    again = ProfileCache(ProfileStore(store_path))  # a later run reads the stored profile
    MPipeMoE(config, partitions=2, strategy="auto", profile=again)(x)
    return cache.measurements, again.measurements


@pytest.mark.gloo
@pytest.mark.parametrize("world_size", [1, 2])
def test_layers_share_one_measured_profile_and_later_runs_reuse_it(world_size, tmp_path):
    results = run_on_ranks(world_size, _shared_cache, str(tmp_path / f"profiles-{world_size}.json"))
    assert results == [(1, 0)] * world_size


def _calibrate(rank, world_size):
    config = MoEConfig(32, 64, 2 * world_size, top_k=2)
    return calibrate(config, 64, ExpertGroup(None), torch.device("cpu"), torch.float32, repeats=2)


@pytest.mark.gloo
@pytest.mark.parametrize("world_size", [1, 2])
def test_calibration_on_cpu_gives_one_profile_for_all_ranks(world_size):
    profiles = run_on_ranks(world_size, _calibrate)
    assert all(p == profiles[0] for p in profiles)
    p = profiles[0]
    assert p.device == "cpu" and p.world_size == world_size and p.dtype == "float32"
    for value in (p.gemm_flops, p.a2a_bytes_per_s, p.d2h_bytes_per_s, p.h2d_bytes_per_s):
        assert value > 0
    assert all(f >= 1.0 for f in p.slowdown.values()) and len(p.slowdown) == 6


def test_the_store_is_read_once_so_a_rank_prices_the_profile_it_agreed_on(tmp_path):
    """A key's first pass asks `held` (its digest goes into the agreement) and then `agreed`:
    a rewrite of the store between the two (another run calibrating) must not change the
    profile priced, or ranks that agreed on equal digests would price different ones."""
    from moe_engine.perf_model import ProfileCache

    store = ProfileStore(str(tmp_path / "profiles.json"))
    mine = profile(device="cpu", dtype="float32", world_size=1)
    store.put(mine)
    reads = []
    original_get = store.get
    store.get = lambda key: reads.append(key) or original_get(key)
    cache = ProfileCache(store)
    held = cache.held(1, torch.device("cpu"), torch.float32)
    assert held == mine
    store.put(dataclasses.replace(mine, gemm_flops=1e12))  # rewritten between the two reads
    priced = cache.agreed(GPT_XL, 1024, ExpertGroup(None), torch.device("cpu"), torch.float32,
                          missing_on_some_rank=False)
    assert priced.digest() == held.digest() and len(reads) == 1
    assert cache.held(1, torch.device("cpu"), torch.float32) is priced  # kept for the other layers
