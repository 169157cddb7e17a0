"""FasterMoE's dynamic shadowing (moe_engine/shadowing.py): the rule on the host (tier 1), then
the FasterMoE layer on 2 and 4 gloo ranks against the brute-force reference in float64 with
an expert made hot (shadowed: its weights broadcast, its pairs computed where their tokens
are, its gradients reduced onto the owner), with a routing that shadows nothing, and with
shadowing off; every rank must issue the same collectives (a `CollectiveLog` per rank)."""
from __future__ import annotations

import pytest
import torch

from moe_engine import FasterMoE, MoEConfig
from moe_engine.comm import CollectiveLog, ExpertGroup
from moe_engine.shadowing import ShadowCosts, choose_shadowed, expert_parameters
from tests.distributed import run_on_ranks
from tests.engine_cases import SCENARIOS, Scenario, load_params, make_problem, max_errors, solve_reference

COSTS = ShadowCosts(row_s=1.0, expert_s=50.0, compute_row_s=0.5)  # Lat(B) = (3·0.5 + 4·1)·B = 5.5·B


def test_the_hot_expert_is_shadowed_when_its_rows_cost_more_than_its_weights():
    # Lat = 5.5·100 = 550; shadowing expert 2 leaves 12: 66 + 50 = 116; then expert 1: 55 + 100 > 116
    assert choose_shadowed([10, 12, 100, 10], COSTS) == (2,)


def test_nothing_is_shadowed_under_a_balanced_load_or_no_load():
    assert choose_shadowed([30, 29, 31, 30], COSTS) == ()
    assert choose_shadowed([0, 0, 0, 0], COSTS) == ()


def test_several_hot_experts_are_shadowed_hottest_first_while_it_pays():
    cheap = ShadowCosts(row_s=1.0, expert_s=1.0, compute_row_s=0.5)
    # 1100 -> 5.5·190 + 1 -> 5.5·5 + 2 = 29.5 -> 5.5·5 + 3 > 29.5
    assert choose_shadowed([5, 200, 5, 190], cheap) == (1, 3)
    # greedy, as FasterMoE's: two equally hot experts gain nothing from shadowing one of them
    assert choose_shadowed([5, 200, 5, 200], cheap) == ()


def test_the_coldest_expert_is_never_shadowed():
    free = ShadowCosts(row_s=1.0, expert_s=0.0, compute_row_s=0.5)
    assert choose_shadowed([9, 7, 5, 3], free) == (0, 1, 2)


def test_costs_ride_the_count_exchange_as_int64_bits_exactly():
    costs = ShadowCosts.of(MoEConfig(1024, 4096, 8), torch.bfloat16, torch.float32)
    assert ShadowCosts.from_values(costs.values()) == costs
    # FasterMoE's defaults: 6.25 GB/s links, 11.5 TFLOP/s
    assert costs.row_s == pytest.approx(1024 * 2 / 6.25e9)
    assert costs.expert_s == pytest.approx(expert_parameters(MoEConfig(1024, 4096, 8)) * 4 / 6.25e9)
    assert costs.compute_row_s == pytest.approx(2 * 1024 * 2 * 4096 / 11.5e12)


def test_the_layer_refuses_a_shadowing_that_is_not_a_bool():
    with pytest.raises(ValueError, match="shadowing="):
        FasterMoE(MoEConfig(8, 12, 8), shadowing="yes")  # type: ignore[arg-type]


# -- gloo ranks against the reference ----------------------------------------------------------
BY_NAME = {s.name: s for s in SCENARIOS}
# The owner of the hot expert (1: rank 0 on 2 and 4 ranks) has no tokens itself, and so has rank 2.
HOT_ON_EMPTY_OWNER = Scenario("hot_expert_owner_without_tokens", MoEConfig(8, 12, 8, top_k=2, activation="swiglu"),
                              (0, 24, 0, 20), skew_to_expert=1)
CASES = [  # (scenario, shadowed on 2 ranks, on 4 ranks)
    (BY_NAME["all_tokens_to_one_expert"], (3,), (3,)),
    (HOT_ON_EMPTY_OWNER, (1,), (1,)),
    (BY_NAME["k2_dropless_gelu"], (), ()),
]
SETTINGS = [(1, True), (2, True), (2, False)]  # (group_size, shadowing)
SCENARIO_OF = {scenario.name: scenario for scenario, *_ in CASES}


