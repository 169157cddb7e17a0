"""Tier 4 (marker gpu; skipped without CUDA): the engines on real CUDA streams against the
reference, and measured peak memory against the memory model.

The GPU tests cannot rot unnoticed on CPU-only CI: each one's setup is a helper that takes
a device, and its twin ``<name>_cpu_twin`` (unmarked) runs the same helper on CPU at small
sizes, so a changed signature or constructor fails there too (tests/test_gpu_twins.py
checks that every test marked gpu has its twin).
"""
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moe_engine import FastMoE, FasterMoE, HostBufferPool, MoEConfig, MPipeMoE
from moe_engine.memory import predict_memory
from tests.engine_cases import SCENARIOS, Scenario, build_engine, load_params, make_problem, solve_reference

CPU = torch.device("cpu")
GPU_ENGINES = ["fastmoe", "fastermoe:1"] + [f"mpipemoe:{n}:{s}" for n in (1, 4, 7) for s in ("none", "S1", "S2", "S3", "S4")]


def _check_against_reference(spec, outs, problem, tolerance=6e-2):
    """outs: (y, dx, w1.grad, w2.grad, ...) on any device, against the float64 reference."""
    for name, got, want in zip(("y", "dx", "w1.grad", "w2.grad"), outs[:4],
                               (problem.ref_y[0], problem.ref_dx[0], problem.ref_expert_grads["experts.w1"],
                                problem.ref_expert_grads["experts.w2"])):
        want = want.to(got.device)
        rel = float((got.double().reshape(want.shape) - want).abs().max() / want.abs().max().clamp_min(1e-12))
        assert rel < tolerance, f"{spec} {name}: relative error {rel:.3g}"


def _engines_match_reference(scenario, specs, device, dtype, tolerance, passes=3):
    problem = make_problem(scenario, 1)
    solve_reference(problem, scenario.config)
    for spec in specs:
        layer = build_engine(spec, scenario.config, dtype=dtype).to(device)
        load_params(layer, problem, 0)
        for _ in range(passes):  # repeated passes reuse slots and pooled host buffers
            layer.zero_grad(set_to_none=True)
            x = problem.x[0].to(device, dtype).requires_grad_(True)
            if scenario.three_d:
                x = x.detach().reshape(2, -1, x.shape[-1]).requires_grad_(True)
            y, aux = layer(x)
            loss = (y.double().reshape(-1, y.shape[-1]) * problem.grad_y[0].to(device)).sum() \
                + problem.aux_coef * aux.double()
            loss.backward()
            _check_against_reference(spec, (y.detach(), x.grad, layer.experts.w1.grad, layer.experts.w2.grad),
                                     problem, tolerance)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 6e-2)])
@pytest.mark.parametrize("scenario", SCENARIOS[:4], ids=lambda s: s.name)
def test_cuda_engines_match_reference(scenario, dtype, tolerance):
    _engines_match_reference(scenario, GPU_ENGINES, torch.device("cuda"), dtype, tolerance)


def test_cuda_engines_match_reference_cpu_twin():
    _engines_match_reference(SCENARIOS[2], GPU_ENGINES, CPU, torch.float32, 1e-4, passes=2)


