"""Tier 1/2: the planner decides on agreed values only (search, strategy, host check), and
an auto layer on 2 gloo ranks runs at most one agreement collective per pass."""
import dataclasses
import os
import tempfile
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from moe_engine import HostBufferPool, MoEConfig, MPipeMoE
from moe_engine.comm import ExpertGroup
from moe_engine.dispatcher import PassStats
from moe_engine.granularity import GranularitySearch
from moe_engine.perf_model import HardwareProfile, PerformanceModel, ProfileCache, ProfileStore
from moe_engine.planner import AgreedHeadroom, AgreedValues, PassPlan, Planner
from tests.distributed import run_on_ranks

CONFIG = MoEConfig(d_model=16, d_hidden=32, num_experts=4, top_k=2)
PLENTY = 64 * 2**30

# Copies almost free, compute and network slow: offloading (S1) is the model's choice for n > 1.
OFFLOAD_FRIENDLY = HardwareProfile(device="cpu", dtype="float32", world_size=2, gemm_flops=1e9,
                                   a2a_latency_s=1e-4, a2a_bytes_per_s=1e6, d2h_bytes_per_s=1e15,
                                   h2d_bytes_per_s=1e15, partition_overhead_s=1e-6)
# Copies slow: recomputation and re-communication (S4) win.
SLOW_COPIES = dataclasses.replace(OFFLOAD_FRIENDLY, gemm_flops=1e15, a2a_bytes_per_s=1e15, a2a_latency_s=1e-6,
                                  d2h_bytes_per_s=1e3, h2d_bytes_per_s=1e3)


def agreed(tokens=64, seconds=None, backward=True):
    return AgreedValues(PassStats(False, tokens, 0), False, seconds, backward, torch.device("cpu"), torch.float32,
                        torch.float32)


def test_the_search_proceeds_on_the_agreed_timings():
    search = GranularitySearch(candidates=(1, 2, 4), warmup=0, repeats=1, give_up_slower=None)
    planner = Planner(CONFIG, ExpertGroup(None), partitions="auto", strategy="S4", search=search)
    seconds = {1: 3.0, 2: 1.0, 4: 2.0}   # the slowest rank's means, as the exchange would agree them
    chosen = []
    for _ in range(5):
        plan = planner.decide(agreed(seconds=seconds if search.timing_agreement_due() else None))
        planner.timing_for_pass(plan, torch.device("cpu"))
        chosen.append(plan.partitions)
    assert chosen == [1, 2, 4, 2, 2]
    assert search.decisions[-1]["event"] == "chose" and search.decisions[-1]["times"] == seconds


def test_the_strategy_is_the_performance_models_choice():
    chosen = {}
    for name, profile in (("offload", OFFLOAD_FRIENDLY), ("slow copies", SLOW_COPIES)):
        planner = Planner(CONFIG, ExpertGroup(None), partitions=4, strategy="auto", profile=profile)
        expected = PerformanceModel(profile).choose(CONFIG, 64, 1, torch.float32, [4]).strategy
        chosen[name] = planner.decide(agreed()).strategy
        assert chosen[name] == expected, name
    assert chosen == {"offload": "S1", "slow copies": "S4"}


def test_the_host_check_falls_back_when_the_agreed_headroom_is_short():
    plan = PassPlan(2, "S1")
    assert Planner.decide_host(plan, AgreedHeadroom(0)) == plan
    assert Planner.decide_host(plan, AgreedHeadroom(-1)) == PassPlan(2, "S4", host_fallback=True)


class OtherRankShort(ExpertGroup):
    """One process standing for a group in which another rank lacks a GiB of host memory."""

    def __init__(self):
        super().__init__(None)
        self.agreements = []

    def agree(self, values, device):
        self.agreements.append(list(values))
        return [max(values[0], 2**30)]


def test_the_host_check_agrees_once_per_pass_shape_and_falls_back_with_the_group():
    group = OtherRankShort()
    planner = Planner(CONFIG, group, partitions=2, strategy="S1",
                      host_pool=HostBufferPool(available_bytes=lambda: PLENTY))
    dispatch = SimpleNamespace(partitions=[SimpleNamespace(rows_received=10)] * 2)
    for _ in range(2):
        checked = planner.check_host_memory(PassPlan(2, "S1"), dispatch, agreed())
        assert checked == PassPlan(2, "S4", host_fallback=True)
    assert len(group.agreements) == 1 and group.agreements[0][0] < 0   # this rank fits
    assert "does not fit on another rank" in planner.host_fallback_reason
    # No backward: nothing is offloaded, nothing checked.
    assert planner.check_host_memory(PassPlan(2, "S1"), dispatch, agreed(tokens=99, backward=False)) == \
        PassPlan(2, "S1")
    assert len(group.agreements) == 1


