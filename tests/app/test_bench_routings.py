"""Tier 1-2: the routings through `mpipemoe bench` and `mpipemoe simulate` on CPU (moe_sim/routing.py):
the bench imposes the very counts the simulator prices, the old name is read with a note, and
a point that does not fit memory is recorded as not measured while the run goes on."""
import json

import pytest
import torch

from app.cli import main
from moe_engine import MemoryBudgetError
from moe_sim.routing import RoutingFile, routing_load, save_routing


def test_a_layer_bench_point_that_does_not_fit_is_recorded_and_the_next_points_run(tmp_path, monkeypatch):
    # On an H100 a CUDA out-of-memory error at one point ended the run and its record lost
    # every row; now the point is named with its reason and the later points are measured.
    import app.bench.layer as layer_bench

    real_point = layer_bench.bench_point

    def point(model, tokens, routing, settings, group, device, log):
        if routing == "uniform":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 24.00 GiB\nmore detail")
        if routing == "hot:0.4":
            raise MemoryBudgetError("memory_budget=1000 bytes is too small: the leanest choice ...")
        return real_point(model, tokens, routing, settings, group, device, log)

    monkeypatch.setattr(layer_bench, "bench_point", point)
    save_routing(RoutingFile("test", 5, 8, ((40, 10, 10, 10, 5, 5, 10, 10),)), tmp_path / "r8.json")
    replay = f"replay:{tmp_path / 'r8.json'}"
    out = tmp_path / "bench.json"
    assert main(["bench", "--tokens", "128", "--no-grid", "--warmup", "0", "--rounds", "1", "--repeats", "1",
                 "--routing", f"uniform,hot:0.4,zipf:1.2,{replay}", "--tracking-uri", "none",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["complete"] is True
    assert result["meta"]["not_measured"] == [
        {"model": "tiny", "routing": "uniform", "tokens": 128,
         "reason": "out of memory: CUDA out of memory. Tried to allocate 24.00 GiB"},
        {"model": "tiny", "routing": "hot:0.4", "tokens": 128,
         "reason": "memory budget refused: memory_budget=1000 bytes is too small: the leanest choice ..."}]
    assert {r["routing"] for r in result["records"]} == {"zipf:1.2", replay}
    for spec in ("zipf:1.2", replay):
        engines = {r["engine"] for r in result["records"] if r["routing"] == spec}
        assert engines == {"fastmoe", "fastermoe", "mpipemoe", "dense-floor"}
        # the bench imposed the counts of the shares the simulator prices: within one of 256 pairs
        measured = next(r for r in result["records"] if r["routing"] == spec)["expert_load"]
        assert measured == pytest.approx(routing_load(spec, 8, 2), abs=1 / 256)
    assert {s["routing"] for s in result["summaries"]} == {"zipf:1.2", replay}
    markdown = out.with_suffix(".md").read_text()
    assert "- tiny, uniform routing, 128 tokens: out of memory: CUDA out of memory." in markdown
    assert "- tiny, hot:0.4 routing, 128 tokens: memory budget refused: " in markdown
    assert "| tiny | zipf:1.2 | 128 |" in markdown


def test_simulate_prices_every_routing_and_reads_the_old_name_with_a_note(tmp_path, capsys):
    def layer_ms(routing: str) -> dict:
        out = tmp_path / f"{routing.replace(':', '-')}.json"
        assert main(["simulate", "--model", "gpt-s", "--tokens", "4096", "--nodes", "1", "--experts", "64",
                     "--routing", routing, "--tracking-uri", "none", "--out", str(out)]) == 0
        (point,) = json.loads(out.read_text())["points"]
        return {"routing": point["routing"], **{r["label"]: r["fwd_bwd_ms"] for r in point["engines"]}}

    uniform = layer_ms("uniform")
    for routing in ("zipf:1.2", "hot-expert", "hot:0.5", "replay:early"):
        priced = layer_ms(routing)
        assert priced["routing"] == routing
        assert priced["fastmoe"] > uniform["fastmoe"]  # a busier rank 0 than uniform's
    # late training is nearer balance: at this shape its busiest rank costs what uniform's does
    assert layer_ms("replay:late")["fastmoe"] >= uniform["fastmoe"]
    assert layer_ms("zipf:2")["fastmoe"] > layer_ms("zipf:1.2")["fastmoe"]  # steeper, slower
    capsys.readouterr()
    assert layer_ms("skewed") == {**layer_ms("hot-expert"), "routing": "hot-expert"}
    assert "--routing skewed is now named hot-expert" in capsys.readouterr().out
    assert main(["simulate", "--model", "gpt-s", "--routing", "zipf", "--tracking-uri", "none"]) == 1
    assert "--routing 'zipf' is invalid: give zipf:S with S >= 0" in capsys.readouterr().err


def test_the_bench_reads_the_old_name_as_hot_expert_with_a_note(capsys):
    from app.commands.bench import routings

    assert routings("uniform,skewed,zipf:1.2") == ("uniform", "hot-expert", "zipf:1.2")
    assert capsys.readouterr().out.count("is now named hot-expert") == 1
