"""Unit tier, no GPU: the schedule simulator, the network model and `mpipemoe simulate`.

The simulator's degenerate case (one rank, no host cost, no row kernels) must agree
with the performance model where their schedules coincide; the network model's
traffic fractions must match the arithmetic of uniform and skewed routing; costs must
grow the way the physics says they do.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from app import cli
from app.simulate import SimulateSettings, section_simulations, validate
from moe_engine.config import MoEConfig
from moe_engine.network import (PRESETS, ClusterLayout, NetworkProfile, all_to_all_traffic, flat_all_to_all_s,
                                hierarchical_all_to_all_s, hot_expert_load, load_network, rank_load, routing_load,
                                uniform_load)
from moe_engine.parts import GpuParts, interpolate
from moe_engine.perf_model import HardwareProfile, PerformanceModel
from moe_engine.simulator import (Cluster, HostScaled, LayerShape, ModelShape, Op, ProfileParts, compare_engines,
                                  run_schedule, simulate_layer, simulate_step, single_gpu)

PARTS = "results/sim-parts-h200.json"


def profile(**changes) -> HardwareProfile:
    values = dict(device="test", dtype="bfloat16", world_size=1, gemm_flops=600e12, a2a_latency_s=0.0,
                  a2a_bytes_per_s=2e12, d2h_bytes_per_s=50e9, h2d_bytes_per_s=50e9, partition_overhead_s=0.0,
                  slowdown={"compute|comm": 1.1, "comm|compute": 1.2, "compute|copy": 1.05, "copy|compute": 1.1})
    values.update(changes)
    return HardwareProfile(**values)


@pytest.fixture(scope="module")
def parts() -> GpuParts:
    return GpuParts.load(PARTS)


# -- the scheduler ------------------------------------------------------------------------------------

def test_one_stream_runs_in_order_and_two_streams_overlap():
    serial = run_schedule([Op("a", "compute", 1.0), Op("b", "compute", 2.0)])
    assert serial.makespan_s == pytest.approx(3.0)
    parallel = run_schedule([Op("a", "compute", 1.0), Op("b", "comm", 2.0)])
    assert parallel.makespan_s == pytest.approx(2.0)
    waiting = run_schedule([Op("a", "compute", 1.0), Op("b", "comm", 2.0, after=(0,))])
    assert waiting.makespan_s == pytest.approx(3.0)


def test_slowdown_applies_only_while_streams_overlap():
    # compute runs at half speed while comm runs (1 s): 0.5 s of work done, 0.5 s left alone.
    timeline = run_schedule([Op("c", "compute", 1.0), Op("m", "comm", 1.0)], {"compute|comm": 2.0})
    assert timeline.finish_s[1] == pytest.approx(1.0)
    assert timeline.finish_s[0] == pytest.approx(1.5)


def test_a_dependency_cycle_is_reported_not_hung():
    with pytest.raises(RuntimeError, match="deadlock"):
        run_schedule([Op("a", "compute", 1.0, after=(1,)), Op("b", "comm", 1.0, after=(0,))])


# -- the degenerate case against the performance model -----------------------------------------------

@pytest.mark.parametrize("strategy", ["none", "S4"])
def test_one_rank_one_partition_equals_the_performance_model(strategy):
    """n = 1 without host copies: both are the plain sum of All-to-All and GEMM time."""
    prof = profile(a2a_latency_s=20e-6, partition_overhead_s=0.0)
    config = MoEConfig(2048, 8192, 8)
    predicted = PerformanceModel(prof).predict(config, 16384, 1, 1, strategy, torch.bfloat16)
    simulated = simulate_layer("mpipemoe", LayerShape(2048, 8192, 8, 16384), single_gpu(), ProfileParts(prof), 1,
                               strategy)
    assert simulated.total_s == pytest.approx(predicted.total_s, rel=1e-9)
    assert simulated.peak_bytes == predicted.peak_bytes


@pytest.mark.parametrize("partitions", [2, 4, 8])
def test_compute_bound_pipeline_equals_the_performance_model(partitions):
    """Unit slowdowns and a fast All-to-All: fill + (n − 1) × compute, as the model says."""
    prof = profile(slowdown={})
    config = MoEConfig(2048, 8192, 8)
    predicted = PerformanceModel(prof).predict(config, 16384, 1, partitions, "none", torch.bfloat16)
    simulated = simulate_layer("mpipemoe", LayerShape(2048, 8192, 8, 16384), single_gpu(), ProfileParts(prof),
                               partitions, "none")
    assert simulated.forward_s == pytest.approx(predicted.forward_s, rel=1e-9)
    assert simulated.backward_s == pytest.approx(predicted.backward_s, rel=1e-9)


def test_offloads_overlap_the_combine_so_the_simulator_is_not_slower_than_the_model():
    prof = profile()
    config = MoEConfig(2048, 8192, 8)
    for strategy in ("S1", "S2", "S3"):
        predicted = PerformanceModel(prof).predict(config, 16384, 1, 1, strategy, torch.bfloat16)
        simulated = simulate_layer("mpipemoe", LayerShape(2048, 8192, 8, 16384), single_gpu(), ProfileParts(prof), 1,
                                   strategy)
        assert simulated.total_s <= predicted.total_s * (1 + 1e-9)


# -- the network model ---------------------------------------------------------------------------------

@pytest.mark.parametrize("nodes,gpus", [(1, 8), (2, 8), (4, 4), (8, 8), (16, 2)])
def test_uniform_routing_sends_n_minus_one_over_n_off_the_node(nodes, gpus):
    layout = ClusterLayout(nodes, gpus)
    traffic = all_to_all_traffic(layout, uniform_load(layout.ranks))
    assert traffic.leaving_node == pytest.approx((nodes - 1) / nodes)
    assert traffic.inter == pytest.approx((nodes - 1) / nodes)
    assert traffic.intra == pytest.approx((gpus - 1) / layout.ranks)
    assert traffic.received == pytest.approx(1.0)
    assert traffic.inter_messages == layout.ranks - gpus


def test_all_rows_to_one_expert_load_its_rank():
    layout = ClusterLayout(2, 4)                       # expert 0 lives on rank 0 of node 0
    traffic = all_to_all_traffic(layout, hot_expert_load(8, 1.0))
    assert traffic.received == pytest.approx(8.0)      # every rank's rows land on rank 0
    assert traffic.inter == pytest.approx(4.0)         # the other node's 4 ranks, through rank 0's NIC
    assert traffic.intra == pytest.approx(3.0)         # its 3 node peers over NVLink
    assert traffic.leaving_node == pytest.approx(0.5)  # half the ranks send everything off their node
    assert traffic.inter_messages == 1


def test_routing_specs_and_their_errors():
    assert routing_load("uniform", 4) == uniform_load(4)
    assert routing_load("hot:0.7", 4)[0] == pytest.approx(0.7)
    assert sum(routing_load("zipf:1.2", 16)) == pytest.approx(1.0)
    assert rank_load(hot_expert_load(4, 1.0), 2) == [1.0, 0.0]
    with pytest.raises(ValueError, match="routing='hot'"):
        routing_load("hot", 4)
    with pytest.raises(ValueError, match="hot_fraction=1.5"):
        hot_expert_load(4, 1.5)


def test_hierarchical_all_to_all_pays_once_messages_dominate():
    network = PRESETS["dgx-a100"]
    small, large = 64 * 1024, 256 * 2**20
    for nodes in (2, 64):
        layout = ClusterLayout(nodes, 8)
        traffic = all_to_all_traffic(layout, uniform_load(layout.ranks))
        flat_small, hier_small = (f(network, *args, traffic, small) for f, args in
                                  ((flat_all_to_all_s, ()), (hierarchical_all_to_all_s, (layout,))))
        flat_large = flat_all_to_all_s(network, traffic, large)
        hier_large = hierarchical_all_to_all_s(network, layout, traffic, large)
        assert hier_large > flat_large                      # big messages: the extra NVLink hops cost
        if nodes == 64:
            assert hier_small < flat_small                  # 504 tiny messages per NIC: aggregation wins
    one_node = ClusterLayout(1, 8)
    traffic = all_to_all_traffic(one_node, uniform_load(8))
    assert hierarchical_all_to_all_s(network, one_node, traffic, large) == flat_all_to_all_s(network, traffic, large)


def test_network_files_override_a_preset_and_errors_name_the_field(tmp_path):
    measured = tmp_path / "net.json"
    measured.write_text(json.dumps({"base": "dgx-h200", "name": "ours", "inter_bytes_per_s": 21.5e9}))
    network = load_network(str(measured))
    assert network.inter_bytes_per_s == 21.5e9 and network.intra_bytes_per_s == PRESETS["dgx-h200"].intra_bytes_per_s
    assert network.name == "ours" and "measured" in network.source
    measured.write_text(json.dumps({"inter_bandwidth": 1}))
    with pytest.raises(ValueError, match="unknown field.*inter_bandwidth"):
        load_network(str(measured))
    with pytest.raises(ValueError, match="NetworkProfile.intra_bytes_per_s=0"):
        NetworkProfile("x", intra_bytes_per_s=0, inter_bytes_per_s=1e9)
    with pytest.raises(ValueError, match="neither a preset"):
        load_network(str(tmp_path / "missing.json"))


# -- the layer on a cluster ------------------------------------------------------------------------------

def _cluster(nodes: int, gpus: int = 8) -> Cluster:
    return Cluster(ClusterLayout(nodes, gpus), PRESETS["dgx-a100"])


def test_fastmoe_pays_more_inter_node_time_as_nodes_grow(parts):
    times, a2a = [], []
    for nodes in (1, 2, 4, 8):
        result = simulate_layer("fastmoe", LayerShape(2048, 8192, 8 * nodes, 8192), _cluster(nodes), parts)
        times.append(result.total_s)
        a2a.append(result.all_to_all_s)
    assert times == sorted(times) and a2a == sorted(a2a) and a2a[-1] > 5 * a2a[0]


def test_skewed_routing_is_slower_than_uniform(parts):
    shape = LayerShape(1024, 4096, 16, 8192)
    uniform = simulate_layer("mpipemoe", shape, _cluster(2), parts, 2, "S3")
    hot = simulate_layer("mpipemoe", shape, Cluster(ClusterLayout(2, 8), PRESETS["dgx-a100"],
                                                    tuple(hot_expert_load(16, 0.3))), parts, 2, "S3")
    assert hot.total_s > uniform.total_s
    assert hot.peak_bytes > uniform.peak_bytes       # the hot rank receives more rows


def test_pipelining_hides_communication_on_a_slow_network(parts):
    choice = compare_engines(LayerShape(2048, 8192, 64, 16384), _cluster(8), parts)
    assert choice.fastest.total_s < choice.fastmoe.total_s
    assert choice.fastermoe.partitions == 16           # 64 ranks in groups of 4
    assert choice.chosen.strategy != "none" or choice.chosen.partitions == 1


def test_host_scale_zero_is_a_lower_bound(parts):
    shape = LayerShape(1024, 4096, 8, 4096)
    measured = simulate_layer("mpipemoe", shape, single_gpu(), parts, 4, "S1")
    device_only = simulate_layer("mpipemoe", shape, single_gpu(), HostScaled(parts, 0.0), 4, "S1")
    assert device_only.total_s < measured.total_s
    with pytest.raises(ValueError, match="host scale"):
        HostScaled(parts, -1)


def test_bad_shapes_fail_with_the_field_and_the_fix(parts):
    with pytest.raises(ValueError, match="LayerShape.tokens=0"):
        LayerShape(1024, 4096, 8, 0)
    with pytest.raises(ValueError, match="num_experts=8 is not a multiple of the 16 ranks; use 16"):
        simulate_layer("fastmoe", LayerShape(1024, 4096, 8, 1024), _cluster(2), parts)
    with pytest.raises(ValueError, match="Cluster.network is None"):
        Cluster(ClusterLayout(2, 8))
    with pytest.raises(ValueError, match="engine='deepspeed'"):
        simulate_layer("deepspeed", LayerShape(1024, 4096, 8, 1024), single_gpu(), parts)


def test_training_step_counts_every_layer_and_the_dense_parts(parts):
    model = ModelShape(1024, 4096, 24, 16, 1024, 64)
    layer = simulate_layer("mpipemoe", model.layer(8192), _cluster(8), parts, 2, "S3")
    step = simulate_step("mpipemoe", model, 8192, _cluster(8), parts, 2, "S3")
    assert step.moe_s == pytest.approx(24 * layer.total_s)
    assert step.step_s > step.moe_s + step.dense_s
    keep = simulate_step("fastermoe", model, 8192, _cluster(8), parts)
    assert step.activation_bytes < keep.activation_bytes and step.state_bytes == keep.state_bytes


# -- parts ---------------------------------------------------------------------------------------------------

def test_interpolation_is_log_log_inside_proportional_above_flat_below():
    xs, ys = [10, 100], [1.0, 100.0]
    assert interpolate(xs, ys, 31.6227766) == pytest.approx(10.0, rel=1e-6)
    assert interpolate(xs, ys, 1000) == pytest.approx(1000.0)
    assert interpolate(xs, ys, 1) == 1.0


def test_the_committed_parts_load_and_a_broken_file_says_what_to_do(parts, tmp_path):
    assert parts.ffn_s("forward", 4096, 2048, 8192) > parts.ffn_s("forward", 1024, 2048, 8192) > 0
    assert parts.host_cost("mpipemoe|S1", 8).forward_s(4) > parts.host_cost("mpipemoe|S1", 8).forward_s(1)
    broken = tmp_path / "parts.json"
    broken.write_text(json.dumps({"device": "x"}))
    with pytest.raises(ValueError, match="measure it again"):
        GpuParts.load(str(broken))


# -- the command line ----------------------------------------------------------------------------------------

def test_simulate_prints_every_engine_and_the_best_choice(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert cli.main(["simulate", "--nodes", "2", "--gpus-per-node", "4", "--model", "gpt-s", "--tokens", "2048",
                     "--partitions", "1,2,4", "--step", "--tracking-uri", "none", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    for word in ("fastmoe", "fastermoe", "mpipemoe", "best n and strategy", "step ms"):
        assert word in text
    point = json.loads(out.read_text())["points"][0]
    assert point["ranks"] == 8 and point["leaving_node"] == pytest.approx(0.5)
    assert {r["label"] for r in point["engines"]} == {"fastmoe", "fastermoe", "mpipemoe", "mpipemoe-fastest"}


def test_simulate_sweeps_nodes(capsys):
    assert cli.main(["simulate", "--sweep-nodes", "1,2", "--gpus-per-node", "2", "--model", "gpt-s", "--tokens",
                     "1024", "--partitions", "1,2", "--tracking-uri", "none"]) == 0
    text = capsys.readouterr().out
    assert "How each engine's cost grows" in text


def test_settings_errors_name_the_option():
    with pytest.raises(ValueError, match="--model 'gpt-q'"):
        SimulateSettings("gpt-q", (1024,), (1,))
    with pytest.raises(ValueError, match="--experts 12 .* multiple of the 16 GPUs"):
        SimulateSettings("gpt-s", (1024,), (2,), experts=12)
    with pytest.raises(ValueError, match="--network 'nvlink9'"):
        SimulateSettings("gpt-s", (1024,), (1,), network="nvlink9")


def test_validation_covers_every_record_and_names_the_term_off(parts):
    result = validate(["results/bench-h200.json"], parts, printer=lambda *_: None)
    assert len(result["rows"]) == 184
    summary = result["summary"]["bench-h200.json"]
    assert summary["memory_within_15pct"] == 184
    assert all(r["term_off"] for r in result["rows"] if abs(r["error"]) > 0.15)
    assert all(math.isfinite(r["simulated_ms"]) for r in result["rows"])


def test_report_section_plots_simulations(tmp_path):
    rows = [{"label": label, "model": "gpt-xl", "tokens": "16384", "network": "dgx-a100", "routing": "uniform",
             "gpus_per_node": "8", "ranks": str(8 * nodes), "fwd_bwd_ms": ms * nodes, "partitions": "4",
             "strategy": "S3", "speedup_vs_fastermoe": 1.1, "memory_ratio_vs_fastermoe": 0.8}
            for nodes in (1, 2, 4) for label, ms in (("fastmoe", 3.0), ("fastermoe", 2.0), ("mpipemoe", 1.5))]
    lines = section_simulations(rows, str(tmp_path))
    assert (tmp_path / "simulate.png").exists()
    assert any("| gpt-xl | 16384 | dgx-a100 | uniform | 32 |" in line for line in lines)
    assert "No data" in "\n".join(section_simulations([], str(tmp_path)))


def test_an_unmeasured_shape_scales_every_curve_of_the_nearest_one_by_flops(parts):
    """A 512x2048 layer was not measured: its FFN curves (FastMoE's per-L curves too) are
    the 1024x4096 ones times the FLOP ratio, 1/4."""
    for phase in ("forward", "backward"):
        assert parts.ffn_s(phase, 4096, 512, 2048) == pytest.approx(parts.ffn_s(phase, 4096, 1024, 4096) / 4)
        assert parts.autograd_ffn_s(phase, 4096, 8, 512, 2048) == pytest.approx(
            parts.autograd_ffn_s(phase, 4096, 8, 1024, 4096) / 4)


def test_host_matched_simulation_reproduces_the_probe_it_is_matched_to(parts, tmp_path):
    """A record's host probe (the same layer at 64 tokens, timed beside it) scales the host
    term so that the simulator gives the probe's time at 64 tokens; at the record's own size
    the matched simulation is what the validation reports beside the plain one."""
    from app.simulate import _host_matched
    from moe_engine.simulator import LayerShape, simulate_layer, single_gpu

    with open("results/bench-h200.json") as f:
        bench = json.load(f)
    record = next(r for r in bench["records"] if r["model"] == "gpt-s" and r["tokens"] == 4096
                  and r["chosen_by"] == "grid" and r["partitions"] == 4 and r["strategy"] == "S3")

    def shape_at(tokens):
        return LayerShape(1024, 4096, 8, tokens, 2, "gelu", 2)

    plain = simulate_layer("mpipemoe", shape_at(64), single_gpu(), parts, 4, "S3").total_s * 1e3
    for probe_ms in (0.5 * plain, 2.0 * plain):
        matched = _host_matched(parts, dict(record, host_probe_ms=probe_ms, host_probe_tokens=64), shape_at)
        at_probe = simulate_layer("mpipemoe", shape_at(64), single_gpu(), matched, 4, "S3").total_s * 1e3
        assert at_probe == pytest.approx(probe_ms, rel=0.03)
    assert _host_matched(parts, record, shape_at) is None  # the committed record has no probe

    path = tmp_path / "bench.json"
    bench["records"] = [dict(record, host_probe_ms=2.0 * plain, host_probe_tokens=64)]
    path.write_text(json.dumps(bench))
    row = validate([str(path)], parts, printer=lambda *_: None)["rows"][0]
    assert row["host_matched_ms"] > row["simulated_ms"]  # a slower host than the parts' one
    assert row["host_matched_error"] == pytest.approx(row["host_matched_ms"] / row["measured_ms"] - 1)


def test_validation_skips_the_records_of_peers_and_the_dense_floor(parts, tmp_path):
    """bench --peers adds torchtitan and dense-floor records; the simulator models our engines only."""
    with open("results/bench-h200.json") as f:
        bench = json.load(f)
    ours = bench["records"][:2]
    bench["records"] = ours + [dict(ours[0], engine="torchtitan", chosen_by="peer"),
                               dict(ours[0], engine="dense-floor", chosen_by="floor")]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    rows = validate([str(path)], parts, printer=lambda *_: None)["rows"]
    assert [r["engine"] for r in rows] == [r["engine"] for r in ours]
