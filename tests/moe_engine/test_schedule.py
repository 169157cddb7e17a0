"""The engine runs exactly the schedule schedule.py describes: every operation, its
partition, its stream, in order, for every engine, partition count and strategy, on one
rank and on two gloo ranks. The simulator and the performance model price that same
description (tests/moe_sim/test_simulator.py, tests/moe_engine/test_perf_model.py).

FastMoE runs the schedule with one partition and "none"; FasterMoE with one partition
per peer group (ceil(ranks / group_size) steps, each exchanging with its peers only) and
"none": its stepped schedule is the pipeline's, the partitions being peer groups instead
of token ranges (there is no shadowing).
"""
from __future__ import annotations

import contextlib
import functools
import subprocess
import sys
from typing import Any

import pytest
import torch

from moe_engine import MoEConfig, layers
from moe_engine.config import STRATEGIES
from moe_engine.memory import RestorePolicy
from moe_engine.pipeline import PipelineRun
from moe_engine.schedule import backward_schedule, forward_schedule
from tests.distributed import run_on_ranks
from tests.engine_cases import build_engine

ENGINES = (["fastmoe", "fastermoe:1", "fastermoe:2"]
           + [f"mpipemoe:{n}:{s}" for n in (1, 2, 4) for s in STRATEGIES])


def _recorded(rank: int, world_size: int) -> dict:
    """Per engine: (partitions, strategy, the operations recorded in forward and backward)."""
    config = MoEConfig(8, 12, 4, top_k=2, activation="swiglu")
    out = {}
    for spec in ENGINES:
        torch.manual_seed(0)
        layer = build_engine(spec, config, dtype=torch.float32)
        x = torch.randn(16 + rank, config.d_model, requires_grad=True)
        recorded: list = []
        real = layers.PipelineRun  # type: ignore[attr-defined]  # (the name layers.py looks up)
        layers.PipelineRun = functools.partial(PipelineRun, recorder=recorded)  # type: ignore[attr-defined]  # (patched for this pass)
        try:
            y, aux = layer(x)
            y.sum().backward()
        finally:
            layers.PipelineRun = real  # type: ignore[attr-defined]  # (restored)
        partitions = getattr(layer, "steps", None) or (int(spec.split(":")[1]) if "mpipemoe" in spec else 1)
        out[spec] = (partitions, layer.last_strategy, recorded)
    return out


def _expected(partitions: int, strategy: str, several: bool) -> list:
    policy = RestorePolicy.of(strategy)
    ops = forward_schedule(partitions, policy, several) + backward_schedule(partitions, policy, several)
    return [(op.name, op.partition, op.stream) for op in ops]


def _check(results: list, several: bool) -> None:
    for rank, per_engine in enumerate(results):
        for spec, (partitions, strategy, recorded) in per_engine.items():
            if spec.startswith("mpipemoe"):
                assert strategy == spec.split(":")[2], (spec, strategy)
            assert recorded == _expected(partitions, strategy, several), f"rank {rank}, {spec}"


@pytest.mark.gloo
def test_one_rank_runs_the_schedule():
    _check(run_on_ranks(1, _recorded), several=False)


@pytest.mark.gloo
def test_two_ranks_run_the_schedule():
    results = run_on_ranks(2, _recorded)
    assert {spec: r[0] for spec, r in results[0].items()}["fastermoe:1"] == 2  # two steps of one peer
    _check(results, several=True)


def test_schedule_waits_only_for_earlier_operations_and_reuses_two_slots():
    for several in (False, True):
        for strategy in STRATEGIES:
            policy = RestorePolicy.of(strategy)
            for ops in (forward_schedule(4, policy, several), backward_schedule(4, policy, several)):
                assert all(max(op.after, default=-1) < k for k, op in enumerate(ops))
                assert {op.slot for op in ops} == {0, 1}


def test_recorder_is_off_by_default():
    assert PipelineRun.__dataclass_fields__["recorder"].default is None


