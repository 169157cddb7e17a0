"""Tier 1/2: the online search of n — exploration, range merging, re-checks, skew shifts,
agreement across ranks — with a synthetic cost, then on real passes."""
import pytest
import torch

from moe_engine import FastMoE, MoEConfig, MPipeMoE
from moe_engine.comm import ExpertGroup
from moe_engine.granularity import GranularitySearch, Setting, skew_bucket
from moe_engine.perf_model import HardwareProfile
from moe_engine.planner import Planner
from tests.distributed import run_on_ranks


class FakeTiming:
    def __init__(self, seconds):
        self._seconds = seconds
        self.backward_done = True

    def seconds(self):
        return self._seconds


class ScriptedSearch(GranularitySearch):
    """Measures a synthetic cost(tokens, n) instead of the clock."""

    def __init__(self, cost, **kwargs):
        super().__init__(**kwargs)
        self.cost = cost
        self._tokens = None

    def choose(self, tokens, skew, group, timing_wanted=True, min_partitions=1, prefer_fastest=False):
        self._tokens = tokens
        return super().choose(tokens, skew, group, timing_wanted, min_partitions, prefer_fastest)

    def timing_for_pass(self, n, device, split="tokens"):
        self._n = n
        return super().timing_for_pass(n, device, split)

    def _new_timing(self, device):
        return FakeTiming(self.cost(self._tokens, self._n))


def run_passes(search, tokens, passes, skew=0):
    group = ExpertGroup(None)
    chosen = []
    for _ in range(passes):
        n = search.choose(tokens, skew, group)
        search.timing_for_pass(n, torch.device("cpu"))
        chosen.append(n)
    return chosen


def best_n_grows_with_tokens(tokens, n):
    best = 1 if tokens < 2000 else 4 if tokens < 10000 else 8
    return 1.0 + abs(n - best) * 0.1


def test_search_explores_then_settles_on_fastest():
    search = ScriptedSearch(best_n_grows_with_tokens, candidates=(1, 2, 4, 8), warmup=1, repeats=2)
    chosen = run_passes(search, 4096, 12 + 3)
    assert chosen[:12] == [1, 1, 1, 2, 2, 2, 4, 4, 4, 8, 8, 8]
    assert chosen[12:] == [4, 4, 4]
    assert search.decisions[-1]["event"] == "chose" and search.decisions[-1]["partitions"] == 4


def test_range_merging_and_pruned_search():
    search = ScriptedSearch(best_n_grows_with_tokens, candidates=(1, 2, 4, 8), warmup=0, repeats=1)
    run_passes(search, 4096, 5)
    run_passes(search, 8192, 5)
    assert [(e.tokens, e.partitions) for e in search.cache] == [(4096, 4), (8192, 4)]
    # between two entries with the same n: reused, no search
    decisions = len(search.decisions)
    assert run_passes(search, 6000, 2) == [4, 4]
    assert len(search.decisions) == decisions
    # above the largest entry: n >= 4 are timed, plus one neighbour below as a guard
    run_passes(search, 20000, 4)
    started = [d for d in search.decisions if d["event"] == "search started"][-1]
    assert started["candidates"] == [2, 4, 8]
    assert search.cache[-1].partitions == 8


def test_periodic_recheck_detects_stale_cache():
    costs = {"best": 2}
    search = ScriptedSearch(lambda t, n: 1.0 + abs(n - costs["best"]), candidates=(1, 2, 4, 8),
                            warmup=0, repeats=1, recheck_every=5)
    run_passes(search, 1000, 5)
    assert search.cache[0].partitions == 2
    costs["best"] = 4   # the hardware / workload changed under the cache
    run_passes(search, 1000, 4 + 3 + 1)
    events = [d["event"] for d in search.decisions]
    assert "cache stale" in events
    assert search.cache[0].partitions == 4


def test_skew_shift_triggers_new_search():
    search = ScriptedSearch(best_n_grows_with_tokens, candidates=(1, 2), warmup=0, repeats=1)
    run_passes(search, 1000, 3, skew=0)
    run_passes(search, 1000, 3, skew=1)   # ordinary drift: the cached n stays
    reasons = [d.get("reason", "") for d in search.decisions if d["event"] == "search started"]
    assert not any("routing skew changed" in r for r in reasons)
    run_passes(search, 1000, 3, skew=2)   # a 4x shift in the heaviest expert's load
    reasons = [d.get("reason", "") for d in search.decisions if d["event"] == "search started"]
    assert any("routing skew changed" in r for r in reasons)


