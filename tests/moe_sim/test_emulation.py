"""Tiers 1-2: the emulated cluster (moe_sim/emulation.py) on CPU.

Its collectives have the shapes of a real W-rank gloo run in which every rank holds the
same tokens and parameters (so routes the same), compared call by call for W = 2 and 4
and every engine; its modelled seconds are network.py's price of rank 0's bytes; and
`mpipemoe bench --emulate` writes records marked emulated. Timing on a GPU is not
tested here (no numbers are claimed for it)."""
import dataclasses
import json

import pytest
import torch

from app.cli import main
from moe_engine import FastMoE, FasterMoE, MoEConfig, MPipeMoE
from moe_engine.comm import ExpertGroup
from moe_sim.emulation import EmulatedCall, EmulatedCluster, fill_from_own_block
from moe_sim.network import (PRESETS, ClusterLayout, all_reduce_s, all_to_all_traffic, flat_all_to_all_s,
                                hierarchical_all_to_all_s, rank_traffic, small_collective_s, uniform_load)
from tests.distributed import run_on_ranks

CONFIG = MoEConfig(d_model=16, d_hidden=32, num_experts=8, top_k=2)
TOKENS = 96
# (engine, argument): MPipeMoE (n, strategy), FasterMoE's peers per step, FastMoE.
ENGINES = {2: [("mpipemoe", (2, "S3")), ("fastermoe", 1), ("fastermoe", 4), ("fastmoe", None)],
           4: [("mpipemoe", (2, "S3")), ("fastermoe", 1), ("fastermoe", 2), ("fastmoe", None)]}


class LoggedGroup(ExpertGroup):
    """Delegates every collective to `inner` and logs, in order, (kind, output shape, input
    shape, output splits, input splits), and the count table an exchange answered."""

    def __init__(self, inner: ExpertGroup, calls: list):
        self.inner, self.calls = inner, calls
        self.group, self.size, self.rank = inner.group, inner.size, inner.rank
        self.always_communicate, self.comm_sms = inner.always_communicate, inner.comm_sms

    @property
    def distributed(self):
        return self.inner.distributed

    def exchange_counts(self, send, stats_width=None):
        recv = self.inner.exchange_counts(send, stats_width)
        self.calls.append(("exchange_counts", tuple(recv.shape), tuple(send.shape), recv.tolist()))
        return recv

    def all_to_all(self, output, input, output_splits, input_splits):
        self.inner.all_to_all(output, input, output_splits, input_splits)
        self.calls.append(("all_to_all", tuple(output.shape), tuple(input.shape), tuple(output_splits),
                           tuple(input_splits)))

    def all_to_all_async(self, output, input, output_splits, input_splits, streams):
        pending = self.inner.all_to_all_async(output, input, output_splits, input_splits, streams)
        self.calls.append(("all_to_all_async", tuple(output.shape), tuple(input.shape), tuple(output_splits),
                           tuple(input_splits)))
        return pending

    def all_reduce_max(self, values):
        self.calls.append(("all_reduce_max", tuple(values.shape)))
        return self.inner.all_reduce_max(values)

    def all_reduce_sum(self, values):
        self.calls.append(("all_reduce_sum", tuple(values.shape)))
        return self.inner.all_reduce_sum(values)

    def broadcast_object(self, obj):
        self.calls.append(("broadcast_object",))
        return self.inner.broadcast_object(obj)

    def broadcast(self, tensor, source):
        self.calls.append(("broadcast", tuple(tensor.shape), source))
        self.inner.broadcast(tensor, source)

    def reduce_sum(self, tensor, destination):
        self.calls.append(("reduce_sum", tuple(tensor.shape), destination))
        self.inner.reduce_sum(tensor, destination)


def _layer(engine: str, argument, group: ExpertGroup):
    torch.manual_seed(1)  # the same parameters on every rank (so the same routing)
    if engine == "mpipemoe":
        return MPipeMoE(CONFIG, group, *argument)
    if engine == "fastermoe":
        return FasterMoE(CONFIG, group, group_size=argument)
    return FastMoE(CONFIG, group)