def _run_cases(rank: int, world_size: int) -> dict:
    results = {}
    for scenario, *_ in CASES:
        problem = make_problem(scenario, world_size)
        solve_reference(problem, scenario.config)
        for group_size, shadowing in SETTINGS:
            log = CollectiveLog()
            layer = FasterMoE(scenario.config, ExpertGroup(recorder=log), group_size=group_size, shadowing=shadowing,
                              dtype=torch.float64)
            load_params(layer, problem, rank)
            errors = max_errors(layer, problem, scenario, rank)
            events = [(e.op, e.sizes) for events in log.by_group.values() for e in events]
            results[(scenario.name, group_size, shadowing)] = (errors, layer.last_shadowed, events)
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=["W2", "W4"])
def ranks(request):
    return request.param, run_on_ranks(request.param, _run_cases, timeout=600.0)


@pytest.mark.gloo
def test_shadowed_fastermoe_matches_the_reference(ranks):
    world_size, per_rank = ranks
    failures = []
    for rank, results in enumerate(per_rank):
        for key, (errors, _, _) in results.items():
            failures += [f"rank {rank} {key}: {q} off by {e:.3g}" for q, e in errors.items() if not e <= 1e-9]
    assert len(per_rank[0]) == len(CASES) * len(SETTINGS)
    assert not failures, "\n".join(failures[:20])


@pytest.mark.gloo
def test_the_hot_expert_is_shadowed_on_every_rank_alike(ranks):
    world_size, per_rank = ranks
    for scenario, on_two, on_four in CASES:
        expected = on_two if world_size == 2 else on_four
        for group_size, shadowing in SETTINGS:
            chosen = [results[(scenario.name, group_size, shadowing)][1] for results in per_rank]
            assert chosen == [expected if shadowing else ()] * world_size, (scenario.name, group_size, chosen)


@pytest.mark.gloo
def test_every_rank_issues_the_same_collectives(ranks):
    world_size, per_rank = ranks
    for key in per_rank[0]:
        sequences = [results[key][2] for results in per_rank]
        ops = [[op for op, _ in events] for events in sequences]
        assert all(o == ops[0] for o in ops), (key, ops)
        shadowed = per_rank[0][key][1]
        # one broadcast forward and one reduce backward per shadowed expert, from/to its owner
        width = expert_parameters(SCENARIO_OF[key[0]].config)
        owners = [e // (8 // world_size) for e in shadowed]
        assert [s for op, s in sequences[0] if op == "broadcast"] == [((width,), o) for o in owners]
        assert [s for op, s in sequences[0] if op == "reduce sum"] == [((width,), o) for o in owners]
        # the All-to-Alls pair up: what rank r sends rank s is what s expects from r
        for k in range(len(sequences[0])):
            if sequences[0][k][0] != "All-to-All":
                assert all(seq[k] == sequences[0][k] for seq in sequences), (key, k)
                continue
            for r in range(world_size):
                for s in range(world_size):
                    assert sequences[r][k][1][1][s] == sequences[s][k][1][0][r], (key, k, r, s)


def test_the_emulated_cluster_runs_shadowing_and_prices_its_collectives():
    from moe_sim.emulation import EmulatedCluster

    stand_in = EmulatedCluster.parse("1x4").build(keep_log=True)
    config = MoEConfig(8, 12, 8, top_k=2)
    torch.manual_seed(0)
    layer = FasterMoE(config, stand_in.for_peer_steps(2), group_size=2)  # peer steps: the bench's FasterMoE
    with torch.no_grad():
        layer.router.weight[0, 0] = 4.0
    x = torch.randn(64, 8)
    x[:, 0] = 6.0  # every token's first choice: expert 0, rank 0's
    x.requires_grad_(True)
    y, aux = layer(x)
    (y.sum() + aux).backward()
    shadowed = layer.last_shadowed  # the hot one first; experts this small are cheap to move, so more
    assert shadowed[0] == 0, shadowed
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    kinds = [call.kind for call in stand_in.calls]
    assert kinds.count("broadcast") == kinds.count("reduce_sum") == len(shadowed), kinds
    assert all(call.seconds > 0 for call in stand_in.calls if call.kind in ("broadcast", "reduce_sum"))
    # rank 0 owns expert 0: its gradient is the sum over the 4 ranks that all route alike
    assert layer.experts.w1.grad is not None and torch.isfinite(layer.experts.w1.grad).all()