def test_monotonicity_violations_are_reported():
    search = ScriptedSearch(lambda t, n: 1.0 + abs(n - (4 if t < 5000 else 2)), candidates=(1, 2, 4),
                            warmup=0, repeats=1)
    run_passes(search, 1000, 4)
    run_passes(search, 9000, 4)
    assert search.monotonicity_violations() == [(1000, 4, 9000, 2)]
    assert any(d["event"] == "monotonicity violated" for d in search.decisions)


def test_minimum_partitions_limit_the_search_and_the_cache():
    search = ScriptedSearch(best_n_grows_with_tokens, candidates=(1, 2, 4, 8), warmup=0, repeats=1)
    run_passes(search, 1000, 5)
    assert search.cache[0].partitions == 1
    group = ExpertGroup(None)
    chosen = []
    for _ in range(4):   # a budget now needs n >= 4: the cached n=1 no longer counts
        n = search.choose(1000, 0, group, True, min_partitions=4)
        search.timing_for_pass(n, torch.device("cpu"))
        chosen.append(n)
    assert set(chosen) <= {4, 8} and search.cache[-1].partitions in (4, 8)


def test_the_largest_n_near_the_fastest_unless_the_fastest_is_asked_for():
    def cost(tokens, n):  # n = 4 fastest, n = 8 within the 5% tolerance of it
        return {1: 1.5, 2: 1.2, 4: 1.0, 8: 1.04}[n]

    group = ExpertGroup(None)
    for prefer_fastest, expected in ((False, 8), (True, 4)):
        search = ScriptedSearch(cost, candidates=(1, 2, 4, 8), warmup=0, repeats=1, give_up_slower=None)
        for _ in range(5):
            n = search.choose(4096, 0, group, True, prefer_fastest=prefer_fastest)
            search.timing_for_pass(n, torch.device("cpu"))
        assert search.cache[-1].partitions == expected, prefer_fastest


@pytest.mark.parametrize("strategy, budget, fastest", [("auto", None, False), ("S4", None, False),
                                                       ("none", None, True), ("auto", 10 ** 12, True)])
def test_the_planner_asks_the_search_for_the_fastest_n_where_more_partitions_buy_nothing(strategy, budget, fastest):
    from tests.moe_engine.test_planner import SeveralRanks, agreed

    asked = []

    class Recording(GranularitySearch):
        def decide_setting(self, *args, **kwargs):
            asked.append(kwargs.get("prefer_fastest"))
            return super().decide_setting(*args, **kwargs)

    planner = Planner(MoEConfig(16, 32, 4, top_k=2), SeveralRanks(None), partitions="auto", strategy=strategy,
                      memory_budget=budget, search=Recording(candidates=(1, 2), warmup=0, repeats=1),
                      profile=HardwareProfile(device="cpu", dtype="float32", world_size=1, gemm_flops=1e9,
                                              a2a_latency_s=1e-4, a2a_bytes_per_s=1e9, d2h_bytes_per_s=1e9,
                                              h2d_bytes_per_s=1e9, partition_overhead_s=1e-6))
    planner.decide(agreed(tokens=32))
    assert asked and set(asked) == {fastest}


def test_memory_budget_steers_auto_layer_to_more_partitions():
    config = MoEConfig(64, 256, 4, top_k=2)
    tokens = 512
    from moe_engine.memory import predict_memory
    budget = min(predict_memory(config, tokens, 1, 4, s, dtype=torch.float32).peak_bytes
                 for s in ("S1", "S2", "S3", "S4"))
    assert budget < min(predict_memory(config, tokens, 1, 2, s, dtype=torch.float32).peak_bytes
                        for s in ("none", "S1", "S2", "S3", "S4"))
    layer = MPipeMoE(config, memory_budget=budget, search=GranularitySearch(candidates=(1, 2, 4, 8), warmup=0,
                                                                            repeats=1))
    for _ in range(4):
        x = torch.randn(tokens, 64, requires_grad=True)
        y, aux = layer(x)
        (y.sum() + aux).backward()
        assert layer.last_partitions >= 4
        peak = predict_memory(config, tokens, 1, layer.last_partitions, layer.last_strategy,  # type: ignore[arg-type]  # (set by the pass above)
                              dtype=torch.float32).peak_bytes
        assert peak <= budget


