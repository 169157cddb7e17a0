"""Tier 1 (one process, no process group): the micro-batch schedules of workers/schedules.py.
The gloo tiers are tests/moe_engine/test_micro_batches.py (every engine x n x strategy
against the reference, 2 and 4 ranks) and tests/workers/test_training_parallel.py (the
trainer's losses, 2 ranks)."""
from __future__ import annotations

import contextlib
import threading
from typing import Any

import pytest
import torch
from torch import nn

from lm.model import MoETransformer, get_preset, leanest_moe_memory
from moe_engine.layers import MoELayerBase
from workers.config import WorkerConfig
from workers.schedules import (Lanes, ScheduleError, choose_schedule, forward_backward, overlap_refusal, profiler_config,
                               trace_mark)


class _Gate(torch.autograd.Function):
    """Identity whose backward waits (up to 20 s) for ``event``: a backward that can only end
    once a later micro-batch's forward has run. ``seen``: whether each backward saw it."""

    seen: list[bool] = []

    @staticmethod
    def forward(ctx, x, event):
        ctx.event = event
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.saw_event = ctx.event.wait(timeout=20)
        _Gate.seen.append(ctx.saw_event)
        return grad, None


def _toy():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 1))


def test_overlapped_runs_the_next_forward_beside_the_backward():
    """Backward of micro-batch k waits for the forward of k+1 to start: it ends only under the
    overlapped schedule (the forward of k+1 is issued while backward k runs on the helper
    thread); the gradients equal the sequential schedule's."""
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    started = [threading.Event() for _ in xs]

    def loss_of(module, k):
        started[k].set()
        gate = started[k + 1] if k + 1 < len(xs) else started[k]
        return _Gate.apply(module(xs[k]), gate).square().sum(), k

    _Gate.seen = []
    model = _toy()
    lanes = Lanes.create(model)
    assert forward_backward(model, range(3), loss_of, schedule="overlapped", lanes=lanes) == [0, 1, 2]
    assert _Gate.seen == [True, True, True]
    overlapped = [p.grad.clone() for p in model.parameters()]
    lanes.close()

    reference = _toy()
    for k in range(3):
        reference(xs[k]).square().sum().backward()
    for got, want in zip(overlapped, (p.grad for p in reference.parameters())):
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same sums in the same order


def test_a_failing_forward_waits_for_the_backward_in_flight_and_names_the_micro_batch():
    model, finished = _toy(), []

    def loss_of(module, k):
        if k == 1:
            raise ValueError("bad batch")
        loss = module(torch.ones(2, 4)).sum()
        loss.register_hook(lambda g: finished.append(k))
        return loss, k

    lanes = Lanes.create(model)
    with pytest.raises(ScheduleError, match="micro-batch 1 forward: ValueError: bad batch") as caught:
        forward_backward(model, range(3), loss_of, schedule="overlapped", lanes=lanes)
    assert isinstance(caught.value.__cause__, ValueError) and caught.value.phase == "forward"
    assert finished == [0]  # backward 0 finished before the error came out
    lanes.close()


def test_the_moe_layers_get_a_lane_each_and_forward_on_it():
    model = MoETransformer(get_preset("tiny-gpt"), engine="mpipemoe", partitions=2, strategy="S1")
    lanes = Lanes.create(model)
    layer = model.moe_layers()[0]
    assert len(lanes.layers) == len(model.moe_layers()) and layer.lanes == 2
    own = layer.group, layer._streams
    with lanes.lane(1):
        assert layer.group is not own[0] and layer._streams is not own[1] and layer.planner.group is layer.group
    assert (layer.group, layer._streams) == own and layer.planner.group is own[0]
    with pytest.raises(ValueError, match="lane 2 does not exist"):
        with layer.lane(2):
            pass
    lanes.close()


def test_schedule_arguments_are_checked():
    model = _toy()
    loss_of = lambda module, k: (module(torch.ones(1, 4)).sum(), k)  # noqa: E731
    with pytest.raises(ValueError, match="schedule='pipelined' is unknown"):
        forward_backward(model, range(2), loss_of, schedule="pipelined")
    with pytest.raises(ValueError, match="needs lanes"):
        forward_backward(model, range(2), loss_of, schedule="overlapped")
    # one micro-batch: nothing to overlap, the sequential schedule (no lanes needed)
    assert forward_backward(model, range(1), loss_of, schedule="overlapped") == [0]
    with pytest.raises(ValueError, match="count=1 is invalid"):
        Lanes(model, count=1)