def _forward_backward(layer) -> None:
    torch.manual_seed(2)  # the same tokens on every rank
    x = torch.randn(TOKENS, CONFIG.d_model, requires_grad=True)
    dy = torch.randn(TOKENS, CONFIG.d_model)
    y, aux = layer(x)
    torch.autograd.backward([y, aux], [dy, torch.ones_like(aux)])
    assert x.grad is not None and torch.isfinite(y).all() and torch.isfinite(x.grad).all()


def _real_calls(rank: int, world_size: int, engines: list) -> list:
    """On each gloo rank: every engine's forward+backward; rank 0's collectives by engine."""
    logs = []
    for engine, argument in engines:
        calls = []
        _forward_backward(_layer(engine, argument, LoggedGroup(ExpertGroup(None), calls)))
        logs.append(calls)
    return logs


def _emulated_calls(world_size: int, engines: list) -> tuple[list, list]:
    """The same engines on one process with the stand-in: the logs as `_real_calls` makes
    them, and the stand-in's own logs."""
    logs, own = [], []
    for engine, argument in engines:
        stand_in = EmulatedCluster.parse(f"1x{world_size}").build(keep_log=True)
        group = stand_in.for_peer_steps(argument) if engine == "fastermoe" else stand_in
        calls = []
        layer = _layer(engine, argument, LoggedGroup(group, calls))
        assert layer.local_experts == CONFIG.num_experts // world_size
        _forward_backward(layer)
        logs.append(calls)
        own.append(stand_in.calls)
    return logs, own


@pytest.mark.gloo
@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_have_the_shapes_of_a_real_run_with_the_same_routing_on_every_rank(world_size):
    engines = ENGINES[world_size]
    real = run_on_ranks(world_size, _real_calls, engines)[0]
    emulated, own = _emulated_calls(world_size, engines)
    for (engine, argument), real_calls, emulated_calls, own_calls in zip(engines, real, emulated, own):
        assert any(c[0] == "all_to_all_async" for c in real_calls), engine
        assert emulated_calls == real_calls, f"{engine} {argument}, W={world_size}"
        # The stand-in's own log holds the same calls, each with its modelled seconds.
        assert [c.kind for c in own_calls] == [c[0] for c in real_calls]
        for logged, call in zip(emulated_calls, own_calls):
            if call.kind.startswith("all_to_all"):
                assert (call.kind, call.output_shape, call.input_shape, call.output_splits,
                        call.input_splits) == logged
            assert call.seconds > 0


def test_a_count_table_that_does_not_fit_the_peer_steps_is_refused():
    stand_in = EmulatedCluster.parse("1x4").build()
    # The group answers for 4 peer steps; the layer exchanges its counts in one.
    layer = FasterMoE(CONFIG, stand_in.for_peer_steps(1), group_size=4)
    with pytest.raises(ValueError, match=r"FasterMoE\(config, group.for_peer_steps\(g\), group_size=g\)"):
        layer(torch.randn(8, CONFIG.d_model))
    with pytest.raises(ValueError, match="group_size"):
        stand_in.for_peer_steps(0)


def test_dispatch_output_is_rank_0s_own_block_from_every_source():
    input_RD = torch.arange(10.0).view(10, 1)
    output_ND = torch.empty(9, 1)
    fill_from_own_block(output_ND, input_RD, [3, 4, 2, 1])  # rank 0 sends itself rows 0-2
    assert output_ND.flatten().tolist() == [0, 1, 2] * 3
    combine = torch.empty(10, 1)
    fill_from_own_block(combine, output_ND, [3, 3, 3])      # own block first, then cycled
    assert combine.flatten().tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]
    step = torch.empty(4, 1)
    fill_from_own_block(step, input_RD[3:6], [0, 3, 0])     # sends itself nothing: the whole input
    assert step.flatten().tolist() == [3, 4, 5, 3]
    empty = torch.ones(2, 1)
    fill_from_own_block(empty, input_RD[:0], [0, 0])
    assert empty.flatten().tolist() == [0, 0]
    wide_RD = torch.arange(20.0).view(10, 2)
    for rows in (1, 2, 7, 64):  # fewer rows than the block, one block, repeats with and without a remainder
        out = torch.empty(rows, 2)
        fill_from_own_block(out, wide_RD, [2, 8])
        assert torch.equal(out, wide_RD[torch.arange(rows) % 2])
    strided = torch.empty(2, 7).t()  # a non-contiguous output takes the same rows
    fill_from_own_block(strided, wide_RD, [2, 8])
    assert torch.equal(strided, wide_RD[torch.arange(7) % 2])


