"""Tier 1: routing and the dispatcher's local steps."""
import math

import torch

from moe_engine import MoEConfig
from moe_engine import dispatcher
from moe_engine.comm import ExpertGroup
from moe_engine.router import Router, capacity_mask


def test_capacity_fills_first_choices_before_second_choices():
    # 3 tokens, k=2, capacity 2 per expert. Expert 0 is chosen by every token's
    # second choice and by token 2's first choice: token 2's first choice wins
    # over tokens 0 and 1's second choices; then token 0's second choice fits.
    ids_TK = torch.tensor([[1, 0], [2, 0], [0, 1]])
    keep = capacity_mask(ids_TK, num_experts=3, capacity=2)
    assert keep.tolist() == [[True, True], [True, False], [True, True]]


def test_router_weights_renormalised_and_balance_loss():
    torch.manual_seed(0)
    router = Router(MoEConfig(8, 16, 4, top_k=2)).double()
    x = torch.randn(32, 8, dtype=torch.float64)
    routing = router(x)
    torch.testing.assert_close(routing.weights_TK.sum(-1), torch.ones(32, dtype=torch.float64))
    probs = torch.softmax(x @ router.weight.t(), -1)
    f = torch.bincount(probs.argmax(-1), minlength=4).double() / 32
    torch.testing.assert_close(routing.aux_loss, 4 * (f * probs.mean(0)).sum())


def test_permute_unpermute_round_trip_restores_input_and_gradient():
    torch.manual_seed(1)
    T, K, E, D = 11, 2, 4, 5
    config = MoEConfig(D, 8, E, top_k=K, capacity_factor=None)
    routing = Router(config).double()(torch.randn(T, D, dtype=torch.float64))
    partition_P = dispatcher.partition_by_tokens(T, K, 3, "cpu")
    plan = dispatcher.plan_dispatch(routing, partition_P, 3, E, ExpertGroup(None))
    assert sum(p.rows_sent for p in plan.partitions) == T * K
    # rows are partition-major and expert-sorted within a partition
    for p in plan.partitions:
        experts = routing.expert_ids_TK.flatten()[p.pair_index_R]
        assert torch.equal(experts, experts.sort().values)
    x = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    rows = dispatcher.gather_rows(x, plan.token_index_R)
    # round trip through the expert-major order and back
    for p in plan.partitions:
        part = dispatcher.gather_rows(x, p.token_index_R)
        assert torch.equal(dispatcher.from_expert_major(dispatcher.to_expert_major(part, p.expert_order_N),
                                                        p.source_order_N), part)
    halves = torch.full((T, K), 1.0 / K, dtype=torch.float64)
    back = dispatcher.unpermute(rows, plan, halves, torch.ones(T, K, dtype=torch.bool))
    torch.testing.assert_close(back, x)
    g = torch.randn(T, D, dtype=torch.float64)
    back.backward(g)
    torch.testing.assert_close(x.grad, g)


def test_partition_by_tokens_more_partitions_than_tokens():
    part = dispatcher.partition_by_tokens(3, 2, 7, "cpu")
    assert part.tolist() == [0, 0, 2, 2, 4, 4]
    assert int(part.max()) < 7


def test_capacity_value():
    from moe_engine.router import expert_capacity
    config = MoEConfig(8, 8, 8, top_k=2, capacity_factor=1.25)
    assert expert_capacity(config, 100) == math.ceil(1.25 * 2 * 100 / 8)