def _pass(layer, x, grad_y):
    """One forward and backward of ``layer`` on ``x`` (a leaf copy), seeded with ``grad_y``."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    y, aux = layer(x)
    torch.autograd.backward([y, aux], [grad_y, torch.ones_like(aux)])
    return y.detach()


def _peak_bytes(layer, x, grad_y):
    layer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    _pass(layer, x, grad_y)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _memory_layers(config, tokens, device, dtype):
    """Every engine and strategy on the same weights: name -> (layer, predicted peak bytes)."""
    source = FastMoE(config, device=device, dtype=dtype)
    layers = {"fastmoe": (FastMoE(config, device=device, dtype=dtype), 1, "none", "fastmoe"),
              "fastermoe": (FasterMoE(config, device=device, dtype=dtype), 1, "none", "fastermoe")}
    for s in ("none", "S1", "S2", "S3", "S4"):
        layers[s] = (MPipeMoE(config, partitions=4, strategy=s, device=device, dtype=dtype), 4, s, "mpipemoe")
    built = {}
    for name, (layer, n, strategy, engine) in layers.items():
        layer.load_state_dict(source.state_dict())
        built[name] = (layer, predict_memory(config, tokens, 1, n, strategy, engine=engine, dtype=dtype).peak_bytes)
    return built


@pytest.mark.gpu
def test_peak_memory_per_strategy_and_model_within_10_percent():
    config = MoEConfig(1024, 4096, 8, top_k=2)
    tokens = 8192
    torch.manual_seed(0)
    x = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16)
    grad_y = torch.randn_like(x)
    measured = {}
    for name, (layer, predicted) in _memory_layers(config, tokens, torch.device("cuda"), torch.bfloat16).items():
        _peak_bytes(layer, x, grad_y)  # warm-up (host pool, allocator)
        measured[name] = _peak_bytes(layer, x, grad_y)
        assert abs(predicted / measured[name] - 1) < 0.10, \
            f"{name}: predicted {predicted / 2**20:.0f} MiB, measured {measured[name] / 2**20:.0f} MiB"
    for s in ("S1", "S2", "S3", "S4"):
        assert measured[s] < measured["none"], f"{s} saves nothing: {measured}"


def test_peak_memory_per_strategy_and_model_within_10_percent_cpu_twin():
    """On CPU: the same layers compute the same output, and the model predicts savings."""
    config, tokens = MoEConfig(16, 32, 4, top_k=2), 64
    torch.manual_seed(0)
    x = torch.randn(tokens, 16)
    grad_y = torch.randn_like(x)
    built = _memory_layers(config, tokens, CPU, torch.float32)
    y_ref = _pass(built["fastmoe"][0], x, grad_y)
    for name, (layer, predicted) in built.items():
        torch.testing.assert_close(_pass(layer, x, grad_y), y_ref, msg=name)
        assert predicted > 0
    for s in ("S1", "S2", "S3", "S4"):
        assert built[s][1] < built["none"][1], s


def _grouped_empty_experts_match_reference(device, dtype, tolerance):
    """bf16 with 16-aligned shapes takes torch._grouped_mm where available; few tokens
    leave several experts empty. Returns the last input (for the kernel check)."""
    scenario = Scenario("aligned_empty_experts", MoEConfig(64, 128, 8, top_k=1, activation="gelu"), (5,))
    problem = make_problem(scenario, 1)
    solve_reference(problem, scenario.config)
    for spec in ["fastmoe", "mpipemoe:1:S4", "mpipemoe:3:S1", "mpipemoe:2:none"]:
        layer = build_engine(spec, scenario.config, dtype=dtype).to(device)
        load_params(layer, problem, 0)
        x = problem.x[0].to(device, dtype).requires_grad_(True)
        y, aux = layer(x)
        ((y.double() * problem.grad_y[0].to(device)).sum() + problem.aux_coef * aux.double()).backward()
        _check_against_reference(spec, (y.detach(), x.grad, layer.experts.w1.grad, layer.experts.w2.grad),
                                 problem, tolerance)
    return x.detach()


@pytest.mark.gpu
def test_grouped_gemm_path_with_empty_experts_matches_reference():
    from moe_engine.experts import grouped_kernel_supports

    x = _grouped_empty_experts_match_reference(torch.device("cuda"), torch.bfloat16, 6e-2)
    assert grouped_kernel_supports(x, 64, 128) == (torch.cuda.get_device_capability()[0] in (9, 10))


def test_grouped_gemm_path_with_empty_experts_matches_reference_cpu_twin():
    _grouped_empty_experts_match_reference(CPU, torch.float32, 1e-4)


def _offload_fallback_matches(strategy, device):
    """With no host memory to spare, an offloading layer runs S4 (no pinned buffers) and
    gives the numbers of the offloading run."""
    config = MoEConfig(d_model=64, d_hidden=128, num_experts=4, top_k=2)
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1)).to(device)

    def step(available_bytes):
        torch.manual_seed(0)
        layer = MPipeMoE(config, partitions=4, strategy=strategy,
                         host_pool=HostBufferPool(available_bytes=available_bytes)).to(device)
        xi = x.clone().requires_grad_(True)
        y, aux = layer(xi)
        (y.pow(2).sum() + aux).backward()
        return layer, y.detach(), xi.grad, layer.experts.w1.grad

    short, y, dx, dw = step(lambda: 0)
    enough, y_ref, dx_ref, dw_ref = step(lambda: 64 * 2**30)
    assert (short.last_strategy, short.host_pool.bytes_allocated) == ("S4", 0)
    assert enough.last_strategy == strategy and enough.host_pool.bytes_allocated > 0
    for got, want in [(y, y_ref), (dx, dx_ref), (dw, dw_ref)]:
        torch.testing.assert_close(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["S1", "S2", "S3"])
def test_offload_falls_back_to_s4_on_cuda_when_host_memory_is_short(strategy):
    _offload_fallback_matches(strategy, torch.device("cuda"))


def test_offload_falls_back_to_s4_on_cuda_when_host_memory_is_short_cpu_twin():
    _offload_fallback_matches("S3", CPU)


def _model_refuses_out_of_vocabulary_ids(device):
    """The check runs before the embedding, so CUDA raises a ValueError instead of a
    device-side assert that would poison the process."""
    from lm.model import MoETransformer, get_preset

    model = MoETransformer(get_preset("tiny-gpt"), engine="mpipemoe").to(device)
    with pytest.raises(ValueError, match=r"token ids outside the vocabulary in the batch: found 0..259"):
        model(torch.tensor([[0, 259]], device=device))
    logits = model(torch.tensor([[0, 258]], device=device))[0]  # the process is still usable
    assert torch.isfinite(logits).all()


@pytest.mark.gpu
def test_model_refuses_token_ids_outside_the_vocabulary_on_cuda():
    _model_refuses_out_of_vocabulary_ids(torch.device("cuda"))


def test_model_refuses_token_ids_outside_the_vocabulary_on_cuda_cpu_twin():
    _model_refuses_out_of_vocabulary_ids(CPU)


def _warm_layer(n, strategy, device, dtype, tokens=512):
    """A layer of ``n`` partitions after two passes (host-memory check, warm-up), its input
    and the pass to observe."""
    config = MoEConfig(d_model=64, d_hidden=128, num_experts=8, top_k=2)
    torch.manual_seed(0)
    x = torch.randn(tokens, 64, device=device, dtype=dtype)
    layer = MPipeMoE(config, partitions=n, strategy=strategy).to(device).to(dtype)

    def one_pass():
        xi = x.clone().requires_grad_(True)
        y, aux = layer(xi)
        (y.float().sum() + aux).backward()
        return y.detach()

    for _ in range(2):
        one_pass()
    return layer, one_pass


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["none", "S3"])
def test_device_waits_per_pass_do_not_grow_with_n(strategy):
    """PyTorch's sync debug mode flags every operation that makes the host wait for the
    GPU; a pass waits the same number of times at n = 1 and n = 8 (tests/moe_engine/test_host_reads.py
    checks the same on CPU by following the reads)."""
    import warnings

    def waits(n):
        _, one_pass = _warm_layer(n, strategy, torch.device("cuda"), torch.bfloat16)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                one_pass()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        # (the mode's own "is a prototype feature" notice is not a wait)
        return [str(w.message).splitlines()[0] for w in caught
                if str(w.message).startswith("called a synchronizing CUDA operation")]

    one, eight = waits(1), waits(8)
    print(f"device waits per pass: n=1 {len(one)}, n=8 {len(eight)}: {one}")
    assert one == [] and eight == [], (one, eight)  # one rank: the layer never reads the device


def test_device_waits_per_pass_do_not_grow_with_n_cpu_twin():
    ys = [_warm_layer(n, "S3", CPU, torch.float32, tokens=32)[1]() for n in (1, 8)]
    torch.testing.assert_close(ys[0], ys[1])  # the same seeded weights and input at n = 1 and 8


def _reference_run(spec, scenario, problem, device, dtype=torch.bfloat16, group=None, stream=None):
    """One forward+backward of engine `spec` on ``device`` (optionally under the CUDA
    `stream`, or with `group` as its expert group); returns (y, dx, w1.grad, w2.grad, layer)."""
    config = scenario.config
    kind, *args = spec.split(":")
    layer: torch.nn.Module
    if kind == "fastmoe":
        layer = FastMoE(config, group, dtype=dtype)
    elif kind == "fastermoe":
        layer = FasterMoE(config, group, group_size=int(args[0]), dtype=dtype)
    else:
        from moe_engine.granularity import GranularitySearch
        n = args[0] if args[0] == "auto" else int(args[0])
        layer = MPipeMoE(config, group, n, args[1], dtype=dtype,
                         search=GranularitySearch(candidates=(1, 2), warmup=0, repeats=1))
    layer = layer.to(device)
    load_params(layer, problem, 0)
    outs = None
    for _ in range(4):  # auto: the search times n = 1 and 2, then settles
        layer.zero_grad(set_to_none=True)
        x = problem.x[0].to(device, dtype).requires_grad_(True)
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                y, aux = layer(x)
                loss = (y.double() * problem.grad_y[0].to(device)).sum() + problem.aux_coef * aux.double()
                loss.backward()
            torch.cuda.current_stream().wait_stream(stream)
        else:
            y, aux = layer(x)
            ((y.double() * problem.grad_y[0].to(device)).sum() + problem.aux_coef * aux.double()).backward()
        outs = (y.detach(), x.grad, layer.experts.w1.grad, layer.experts.w2.grad, layer)
    return outs


NCCL_ENGINES = ["fastmoe", "fastermoe:1", "mpipemoe:auto:auto", "mpipemoe:auto:S3",
                *[f"mpipemoe:3:{s}" for s in ("none", "S1", "S2", "S3", "S4")]]


def _collectives_match_reference(backend, device, init_file, scenarios, dtype, tolerance):
    """The engines' real collectives (count exchange with the pass statistics, every
    All-to-All, the search's and the host check's agreements, the profile's) through a
    process group of one rank; results match the reference."""
    from moe_engine.comm import ExpertGroup

    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=0, world_size=1,
                            device_id=device if device.type == "cuda" else None)
    try:
        for scenario in scenarios:
            problem = make_problem(scenario, 1)
            solve_reference(problem, scenario.config)
            for spec in NCCL_ENGINES:
                group = ExpertGroup(dist.group.WORLD, always_communicate=True)
                outs = _reference_run(spec, scenario, problem, device, dtype, group=group)
                _check_against_reference(f"{scenario.name} {spec} ({backend})", outs, problem, tolerance)
                if spec.startswith("mpipemoe:auto"):
                    assert outs[4].search.cache, f"{spec}: the search did not finish on {backend}"
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_every_collective_goes_through_nccl_on_one_gpu(tmp_path):
    """NCCL rejects CPU tensors: every collective's tensors are on the GPU."""
    device = torch.device("cuda", torch.cuda.current_device())
    _collectives_match_reference("nccl", device, tmp_path / "init", SCENARIOS[:3], torch.bfloat16, 6e-2)


