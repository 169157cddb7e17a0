"""Tier 1-2: ``mpipemoe bench`` end to end on CPU (gloo ranks): one record per engine,
routing and setting, the pipeline's stages timed alone, the targets, the command/
hardware/date metadata, and the Markdown table beside the JSON."""
import json

import pytest
import torch

from app.bench import BenchSettings, layer_inputs, overlap_bound_ms, pipeline_stages, targets
from app.cli import main
from moe_engine import MoEConfig
from moe_engine.comm import ExpertGroup


def test_bench_writes_records_for_every_engine_routing_and_grid_point(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", "--tokens", "64", "--partitions", "1,2", "--strategies", "none,S3",
                 "--routing", "uniform,skewed", "--warmup", "1", "--repeats", "1", "--world-size", "2",
                 "--tracking-uri", "none", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    meta = result["meta"]
    assert meta["world_size"] == 2 and meta["hardware"].startswith("cpu") and meta["date"]
    assert meta["settings"]["tokens"] == [64] and meta["settings"]["routings"] == ["uniform", "skewed"]
    for routing in ("uniform", "skewed"):
        records = [r for r in result["records"] if r["routing"] == routing]
        chosen = sorted((r["engine"], r["chosen_by"]) for r in records if r["chosen_by"] != "grid")
        assert chosen == [("fastermoe", "baseline"), ("fastmoe", "baseline"), ("mpipemoe", "auto")]
        grid = {(r["partitions"], r["strategy"]) for r in records if r["chosen_by"] == "grid"}
        assert grid == {(1, "none"), (1, "S3"), (2, "none"), (2, "S3")}
        for record in records:
            assert record["fwd_bwd_ms"] > 0 and record["world_size"] == 2
            assert record["all_to_all_ms"] > 0 and record["expert_ms"] > 0
            if record["chosen_by"] != "auto":
                assert record["host_probe_ms"] > 0 and record["host_probe_tokens"] == 64
        # the automatic layer is not probed itself (its search would start at 64 tokens):
        # it carries the probe of the grid layer it settled on, if the grid has that one
        auto = next(r for r in records if r["chosen_by"] == "auto")
        twin = [r for r in records if r["chosen_by"] == "grid" and
                (r["partitions"], r["strategy"]) == (auto["partitions"], auto["strategy"])]
        assert auto.get("host_probe_ms") == (twin[0]["host_probe_ms"] if twin else None)
    summaries = {s["routing"]: s for s in result["summaries"]}
    assert summaries["skewed"]["hot_expert_share"] > 0.25 > summaries["uniform"]["hot_expert_share"]
    for s in summaries.values():
        assert s["overlap_bound_ms"] == pytest.approx(
            overlap_bound_ms(s["all_to_all_ms"], s["expert_ms"], s["auto_partitions"]))
    assert set(result["targets"]["best_n_by_tokens"]) == {"tiny/uniform", "tiny/skewed"}
    table = out.with_suffix(".md").read_text()
    assert "| tiny | skewed | 64 |" in table and "## Targets" in table


def test_overlap_bound_is_the_longer_stage_plus_one_partition_of_the_shorter():
    assert overlap_bound_ms(3.0, 8.0, 1) == 11.0  # n = 1: nothing overlaps
    assert overlap_bound_ms(3.0, 8.0, 4) == 8.75
    assert overlap_bound_ms(8.0, 3.0, 4) == 8.75


def test_targets_flag_a_best_n_that_falls_with_more_tokens():
    rows = [{"model": "m", "routing": "uniform", "tokens": t, "grid_best_partitions": n,
             "auto_vs_grid_best": gap, "strategy_pick_vs_fastest": pick, "auto_vs_overlap_bound": bound}
            for t, n, gap, pick, bound in [(1024, 2, 0.01, 0.0, 0.10), (2048, 4, 0.08, 0.02, 0.30),
                                           (4096, 2, 0.0, 0.05, 0.05)]]
    checks = targets(rows)
    assert checks["best_n_by_tokens"] == {"m/uniform": [2, 4, 2]}
    assert checks["best_n_non_decreasing"] == {"m/uniform": False}
    assert checks["auto_within_5pct_of_grid_best"] == pytest.approx(2 / 3)
    assert checks["strategy_pick_within_3pct"] == pytest.approx(2 / 3)
    assert checks["within_15pct_of_overlap_bound"] == pytest.approx(2 / 3)


def test_skewed_inputs_send_half_the_tokens_to_expert_zero_first():
    config = MoEConfig(d_model=32, d_hidden=64, num_experts=8, top_k=2)
    torch.manual_seed(0)
    weight = torch.randn(8, 32) / 32 ** 0.5
    settings = BenchSettings(models=["tiny"], tokens=[512], warmup=0, repeats=1)
    for routing, (low, high) in {"uniform": (0.08, 0.2), "skewed": (0.28, 0.36)}.items():
        x = layer_inputs(512, weight, routing)
        first = torch.topk(x @ weight.t(), 2).indices[:, 0]
        if routing == "skewed":
            assert bool((first[:256] == 0).all())
        stages = pipeline_stages(config, x, weight, ExpertGroup(None), torch.device("cpu"), torch.float32, settings)
        assert low < stages["hot_expert_share"] < high, (routing, stages)
        assert stages["all_to_all_ms"] > 0 and stages["expert_ms"] > 0


def test_unknown_routing_is_refused_naming_the_option():
    with pytest.raises(ValueError, match=r"--routing 'zipf' is unknown: choose from uniform, skewed"):
        BenchSettings(models=["tiny"], tokens=[64], routings=("zipf",))


@pytest.mark.parametrize("field,value", [("rounds", 0), ("repeats", 0), ("warmup", -1)])
def test_timing_counts_are_checked_naming_the_option(field, value):
    with pytest.raises(ValueError, match=f"--{field} {value} is invalid"):
        BenchSettings(models=["tiny"], tokens=[64], **{field: value})