class CountingGroup(ExpertGroup):
    """The process group's ExpertGroup, counting each collective by kind."""

    def __init__(self):
        super().__init__(None)
        self.calls = Counter()

    def exchange_counts(self, send_counts):
        self.calls["exchange_counts"] += 1
        return super().exchange_counts(send_counts)

    def all_reduce_max(self, values):
        self.calls["agreement"] += 1
        return super().all_reduce_max(values)

    def all_reduce_sum(self, values):
        self.calls["agreement"] += 1
        return super().all_reduce_sum(values)

    def broadcast_object(self, obj):
        self.calls["agreement"] += 1
        return super().broadcast_object(obj)


def _collectives_per_pass(rank, world_size):
    group = CountingGroup()
    with tempfile.TemporaryDirectory() as tmp:
        store = ProfileStore(os.path.join(tmp, "profiles.json"))
        store.put(OFFLOAD_FRIENDLY)   # held on every rank: the "missing" flag rides in the exchange
        torch.manual_seed(0)
        layer = MPipeMoE(CONFIG, group, "auto", "auto", profile=ProfileCache(store),
                         search=GranularitySearch(candidates=(1, 2, 4), warmup=0, repeats=1),
                         host_pool=HostBufferPool(available_bytes=lambda: PLENTY))
        passes = []
        for step in range(12):
            tokens = 20 + 6 * rank + (8 if step >= 8 else 0)   # ranks differ; the shape changes at step 8
            x = torch.randn(tokens, CONFIG.d_model, generator=torch.Generator().manual_seed(step)).requires_grad_()
            group.calls.clear()
            y, aux = layer(x)
            (y.square().sum() + aux).backward()
            passes.append((dict(group.calls), layer.last_partitions, layer.last_strategy))
        measured = layer.profile.measurements
    return passes, [d["event"] for d in layer.search.decisions], measured


@pytest.mark.gloo
def test_an_auto_layer_runs_at_most_one_agreement_collective_per_pass():
    results = run_on_ranks(2, _collectives_per_pass)
    (passes, events, measured), other = results[0], results[1]
    assert [p[1:] for p in passes] == [p[1:] for p in other[0]], "ranks chose differently"
    for calls, n, strategy in passes:
        assert calls.get("exchange_counts") == 1, calls
        assert calls.get("agreement", 0) <= 1, calls
    assert "chose" in events and measured == 0                  # the search ended; nothing was calibrated
    assert {s for _, _, s in passes} >= {"S1"}                  # offloads ran, so the host check did too
    assert sum(c.get("agreement", 0) for c, _, _ in passes) >= 2  # once per new pass shape


def test_the_budget_fit_check_bounds_the_busiest_ranks_rows_under_skew():
    """Under a budget, the fewest partitions that fit are chosen on the busiest rank's rows:
    with an agreed skew bucket of 2 on 4 ranks a rank may receive up to 4·k·T rows, so more
    partitions are needed than balanced routing suggests, and the bound's peak fits."""
    from moe_engine.memory import predict_memory

    group = ExpertGroup(None)
    group.size = 4  # the planner's arithmetic for a 4-rank group (no collective runs here)
    config = MoEConfig(d_model=256, d_hidden=1024, num_experts=8, top_k=2)
    search = GranularitySearch(candidates=(1, 2, 4, 8, 16))
    budget = predict_memory(config, 4096, 4, 2, "S4", dtype=torch.float32).peak_bytes
    planner = Planner(config, group, partitions="auto", strategy="S4", search=search, memory_budget=budget)
    balanced = planner._fewest_partitions_within_budget(4096, torch.float32, skew_bucket=0)
    skewed = planner._fewest_partitions_within_budget(4096, torch.float32, skew_bucket=2)
    assert balanced <= 2 < skewed
    busiest = predict_memory(config, 4096, 4, skewed, "S4", dtype=torch.float32, rows_received=4 * 2 * 4096)
    assert busiest.peak_bytes <= budget