def test_every_collective_goes_through_nccl_on_one_gpu_cpu_twin(tmp_path):
    _collectives_match_reference("gloo", CPU, tmp_path / "init", SCENARIOS[:1], torch.float32, 1e-4)


def _side_stream_runs_match_reference(device, stream, dtype, tolerance):
    """Called under a stream other than the default (as CUDA graph warm-up and micro-batch
    overlap do), the layer orders its side streams against that stream."""
    scenario = SCENARIOS[0]
    problem = make_problem(scenario, 1)
    solve_reference(problem, scenario.config)
    for spec in ["fastmoe", "fastermoe:1", "mpipemoe:4:none", "mpipemoe:4:S1", "mpipemoe:3:S3", "mpipemoe:4:S4"]:
        _check_against_reference(f"{spec} (side stream)",
                                 _reference_run(spec, scenario, problem, device, dtype, stream=stream),
                                 problem, tolerance)


@pytest.mark.gpu
def test_layer_under_a_side_stream_matches_the_reference():
    _side_stream_runs_match_reference(torch.device("cuda"), torch.cuda.Stream(), torch.bfloat16, 6e-2)


def test_layer_under_a_side_stream_matches_the_reference_cpu_twin():
    _side_stream_runs_match_reference(CPU, None, torch.float32, 1e-4)


