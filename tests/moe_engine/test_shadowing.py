"""FasterMoE's dynamic shadowing and MPipeMoE's hot-expert replication (moe_engine/shadowing.py):
the rules on the host (tier 1), then the layers on 2 and 4 gloo ranks against the brute-force
reference in float64 with an expert made hot (shadowed or replicated: its weights broadcast,
its pairs computed where their tokens are, its gradients reduced onto the owner), with a
routing that shadows nothing, and with the option off; MPipeMoE's replica beside every
partition count, strategy and split. Every rank must issue the same collectives (a
`CollectiveLog` per rank)."""
from __future__ import annotations

import pytest
import torch

import numpy as np

from moe_engine import FasterMoE, MoEConfig, MPipeMoE
from moe_engine.comm import CollectiveLog, ExpertGroup
from moe_engine.shadowing import ShadowCosts, choose_replicated, choose_shadowed, expert_parameters
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
    with pytest.raises(ValueError, match="hot_replicas="):
        MPipeMoE(MoEConfig(8, 12, 8), hot_replicas=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hot_replicas=True needs the dropless exchange"):
        MPipeMoE(MoEConfig(8, 12, 8), partitions=2, strategy="S1", hot_replicas=True, sync_free_capacity=2.0)


def test_the_hottest_expert_is_replicated_where_the_busiest_rank_gains_more_than_its_weights_cost():
    # 2 ranks of 2 experts; expert 0 (rank 0) takes 100 rows from each rank.
    load_WE = np.array([[100, 5, 5, 5], [100, 5, 5, 5]])
    # before: rank 0 receives 210 rows, 5.5 per row: 1155; after: rank 1's 20 on the link (80),
    # compute max(10 + 100, 20 + 100) · 1.5 = 180, weights 2 · 50: 360 < 1155
    assert choose_replicated(load_WE, COSTS) == (0,)
    # weights too dear for the rows saved
    assert choose_replicated(load_WE, ShadowCosts(row_s=1.0, expert_s=600.0, compute_row_s=0.5)) == ()
    # balanced: the busiest rank gains nothing
    assert choose_replicated(np.full((2, 4), 10), COSTS) == ()
    assert choose_replicated(np.zeros((2, 4), dtype=np.int64), COSTS) == ()


# -- gloo ranks against the reference ----------------------------------------------------------
BY_NAME = {s.name: s for s in SCENARIOS}
# The owner of the hot expert (1: rank 0 on 2 and 4 ranks) has no tokens itself, and so has rank 2.
HOT_ON_EMPTY_OWNER = Scenario("hot_expert_owner_without_tokens", MoEConfig(8, 12, 8, top_k=2, activation="swiglu"),
                              (0, 24, 0, 20), skew_to_expert=1)
CASES = [  # (scenario, {engine: (shadowed on 2 ranks, on 4 ranks)})
    (BY_NAME["all_tokens_to_one_expert"], {"fastermoe": ((3,), (3,)), "mpipemoe": ((3,), (3,))}),
    # on 4 ranks the owner's neighbour (experts 2 and 3) receives almost as many rows as the
    # owner: MPipeMoE's replica would not relieve the busiest rank, FasterMoE's rule shadows
    (HOT_ON_EMPTY_OWNER, {"fastermoe": ((1,), (1,)), "mpipemoe": ((1,), ())}),
    (BY_NAME["k2_dropless_gelu"], {"fastermoe": ((), ()), "mpipemoe": ((), ())}),
]
# (engine, option, shadowing on): FasterMoE's group_size; MPipeMoE's (n, strategy, split)
SETTINGS = [("fastermoe", 1, True), ("fastermoe", 2, True), ("fastermoe", 2, False)] + [
    ("mpipemoe", (n, strategy, "tokens"), True) for n, strategy in ((1, "none"), (2, "S1"), (2, "S2"), (3, "S3"), (3, "S4"))
] + [("mpipemoe", (2, "S3", "peers"), True), ("mpipemoe", (2, "none", "tokens"), False)]


def _layer(engine: str, option, shadowing: bool, config: MoEConfig, group: ExpertGroup):
    if engine == "fastermoe":
        return FasterMoE(config, group, group_size=option, shadowing=shadowing, dtype=torch.float64)
    n, strategy, split = option
    return MPipeMoE(config, group, n, strategy, split=split, hot_replicas=shadowing, dtype=torch.float64)
SCENARIO_OF = {scenario.name: scenario for scenario, *_ in CASES}


def _run_cases(rank: int, world_size: int) -> dict:
    results = {}
    for scenario, *_ in CASES:
        problem = make_problem(scenario, world_size)
        solve_reference(problem, scenario.config)
        for engine, option, shadowing in SETTINGS:
            log = CollectiveLog()
            layer = _layer(engine, option, shadowing, scenario.config, ExpertGroup(recorder=log))
            load_params(layer, problem, rank)
            errors = max_errors(layer, problem, scenario, rank)
            events = [(e.op, e.sizes) for events in log.by_group.values() for e in events]
            results[(scenario.name, engine, option, shadowing)] = (errors, layer.last_shadowed, events)
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
    for scenario, by_engine in CASES:
        for engine, option, shadowing in SETTINGS:
            expected = by_engine[engine][0 if world_size == 2 else 1]
            chosen = [results[(scenario.name, engine, option, shadowing)][1] for results in per_rank]
            assert chosen == [expected if shadowing else ()] * world_size, (scenario.name, engine, option, chosen)


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
    assert x.grad is not None and torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    kinds = [call.kind for call in stand_in.calls]
    assert kinds.count("broadcast") == kinds.count("reduce_sum") == len(shadowed), kinds
    assert all(call.seconds > 0 for call in stand_in.calls if call.kind in ("broadcast", "reduce_sum"))
    # rank 0 owns expert 0: its gradient is the sum over the 4 ranks that all route alike
    assert layer.experts.w1.grad is not None and torch.isfinite(layer.experts.w1.grad).all()


def test_the_memory_model_counts_the_replicas_weights_and_rows():
    from moe_engine import predict_memory

    config = MoEConfig(64, 128, 8, top_k=2, activation="swiglu")
    plain = predict_memory(config, 256, 4, 2, "S1", dtype=torch.float32, rows_sent=400, rows_received=600)
    replicated = predict_memory(config, 256, 4, 2, "S1", dtype=torch.float32, rows_sent=400, rows_received=600,
                                replicas=1, replica_rows=100)
    X = expert_parameters(config)
    per_row = 4 * (64 + 256 + 128 + 128) + 4 * (64 + 1) + 16
    assert replicated.saved_bytes - plain.saved_bytes == 4 * X + 100 * per_row
    assert replicated.backward_working_bytes - plain.backward_working_bytes == 4 * 2 * X