def test_modelled_seconds_are_network_py_s_price_of_rank_0s_bytes():
    network = PRESETS["dgx-a100"]
    cluster = EmulatedCluster.parse("2x4", "dgx-a100")
    group = cluster.build(keep_log=True)
    send, recv = [5, 9, 0, 7, 3, 11, 4, 6], [5] * 8
    input_RD, output_ND = torch.randn(sum(send), 16), torch.empty(sum(recv), 16)
    group.all_to_all(output_ND, input_RD, recv, send)
    row_bytes = 16 * 4
    call = group.calls[-1]
    assert call == EmulatedCall("all_to_all", (40, 16), (45, 16), tuple(recv), tuple(send), call.seconds)
    assert call.seconds == flat_all_to_all_s(network, rank_traffic(cluster.layout, 0, send, recv), row_bytes)
    # By hand: rank 0's NVLink peers 1-3 (16 rows out, 15 in; 3 peers), its NIC peers 4-7 (24 out, 20 in; 4).
    nvlink = 3 * network.intra_message_s + 16 * row_bytes / network.intra_bytes_per_s
    nic = 4 * network.inter_message_s + 24 * row_bytes / network.inter_bytes_per_s
    assert call.seconds == pytest.approx(network.collective_s + max(nvlink, nic))

    # A balanced exchange costs what the simulator's traffic model says for uniform routing.
    b = 8 * 64
    balanced = torch.randn(b, 16)
    group.all_to_all_async(torch.empty_like(balanced), balanced, [64] * 8, [64] * 8, streams_on_cpu())
    uniform = all_to_all_traffic(cluster.layout, uniform_load(8))
    assert group.calls[-1].kind == "all_to_all_async"
    assert group.calls[-1].seconds == pytest.approx(flat_all_to_all_s(network, uniform, b * row_bytes))

    hierarchical = EmulatedCluster(layout=cluster.layout, network=network, hierarchical=True).build(keep_log=True)
    hierarchical.all_to_all(torch.empty_like(balanced), balanced, [64] * 8, [64] * 8)
    assert hierarchical.calls[-1].seconds == pytest.approx(
        hierarchical_all_to_all_s(network, cluster.layout, uniform, b * row_bytes))

    counts = torch.zeros(8, 5, dtype=torch.int64)
    group.exchange_counts(counts)
    assert group.calls[-1].seconds == small_collective_s(network, cluster.layout)


def test_rank_traffic_of_a_balanced_exchange_is_all_to_all_traffic():
    layout = ClusterLayout(2, 4)
    mine = rank_traffic(layout, 5, [10] * 8, [10] * 8)
    uniform = all_to_all_traffic(layout, uniform_load(8))
    assert mine.intra == pytest.approx(uniform.intra * 80) and mine.inter == pytest.approx(uniform.inter * 80)
    assert (mine.intra_messages, mine.inter_messages) == (uniform.intra_messages, uniform.inter_messages)
    assert mine.leaving_node == pytest.approx(uniform.leaving_node)
    with pytest.raises(ValueError, match="one split per rank"):
        rank_traffic(layout, 0, [1] * 4, [1] * 8)


def test_agreements_over_identical_ranks():
    group = EmulatedCluster.parse("2x2").build()
    values = torch.tensor([3, 5])
    assert group.all_reduce_max(values).tolist() == [3, 5]
    assert group.all_reduce_sum(values).tolist() == [12, 20]
    assert group.broadcast_object({"n": 2}) == {"n": 2}
    assert isinstance(group, ExpertGroup) and group.distributed and (group.size, group.rank) == (4, 0)


def test_cluster_settings_are_checked():
    with pytest.raises(ValueError, match="NODESxGPUS"):
        EmulatedCluster.parse("8by8")
    with pytest.raises(ValueError, match="no emulation"):
        EmulatedCluster.parse("1x1")
    with pytest.raises(ValueError, match="neither a preset"):
        EmulatedCluster.parse("2x2", "no-such-network")
    with pytest.raises(ValueError, match="one entry per rank"):
        EmulatedCluster.parse("1x2").build().all_to_all(torch.empty(2, 1), torch.empty(2, 1), [2], [2])