def _graph_layer_and_input(spec, device, dtype):
    """A layer of ``spec`` (fastmoe or mpipemoe:N:S) and a static input for graph capture."""
    config = MoEConfig(d_model=64, d_hidden=128, num_experts=8, top_k=2)
    kind, *args = spec.split(":")
    torch.manual_seed(0)
    layer = (FastMoE(config) if kind == "fastmoe" else MPipeMoE(config, partitions=int(args[0]), strategy=args[1]))
    return layer.to(device).to(dtype), torch.randn(256, 64, device=device, dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["mpipemoe:1:none", "mpipemoe:4:S4", "fastmoe"])
def test_forward_captured_in_a_cuda_graph_replays_the_eager_output(spec):
    """With one rank and dropless routing the forward reads nothing back from the device,
    so it can be captured in a CUDA graph (after the usual warm-up on a side stream) and
    replayed on new inputs."""
    layer, static_x = _graph_layer_and_input(spec, torch.device("cuda"), torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            layer(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_y, _ = layer(static_x)
    for seed in (1, 2):
        new_x = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(seed))
        static_x.copy_(new_x)
        graph.replay()
        with torch.no_grad():
            eager_y, _ = layer(new_x)
        torch.testing.assert_close(static_y, eager_y)


def test_forward_captured_in_a_cuda_graph_replays_the_eager_output_cpu_twin():
    """On CPU: a forward without autograd repeats itself exactly (what a replay relies on)."""
    for spec in ["mpipemoe:4:S4", "fastmoe"]:
        layer, x = _graph_layer_and_input(spec, CPU, torch.float32)
        with torch.no_grad():
            torch.testing.assert_close(layer(x)[0], layer(x.clone())[0])


def _emulated_exchange(device, rows, width):
    """An emulated 2x4 DGX-A100 group, the device's streams, and an exchange of ``rows`` rows
    of ``width`` bf16 values per peer: (group, streams, send, recv, splits, modelled seconds)."""
    from moe_sim.emulation import EmulatedCluster
    from moe_engine.streams import StreamSet

    group = EmulatedCluster.parse("2x4", "dgx-a100").build()
    streams = StreamSet(device)
    splits = [rows] * group.size
    send = torch.randn(sum(splits), width, device=device, dtype=torch.bfloat16)
    recv = torch.empty_like(send)
    return group, streams, send, recv, splits, group.cluster.all_to_all_s(splits, splits, width * 2)


@pytest.mark.gpu
def test_emulated_all_to_all_holds_the_comm_stream_and_leaves_compute_free():
    """On CUDA an emulated asynchronous All-to-All occupies the communication stream for
    the network's time for its bytes, while the compute stream goes on (issue 16)."""
    group, streams, send, recv, splits, modelled_s = _emulated_exchange(torch.device("cuda"), 16384, 2048)
    assert modelled_s > 5e-3  # long against launch costs, so the check below can tell
    group.all_to_all_async(recv, send, splits, splits, streams).wait()  # warm-up: clock, streams, first launches
    torch.cuda.synchronize()
    start, comm_done, compute_done = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    start.record()
    pending = group.all_to_all_async(recv, send, splits, splits, streams)
    torch.cuda.current_stream().record_event(compute_done)  # nothing queued behind the transfer here
    pending.wait()
    comm_done.record()
    torch.cuda.synchronize()
    assert start.elapsed_time(comm_done) / 1e3 >= 0.9 * modelled_s
    assert start.elapsed_time(compute_done) / 1e3 < 0.5 * modelled_s
    own = send[:splits[0]]
    assert torch.equal(recv[:splits[0]], own) and torch.equal(recv[-splits[0]:], own)


# The wall-clock wait's fixed cost on the device: reading the timer and leaving the spin. The
# host's launch cost is not in it (WallClockWait._timed_wait gives the device a head start: on
# an H100 host the launch took up to 0.45 ms and a 2 ms wait timed 2.45 ms from an idle device).
WAIT_FIXED_COST_S = 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("modelled_ms", [0.5, 2.0, 10.0, 50.0])
def test_emulated_wait_takes_its_modelled_time_whatever_the_clock(modelled_ms):
    """Issue 26: an emulated transfer alone takes its modelled time within 3% plus a fixed
    start cost, after GEMMs have warmed the GPU up (the SM clock falls; the wait must not
    stretch with it); beside GEMMs its dilation is measured and bounded."""
    from moe_sim.emulation import WallClockWait

    wait = WallClockWait()
    device = torch.device("cuda")
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(200):  # ~0.3 s of GEMMs: the clock leaves its idle peak
        a @ a
    torch.cuda.synchronize()
    seconds = modelled_ms / 1e3
    took = sorted(wait._timed_wait(seconds, device) for _ in range(5))[2]
    assert seconds <= took <= 1.03 * seconds + WAIT_FIXED_COST_S
    dilation = wait.measure_dilation(device, seconds=max(seconds, 5e-3))
    assert 0.97 <= dilation["alone"] <= 1.03 + WAIT_FIXED_COST_S / max(seconds, 5e-3)
    assert dilation["beside_gemms"] >= 0.97


@pytest.mark.gpu
def test_emulated_wait_can_hold_several_ctas():
    from moe_sim.emulation import WallClockWait

    wait = WallClockWait(ctas=8)
    took = sorted(wait._timed_wait(5e-3, torch.device("cuda")) for _ in range(3))[1]
    assert 5e-3 <= took <= 1.03 * 5e-3 + WAIT_FIXED_COST_S


def _emulated_group_with_ctas(device, ctas):
    """An emulated 2x2 cluster whose transfers hold ``ctas`` thread blocks, and one exchange."""
    from moe_sim.emulation import EmulatedCluster

    group = EmulatedCluster.parse("2x2", transfer_ctas=ctas).build(keep_log=True)
    send = torch.arange(8 * 4, dtype=torch.float32, device=device).reshape(8, 4)
    recv = torch.empty_like(send)
    group.all_to_all(recv, send, [2] * 4, [2] * 4)
    return group, send, recv


def test_emulated_wait_takes_its_modelled_time_whatever_the_clock_cpu_twin():
    """On CPU the transfers move the rows and wait for nothing (no Triton needed); the wait's
    thread blocks are validated where they are given."""
    from moe_sim.emulation import WallClockWait

    group, send, recv = _emulated_group_with_ctas(CPU, 1)
    assert torch.equal(recv[:2], send[:2]) and group.calls[-1].seconds > 0
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="ctas="):
            WallClockWait(ctas=bad)  # type: ignore[arg-type]  # (the check under test)