def test_skew_bucket():
    assert skew_bucket(torch.tensor([10, 10, 10, 10])) == 0
    assert skew_bucket(torch.tensor([40, 0, 0, 0])) == 2
    assert skew_bucket(torch.tensor([0, 0])) == 0
    assert skew_bucket(torch.tensor([], dtype=torch.long)) == 0
    assert skew_bucket(torch.tensor([23, 1, 0, 0])) == 2   # max / mean = 3.83: log2 1.94
    assert skew_bucket(torch.tensor([17, 5, 5, 5])) == 1   # 2.125: log2 1.09


def test_bad_search_settings():
    with pytest.raises(ValueError, match="candidates="):
        GranularitySearch(candidates=(0, 2))


def _auto_layer_matches_fastmoe(rank, world_size, splits=("tokens",)):
    config = MoEConfig(16, 32, 2 * world_size, top_k=2)
    torch.manual_seed(0)
    reference = FastMoE(config, dtype=torch.float64)
    layer = MPipeMoE(config, partitions="auto", strategy="auto", dtype=torch.float64,
                     search=GranularitySearch(candidates=(1, 2, 4), warmup=0, repeats=1, give_up_slower=None,
                                              splits=splits))
    layer.load_state_dict(reference.state_dict())
    chosen = []
    for step in range(5):
        x = torch.randn(24, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * rank + step))
        for model in (reference, layer):
            model.zero_grad()
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        ya, aa = reference(xa)
        yb, ab = layer(xb)
        (ya.square().sum() + aa).backward()
        (yb.square().sum() + ab).backward()
        torch.testing.assert_close(yb, ya)
        torch.testing.assert_close(xb.grad, xa.grad)
        torch.testing.assert_close(layer.experts.w1.grad, reference.experts.w1.grad)
        chosen.append((layer.last_partitions, layer.last_strategy) if len(splits) == 1
                      else (layer.last_partitions, layer.last_split))
    return chosen, [d["event"] for d in layer.search.decisions], layer.profile.profiles


@pytest.mark.gloo
def test_auto_layer_is_exact_and_ranks_agree():
    world_size = 2
    results = run_on_ranks(world_size, _auto_layer_matches_fastmoe)
    chosen = [r[0] for r in results]
    assert all(c == chosen[0] for c in chosen), f"ranks chose differently: {chosen}"
    assert [n for n, _ in chosen[0][:3]] == [1, 2, 4]          # the search timed each candidate
    assert "chose" in results[0][1]
    assert all(s in ("none", "S1", "S2", "S3", "S4") for _, s in chosen[0])
    # the figures the model reads (measured_at is each rank's own clock, to the second)
    figures = [{key: p.figures() for key, p in r[2].items()} for r in results]
    assert len(figures[0]) == 1 and all(f == figures[0] for f in figures), "ranks hold different profiles"


def test_one_stalled_pass_does_not_decide_the_search():
    # n=8 is fastest, but one of its two timed passes stalls (as the caching allocator does
    # under memory pressure): a candidate's time is its fastest pass, so n=8 still wins,
    # and the decision log keeps every pass.
    passes = {}

    def cost(tokens, n):
        passes[n] = passes.get(n, 0) + 1
        stalled = n == 8 and passes[n] == 2          # its second timed pass (warm-ups are not timed)
        return {1: 1.0, 2: 0.8, 4: 0.6, 8: 0.5}[n] + (5.0 if stalled else 0.0)

    search = ScriptedSearch(cost, candidates=(1, 2, 4, 8), warmup=1, repeats=2, give_up_slower=None)
    chosen = run_passes(search, 4096, 12 + 1)
    assert chosen[12] == 8
    chose = search.decisions[-1]
    assert chose["event"] == "chose" and chose["times"][8] == pytest.approx(0.5)
    assert chose["local_passes_ms"][8] == [pytest.approx(500.0), pytest.approx(5500.0)]


def one_gpu_like(tokens, n):
    """Nothing to overlap: every partition adds its launch cost."""
    return 1.0 + 0.6 * (n - 1)


def test_search_stops_timing_larger_n_once_they_only_get_slower():
    search = ScriptedSearch(one_gpu_like, candidates=(1, 2, 4, 8, 16), warmup=1, repeats=2)
    chosen = run_passes(search, 4096, 9 + 3)
    # n=2 is 60% slower than n=1 and slower than it: 4, 8 and 16 are never run
    assert chosen == [1, 1, 1, 2, 2, 2, 1, 1, 1, 1, 1, 1]
    cut = next(d for d in search.decisions if d["event"] == "search cut short")
    assert cut["skipped"] == [4, 8, 16] and "n=2 is 60% slower" in cut["reason"]
    assert search.decisions[-1]["event"] == "chose" and search.decisions[-1]["partitions"] == 1


