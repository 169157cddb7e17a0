"""Tier 1: routings replayed from a training run (app/bench/routing_replay.py, `mpipemoe routing`):
the file from logged metrics, the spread over more experts, the pushes route as the file
says (counted by the router's own top-k), the layout with the busiest rank first, and the
extraction from an MLflow store."""
import json

import pytest
import torch

from app.bench.parts import layer_inputs
from app.cli import main
from app.bench.routing_replay import busiest_rank_first, routing_push
from moe_sim.routing import RoutingFile, load_routing, routing_from_metrics, save_routing
from moe_engine.router import count_ids


def test_the_file_holds_every_layers_loads_from_the_logged_metrics(tmp_path):
    metrics = {f"moe_load/l{layer}/tokens_e{e}": float(10 * (layer + 1) + e) for layer in range(2) for e in range(4)}
    metrics.update({"moe_load/l0/imbalance": 1.2, "loss": 3.0})
    routing = routing_from_metrics(metrics, "run x", 7)
    assert routing.layers == ((10, 11, 12, 13), (20, 21, 22, 23)) and routing.num_experts == 4
    save_routing(routing, tmp_path / "r.json")
    assert load_routing(tmp_path / "r.json") == routing
    # 4 logged experts over 8: each share halved over two neighbours
    assert routing.shares(1, 8) == pytest.approx([20 / 86 / 2, 20 / 86 / 2, 21 / 86 / 2, 21 / 86 / 2,
                                                  22 / 86 / 2, 22 / 86 / 2, 23 / 86 / 2, 23 / 86 / 2])
    with pytest.raises(ValueError, match="give --experts a multiple of 4"):
        routing.shares(0, 6)
    with pytest.raises(ValueError, match="no moe_load"):
        routing_from_metrics({"loss": 1.0}, "run y", None)


def test_the_busiest_rank_comes_first():
    assert busiest_rank_first([0.1, 0.1, 0.5, 0.3], 2) == [0.5, 0.3, 0.1, 0.1]
    assert busiest_rank_first([0.4, 0.1, 0.2, 0.3], 2) == [0.4, 0.1, 0.2, 0.3]


def _shares_routed(x_TD: torch.Tensor, router_ED: torch.Tensor, top_k: int) -> list[float]:
    ids = torch.topk(x_TD @ router_ED.t(), top_k, dim=-1).indices.flatten()
    counts = count_ids(ids, router_ED.shape[0]).double()
    return (counts / counts.sum()).tolist()


def test_the_pushes_route_the_tokens_as_the_file_says(tmp_path):
    loads = [300, 50, 50, 200, 100, 100, 100, 100]  # layer 1: the most imbalanced
    save_routing(RoutingFile("t", 3, 8, ((1, 1, 1, 1, 1, 1, 1, 1), tuple(loads))), tmp_path / "r.json")
    spec = f"replay:{tmp_path / 'r.json'}"
    torch.manual_seed(0)
    router_ED = torch.randn(8, 64) * 0.02
    x_TD = layer_inputs(8000, router_ED, spec, top_k=2)  # the layer bench: the most imbalanced layer
    target = [v / 1000 for v in loads]
    assert _shares_routed(x_TD, router_ED, 2) == pytest.approx(target, abs=0.015)
    # the step bench on 2 ranks: layer 1, rank blocks rotated so the busiest (experts 0-3) is rank 0
    push = routing_push(spec, router_ED, 8000, 2, ranks=2, layer=1)
    assert push is not None
    routed = _shares_routed(torch.randn(8000, 64) + push, router_ED, 2)
    assert routed == pytest.approx(busiest_rank_first(target, 2), abs=0.015)
    assert routing_push("uniform", router_ED, 10, 2) is None


def test_the_step_benchs_hot_expert_push_sends_every_other_token_to_expert_zero_and_the_rest_evenly():
    """Spread over the batch: both halves of it (a 2-partition token split) hold the same
    hot tokens; the tokens between them are pushed to equal shares of the experts."""
    torch.manual_seed(0)
    router_ED = torch.randn(8, 64) * 0.02
    push = routing_push("hot-expert", router_ED, 4000, 2, ranks=2, impose_uniform=True)
    assert push is not None
    first = torch.topk((torch.randn(4000, 64) + push) @ router_ED.t(), 2).indices
    assert bool((first[::2, 0] == 0).all()) and not bool((first[1::2, 0] == 0).all())
    between = count_ids(first[1::2].flatten(), 8).double()
    assert (between / between.sum()).tolist() == pytest.approx([1 / 8] * 8, abs=0.02)


def test_routing_extracts_a_runs_logged_loads_from_mlflow(tmp_path, capsys):
    from app.tracking.run_kinds import TRAIN, kind_tags
    from app.tracking.store import RunLogger

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run = RunLogger.start(uri, "mpipemoe", run_name="gpt-s-run", tags=kind_tags(TRAIN))
    for step, hot in ((5, 90), (10, 60)):
        run.log_metrics({"moe_load/l0/tokens_e0": hot, "moe_load/l0/tokens_e1": 10, "moe_load/l1/tokens_e0": 50,
                         "moe_load/l1/tokens_e1": 50, "loss": 2.0}, step=step, flush=True)
    run.finish()
    out = tmp_path / "routing.json"
    assert main(["routing", "--run", "gpt-s-run", "--step", "5", "--out", str(out), "--tracking-uri", uri]) == 0
    data = json.loads(out.read_text())
    assert (data["step"], data["num_experts"], data["layers"]) == (5, 2, [[90, 10], [50, 50]])
    assert "most imbalanced is layer 0 (busiest expert 1.80x the mean)" in capsys.readouterr().out
    assert main(["routing", "--run", run.run_id, "--out", str(out), "--tracking-uri", uri]) == 0  # by id, last step
    assert json.loads(out.read_text())["layers"] == [[60, 10], [50, 50]]
    assert main(["routing", "--run", "gpt-s-run", "--step", "7", "--out", str(out), "--tracking-uri", uri]) == 1
    assert "logged the loads at steps 5, 10" in capsys.readouterr().err


def test_each_token_gets_distinct_experts_and_a_hot_share_is_capped_at_one_over_k():
    from app.bench.routing_replay import assign_experts

    picks_TK = assign_experts([0.7, 0.1, 0.1, 0.1], 100, 2)
    assert picks_TK.shape == (100, 2) and bool((picks_TK[:, 0] != picks_TK[:, 1]).all())
    assert count_ids(picks_TK.flatten(), 4).tolist() == [100, 34, 33, 33]  # 0.5 of the 200 pairs, the rest spread