def test_emulated_wait_can_hold_several_ctas_cpu_twin():
    group, _, _ = _emulated_group_with_ctas(CPU, 8)
    assert group.clock.ctas == 8 and group.comm_sms == 16  # the SMs real NCCL holds (EmulatedCluster.comm_sms)


def test_emulated_all_to_all_holds_the_comm_stream_and_leaves_compute_free_cpu_twin():
    group, streams, send, recv, splits, modelled_s = _emulated_exchange(CPU, 16, 8)
    assert modelled_s > 0
    group.all_to_all_async(recv, send, splits, splits, streams).wait()
    own = send[:splits[0]]
    assert torch.equal(recv[:splits[0]], own) and torch.equal(recv[-splits[0]:], own)


def _train_three_ways(data_dir: Path, device, backend, init_file, steps=4, batch_size=4, seq_len=None):
    """The worker's Trainer on one rank of a ``backend`` group, for float32, bf16 autocast
    over float32 parameters ("mixed") and pure bf16: the per-step losses and the dtypes of
    the parameters and AdamW state of each."""
    from lm.model import get_preset
    from workers.config import WorkerConfig
    from workers.loop import Trainer

    preset = get_preset("tiny-gpt").replace(vocab_size=259)
    base = WorkerConfig(preset=preset, engine="mpipemoe", partitions=2, strategy="S1", seed=3, lr=3e-3,
                        weight_decay=0.1, warmup_steps=1, grad_clip=1.0, aux_loss_weight=0.01, steps=steps,
                        batch_size=batch_size, seq_len=seq_len or preset.seq_len, data_dir=str(data_dir),
                        shard_dense=False, grad_accum=1)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=0, world_size=1,
                            device_id=device if device.type == "cuda" else None)
    try:
        losses, dtypes = {}, {}
        for name, change in (("fp32", {"dtype": "float32"}), ("mixed", {"dtype": "bfloat16"}),
                             ("pure", {"dtype": "bfloat16", "param_dtype": "bfloat16"})):
            torch.manual_seed(0)
            trainer = Trainer(base.replace(**change), 0, 1, device)
            losses[name] = [trainer.step(step)["lm_loss"] for step in range(1, steps + 1)]
            state = [t for s in trainer.optimizer.state.values() for t in s.values() if t.dim()]
            dtypes[name] = {t.dtype for t in [*trainer.model.parameters(), *state]}
    finally:
        dist.destroy_process_group()
    return losses, dtypes