def test_the_engine_never_imports_the_simulator():
    code = ("import pkgutil, importlib, sys, moe_engine\n"
            "for m in pkgutil.iter_modules(moe_engine.__path__): importlib.import_module('moe_engine.' + m.name)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'moe_sim'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


class _CarveOutRecorder:
    """Stands in for a StreamSet in `pipeline._execute`: holds the SMs reserved around the
    operation being issued (0 outside `reserving_sms`)."""

    def __init__(self):
        self.holding = 0

    @contextlib.contextmanager
    def reserving_sms(self, count):
        self.holding = count
        try:
            yield
        finally:
            self.holding = 0


def _reserved_per_op(ops):
    from moe_engine.pipeline import _execute
    from moe_engine.streams import Pending

    streams = _CarveOutRecorder()
    reserved = {}

    def handler(op):
        reserved[op.name, op.partition] = streams.holding
        return Pending.done()
    _execute(ops, {op.name: handler for op in ops}, streams, reserved_sms=16)  # type: ignore[arg-type]  # (a recording stand-in)
    return reserved


def test_the_sm_carve_out_is_on_only_while_an_all_to_all_is_in_flight():
    """A compute operation reserves SMs for communication only when an All-to-All was issued
    and not yet waited for (it may run beside it): not at the pass's fill (the first gather),
    not with one partition (its experts wait for the only dispatch), never on one rank, and
    never for a side-stream operation."""
    policy = RestorePolicy.of("S4")
    forward = _reserved_per_op(forward_schedule(3, policy, several=True))
    assert forward[("gather", 0)] == 0
    assert [forward[("experts", i)] for i in range(3)] == [16, 16, 16]
    assert forward[("dispatch", 1)] == forward[("combine", 2)] == 0
    assert _reserved_per_op(forward_schedule(1, policy, several=True))[("experts", 0)] == 0
    assert set(_reserved_per_op(forward_schedule(3, policy, several=False)).values()) == {0}
    backward = _reserved_per_op(backward_schedule(3, policy, several=True))
    assert [backward[("dgrad", i)] for i in range(3)] == [16, 16, 16]
    assert backward[("wgrad", 0)] == 16  # partition 0's dx travels beside its weight gradients
    assert backward[("fetch_dy", 2)] == 0


def test_inside_a_held_carve_out_no_lane_writes_the_process_wide_settings_cpu_twin(monkeypatch):
    """Issue 39 (seen on an H100: "bad optional access" in the overlapped step bench; torch
    reads the carve-out at each GEMM's launch without a lock, and the other lane's thread
    unset it meanwhile). The overlapped schedule holds one carve-out, with cuBLASLt, for its
    whole section: the lanes' reservations and the per-expert loops' BLAS choice inside write
    neither setting, and the caller's come back after. Outside a hold a reservation sets the
    carve-out (clamped) and unsets it; a caller's carve-out is left as it is. The
    process-wide knobs and the device's SM count are stood in for (CPU)."""
    from types import SimpleNamespace

    from moe_engine.streams import StreamSet, holding_sm_carveout, honouring_sm_carveout

    knob: dict[str, Any] = {"carve_out": None, "blas": torch._C._BlasBackend.Cublas}
    writes: list[tuple[str, Any]] = []

    def set_carve_out(value):
        writes.append(("carve_out", value))
        knob["carve_out"] = value

    def blas_library(backend=None):
        if backend is not None:
            writes.append(("blas", backend))
            knob["blas"] = torch._C._BlasBackend.Cublaslt if backend == "cublaslt" else backend
        return knob["blas"]

    monkeypatch.setattr(torch._C, "_get_sm_carveout_experimental", lambda: knob["carve_out"], raising=False)
    monkeypatch.setattr(torch._C, "_set_sm_carveout_experimental", set_carve_out, raising=False)
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", blas_library)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    lane_a, lane_b = StreamSet(torch.device("cpu")), StreamSet(torch.device("cpu"))
    lane_a.is_cuda = lane_b.is_cuda = True
    for caller in (None, 8):
        knob["carve_out"] = caller
        with holding_sm_carveout(torch.device("cuda"), 16):
            assert knob == {"carve_out": 16, "blas": torch._C._BlasBackend.Cublaslt}
            writes.clear()
            with lane_a.reserving_sms(16), lane_b.reserving_sms(16), honouring_sm_carveout():
                assert knob["carve_out"] == 16
            with lane_b.reserving_sms(16), honouring_sm_carveout():
                pass
            assert writes == []
        assert knob == {"carve_out": caller, "blas": torch._C._BlasBackend.Cublas}
    knob["carve_out"] = None
    with lane_a.reserving_sms(10**6):
        assert knob["carve_out"] == 131
        with honouring_sm_carveout():
            assert knob["blas"] == torch._C._BlasBackend.Cublaslt
        assert knob["blas"] == torch._C._BlasBackend.Cublas
    assert knob["carve_out"] is None
    knob["carve_out"] = 8
    writes.clear()
    with lane_a.reserving_sms(16):
        assert knob["carve_out"] == 8
    assert writes == [] and knob["carve_out"] == 8
    with holding_sm_carveout(torch.device("cpu"), 16), holding_sm_carveout(torch.device("cuda"), 0):
        assert writes == []  # off CUDA, or nothing to leave: nothing set


def test_the_sm_carve_out_is_clamped_to_leave_the_gemms_an_sm():
    from moe_engine.streams import sm_carveout

    assert [sm_carveout(count, 132) for count in (0, -3, 16, 131, 132, 10**6)] == [None, None, 16, 131, 131, 131]


@pytest.mark.gpu
def test_the_sm_carve_out_is_clamped_restored_and_the_per_expert_loop_honours_it():
    """On CUDA: a count past the GPU's SMs leaves one; the caller's setting comes back; the
    per-expert GEMMs run on cuBLASLt (which targets the SMs left) while it is on, with the
    same numbers as without."""
    from moe_engine.experts import ExpertSegments, grouped_weight_grad
    from moe_engine.streams import StreamSet, honouring_sm_carveout, sm_carveout_available

    if not sm_carveout_available():
        pytest.skip("this torch has no SM carve-out")
    device = torch.device("cuda")
    streams = StreamSet(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    seg = ExpertSegments.from_counts([100, 0, 37, 300], device)
    x_NI, dy_NO = torch.randn(437, 64, device=device), torch.randn(437, 96, device=device)  # float32: per expert
    plain = grouped_weight_grad(x_NI, dy_NO, seg)
    library = torch.backends.cuda.preferred_blas_library()
    with streams.reserving_sms(10**6):
        assert torch._C._get_sm_carveout_experimental() == sms - 1
        carved = grouped_weight_grad(x_NI, dy_NO, seg)
        with honouring_sm_carveout():
            assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublaslt
    assert torch._C._get_sm_carveout_experimental() is None
    assert torch.backends.cuda.preferred_blas_library() == library
    # cuBLASLt and cuBLAS may sum a float32 product in another order: the same numbers to float32 rounding
    torch.testing.assert_close(carved, plain, rtol=1e-4, atol=1e-4)


def test_the_sm_carve_out_is_clamped_restored_and_the_per_expert_loop_honours_it_cpu_twin():
    """The GPU test's weight gradients on CPU: the same numbers inside a reservation (a
    no-op on CPU) as without."""
    from moe_engine.experts import ExpertSegments, grouped_weight_grad
    from moe_engine.streams import StreamSet

    device = torch.device("cpu")
    streams = StreamSet(device)
    seg = ExpertSegments.from_counts([100, 0, 37, 300], device)
    x_NI, dy_NO = torch.randn(437, 64), torch.randn(437, 96)
    plain = grouped_weight_grad(x_NI, dy_NO, seg)
    with streams.reserving_sms(10**6):
        carved = grouped_weight_grad(x_NI, dy_NO, seg)
    assert torch.equal(plain, carved)