def test_profiler_ranges_name_each_micro_batch_phase():
    model = _toy()
    lanes = Lanes.create(model)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                experimental_config=profiler_config()) as prof:
        forward_backward(model, range(2), lambda module, k: (module(torch.ones(2, 4)).sum(), k),
                         schedule="overlapped", lanes=lanes)
    names = {event.name for event in prof.events()}
    lanes.close()
    assert {trace_mark(k, phase) for k in range(2) for phase in ("forward", "backward")} <= names


def test_auto_overlaps_two_or_more_micro_batches_that_fit_the_budget():
    preset = get_preset("tiny-gpt")
    tokens = 2 * preset.seq_len
    one, _, _ = leanest_moe_memory(preset, tokens, 2, torch.float32)
    two, _, _ = leanest_moe_memory(preset, tokens, 2, torch.float32, in_flight=2)
    assert two == 2 * one

    def choose(choice: str, micro_batches: int, **change: Any) -> tuple[str, str]:
        return choose_schedule(choice, micro_batches, preset=preset, tokens=tokens, world_size=2,
                               dtype=torch.float32, **change)

    assert choose("auto", 2, budget_bytes=two)[0] == "overlapped"
    assert choose("auto", 2)[0] == "overlapped"  # no budget: nothing to keep within
    schedule, why = choose("auto", 2, budget_bytes=two - 1)
    assert schedule == "sequential" and "over the" in why  # one in flight fits, two do not
    assert choose("auto", 1)[0] == "sequential"
    assert choose("auto", 4, shard_dense=True)[0] == "sequential"
    assert choose("overlapped", 1)[0] == "overlapped"  # (runs sequentially: M = 1)


def test_worker_config_checks_the_schedule():
    base: dict[str, Any] = dict(preset=get_preset("tiny-gpt"), engine="mpipemoe", data_dir="/data")
    with pytest.raises(ValueError, match="micro_batch_schedule='1f1b' is invalid: choose one of sequential, "
                                         "overlapped, auto"):
        WorkerConfig(**base, micro_batch_schedule="1f1b")
    with pytest.raises(ValueError, match="FSDP2"):
        WorkerConfig(**base, micro_batch_schedule="overlapped", shard_dense=True)
    assert WorkerConfig(**base, micro_batch_schedule="auto", shard_dense=True).micro_batch_schedule == "auto"