@pytest.mark.gpu
def test_trainer_on_cuda_keeps_float32_master_weights_under_bf16_compute(tmp_path):
    """The worker's Trainer on one GPU with an NCCL group: bf16 autocast compute (the experts'
    grouped GEMMs included) over float32 parameters and AdamW state stays near float32
    compute; pure bf16 parameters train too. MFU is reported on known GPUs."""
    from lm.data import prepare_dataset
    from lm.model import get_preset
    from workers.loop import model_flops_metrics

    prepare_dataset(tmp_path / "data", max_bytes=2**18, row_len=1024)
    device = torch.device("cuda", torch.cuda.current_device())
    losses, dtypes = _train_three_ways(tmp_path / "data", device, "nccl", tmp_path / "init")
    assert dtypes == {"fp32": {torch.float32}, "mixed": {torch.float32}, "pure": {torch.bfloat16}}
    assert losses["mixed"] == pytest.approx(losses["fp32"], rel=3e-2) and losses["mixed"] != losses["fp32"]
    assert losses["pure"] == pytest.approx(losses["fp32"], rel=5e-2)
    metrics = model_flops_metrics(1e5, get_preset("tiny-gpt"), device, "bfloat16")
    if any(part in torch.cuda.get_device_name(device) for part in ("H100", "H200", "A100")):
        assert 0 < metrics["mfu"] < 1