def test_an_expert_group_of_one_node_exchanges_over_nvlink_and_reduces_across_nodes():
    """8x8 with P = 8: rank 0's group is node 0's 8 GPUs: its All-to-All and count exchange are
    priced on NVLink alone, the layer holds E / 8 experts, and the expert gradients reduce over
    the 8 copies (one per node). P = 64 (the default) prices the whole cluster and reduces nothing."""
    network = PRESETS["dgx-h200"]
    node = EmulatedCluster.parse("8x8", "dgx-h200", expert_parallel=8)
    world = EmulatedCluster.parse("8x8", "dgx-h200")
    group = node.build(keep_log=True)
    assert (group.size, node.expert_ranks, world.build().size) == (8, 8, 64)
    assert node.record_fields()["expert_parallel"] == 8 and world.record_fields()["expert_parallel"] == 64
    balanced = torch.randn(8 * 64, 16)
    group.all_to_all(torch.empty_like(balanced), balanced, [64] * 8, [64] * 8)
    row_bytes = 16 * 4
    nvlink = 7 * network.intra_message_s + 7 * 64 * row_bytes / network.intra_bytes_per_s
    assert group.calls[-1].seconds == pytest.approx(network.collective_s + nvlink)
    assert world.all_to_all_s([8] * 64, [8] * 64, row_bytes) > 3 * group.calls[-1].seconds  # 56 of 63 peers off the node
    group.exchange_counts(torch.zeros(8, 5, dtype=torch.int64))
    assert group.calls[-1].seconds == small_collective_s(network, ClusterLayout(1, 8)) \
        < world.small_collective_s() == node.small_collective_s(world=True)
    assert node.expert_reduction_s(2**30) == all_reduce_s(network, ClusterLayout(8, 1), 2**30) > 0
    assert world.expert_reduction_s(2**30) == 0.0
    layer = MPipeMoE(MoEConfig(d_model=16, d_hidden=32, num_experts=64), group=group, partitions=1, strategy="none")
    assert layer.experts.w1.shape[0] == 8


@pytest.mark.parametrize("degree, message", [(3, r"expert_parallel=3 is invalid on 8x8: .* --expert-parallel 1, 2, 4, "),
                                             (1, r"expert_parallel=1 is invalid: one rank per expert group has no "
                                                 r"All-to-All to emulate; give --expert-parallel >= 2")])
def test_an_expert_degree_the_cluster_cannot_take_is_refused_naming_the_flag(degree, message):
    with pytest.raises(ValueError, match=message):
        EmulatedCluster.parse("8x8", expert_parallel=degree)

def streams_on_cpu():
    from moe_engine.streams import StreamSet

    return StreamSet(torch.device("cpu"))


