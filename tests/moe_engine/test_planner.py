"""Tier 1/2: the planner decides on agreed values only (search, strategy, host check), and
an auto layer on 2 gloo ranks runs at most one agreement collective per pass."""
import dataclasses
import os
import tempfile
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from moe_engine import HostBufferPool, MemoryBudget, MoEConfig, MPipeMoE
from moe_engine.comm import ExpertGroup
from moe_engine.dispatcher import PassStats
from moe_engine.granularity import GranularitySearch, Setting
from moe_engine.perf_model import HardwareProfile, PerformanceModel, ProfileCache, ProfileStore
from moe_engine.planner import AgreedHeadroom, AgreedValues, PassPlan, Planner
from tests.distributed import run_on_ranks

CONFIG = MoEConfig(d_model=16, d_hidden=32, num_experts=4, top_k=2)
PLENTY = 64 * 2**30

# Copies almost free, compute and network slow: offloading (S1) is the model's choice for n > 1.
OFFLOAD_FRIENDLY = HardwareProfile(device="cpu", dtype="float32", world_size=2, gemm_flops=1e9,
                                   a2a_latency_s=1e-4, a2a_bytes_per_s=1e6, d2h_bytes_per_s=1e15,
                                   h2d_bytes_per_s=1e15, partition_overhead_s=1e-6)
# Copies slow, compute and network fast: of the restore strategies recomputation and
# re-communication (S4) win, but cost more than keeping everything ("none").
SLOW_COPIES = dataclasses.replace(OFFLOAD_FRIENDLY, gemm_flops=1e15, a2a_bytes_per_s=1e15, a2a_latency_s=1e-6,
                                  d2h_bytes_per_s=1e3, h2d_bytes_per_s=1e3)


class SeveralRanks(ExpertGroup):
    """One process standing in for a group whose passes run All-to-Alls, where the planner
    searches n (on one rank it runs the fewest partitions that fit: nothing to overlap). Only
    for decisions that run no collective."""

    @property
    def distributed(self) -> bool:
        return True


def agreed(tokens=64, seconds=None, backward=True, dtype=torch.float32):
    return AgreedValues(PassStats(False, tokens, 0), False, False, seconds, backward, torch.device("cpu"), dtype)


def test_the_search_proceeds_on_the_agreed_timings():
    search = GranularitySearch(candidates=(1, 2, 4), warmup=0, repeats=1, give_up_slower=None)
    planner = Planner(CONFIG, SeveralRanks(None), partitions="auto", strategy="S4", search=search)
    seconds = {1: 3.0, 2: 1.0, 4: 2.0}   # the slowest rank's fastest passes, as the exchange would agree them
    agreed_seconds = {Setting(n): t for n, t in seconds.items()}
    chosen = []
    for _ in range(5):
        plan = planner.decide(agreed(seconds=agreed_seconds if search.timing_agreement_due() else None))
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
    assert chosen == {"offload": "S1", "slow copies": "none"}
    shared = PerformanceModel(SLOW_COPIES).choose(CONFIG, 64, 1, torch.float32, [4], saving_slack=10.0)
    assert shared.strategy == "S4"


def test_the_strategy_is_priced_once_per_pass_shape_and_profile(monkeypatch):
    priced = []
    choose = PerformanceModel.choose
    monkeypatch.setattr(PerformanceModel, "choose", lambda self, *a, **k: priced.append(a[1]) or choose(self, *a, **k))
    planner = Planner(CONFIG, ExpertGroup(None), partitions=4, strategy="auto", profile=OFFLOAD_FRIENDLY)
    plans = [planner.decide(agreed(tokens)) for tokens in (64, 64, 64, 32, 64, 32)]
    assert [p.strategy for p in plans] == ["S1"] * 6 and priced == [64, 32]   # each token count priced once
    planner.profile = SLOW_COPIES   # another profile (as adopting rank 0's would give): priced again
    assert planner.decide(agreed(64)).strategy == "none" and priced == [64, 32, 64]
    planner.memory_budget = 10 ** 12  # another budget: priced again
    planner.decide(agreed(64))
    assert priced == [64, 32, 64, 64]


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

    def exchange_counts(self, send_counts, stats_width=None):
        self.calls["exchange_counts"] += 1
        return super().exchange_counts(send_counts, stats_width)

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