def _graph_training_step(strategy, device, dtype):
    """One rank, n = 2: a layer, its static input and output gradient, and a step that runs
    forward + backward and returns the output and the gradients of the input and parameters."""
    config = MoEConfig(d_model=64, d_hidden=128, num_experts=8, top_k=2, activation="swiglu")
    torch.manual_seed(0)
    layer = MPipeMoE(config, partitions=2, strategy=strategy).to(device=device, dtype=dtype)
    params = list(layer.parameters())
    static_x = torch.randn(256, 64, device=device, dtype=dtype, requires_grad=True)
    static_dy = torch.randn(256, 64, device=device, dtype=dtype)

    def step(x, dy):
        y, aux = layer(x)
        return (y, *torch.autograd.grad([y, aux], [x] + params, [dy, torch.ones_like(aux)]))

    return step, static_x, static_dy


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["none", "S1", "S2", "S3", "S4"])
def test_training_step_captured_in_a_cuda_graph_replays_eager_or_is_refused(strategy):
    """One rank, n = 2: forward + backward captured in one CUDA graph replays the eager
    output and gradients on new inputs (none, S4); an offloading strategy (S1–S3) is refused
    with an error naming why, before it touches host memory."""
    step, static_x, static_dy = _graph_training_step(strategy, torch.device("cuda"), torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(static_x, static_dy)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    if strategy in ("S1", "S2", "S3"):
        with pytest.raises(RuntimeError, match=f"strategy {strategy} cannot be captured in a CUDA graph"):
            with torch.cuda.graph(graph):
                step(static_x, static_dy)
        return
    with torch.cuda.graph(graph):
        static_out = step(static_x, static_dy)
    for seed in (1, 2):
        g = torch.Generator("cuda").manual_seed(seed)
        new_x = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16, generator=g)
        new_dy = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16, generator=g)
        with torch.no_grad():
            static_x.copy_(new_x)
            static_dy.copy_(new_dy)
        graph.replay()
        eager = step(new_x.requires_grad_(True), new_dy)
        for got, want in zip(static_out, eager):
            torch.testing.assert_close(got, want)


def test_training_step_captured_in_a_cuda_graph_replays_eager_or_is_refused_cpu_twin():
    """The step the capture records, eagerly on CPU: every strategy gives the same output and
    gradients (outside a capture nothing is refused)."""
    results = {}
    for strategy in ("none", "S1", "S2", "S3", "S4"):
        step, x, dy = _graph_training_step(strategy, CPU, torch.float32)
        results[strategy] = step(x, dy)
    for strategy, out in results.items():
        for got, want in zip(out, results["none"]):
            torch.testing.assert_close(got, want, msg=strategy)


def test_trainer_on_cuda_keeps_float32_master_weights_under_bf16_compute_cpu_twin(tmp_path):
    """On CPU (one gloo rank): the same three Trainers keep their parameter dtypes and train
    (tests/workers/test_training_parallel.py compares the losses on two ranks)."""
    from lm.data import prepare_dataset

    prepare_dataset(tmp_path / "data", max_bytes=2**16, row_len=1024)
    losses, dtypes = _train_three_ways(tmp_path / "data", CPU, "gloo", tmp_path / "init", steps=2, batch_size=2,
                                       seq_len=32)
    assert dtypes == {"fp32": {torch.float32}, "mixed": {torch.float32}, "pure": {torch.bfloat16}}
    assert losses["mixed"] != losses["fp32"]  # autocast is on
    assert all(math.isfinite(v) for run in losses.values() for v in run)