def test_bench_emulate_marks_every_record_emulated(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", "--emulate", "2x2", "--tokens", "256", "--rounds", "1", "--repeats", "1", "--no-grid",
                 "--tracking-uri", "none", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    meta = result["meta"]
    assert (meta["measured_as"], meta["network"], meta["emulated_cluster"], meta["world_size"],
            meta["processes"]) == ("emulated", "dgx-a100", "2x2", 4, 1)
    engines = sorted(r["engine"] for r in result["records"])
    assert engines == ["dense-floor", "fastermoe", "fastmoe", "mpipemoe"]
    for record in result["records"]:
        assert (record["measured_as"], record["network"], record["world_size"], record["nodes"],
                record["gpus_per_node"]) == ("emulated", "dgx-a100", 4, 2, 2)
        assert record["all_to_all_ms"] > 0
    assert "**Emulated**" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize("extra, message", [(["--world-size", "2"], "drop --world-size 2"),
                                             (["--peers", "torchtitan", "--activation", "swiglu", "--no-bias"],
                                              "cannot time --peers"),
                                             (["--experts", "6"], "multiple of the 4 emulated ranks"),
                                             (["--network", "nowhere.json"], "neither a preset")])
def test_bench_emulate_refuses_what_it_cannot_emulate(extra, message, tmp_path, capsys):
    assert main(["bench", "--emulate", "2x2", "--tokens", "64", "--tracking-uri", "none",
                 "--out", str(tmp_path / "b.json"), *extra]) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists()


def test_training_never_uses_the_emulated_group():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    training = [*sorted((root / "workers").glob("*.py")), root / "app" / "commands" / "train.py",
                *sorted((root / "app" / "jobs").glob("*.py")),
                *sorted((root / "lm").glob("*.py"))]
    assert len(training) > 3
    for path in training:
        assert "emulation" not in path.read_text(), f"{path.relative_to(root)} uses the emulated cluster"


def test_busiest_rank_becomes_rank_0_by_swapping_router_rows():
    from app.bench.measure import busiest_rank_first
    from moe_engine.router import count_ids

    torch.manual_seed(0)
    ranks, local, top_k = 4, 2, 2
    weight = torch.randn(ranks * local, 16)
    x = torch.randn(512, 16)
    x[:256] += 4 * weight[5] / weight[5].norm()  # rank 2 (experts 4, 5) is the busiest

    def rows_per_rank(w):
        ids = torch.topk(x @ w.t(), top_k, dim=-1).indices.flatten()
        return count_ids(ids, ranks * local).view(ranks, local).sum(1)

    before = rows_per_rank(weight)
    assert int(before.argmax()) == 2
    original = weight.clone()
    busiest_rank_first(weight, x, ranks, top_k)
    after = rows_per_rank(weight)
    assert int(after.argmax()) == 0 and after[0] == before.max()
    assert torch.equal(weight[:local], original[2 * local:3 * local])
    assert torch.equal(weight[2 * local:3 * local], original[:local])
    assert torch.equal(weight[local:2 * local], original[local:2 * local])  # other ranks untouched


def test_simulator_validates_emulated_records_in_their_cluster(tmp_path):
    """`simulate --validate` prices an emulated record in the emulated cluster (its layout,
    network and measured expert load), and the All-to-All stage against the network model."""
    from app.bench.simulate_validation import emulated_all_to_all_ms, validate
    from moe_sim.parts import GpuParts

    out = tmp_path / "bench.json"
    assert main(["bench", "--emulate", "2x2", "--tokens", "256", "--rounds", "1", "--repeats", "1", "--no-grid",
                 "--routing", "hot-expert", "--tracking-uri", "none", "--out", str(out)]) == 0
    bench = json.loads(out.read_text())
    record = next(r for r in bench["records"] if r["engine"] == "fastmoe")
    assert len(record["expert_load"]) == 8 and abs(sum(record["expert_load"]) - 1) < 1e-3
    assert record["expert_load"][0] == max(record["expert_load"])  # hot-expert: expert 0, on rank 0, is hot
    modelled = emulated_all_to_all_ms(bench["meta"], record)
    cluster = EmulatedCluster.parse("2x2", "dgx-a100")
    rows = 2 * 256
    send = [round(rows * sum(record["expert_load"][r * 2:(r + 1) * 2])) for r in range(4)]
    assert modelled == pytest.approx(4e3 * cluster.all_to_all_s([send[0]] * 4, send, record["d_model"] * 4))
    # the H200's parts stand in for this machine's (only the pricing in the cluster is checked);
    # as measured on the H200 they do not price a record of another device
    h200 = GpuParts.load("results/sim-parts-h200.json")
    said: list[str] = []
    assert validate([str(out)], h200, printer=said.append)["rows"] == [] and "not simulated here" in said[0]
    result = validate([str(out)], dataclasses.replace(h200, device=bench["meta"]["device"]), printer=lambda *_: None)
    rows = result["rows"]
    assert {r["engine"] for r in rows} == {"fastmoe", "fastermoe", "mpipemoe"}
    for row in rows:
        assert row["measured_as"] == "emulated" and row["routing"] == "hot-expert"
        assert row["busy_ms"]["comm"] > 0  # priced in a 4-rank cluster, not on one GPU
        assert row["network_dilation"] > 0 and row["dilated_ms"] > 0


def test_wall_clock_wait_and_transfer_ctas_are_checked():
    from moe_sim.emulation import WallClockWait

    with pytest.raises(ValueError, match="ctas=0 is invalid"):
        WallClockWait(0)
    with pytest.raises(ValueError, match="transfer_ctas=0 is invalid"):
        EmulatedCluster.parse("2x2", transfer_ctas=0)
    group = EmulatedCluster.parse("2x2", transfer_ctas=4).build()
    assert group.clock.ctas == 4


def test_the_emulated_gemms_leave_nccls_sms_free_by_default_and_say_so():
    """Issue 36: real pipelined passes leave NCCL 16 SMs; the emulator reserves as many, not
    its transfers' one CTA, and every record states it."""
    from moe_engine.comm import DEFAULT_COMM_SMS

    cluster = EmulatedCluster.parse("2x2")
    assert DEFAULT_COMM_SMS == 16 and cluster.build().comm_sms == 16 and cluster.transfer_ctas == 1
    assert cluster.record_fields()["comm_sms"] == 16
    assert EmulatedCluster.parse("2x2", comm_sms=0).build().comm_sms == 0
    with pytest.raises(ValueError, match="comm_sms=-1 is invalid"):
        EmulatedCluster.parse("2x2", comm_sms=-1)


def test_free_transfers_price_and_log_the_all_to_all_and_copy_its_rows():
    group = EmulatedCluster.parse("1x2").build()
    send, recv = torch.arange(6.0).view(6, 1), torch.full((5, 1), -1.0)
    with group.logging_calls() as priced:
        group.all_to_all(recv, send, [3, 2], [4, 2])
    assert recv.flatten().tolist() == [0, 1, 2, 3, 0]  # a normal transfer fills rank 0's own block
    recv.fill_(-1.0)
    with group.free_transfers(), group.logging_calls() as free:
        group.all_to_all(recv, send, [3, 2], [4, 2])
    # the rows arrive (the experts compute on what they would), only the modelled wait is gone
    assert recv.flatten().tolist() == [0, 1, 2, 3, 0] and group.calls is None
    assert [(c.kind, c.seconds) for c in free] == [(c.kind, c.seconds) for c in priced] and priced[0].seconds > 0
    recv.fill_(-1.0)
    group.all_to_all(recv, send, [3, 2], [4, 2])  # after: priced transfers again
    assert recv.flatten().tolist() == [0, 1, 2, 3, 0] and not group._free_transfers


def test_comm_sms_default_follows_ncclmax_ctas_and_is_checked(monkeypatch):
    from moe_engine.comm import DEFAULT_COMM_SMS, ExpertGroup

    monkeypatch.delenv("NCCL_MAX_CTAS", raising=False)
    monkeypatch.delenv("NCCL_MAX_NCHANNELS", raising=False)
    assert ExpertGroup(None).comm_sms == DEFAULT_COMM_SMS
    monkeypatch.setenv("NCCL_MAX_CTAS", "8")
    assert ExpertGroup(None).comm_sms == 8
    assert ExpertGroup(None, comm_sms=0).comm_sms == 0
    with pytest.raises(ValueError, match="comm_sms=-1 is invalid"):
        ExpertGroup(None, comm_sms=-1)


def test_reserving_sms_is_a_no_op_off_cuda():
    from moe_engine.streams import StreamSet

    with StreamSet(torch.device("cpu")).reserving_sms(16):
        assert torch._C._get_sm_carveout_experimental() is None


def test_lane_clones_share_the_cluster_prices_and_link_and_log_into_their_group():
    group = EmulatedCluster.parse("1x2", "dgx-a100").build()
    faster = group.for_peer_steps(1)
    [lane] = faster.lane_groups(1)
    [nested] = lane.lane_groups(1)
    assert lane is not faster and lane.lane_of is faster and nested.lane_of is faster
    assert lane.timing is group.timing and lane.cluster is group.cluster and lane.peer_group_size == 1
    assert (lane.size, lane.rank, lane.group) == (2, 0, None)
    send, recv = torch.arange(6.0).view(6, 1), torch.zeros(5, 1)
    with faster.logging_calls() as calls:
        lane.all_to_all(recv, send, [3, 2], [4, 2])
        lane.all_reduce_max(torch.ones(2))
    assert [c.kind for c in calls] == ["all_to_all", "all_reduce_max"] and recv.flatten().tolist() == [0, 1, 2, 3, 0]
    recv.fill_(-1.0)
    with faster.free_transfers():
        assert nested._lane_origin._free_transfers  # the clone follows its group's free_transfers
        nested.all_to_all(recv, send, [3, 2], [4, 2])
    assert recv.flatten().tolist() == [0, 1, 2, 3, 0] and not nested._lane_origin._free_transfers
    assert faster.lane_groups(0) == []
    with pytest.raises(ValueError, match="count=-1 is invalid"):
        group.lane_groups(-1)