# -- the dtype the experts run in (autocast) ---------------------------------------------------------
def _autocast_pass(layer, tokens=24):
    """One forward+backward of ``layer`` on float32 input under CPU bf16 autocast (the Trainer's
    mixed precision: a LayerNorm's float32 output, float32 parameters)."""
    x = torch.randn(tokens, CONFIG.d_model, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, aux = layer(x)
    (y.float().square().sum() + aux).backward()


def test_under_autocast_the_profile_is_keyed_timed_and_priced_in_the_experts_dtype(monkeypatch):
    import moe_engine.experts as experts_module

    gemms, priced = [], []
    grouped_mm, predict = experts_module.grouped_mm, PerformanceModel.predict
    monkeypatch.setattr(experts_module, "grouped_mm",
                        lambda x, w, seg: gemms.append((x.dtype, w.dtype)) or grouped_mm(x, w, seg))
    monkeypatch.setattr(PerformanceModel, "predict", lambda self, *args: priced.append(args[-1]) or predict(self, *args))
    cache = ProfileCache()
    _autocast_pass(MPipeMoE(CONFIG, ExpertGroup(None), 2, "auto", profile=cache))
    assert list(cache.profiles) == ["cpu|bfloat16|ws1"] and cache.profiles["cpu|bfloat16|ws1"].dtype == "bfloat16"
    assert cache.measurements == 1
    assert set(gemms) == {(torch.bfloat16, torch.bfloat16)}   # the calibration's GEMMs and the pass's
    assert priced and set(priced) == {torch.bfloat16}          # rows priced at 2 bytes
    # Without autocast the same float32 input is priced as what it is.
    plain = ProfileCache()
    layer = MPipeMoE(CONFIG, ExpertGroup(None), 2, "auto", profile=plain)
    layer(torch.randn(24, CONFIG.d_model))[0].sum().backward()
    assert list(plain.profiles) == ["cpu|float32|ws1"] and priced[-1] == torch.float32


def _bf16_autocast_profile(device, tokens):
    """The trainer's setting: float32 parameters and input under bf16 autocast on ``device``;
    the one profile measured (its key and itself) and the output's dtype."""
    cache = ProfileCache()
    layer = MPipeMoE(CONFIG, ExpertGroup(None), 2, "auto", profile=cache, device=device)
    x = torch.randn(tokens, CONFIG.d_model, device=device, requires_grad=True)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        y, aux = layer(x)
    (y.float().square().sum() + aux).backward()
    (key, profile), = cache.profiles.items()
    return key, profile, y.dtype


@pytest.mark.gpu
def test_under_cuda_autocast_the_profile_is_measured_and_keyed_in_bf16():
    key, profile, out_dtype = _bf16_autocast_profile(torch.device("cuda", torch.cuda.current_device()), 256)
    assert key.endswith("|bfloat16|ws1") and profile.dtype == "bfloat16" and out_dtype == torch.float32


def test_under_cuda_autocast_the_profile_is_measured_and_keyed_in_bf16_cpu_twin():
    key, profile, out_dtype = _bf16_autocast_profile(torch.device("cpu"), 24)
    assert key == "cpu|bfloat16|ws1" and profile.dtype == "bfloat16" and out_dtype == torch.float32


def test_under_autocast_the_host_check_prices_the_bf16_buffers_the_offloads_take():
    """The offloads copy bf16 rows: host memory for exactly those fits (priced at float32 it
    would look twice as large and fall back to S4 for nothing)."""
    def run(pool):
        torch.manual_seed(0)
        layer = MPipeMoE(CONFIG, ExpertGroup(None), 2, "S1", host_pool=pool)
        _autocast_pass(layer)
        return layer

    roomy = HostBufferPool(available_bytes=lambda: PLENTY)
    run(roomy)
    taken = roomy.bytes_allocated
    assert taken > 0
    exact = HostBufferPool(available_bytes=lambda: taken, usable_fraction=1.0)
    layer = run(exact)
    assert layer.last_strategy == "S1" and layer.host_fallback_reason is None
    assert exact.bytes_allocated == taken


# -- one profile across ranks ------------------------------------------------------------------------
def _different_local_profiles(rank, world_size):
    """Rank 0 holds a profile under which offloading (S1) wins, rank 1 one under which S4
    (extra All-to-Alls in backward) wins: given directly, and read from a store of each
    rank's own (one per node) through a ProfileCache shared by two layers."""
    import logging

    warned = []
    handler = logging.Handler()
    handler.emit = warned.append
    logging.getLogger("moe_engine.perf_model").addHandler(handler)
    mine = OFFLOAD_FRIENDLY if rank == 0 else SLOW_COPIES
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = ProfileStore(os.path.join(tmp, "profiles.json"))
        store.put(mine)
        cache = ProfileCache(store)

        def layer(profile):
            return MPipeMoE(CONFIG, CountingGroup(), 2, "auto", profile=profile,
                            host_pool=HostBufferPool(available_bytes=lambda: PLENTY))

        for name, stack in (("given", [layer(mine)]), ("stored", [layer(cache), layer(cache)])):
            passes, before = [], len(warned)
            for step in range(3):
                torch.manual_seed(step)
                h = torch.randn(20 + 6 * rank, CONFIG.d_model, requires_grad=True)   # ranks differ
                for moe in stack:
                    moe.group.calls.clear()
                    h = moe(h)[0]
                h.square().sum().backward()
                passes.append([(dict(moe.group.calls), moe.last_partitions, moe.last_strategy) for moe in stack])
            results[name] = (passes, len(warned) - before)
        before = len(warned)
        fresh = ProfileCache(store).get_or_measure(CONFIG, 32, ExpertGroup(None), torch.device("cpu"), torch.float32)
        results["get_or_measure"] = (fresh.figures(), len(warned) - before)
    return results


@pytest.mark.gloo
def test_ranks_with_different_local_profiles_adopt_rank_0s_and_choose_alike():
    results = run_on_ranks(2, _different_local_profiles, collective_timeout_s=30)
    for name in ("given", "stored"):
        (passes, warnings), (other, other_warnings) = results[0][name], results[1][name]
        choices = [[(n, s) for _, n, s in layers] for layers in passes]
        assert choices == [[(n, s) for _, n, s in layers] for layers in other], name
        assert {s for layers in choices for _, s in layers} == {"S1"}, name   # rank 0's profile's choice
        assert warnings == other_warnings == 1, name   # adopted once (a shared cache: once for its layers)
        for step, layers in enumerate(passes):
            for i, (calls, _, _) in enumerate(layers):
                assert calls.get("exchange_counts") == 1, (name, step, calls)
                # One agreement at most (the host check), plus the one-off adoption on the first pass.
                assert calls.get("agreement", 0) <= 1 + (step == 0 and i == 0), (name, step, i, calls)
    figures, warnings = results[0]["get_or_measure"]
    assert results[1]["get_or_measure"] == (figures, warnings) and warnings == 1
    assert figures == OFFLOAD_FRIENDLY.figures()


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


def test_the_budget_floor_on_n_prices_the_dtype_the_experts_run_in():
    """Under autocast (float32 parameters, bf16 experts) the fewest partitions that fit are
    priced in bf16, as the strategy model and the job check price them: a budget that n = 1
    fits in bf16 but not in float32 keeps n = 1 in reach (it forced n = 16 for gpt-xl)."""
    from moe_engine.memory import predict_memory

    config = MoEConfig(d_model=256, d_hidden=1024, num_experts=8, top_k=2)
    search = GranularitySearch(candidates=(1, 2, 4, 8, 16))
    budget = MemoryBudget.of(predict_memory(config, 4096, 1, 1, "S4", dtype=torch.bfloat16).peak_bytes)
    assert budget.need_of(predict_memory(config, 4096, 1, 1, "S4", dtype=torch.float32)) > budget.bytes
    planner = Planner(config, SeveralRanks(None), partitions="auto", strategy="S4", search=search,
                      memory_budget=budget)
    floors = []
    decide = search.decide_setting
    search.decide_setting = lambda *args, min_partitions, **kw: floors.append(min_partitions) or decide(
        *args, min_partitions=min_partitions, **kw)
    planner.decide(agreed(tokens=4096, dtype=torch.bfloat16))
    planner.decide(agreed(tokens=4096, dtype=torch.float32))
    assert floors[0] == 1 and floors[1] > 1


@pytest.mark.parametrize("budget", [None, "n=4 fits"])
def test_on_one_rank_auto_runs_the_fewest_partitions_that_fit_without_searching(budget):
    """One rank has no All-to-All for partitions to hide and each adds host work: n = 1, or
    under a memory budget the fewest that fit; the search never times a candidate."""
    from moe_engine.memory import predict_memory

    config, tokens = MoEConfig(64, 256, 4, top_k=2), 512
    if budget is not None:
        budget = min(predict_memory(config, tokens, 1, 4, s, dtype=torch.float32).peak_bytes for s in ("S1", "S4"))
    search = GranularitySearch(candidates=(1, 2, 4, 8), warmup=0, repeats=1)
    layer = MPipeMoE(config, partitions="auto", strategy="S4", memory_budget=budget, search=search)
    chosen = set()
    for _ in range(4):
        x = torch.randn(tokens, 64, requires_grad=True)
        y, aux = layer(x)
        (y.sum() + aux).backward()
        chosen.add(layer.last_partitions)
    fewest = 1 if budget is None else min(n for n in (1, 2, 4, 8) if min(
        predict_memory(config, tokens, 1, n, s, dtype=torch.float32).peak_bytes for s in ("S1", "S2", "S3", "S4"))
        <= budget)
    assert chosen == {fewest} and (budget is None or fewest > 1)
    assert search.decisions == [] and search.active is None
