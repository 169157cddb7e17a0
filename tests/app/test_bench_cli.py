"""Tier 1-2: ``mpipemoe bench`` end to end on CPU (gloo ranks): one record per engine,
routing and setting, the pipeline's stages timed alone, the targets, the command/
hardware/date metadata, and the Markdown table beside the JSON."""
import json

import pytest
import torch

from app.bench.layer_settings import BenchSettings
from app.bench.layer_bound import overlap_bound_ms
from app.bench.layer_summary import markdown_table, summarize, targets
from app.bench.measure import pipeline_stages
from app.bench.parts import same_setting
from app.bench.parts import layer_inputs
from app.cli import main
from moe_engine import MoEConfig
from moe_engine.comm import ExpertGroup


def test_bench_writes_records_for_every_engine_routing_and_grid_point(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", "--tokens", "96", "--partitions", "1,2", "--strategies", "none,S3",
                 "--routing", "uniform,hot-expert", "--warmup", "1", "--repeats", "1", "--world-size", "2",
                 "--tracking-uri", "none", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    meta = result["meta"]
    assert meta["world_size"] == 2 and meta["hardware"].startswith("cpu") and meta["date"]
    assert meta["settings"]["tokens"] == [96] and meta["settings"]["routings"] == ["uniform", "hot-expert"]
    for routing in ("uniform", "hot-expert"):
        records = [r for r in result["records"] if r["routing"] == routing]
        chosen = sorted((r["engine"], r["chosen_by"]) for r in records if r["chosen_by"] != "grid")
        assert chosen == [("dense-floor", "floor"), ("fastermoe", "baseline"), ("fastmoe", "baseline"),
                          ("mpipemoe", "auto")]
        grid = {(r["partitions"], r["strategy"]) for r in records if r["chosen_by"] == "grid"}
        assert grid == {(1, "none"), (1, "S3"), (2, "none"), (2, "S3")}
        for record in records:
            assert record["fwd_bwd_ms"] > 0 and record["world_size"] == 2 and record["measured_as"] == "measured"
            assert record["all_to_all_ms"] > 0 and record["expert_ms"] > 0
            if record["chosen_by"] not in ("auto", "floor"):
                assert record["host_probe_ms"] > 0 and record["host_probe_tokens"] == 64
        # the automatic layer is not probed itself (its search would start at 64 tokens): it
        # carries the probe of the grid layer of the setting it settled on (n, strategy and
        # split), or, where the grid lacks that setting (a peers split), of a fixed twin
        auto = next(r for r in records if r["chosen_by"] == "auto")
        twin = [r for r in records if r["chosen_by"] == "grid" and same_setting(r, auto)]
        assert auto["host_probe_ms"] > 0 and auto["host_probe_tokens"] == 64
        if twin:
            assert auto["host_probe_ms"] == twin[0]["host_probe_ms"]
    # the memory prediction is made on the rows the pass moved: under skew not the balanced k·T
    hot = [r for r in result["records"] if r["routing"] == "hot-expert" and r["engine"] != "dense-floor"]
    assert all("rows_received" in r for r in hot)
    # ... of the measured pass, not the 64-token host probe's: every layer routes the same
    # input with the same weights, so all moved the rows FastMoE moved, but for the rows of
    # the experts FasterMoE's shadowing or auto's replica computed where their tokens are
    # (whether auto replicates follows its measured profile)
    for routing in ("uniform", "hot-expert"):
        records = [r for r in result["records"] if r["routing"] == routing and r["engine"] != "dense-floor"]
        fast = next(r for r in records if r["engine"] == "fastmoe")
        assert fast["rows_sent"] == fast["top_k"] * 96
        assert {(r["rows_sent"], r["rows_received"]) for r in records if not r.get("shadowed_experts")} == \
            {(fast["rows_sent"], fast["rows_received"])}
        assert all(r["rows_sent"] <= fast["rows_sent"] and r["rows_received"] <= fast["rows_received"]
                   for r in records if r.get("shadowed_experts"))
    faster = next(r for r in hot if r["engine"] == "fastermoe")
    assert 0 in faster["shadowed_experts"]  # the hot expert of the hot-expert routing
    assert any(r["rows_received"] != r["top_k"] * r["tokens"] for r in hot)
    summaries = {s["routing"]: s for s in result["summaries"]}
    assert summaries["hot-expert"]["hot_expert_share"] > 0.25 > summaries["uniform"]["hot_expert_share"]
    for s in summaries.values():
        assert s["overlap_bound_ms"] == pytest.approx(
            overlap_bound_ms(s["all_to_all_ms"], s["expert_ms"], s["auto_partitions"]))
        assert s["floor_ms"] == pytest.approx(max(s["all_to_all_ms"], s["expert_ms"]))
    assert set(result["targets"]["best_n_by_tokens"]) == {"tiny/uniform", "tiny/hot-expert"}
    table = out.with_suffix(".md").read_text()
    assert "| tiny | hot-expert | 96 |" in table and "## Targets" in table


def test_the_automatic_layer_gets_a_host_probe_where_the_grid_lacks_its_setting(tmp_path):
    """Without a grid (or with one that lacks the setting auto settled on, e.g. a peers split),
    a fixed layer of that setting is probed for the automatic record."""
    out = tmp_path / "bench.json"
    assert main(["bench", "--tokens", "96", "--partitions", "1,2", "--no-grid", "--warmup", "0", "--repeats", "1",
                 "--rounds", "1", "--tracking-uri", "none", "--out", str(out)]) == 0
    (auto,) = [r for r in json.loads(out.read_text())["records"] if r["chosen_by"] == "auto"]
    assert auto["host_probe_ms"] > 0 and auto["host_probe_tokens"] == 64


def test_overlap_bound_is_the_longer_stage_plus_one_partition_of_the_shorter():
    assert overlap_bound_ms(3.0, 8.0, 1) == 11.0  # n = 1: nothing overlaps
    assert overlap_bound_ms(3.0, 8.0, 4) == 8.75
    assert overlap_bound_ms(8.0, 3.0, 4) == 8.75


def test_targets_flag_a_best_n_that_falls_with_more_tokens():
    rows = [{"model": "m", "routing": "uniform", "tokens": t, "grid_best_partitions": n,
             "auto_vs_grid_best": gap, "strategy_pick_vs_fastest": pick, "auto_vs_floor": bound}
            for t, n, gap, pick, bound in [(1024, 2, 0.01, 0.0, 0.10), (2048, 4, 0.08, 0.02, 0.30),
                                           (4096, 2, 0.0, 0.05, 0.05)]]
    checks = targets(rows)
    assert checks["best_n_by_tokens"] == {"m/uniform": [2, 4, 2]}
    assert checks["best_n_non_decreasing"] == {"m/uniform": False}
    assert checks["auto_within_5pct_of_grid_best"] == pytest.approx(2 / 3)
    assert checks["strategy_pick_within_3pct"] == pytest.approx(2 / 3)
    assert checks["within_15pct_of_floor"] == pytest.approx(2 / 3)


def test_hot_expert_inputs_send_every_other_token_to_expert_zero_first():
    """Half of the tokens pick expert 0 first, spread over the batch: each half of it (the two
    partitions of a token split) carries the same share of them, as a real batch would."""
    config = MoEConfig(d_model=32, d_hidden=64, num_experts=8, top_k=2)
    torch.manual_seed(0)
    weight = torch.randn(8, 32) / 32 ** 0.5
    settings = BenchSettings(models=["tiny"], tokens=[512], warmup=0, repeats=1)
    for routing, (low, high) in {"uniform": (0.08, 0.2), "hot-expert": (0.28, 0.36)}.items():
        x = layer_inputs(512, weight, routing)
        first = torch.topk(x @ weight.t(), 2).indices[:, 0]
        if routing == "hot-expert":  # what the simulator prices it at: 1/(2k) + 1/(2E) = 0.3125
            assert bool((first[::2] == 0).all())
            assert abs(int((first[:256] == 0).sum()) - int((first[256:] == 0).sum())) <= 8
        stages = pipeline_stages(config, x, weight, ExpertGroup(None), torch.device("cpu"), torch.float32, settings)
        assert low < stages["hot_expert_share"] < high, (routing, stages)
        assert stages["all_to_all_ms"] > 0 and stages["expert_ms"] > 0


def test_unknown_routing_is_refused_naming_the_option():
    with pytest.raises(ValueError, match=r"--routing 'pareto' is unknown: choose from uniform, zipf:S"):
        BenchSettings(models=["tiny"], tokens=[64], routings=("pareto",))
    with pytest.raises(ValueError, match=r"--routing 'zipf:-1' is invalid: give zipf:S with S >= 0"):
        BenchSettings(models=["tiny"], tokens=[64], routings=("zipf:-1",))
    with pytest.raises(ValueError, match=r"--routing skewed is now named hot-expert: give --routing hot-expert"):
        BenchSettings(models=["tiny"], tokens=[64], routings=("skewed",))


@pytest.mark.parametrize("field,value", [("rounds", 0), ("repeats", 0), ("warmup", -1)])
def test_timing_counts_are_checked_naming_the_option(field, value):
    with pytest.raises(ValueError, match=f"--{field} {value} is invalid"):
        BenchSettings(models=["tiny"], tokens=[64], **{field: value})


def test_bench_times_the_dense_floor_in_the_same_rounds(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", "--tokens", "64", "--activation", "swiglu", "--no-bias", "--partitions", "1",
                 "--strategies", "none,S4", "--warmup", "0", "--repeats", "1", "--rounds", "2",
                 "--tracking-uri", "none", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["settings"]["bias"] is False and result["meta"]["settings"]["peers"] == []
    (floor,) = [r for r in result["records"] if r["engine"] == "dense-floor"]
    assert floor["chosen_by"] == "floor" and floor["fwd_bwd_ms"] > 0 and floor["predicted_memory_bytes"] is None
    assert all(r["bias"] is False for r in result["records"])
    (summary,) = result["summaries"]
    n1 = next(r for r in result["records"] if r["chosen_by"] == "grid" and r["partitions"] == 1
              and r["strategy"] == "none")
    assert summary["n1_vs_dense_floor"] == pytest.approx(n1["fwd_bwd_ms"] / floor["fwd_bwd_ms"])
    assert summary["fastmoe_vs_mpipemoe_n1"] > 0 and "mpipemoe_n1_vs_torchtitan" not in summary
    table = out.with_suffix(".md").read_text()
    assert "## Against torchtitan and the dense-GEMM floor" in table and "| dense-floor | floor |" in table


def _synthetic(engine, chosen_by, ms, peak, partitions=1, strategy="none"):
    return {"engine": engine, "chosen_by": chosen_by, "model": "gpt-s", "routing": "uniform", "tokens": 4096,
            "partitions": partitions, "strategy": strategy, "fwd_bwd_ms": ms, "fwd_bwd_ms_std": 0.1,
            "peak_memory_bytes": peak, "predicted_memory_bytes": None if chosen_by in ("peer", "floor") else peak,
            "expert_gemm_efficiency": 0.9}


def test_summary_compares_with_torchtitan_and_the_floor_from_synthetic_records():
    mib = 2 ** 20
    records = [_synthetic("fastmoe", "baseline", 12.0, 900 * mib), _synthetic("fastermoe", "baseline", 11.0, 900 * mib),
               _synthetic("mpipemoe", "auto", 10.0, 1000 * mib),
               _synthetic("mpipemoe", "grid", 10.0, 1000 * mib), _synthetic("mpipemoe", "grid", 10.5, 900 * mib, 2),
               _synthetic("mpipemoe", "grid", 11.0, 450 * mib, 2, "S3"),
               _synthetic("mpipemoe", "grid", 9.0, 700 * mib, 2, "S1"),
               _synthetic("mpipemoe", "grid", 14.0, 300 * mib, 4, "S4"),
               _synthetic("torchtitan", "peer", 8.0, 1000 * mib), _synthetic("dense-floor", "floor", 5.0, 200 * mib)]
    (summary,) = summarize(records)
    assert summary["mpipemoe_n1_vs_torchtitan"] == pytest.approx(10 / 8)
    assert summary["fastmoe_vs_mpipemoe_n1"] == pytest.approx(12 / 10)
    assert summary["n1_vs_dense_floor"] == pytest.approx(10 / 5)
    # lean: the fastest S1-S4 setting at <= half torchtitan's peak (S1 is faster but too big)
    assert summary["lean_setting"] == "2/S3" and summary["lean_vs_torchtitan"] == pytest.approx(11 / 8)
    assert summary["lean_memory_vs_torchtitan"] == pytest.approx(0.45)
    assert summary["speedup_vs_fastmoe"] == pytest.approx(1.2)  # the existing fields are unchanged
    meta = {"device": "H200", "world_size": 1, "date": "d", "command": "c", "torch": "t", "python": "p"}
    table = markdown_table({"meta": meta, "records": records, "summaries": [summary]})
    assert "| gpt-s | uniform | 4096 | 10.00 | 8.00 | 5.00 | 1.25 | 1.20 | 2.00 | 1.00 | 2/S3 | 1.38 | 0.45 |" in table
    assert "| gpt-s | uniform | 4096 | torchtitan | peer | 1 | none | 8.00 | 0.10 | – | – | – | 1000 | – |" in table


def test_peers_need_one_rank_naming_the_option():
    with pytest.raises(ValueError, match=r"world size 2 \(give --world-size 1"):
        BenchSettings(models=["tiny"], tokens=[64], activation="swiglu", bias=False, peers=("torchtitan",),
                      world_size=2)
    with pytest.raises(ValueError, match=r"--peers 'deepspeed' is unknown"):
        BenchSettings(models=["tiny"], tokens=[64], peers=("deepspeed",))


def test_a_stopped_bench_writes_the_points_it_finished(tmp_path, monkeypatch):
    """SIGTERM (a scheduler's or `timeout`'s stop) or Ctrl-C mid-run: the finished points are
    written, marked incomplete, and the command fails."""
    import app.bench.layer as bench

    real_point = bench.bench_point
    calls = []

    def stop_at_the_second_point(*args, **kwargs):
        calls.append(args[:3])
        if len(calls) == 2:
            raise KeyboardInterrupt("signal 15")
        return real_point(*args, **kwargs)

    monkeypatch.setattr(bench, "bench_point", stop_at_the_second_point)
    out = tmp_path / "bench.json"
    assert main(["bench", "--tokens", "64,128", "--no-grid", "--rounds", "1", "--repeats", "1",
                 "--tracking-uri", "none", "--out", str(out)]) == 1
    result = json.loads(out.read_text())
    assert result["meta"]["complete"] is False
    assert {r["tokens"] for r in result["records"]} == {64}
    assert all(r["all_to_all_ms"] is not None for r in result["records"])  # logged whole
    assert "**Incomplete**" in out.with_suffix(".md").read_text()


def test_the_memory_saving_setting_is_the_fastest_under_the_cap():
    from app.bench.layer_summary import memory_saving_setting

    fastmoe = {"fwd_bwd_ms": 10.0, "peak_memory_bytes": 1000}
    settings = [{"partitions": 1, "strategy": "none", "fwd_bwd_ms": 8.0, "peak_memory_bytes": 990},
                {"partitions": 4, "strategy": "S3", "fwd_bwd_ms": 8.3, "peak_memory_bytes": 500},
                {"partitions": 8, "strategy": "S4", "fwd_bwd_ms": 9.0, "peak_memory_bytes": 300},
                {"partitions": 4, "strategy": "S1", "fwd_bwd_ms": 8.2, "peak_memory_bytes": 560}]
    lean = memory_saving_setting(fastmoe, settings)
    assert lean["lean_setting"] == "4/S3" and lean["fastest_setting"] == "1/none"
    assert lean["lean_vs_fastest"] == pytest.approx(8.3 / 8.0 - 1)
    assert lean["lean_memory_ratio_vs_fastmoe"] == pytest.approx(0.5)
    assert memory_saving_setting(fastmoe, settings[:1]) == {}  # nothing under 0.55x
    assert memory_saving_setting({"fwd_bwd_ms": 10.0}, settings) == {}  # no memory figures (CPU)


def _point(engine, chosen_by, n, strategy, ms, **extra):
    return {"model": "m", "routing": "uniform", "tokens": 64, "engine": engine, "chosen_by": chosen_by,
            "partitions": n, "strategy": strategy, "fwd_bwd_ms": ms, **extra}


def test_the_best_is_the_fastest_of_every_setting_auto_included():
    """Issue 36: 'auto within 5%' against the fastest setting of any strategy, none included;
    a grid of strategy none alone has a best too."""
    records = [_point("fastmoe", "baseline", 1, "none", 10.0), _point("mpipemoe", "auto", 2, "S3", 9.0),
               _point("mpipemoe", "grid", 2, "none", 8.0), _point("mpipemoe", "grid", 2, "S3", 9.0),
               _point("mpipemoe", "grid", 4, "S4", 8.5)]
    summary, = summarize(records)
    assert (summary["grid_best_partitions"], summary["grid_best_strategy"]) == (2, "none")
    assert summary["auto_vs_grid_best"] == pytest.approx(9.0 / 8.0 - 1)
    assert summary["strategy_pick_vs_fastest"] == pytest.approx(9.0 / 8.0 - 1)  # at n = 2, none is faster
    only_none = [records[0], _point("mpipemoe", "auto", 1, "none", 7.0), _point("mpipemoe", "grid", 1, "none", 7.5)]
    summary, = summarize(only_none)
    assert (summary["grid_best_chosen_by"], summary["auto_vs_grid_best"]) == ("auto", 0.0)


def _emulated_bounds(out, *options) -> dict:
    """`mpipemoe bench --emulate ...` with `options` (it fails on a GPU when a record beats its
    bound); checks every record's own-pass bound, per-phase floor, the 16 SMs reserved and
    stated, the timeline account in every record, the best as the fastest setting of all.
    Returns the result."""
    from app.bench.layer_bound import OWN_PASS, STAGE_KEYS

    assert main(["bench", *options, "--tracking-uri", "none", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["comm_sms"] == 16
    for summary in result["summaries"]:
        point = [r for r in result["records"] if (r["model"], r["routing"], r["tokens"]) ==
                 (summary["model"], summary["routing"], summary["tokens"])]
        layers = [r for r in point if r["engine"] != "dense-floor"]
        for r in layers:
            assert r["comm_sms"] == 16 and r["bound_stages"] == OWN_PASS and "timeline" in r
            assert all(r[key] >= 0 for key in STAGE_KEYS) and r["comm_fwd_ms"] > 0 and r["compute_fwd_ms"] > 0
            comm, compute = r["comm_fwd_ms"] + r["comm_bwd_ms"], r["compute_fwd_ms"] + r["compute_bwd_ms"]
            assert r["overlap_bound_ms"] == pytest.approx(overlap_bound_ms(comm, compute, r["partitions"]))
            assert r["phase_floor_ms"] == pytest.approx(max(r["comm_fwd_ms"], r["compute_fwd_ms"])
                                                        + max(r["comm_bwd_ms"], r["compute_bwd_ms"]))
            assert max(comm, compute) <= min(r["overlap_bound_ms"], r["phase_floor_ms"]) + 1e-9
            assert r["floor_ms"] == r["phase_floor_ms"]  # the floor checked, not the pipeline model
            assert r["bound_ratio"] == pytest.approx(r["fwd_bwd_ms"] / r["floor_ms"])
            # the host's time to issue the pass, the emulator's own share of it apart
            assert 0 < r["emulator_host_ms"] < r["host_ms"]
            assert (r["compute_device_busy_ms"] is None) == (r["device"] == "cpu")
        by = {(r["engine"], r["chosen_by"], r["partitions"], r["strategy"], r["split"]): r for r in layers}
        # The same transfers are priced alike: FastMoE and MPipeMoE at n = 1 move the same rows, and
        # a backward moves what its forward did; two partitions pay each transfer's latency twice.
        fast, one, two = by["fastmoe", "baseline", 1, "none", "tokens"], by["mpipemoe", "grid", 1, "none", "tokens"], \
            by["mpipemoe", "grid", 2, "none", "tokens"]
        assert fast["comm_fwd_ms"] == pytest.approx(one["comm_fwd_ms"]) == pytest.approx(fast["comm_bwd_ms"])
        assert two["comm_fwd_ms"] > one["comm_fwd_ms"]
        auto = next(r for r in layers if r["chosen_by"] == "auto")
        twin = by.get(("mpipemoe", "grid", auto["partitions"], auto["strategy"], auto["split"]))
        assert twin is None or all(auto[key] == twin[key] for key in STAGE_KEYS)
        fastest = min((r for r in layers if r["engine"] == "mpipemoe"), key=lambda r: r["fwd_bwd_ms"])
        assert summary["grid_best_fwd_bwd_ms"] == fastest["fwd_bwd_ms"]
        assert summary["floor_ms"] == auto["floor_ms"] and summary["bound_stages"] == OWN_PASS
        assert summary["best_floor_ms"] == min((r for r in layers if r["engine"] == "mpipemoe"),
                                               key=lambda r: r["fwd_bwd_ms"])["floor_ms"]
    assert "| model ms | floor ms | t / floor |" in out.with_suffix(".md").read_text()
    return result


@pytest.mark.gpu
def test_no_emulated_pass_beats_its_own_bound(tmp_path):
    """Issue 36 on a GPU: the bench checks every record against 0.98x its own-pass bound (and
    fails otherwise); balanced and one hot expert, every engine, a grid of strategies."""
    result = _emulated_bounds(tmp_path / "bench.json", "--model", "gpt-s", "--tokens", "8192", "--emulate", "8x8",
                              "--network", "dgx-h200", "--experts", "64", "--partitions", "1,2,4",
                              "--strategies", "none,S3", "--splits", "tokens,peers", "--routing", "uniform,hot-expert",
                              "--rounds", "2", "--repeats", "2")
    assert all(r["bound_ratio"] >= 0.98 for r in result["records"] if "bound_ratio" in r)
    assert all(r["timeline"]["comm_busy_ms"] > 0 for r in result["records"] if r["engine"] != "dense-floor")


def test_no_emulated_pass_beats_its_own_bound_cpu_twin(tmp_path):
    """The same on CPU (emulated 2x2, the issue's `--strategies none` alone, which failed)."""
    _emulated_bounds(tmp_path / "bench.json", "--emulate", "2x2", "--tokens", "256", "--partitions", "1,2",
                     "--strategies", "none", "--splits", "tokens,peers", "--rounds", "1", "--repeats", "1")


def test_a_record_below_its_bound_fails_the_bench_naming_it():
    from app.bench.layer_bound import OWN_PASS, BoundError, check_bounds

    def record(ms, device="NVIDIA H200", stages=OWN_PASS):
        return {**_point("mpipemoe", "grid", 2, "none", ms), "device": device, "bound_stages": stages,
                "floor_ms": 57.1}

    check_bounds([record(56.0)], "out/b.json")  # within 2%: timing noise
    with pytest.raises(BoundError, match=r"1 record\(s\) ran below 0.98x their floor, first m uniform 64 tokens "
                                         r"mpipemoe grid 2/none: 51.50 ms against a floor of 57.10 ms.*out/b.json"):
        check_bounds([record(56.0), record(51.5)], "out/b.json")
    # CPU runs (the emulated transfers take no time there) and bounds of stages timed alone are not checked
    check_bounds([record(51.5, device="cpu"), record(51.5, stages="timed alone")], "out/b.json")


def test_comm_sms_needs_an_emulated_cluster(tmp_path, capsys):
    assert main(["bench", "--comm-sms", "8", "--tokens", "64", "--tracking-uri", "none",
                 "--out", str(tmp_path / "b.json")]) == 1
    assert "--comm-sms 8 sets the SMs an emulated cluster leaves to communication" in capsys.readouterr().err


def test_the_grid_times_the_peer_split_and_auto_searches_both_splits(tmp_path):
    """`--splits tokens,peers`: the grid's n that divide the expert group's ranks run split by
    peers too, each record names its split, and auto's search timed both splits."""
    out = tmp_path / "bench.json"
    assert main(["bench", "--emulate", "2x2", "--tokens", "256", "--partitions", "1,2,3", "--strategies", "none,S1",
                 "--splits", "tokens,peers", "--rounds", "1", "--repeats", "1", "--tracking-uri", "none",
                 "--out", str(out)]) == 0
    records = json.loads(out.read_text())["records"]
    grid = {(r["partitions"], r["strategy"], r["split"]) for r in records if r["chosen_by"] == "grid"}
    # n = 3 does not divide the 4 ranks, and n = 1 is one partition however it is split
    assert grid == {(n, s, "tokens") for n in (1, 2, 3) for s in ("none", "S1")} | \
        {(2, s, "peers") for s in ("none", "S1")}
    assert next(r for r in records if r["engine"] == "fastermoe")["split"] == "peers"
    auto = next(r for r in records if r["chosen_by"] == "auto")
    started = next(d for d in auto["search_decisions"] if d["event"] == "search started")
    assert started["candidates"] == [1, 2, "2:peers", 3]
    assert "| mpipemoe | grid | 2:peers | S1 |" in out.with_suffix(".md").read_text()


def test_splits_are_named_and_checked(tmp_path, capsys):
    assert main(["bench", "--splits", "rows", "--tokens", "64", "--tracking-uri", "none",
                 "--out", str(tmp_path / "b.json")]) == 1
    assert "--splits rows is invalid: 'rows' is not a split; give tokens, peers or both" in capsys.readouterr().err


def test_bench_without_a_gpu_defaults_to_a_small_smoke(monkeypatch):
    """`mpipemoe bench` with no options on CPU: one point, a 2 x 2 grid, one timed step per round
    (about 20-30 s on 2 cores); a GPU gets the full study."""
    from app.commands import bench

    given = []
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bench, "bench_and_write", lambda settings, *rest: given.append(settings) or 0)
    assert main(["bench", "--tracking-uri", "none"]) == 0
    (settings,) = given
    assert (settings.models, settings.tokens, settings.partitions, settings.strategies) == (
        ["tiny"], [256], (1, 2), ("none", "S3"))
    assert (settings.repeats, settings.rounds) == (1, 1)