def test_a_slower_candidate_within_the_margin_does_not_stop_the_search():
    # n=2 is 30% slower than n=1 (under the 50% margin), n=4 is fastest
    search = ScriptedSearch(lambda t, n: {1: 1.0, 2: 1.3, 4: 0.8, 8: 2.0, 16: 3.0}[n],
                            candidates=(1, 2, 4, 8, 16), warmup=0, repeats=1)
    chosen = run_passes(search, 4096, 5)
    assert chosen[:4] == [1, 2, 4, 8]          # n=8 is 150% slower than n=4 and slower: 16 is skipped
    assert search.cache[0].partitions == 4 and chosen[4] == 4
    unlimited = ScriptedSearch(one_gpu_like, candidates=(1, 2, 4, 8, 16), warmup=0, repeats=1, give_up_slower=None)
    assert run_passes(unlimited, 4096, 5) == [1, 2, 4, 8, 16]


def test_give_up_slower_is_validated():
    with pytest.raises(ValueError, match=r"give_up_slower=0 is invalid: give a fraction > 0"):
        GranularitySearch(give_up_slower=0)


def _cut_on_ranks(rank, world_size):
    # rank 1 sees n=2 as slow, rank 0 does not: the slowest rank's times decide for both
    cost = (lambda t, n: 1.0 + 0.05 * n) if rank == 0 else one_gpu_like
    search = ScriptedSearch(cost, candidates=(1, 2, 4, 8), warmup=0, repeats=1)
    return run_passes(search, 4096, 4), [d["event"] for d in search.decisions]


@pytest.mark.gloo
def test_ranks_cut_the_search_at_the_same_pass():
    results = run_on_ranks(2, _cut_on_ranks)
    assert results[0] == results[1]
    assert results[0][0] == [1, 2, 1, 1] and "search cut short" in results[0][1]


def _auto_split_layer_matches_fastmoe(rank, world_size):
    return _auto_layer_matches_fastmoe(rank, world_size, splits=("tokens", "peers"))


@pytest.mark.gloo
def test_an_auto_split_layer_is_exact_under_either_split_and_ranks_agree():
    # 2 ranks: the search times 1, 2 and 2 split by peers (4 split by peers needs 4 ranks)
    results = run_on_ranks(2, _auto_split_layer_matches_fastmoe)
    chosen = [r[0] for r in results]
    assert chosen[0] == chosen[1], f"ranks chose differently: {chosen}"
    assert chosen[0][:4] == [(1, "tokens"), (2, "tokens"), (2, "peers"), (4, "tokens")]
    assert "chose" in results[0][1]


class RecordingGroup(ExpertGroup):
    """One process; records the device of each all-reduce's tensor and answers zeros."""

    def __init__(self):
        super().__init__(None)
        self.devices = []

    def all_reduce_max(self, values):
        self.devices.append(values.device)
        return torch.zeros(values.shape, dtype=values.dtype)


def test_the_agreement_runs_on_the_timed_passes_device():
    # NCCL rejects CPU tensors: the all-reduce of the timings must be on the data's device
    # ("meta" stands in for a GPU: it is not the default device, and holds no data).
    search = ScriptedSearch(one_gpu_like, candidates=(1, 2, 4), warmup=0, repeats=1)
    group = RecordingGroup()
    for _ in range(4):
        n = search.choose(4096, 0, group)
        search.timing_for_pass(n, torch.device("meta"))
    assert group.devices and all(d == torch.device("meta") for d in group.devices), group.devices
    assert search.decisions[-1]["event"] == "chose"


class ScriptedSplitSearch(GranularitySearch):
    """Times both splits: a synthetic cost(n, split) instead of the clock."""

    def __init__(self, cost, **kwargs):
        super().__init__(splits=("tokens", "peers"), **kwargs)
        self.cost = cost

    def timing_for_pass(self, n, device, split="tokens"):
        self._setting = (n, split)
        return super().timing_for_pass(n, device, split)

    def _new_timing(self, device):
        return FakeTiming(self.cost(*self._setting))