def _capture_case(case, device):
    """(layer, input, autocast dtype or None) of a configuration whose capture the layer
    refuses on CUDA (the grouped kernel cannot run its GEMMs; mixed precision where this
    torch's grouped kernel cannot write float32 weight gradients)."""
    d_model, dtype, autocast = {"mixed": (64, torch.float32, torch.bfloat16), "fp32": (64, torch.float32, None),
                                "unaligned": (60, torch.bfloat16, None)}[case]
    config = MoEConfig(d_model=d_model, d_hidden=128, num_experts=8, top_k=2, activation="swiglu")
    torch.manual_seed(0)
    layer = MPipeMoE(config, partitions=2, strategy="S4").to(device=device, dtype=dtype)
    x = torch.randn(256, d_model, device=device, dtype=dtype, requires_grad=True)
    return layer, x, autocast


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["mixed", "fp32", "unaligned"])
def test_a_capture_whose_experts_read_counts_on_the_host_is_refused_up_front(case):
    """float32 master weights under bf16 autocast (where torch's grouped kernel cannot write
    float32), float32 experts, widths the grouped kernel cannot take: the weight gradients
    (or every GEMM) run per expert and read the counts on the host, which aborts a capture.
    The layer refuses before any such read, with one line naming why; where this torch's
    kernel writes float32 (mixed) the capture replays the eager step instead."""
    from moe_engine.experts import _grouped_kernel_widens

    layer, x, autocast = _capture_case(case, torch.device("cuda"))
    params = list(layer.parameters())

    def step():
        with torch.autocast("cuda", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            y, aux = layer(x)
        return (y, *torch.autograd.grad([y.float().sum(), aux], [x] + params))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager = step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    if case == "mixed" and _grouped_kernel_widens("cuda") and torch.cuda.get_device_capability()[0] in (9, 10):
        with torch.cuda.graph(graph):
            captured = step()
        graph.replay()
        for got, want in zip(captured, eager):
            torch.testing.assert_close(got, want)
        return
    with pytest.raises(RuntimeError, match=r"^this MoE layer cannot be captured in a CUDA graph: [^\n]+$"):
        with torch.cuda.graph(graph):
            step()


def test_a_capture_whose_experts_read_counts_on_the_host_is_refused_up_front_cpu_twin():
    """The reasons the layer gives (`capture_refusal`), on CPU: float64 and unaligned widths
    have no grouped kernel; float32 under bf16 autocast upcasts on CPU (no host reads);
    several ranks read their count tables on the host whatever the dtype."""
    layer, x, _ = _capture_case("fp32", CPU)
    assert layer.capture_refusal(x) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer.capture_refusal(x) is None
    assert "float64 rows" in layer.double().capture_refusal(x.double())
    odd_layer = MPipeMoE(MoEConfig(d_model=6, d_hidden=128, num_experts=8, top_k=2))
    assert "widths 6 and 128" in odd_layer.capture_refusal(torch.randn(4, 6))
    layer.group.group, layer.group.size = object(), 2  # as a two-rank group looks (no collective runs)
    assert "2 ranks exchange their row counts" in layer.float().capture_refusal(x)


def _sync_free_capacity_on_one_rank(backend, device, init_file, dtype, tolerance, capture):
    """The sync-free capacity mode through a process group of one rank (its All-to-Alls
    really run): a training step equals the dropless exchange's where nothing overflows,
    makes no host-device synchronisation in a steady pass (CUDA's sync debug mode) and,
    ``capture``, a CUDA graph of the whole step replays the eager step on new inputs."""
    import warnings

    from moe_engine.comm import ExpertGroup

    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=0, world_size=1,
                            device_id=device if device.type == "cuda" else None)
    try:
        config = MoEConfig(d_model=64, d_hidden=128, num_experts=8, top_k=2, activation="swiglu")
        group = ExpertGroup(dist.group.WORLD, always_communicate=True)
        torch.manual_seed(0)
        layer = MPipeMoE(config, group, partitions=2, strategy="S4", sync_free_capacity=4.0).to(device, dtype)
        params = list(layer.parameters())
        static_x = torch.randn(256, 64, device=device, dtype=dtype, requires_grad=True)
        static_dy = torch.randn(256, 64, device=device, dtype=dtype)

        def step(x, dy):
            y, aux = layer(x)
            return (y, *torch.autograd.grad([y, aux], [x] + params, [dy, torch.ones_like(aux)]))

        capacity = step(static_x, static_dy)
        with layer.dropless():
            dropless = step(static_x, static_dy)
        for got, want in zip(capacity, dropless):
            torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)
        assert int(layer.overflowed) == 0 and int(layer.nonfinite_inputs) == 0
        if device.type != "cuda":
            return
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step(static_x, static_dy)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        waits = [str(w.message).splitlines()[0] for w in caught
                 if str(w.message).startswith("called a synchronizing CUDA operation")]
        assert waits == [], waits
        if not capture:
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step(static_x, static_dy)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = step(static_x, static_dy)
        for seed in (1, 2):
            g = torch.Generator(device).manual_seed(seed)
            with torch.no_grad():
                static_x.copy_(torch.randn(256, 64, device=device, dtype=dtype, generator=g))
                static_dy.copy_(torch.randn(256, 64, device=device, dtype=dtype, generator=g))
            graph.replay()
            eager = step(static_x.detach().clone().requires_grad_(True), static_dy)
            for got, want in zip(static_out, eager):
                torch.testing.assert_close(got, want)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_sync_free_capacity_step_matches_dropless_without_syncs_and_is_captured(tmp_path):
    device = torch.device("cuda", torch.cuda.current_device())
    _sync_free_capacity_on_one_rank("nccl", device, tmp_path / "init", torch.bfloat16, 2e-2, capture=True)


def test_sync_free_capacity_step_matches_dropless_without_syncs_and_is_captured_cpu_twin(tmp_path):
    _sync_free_capacity_on_one_rank("gloo", CPU, tmp_path / "init", torch.float32, 1e-5, capture=False)