def test_the_overlapped_schedule_is_refused_where_both_lanes_share_one_hardware_queue(monkeypatch):
    """CUDA_DEVICE_MAX_CONNECTIONS=1 on CUDA: one lane's All-to-All waiting for its peers would
    hold up the other lane's kernels. "overlapped" is refused naming it, "auto" falls back."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in overlap_refusal(cuda, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert overlap_refusal(cuda, {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}) is None
    assert overlap_refusal(cuda, {}) is None
    assert overlap_refusal(cpu, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}) is None  # (one queue matters on CUDA only)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with pytest.raises(ValueError, match=r"micro_batch_schedule='overlapped' is refused: CUDA_DEVICE_MAX_CONNECTIONS"
                                         r"=1 .* use the sequential micro-batch schedule"):
        choose_schedule("overlapped", 2, device=cuda)
    schedule, why = choose_schedule("auto", 2, device=cuda)
    assert schedule == "sequential" and why.startswith("CUDA_DEVICE_MAX_CONNECTIONS=1")
    assert choose_schedule("auto", 2, device=cpu)[0] == "overlapped"
    assert choose_schedule("sequential", 2, device=cuda)[0] == "sequential"


def test_kernel_probes_run_before_the_overlapped_section_and_host_cache_release_waits_for_its_end(monkeypatch):
    """Inside the overlapped section two threads launch work: the expert kernels' probes (which
    switch CUDA's process-wide sync-debug mode) ran before it, on the calling thread, and a
    pinned host cache release (a device wait) is deferred until it ends."""
    from moe_engine import memory
    from workers import schedules

    events: list[str] = []
    monkeypatch.setattr(schedules, "resolve_kernel_probes",
                        lambda device: events.append(f"probe on {threading.current_thread().name}"))
    monkeypatch.setattr(memory, "empty_host_cache", lambda: events.append("host cache emptied"))
    model = MoETransformer(get_preset("tiny-gpt"), engine="mpipemoe", partitions=2, strategy="S1")
    layer = model.moe_layers()[0]
    assert isinstance(layer, MoELayerBase)
    pool = layer.host_pool
    lanes = Lanes.create(model)
    pinned: list[torch.Tensor] = []
    monkeypatch.setattr(pool, "_is_pinned", lambda buffer: True)  # CPU buffers counted as pinned blocks

    def loss_of(module, k):
        events.append(f"forward {k}")
        buffer = pool.take(1 << (12 + 4 * k), torch.float32, pin=False)  # each larger: the older one is dropped
        pool.give_back(buffer)
        pinned.append(buffer)
        return module(torch.zeros(1, 8, dtype=torch.long))[0].sum(), k

    forward_backward(model, range(3), loss_of, schedule="overlapped", lanes=lanes)
    lanes.close()
    assert events[0] == f"probe on {threading.current_thread().name}" and events[1] == "forward 0"
    assert events[-1] == "host cache emptied" and events.count("host cache emptied") == 1, events


def test_the_sm_carve_out_is_held_only_while_both_threads_launch_work(monkeypatch):
    """From backward 0 to the last forward (two threads launch GEMMs): held. Forward 0 (where a
    layer measures its hardware profile) and the last backward run alone, on every SM; it is
    entered and left while the helper thread is idle."""
    model = _toy()
    lanes = Lanes.create(model)
    state = {"held": False, "entered": 0}
    seen: list[tuple[str, int, bool]] = []

    @contextlib.contextmanager
    def holding():
        state["held"], state["entered"] = True, state["entered"] + 1
        try:
            yield
        finally:
            state["held"] = False

    backward = lanes.backward

    def logged_backward(loss, k):
        seen.append(("backward", k, bool(state["held"])))
        backward(loss, k)

    monkeypatch.setattr(lanes, "holding_sms", holding)
    monkeypatch.setattr(lanes, "backward", logged_backward)

    def loss_of(module, k):
        seen.append(("forward", k, bool(state["held"])))
        return module(torch.randn(3, 4)).square().sum(), k

    forward_backward(model, range(4), loss_of, schedule="overlapped", lanes=lanes)
    lanes.close()
    held = {(phase, k): on for phase, k, on in seen}
    assert held == {("forward", 0): False, ("forward", 1): True, ("forward", 2): True, ("forward", 3): True,
                    ("backward", 0): True, ("backward", 1): True, ("backward", 2): True, ("backward", 3): False}
    assert state == {"held": False, "entered": 1}


def test_one_rank_per_expert_group_leaves_no_sms_to_communication(monkeypatch):
    """At world size 1 no All-to-All runs beside the GEMMs: nothing is held (CUDA), even with
    the layers' comm_sms set."""
    from types import SimpleNamespace

    from workers import schedules

    model = MoETransformer(get_preset("tiny-gpt"), engine="mpipemoe", partitions=2, strategy="none")
    lanes = Lanes.create(model)
    counts: list[int] = []
    monkeypatch.setattr(lanes, "streams", [SimpleNamespace(device=torch.device("cpu"))])  # as on CUDA
    monkeypatch.setattr(schedules, "holding_sm_carveout", lambda device, count: counts.append(count)
                        or contextlib.nullcontext())
    assert all(layer.group.size == 1 and layer.group.comm_sms > 0 for layer in lanes.layers)
    with lanes.holding_sms():
        pass
    lanes.close()
    assert counts == [0]


def _overlapped_step_probes(device: torch.device) -> tuple[list, int]:
    """Three overlapped micro-batches of tiny-gpt under autocast on ``device``: at each forward
    (probes cached, CUDA's sync-debug mode), and the widening probe's misses."""
    from moe_engine.experts import _grouped_kernel_widens

    _grouped_kernel_widens.cache_clear()
    model = MoETransformer(get_preset("tiny-gpt"), engine="mpipemoe", partitions=2, strategy="S1").to(device)
    lanes = Lanes.create(model)
    tokens_BS = torch.zeros(2, 16, dtype=torch.long, device=device)
    seen: list[tuple[int, int]] = []  # (probes cached, sync-debug mode) at each forward

    def loss_of(module, k):
        seen.append((_grouped_kernel_widens.cache_info().currsize,
                     torch.cuda.get_sync_debug_mode() if device.type == "cuda" else 0))
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits_BSV, aux_loss = module(tokens_BS)
        return logits_BSV.float().square().mean() + aux_loss.float(), k

    forward_backward(model, range(3), loss_of, schedule="overlapped", lanes=lanes)
    lanes.close()
    return seen, _grouped_kernel_widens.cache_info().misses


@pytest.mark.gpu
def test_an_overlapped_bf16_step_on_cuda_probes_the_kernels_before_its_first_forward():
    """The widening grouped kernel's probe (first needed by a bf16 backward, on the helper
    thread) has run on the calling thread before the first forward, and no forward sees
    CUDA's process-wide sync-debug mode switched."""
    seen, misses = _overlapped_step_probes(torch.device("cuda"))
    assert seen == [(1, 0)] * 3
    assert misses == 1


def test_an_overlapped_bf16_step_on_cuda_probes_the_kernels_before_its_first_forward_cpu_twin():
    seen, misses = _overlapped_step_probes(torch.device("cpu"))
    assert seen == [(0, 0)] * 3 and misses == 0  # three forwards ran; the CPU's kernels need no probe