def run_setting_passes(search, tokens, passes):
    group = ExpertGroup(None)
    chosen = []
    for _ in range(passes):
        seconds = search.agreed_seconds(group) if search.timing_agreement_due() else None
        setting = search.decide_setting(tokens, 0, seconds, True)
        search.timing_for_pass(setting.partitions, torch.device("cpu"), setting.split)
        chosen.append(setting.label)
    return chosen


def test_with_both_splits_each_n_is_timed_split_by_tokens_and_by_peers():
    # Under skew more partitions win, but n = 16 split by tokens pays n·W messages: the
    # peer split at 16 is fastest. n = 1 is timed once (one partition however it is split).
    cost = {(1, "tokens"): 10.0, (2, "tokens"): 8.0, (2, "peers"): 8.5, (4, "tokens"): 6.0,
            (4, "peers"): 6.2, (8, "tokens"): 5.5, (8, "peers"): 5.4, (16, "tokens"): 9.0, (16, "peers"): 5.0}
    search = ScriptedSplitSearch(lambda n, split: cost[n, split], warmup=0, repeats=1, give_up_slower=None)
    chosen = run_setting_passes(search, 4096, 9 + 2)
    assert chosen == [1, 2, "2:peers", 4, "4:peers", 8, "8:peers", 16, "16:peers", "16:peers", "16:peers"]
    chose = search.decisions[-1]
    assert chose["event"] == "chose" and (chose["partitions"], chose["split"]) == (16, "peers")
    assert chose["times"]["16:peers"] == 5.0 and chose["times"][16] == 9.0
    assert search.cache[0].setting == Setting(16, "peers")


def test_a_split_that_only_gets_slower_stops_being_timed_the_other_goes_on():
    # split by tokens n = 4 is 60% slower than the fastest and slower than n = 2: 8 and 16
    # split by tokens are not timed, while the peer split goes on to its fastest n = 8.
    cost = {(1, "tokens"): 1.0, (2, "tokens"): 1.1, (2, "peers"): 0.9, (4, "tokens"): 1.5,
            (4, "peers"): 0.8, (8, "tokens"): 9.0, (8, "peers"): 0.7, (16, "tokens"): 9.0, (16, "peers"): 0.75}
    search = ScriptedSplitSearch(lambda n, split: cost[n, split], warmup=0, repeats=1)
    chosen = run_setting_passes(search, 4096, 8)
    assert chosen == [1, 2, "2:peers", 4, "4:peers", "8:peers", "16:peers", "8:peers"]
    cut = next(d for d in search.decisions if d["event"] == "search cut short")
    assert cut["skipped"] == [8, 16] and "split by peers" not in cut["reason"]


def test_a_world_size_keeps_the_peer_splits_it_can_run():
    search = GranularitySearch(candidates=(1, 2, 3, 4, 8), splits=("tokens", "peers"))
    search.limit_to_world(4)
    assert [s.label for s in search.settings] == [1, 2, "2:peers", 3, 4, "4:peers", 8]
    assert search.token_candidates == [1, 2, 3, 4, 8] and search.partition_counts == [1, 2, 3, 4, 8]
    only_peers = GranularitySearch(candidates=(3, 5), splits=("peers",))
    with pytest.raises(ValueError, match=r"none divides the expert-parallel world size 4"):
        only_peers.limit_to_world(4)
    with pytest.raises(ValueError, match=r"splits=\('rows',\) is invalid"):
        GranularitySearch(splits=("rows",))


def test_a_periodic_recheck_times_the_neighbours_in_its_split_and_its_n_in_the_other():
    cost = {(1, "tokens"): 9.0, (2, "tokens"): 8.0, (2, "peers"): 7.0, (4, "tokens"): 6.0, (4, "peers"): 5.0,
            (8, "tokens"): 7.0, (8, "peers"): 6.0}
    search = ScriptedSplitSearch(lambda n, split: cost[n, split], candidates=(1, 2, 4, 8), warmup=0, repeats=1,
                                 recheck_every=3, give_up_slower=None)
    run_setting_passes(search, 4096, 7 + 3)
    assert search.cache[0].setting == Setting(4, "peers")
    recheck = [d for d in search.decisions if d["event"] == "search started"][-1]
    assert "periodic re-check of cached n=4:peers" in recheck["reason"]
    assert recheck["candidates"] == ["2:peers", 4, "4:peers", "8:peers"]  # not 2 and 8 split by tokens
