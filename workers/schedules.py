"""The micro-batch schedules of a training step: M micro-batches' forwards and backwards.

    lanes = Lanes.create(parallel.model)                 # collective, once (overlapped only)
    records = forward_backward(parallel, range(M), loss_of, schedule="overlapped", lanes=lanes)

``loss_of(module, item)`` runs one micro-batch's forward on ``module`` and returns
``(loss, record)``: the loss to back-propagate (already scaled, e.g. by 1/M) and whatever
the caller wants back for it (detached losses, say); ``forward_backward`` returns the
records in micro-batch order, with every gradient accumulated and the dense gradients
reduced over ranks. No Ray, no MLflow: the trainer (workers/loop.py) and the step
benchmark call it alike.

Schedules (``SCHEDULES``):

- "sequential": forward k, backward k, forward k+1, ... One micro-batch in flight; DDP /
  FSDP2 reduce the dense gradients in the last micro-batch's backward (``parallel.sync``).
- "overlapped": the forward of micro-batch k+1 runs beside the backward of micro-batch k,
  so that one's All-to-Alls hide behind the other's attention and expert GEMMs:

      main thread:    F0 | F1 (lane 1)  | F2 (lane 0)  | ... | F(M-1)       |
      helper thread:     | B0 (lane 0)  | B1 (lane 1)  | ... | B(M-2) | B(M-1)

  Micro-batch k runs on lane k mod 2: each MoE layer's collectives go through the lane's
  own process group and side streams (``MoELayerBase.set_lanes``). On one group, two host
  threads would issue their collectives in an order that differs between ranks and pair
  the wrong ones; per lane the order is fixed (F_k, then B_k, then F_{k+2}, ...) on every
  rank. Backward k starts after forward k+1 has been issued and is joined before backward
  k+1 starts, so gradients accumulate in the sequential order and equal the sequential
  schedule's. Autograd runs a backward on the streams its forward used (CUDA) or on the
  calling thread (CPU), so the helper thread's backward and the main thread's forward are
  issued concurrently (the GIL is released inside the kernels and collectives).
  DDP's reducer prepares a backward in its forward (``no_sync`` and the last
  micro-batch's ``prepare_for_backward`` are read there), which a forward issued during
  another micro-batch's backward breaks: the forwards run on the plain model and the dense
  gradients are reduced once after the last backward (``DenseParallel.reduce_dense_gradients``),
  not overlapped with it. FSDP2 (``shard_dense``) all-gathers and frees parameters in its
  forward and backward hooks, which two micro-batches in flight would interleave: it takes
  the sequential schedule (WorkerConfig refuses the pair).
  Two host threads issue collectives concurrently, so nothing inside the section may depend
  on how they interleave: every lane's communicator is created (by a first collective) and
  the ranks meet in ``Lanes.create``, not lazily inside the section; the expert kernels'
  once-per-process probes (which switch CUDA's process-wide sync-debug mode and synchronise
  the device) run before it (``resolve_kernel_probes``); the host buffer pools defer
  emptying torch's pinned cache (a device wait) to its end; and on CUDA the schedule is
  refused under ``CUDA_DEVICE_MAX_CONNECTIONS=1``, where both lanes' kernels share one
  hardware queue and one lane's All-to-All waiting for its peers holds up the other lane's
  work (``overlap_refusal``).
  Memory: two micro-batches' activations are live at once (``MemoryBudget.in_flight``).
  SMs (CUDA): the SMs the MoE layers leave to communication are held while both threads
  launch work, from backward 0 to the last forward (``Lanes.holding_sms``): the other lane's
  All-to-All may run beside any GEMM, and the carve-out is a process-wide setting no thread
  may write while another launches. Forward 0 and the last backward run alone, on every SM
  (a layer measures its hardware profile in its first forward); with one rank per expert
  group nothing is held.
  With M = 1 there is nothing to overlap and it runs the sequential schedule.

Profiler ranges (``trace_mark``): ``mpipemoe.micro_batch{k}.forward`` / ``.backward`` around
each micro-batch's phases, and inside a block ``mpipemoe.block.attention`` /
``mpipemoe.block.moe`` (lm/model.py), so a timeline can tell which micro-batch's
communication ran beside which compute. The backwards run on the helper thread, which
torch's profiler records only when asked (``profiler_config()``: ``profile_all_threads``;
the device's kernels are traced either way).
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from moe_engine.comm import CollectiveLog, ExpertGroup
from moe_engine.experts import resolve_kernel_probes
from moe_engine.streams import holding_sm_carveout
from workers.distributed import DenseParallel

SCHEDULES = ("sequential", "overlapped")
LANES = 2  # micro-batches in flight under the overlapped schedule

T = TypeVar("T")
LossOf = Callable[[nn.Module, T], "tuple[torch.Tensor, Any]"]


class ScheduleError(RuntimeError):
    """Micro-batch ``micro_batch``'s ``phase`` ("forward" or "backward") raised; the
    original exception is the ``__cause__``."""

    def __init__(self, phase: str, micro_batch: int, error: BaseException):
        super().__init__(f"micro-batch {micro_batch} {phase}: {type(error).__name__}: {error}")
        self.phase, self.micro_batch = phase, micro_batch


def trace_mark(micro_batch: int, phase: str) -> str:
    """The profiler range name of a micro-batch's phase ("forward" or "backward")."""
    return f"mpipemoe.micro_batch{micro_batch}.{phase}"


def profiler_config() -> Any:
    """The ``experimental_config`` of a ``torch.profiler.profile`` that also records the
    overlapped schedule's helper thread (its backwards' host ranges and operators)."""
    from torch._C._profiler import _ExperimentalConfig

    return _ExperimentalConfig(profile_all_threads=True)


def overlap_refusal(device: torch.device, environ: Mapping[str, str] = os.environ) -> str | None:
    """Local. Why the overlapped schedule cannot run on ``device``, or None: on CUDA with
    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (``environ``) every stream feeds one hardware queue,
    so a lane's All-to-All kernel waiting for its peers holds up the other lane's kernels
    queued behind it, which those peers may be waiting for."""
    if device.type == "cuda" and environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "").strip() == "1":
        return ("CUDA_DEVICE_MAX_CONNECTIONS=1 puts both lanes' kernels in one hardware queue, where one lane's "
                "All-to-All waiting for its peers holds up the other lane's work: unset it (or set it above 1), "
                "or use the sequential micro-batch schedule")
    return None


def _lane_layers(model: nn.Module) -> list[Any]:
    """The MoE layers of ``model`` (modules with lanes: moe_engine.layers.MoELayerBase)."""
    return [m for m in model.modules() if hasattr(m, "set_lanes") and hasattr(m, "lane")]


class Lanes:
    """The lanes of ``model``'s MoE layers for the overlapped schedule, and the helper
    thread that runs backwards. ``create`` makes them (collective); ``lane(k)`` is the
    context a forward runs in."""

    def __init__(self, model: nn.Module, count: int = LANES, recorder: CollectiveLog | None = None):
        if isinstance(count, bool) or not isinstance(count, int) or count < 2:
            raise ValueError(f"count={count!r} is invalid: give an integer >= 2 (micro-batches in flight)")
        self.model, self.count, self.recorder = model, count, recorder
        self.layers = _lane_layers(model)
        device = self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        refusal = overlap_refusal(device)
        if refusal is not None:
            raise ValueError(f"the overlapped micro-batch schedule is refused: {refusal}")
        self.helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mpipemoe-backward")
        # CUDA: a compute stream per lane. On one stream, a backward's wait for its
        # All-to-All would hold up the other lane's forward kernels queued behind it.
        self.streams = [torch.cuda.Stream(device) for _ in range(count)] if device.type == "cuda" else []
        self.backward_done: torch.cuda.Event | None = None  # recorded after the last backward
        # lanes 1... of each expert-parallel group (by its ranks), as Lanes.create made them
        self.groups: dict[tuple[int, ...], list[Any]] = {}

    @classmethod
    def create(cls, model: nn.Module, count: int = LANES, timeout_s: float | None = None,
               recorder: CollectiveLog | None = None) -> Lanes:
        """Collective (every rank of the default group calls it, with the same ``count``):
        for each distinct expert-parallel group among ``model``'s MoE layers, ``count`` - 1
        process groups of the same ranks, given to the layers as lanes 1..., each connected
        (``_connect``) before it returns. Without a process group (one process) the lanes
        need none: they only get their own streams. A layer whose group makes its own lanes
        (a ``lane_groups(count)`` method: the emulated cluster's stand-in, moe_sim's
        EmulatedExpertGroup) gets them from it. ``recorder``: a CollectiveLog that records
        every collective of the MoE layers, on every lane (tests). Refused (ValueError) where
        ``overlap_refusal`` says."""
        from datetime import timedelta

        lanes = cls(model, count, recorder)
        groups = lanes.groups
        if dist.is_available() and dist.is_initialized():
            # every rank learns every layer group's ranks, so that all create the same groups
            # in the same order (new_group is collective over the default group)
            own = sorted({tuple(dist.get_process_group_ranks(layer.group.group)) for layer in lanes.layers
                          if layer.group.group is not None})
            everyone: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, own)
            timeout = timedelta(seconds=timeout_s) if timeout_s else None
            for ranks in sorted({tuple(r) for ranks_list in everyone for r in ranks_list}):
                made = [dist.new_group(list(ranks), timeout=timeout) for _ in range(count - 1)]
                if dist.get_rank() in ranks:
                    groups[ranks] = made
        lanes._attach()
        lanes._connect()
        return lanes

    def _connect(self) -> None:
        """Collective (every rank of the default group). One small all-reduce on each
        communicator this rank's MoE layers use (each expert group's own, then its lanes', in
        the same order on every rank of it), then one on the default group: NCCL creates a
        communicator at its first collective, which must not happen inside an overlapped
        section (its two threads would create them in an order that differs between ranks),
        and every rank leaves with every lane ready."""
        if not (dist.is_available() and dist.is_initialized()):
            return
        first_of = {tuple(dist.get_process_group_ranks(layer.group.group)): layer.group.group
                    for layer in reversed(self.layers) if layer.group.group is not None}
        probe = torch.zeros(1, device=self.device)
        for ranks in sorted(self.groups):
            for group in (first_of[ranks], *self.groups[ranks]):
                ExpertGroup(group, recorder=self.recorder).all_reduce_sum(probe)
        ExpertGroup(dist.group.WORLD, recorder=self.recorder).all_reduce_sum(probe)

    def reuse(self, model: nn.Module) -> Lanes:
        """Local. Lanes for another model whose MoE layers use the same expert-parallel
        groups, on this one's lane groups (``create`` made them; making more is collective)."""
        lanes = Lanes(model, self.count, self.recorder)
        lanes.groups = self.groups
        lanes._attach()
        return lanes

    def _attach(self) -> None:
        for layer in self.layers:
            lane_groups = getattr(layer.group, "lane_groups", None)
            if lane_groups is not None:  # a stand-in group (the emulated cluster) makes its own lane clones
                layer.set_lanes(lane_groups(self.count - 1))
                continue
            if layer.group.group is None:
                layer.set_lanes([ExpertGroup(None)] * (self.count - 1))
                continue
            ranks = tuple(dist.get_process_group_ranks(layer.group.group))
            if ranks not in self.groups:
                raise ValueError(f"an MoE layer's group of ranks {list(ranks)} has no lanes: make them with "
                                 f"Lanes.create(model) on every rank (collective)")
            if self.recorder is not None:
                layer.group.recorder = self.recorder
            layer.set_lanes([ExpertGroup(group, recorder=self.recorder) for group in self.groups[ranks]])

    @contextlib.contextmanager
    def lane(self, index: int) -> Iterator[None]:
        """Local. Every MoE layer's forwards inside run on lane ``index`` (its group and side
        streams), on CUDA on the lane's compute stream, after the work queued so far."""
        with contextlib.ExitStack() as stack:
            if self.streams:
                stream = self.streams[index]
                stream.wait_stream(torch.cuda.current_stream(stream.device))
                stack.enter_context(torch.cuda.stream(stream))
            for layer in self.layers:
                stack.enter_context(layer.lane(index))
            yield

    def backward(self, loss: torch.Tensor, micro_batch: int) -> None:
        """One micro-batch's backward, on the helper thread. CUDA: on its lane's compute
        stream (autograd runs each op on its forward's stream and, at the end, orders the
        calling thread's current stream after them), after the previous backward: the
        gradients accumulate in micro-batch order."""
        with contextlib.ExitStack() as stack:
            for layer in self.layers:  # a checkpointed MoE layer recomputed in it replays this lane's plans
                stack.enter_context(layer.replaying_lane(micro_batch % self.count))
            self._backward_on_lane(loss, micro_batch)

    def _backward_on_lane(self, loss: torch.Tensor, micro_batch: int) -> None:
        if not self.streams:
            _backward(loss, micro_batch)
            return
        stream = self.streams[micro_batch % self.count]
        with torch.cuda.stream(stream):
            if self.backward_done is not None:
                stream.wait_event(self.backward_done)
            _backward(loss, micro_batch)
            self.backward_done = torch.cuda.Event()
            self.backward_done.record(stream)

    def join(self) -> None:
        """Local. The caller's current stream waits for every lane (CUDA): the optimizer
        then reads finished gradients."""
        for stream in self.streams:
            torch.cuda.current_stream(stream.device).wait_stream(stream)
        self.backward_done = None

    def holding_sms(self) -> contextlib.AbstractContextManager[None]:
        """Local. The SMs the MoE layers leave to communication (their groups' ``comm_sms``),
        held while both threads of an overlapped section launch work
        (moe_engine.streams.holding_sm_carveout): the other lane's All-to-All may run beside any
        GEMM, and no thread may write the process-wide carve-out while another launches a GEMM.
        No-op off CUDA, and where no layer's expert group has several ranks (nothing to leave
        SMs to)."""
        if not self.streams:
            return contextlib.nullcontext()
        count = max((getattr(layer.group, "comm_sms", 0) for layer in self.layers if layer.group.size > 1), default=0)
        return holding_sm_carveout(self.streams[0].device, count)

    @contextlib.contextmanager
    def deferring_host_release(self) -> Iterator[None]:
        """Local. Every host buffer pool of the MoE layers defers emptying torch's pinned host
        cache (a device wait) until the section ends (``HostBufferPool.deferring_cache_release``)."""
        pools = {id(pool): pool for layer in self.layers if (pool := getattr(layer, "host_pool", None)) is not None}
        with contextlib.ExitStack() as stack:
            for pool in pools.values():
                stack.enter_context(pool.deferring_cache_release())
            yield

    def close(self) -> None:
        self.helper.shutdown(wait=True)


def _backward(loss: torch.Tensor, micro_batch: int) -> None:
    """One micro-batch's backward (on the helper thread under the overlapped schedule)."""
    try:
        with torch.profiler.record_function(trace_mark(micro_batch, "backward")):
            loss.backward()
    except Exception as error:
        raise ScheduleError("backward", micro_batch, error) from error


def _forward(module: nn.Module, loss_of: LossOf[T], item: T, micro_batch: int) -> tuple[torch.Tensor, Any]:
    try:
        with torch.profiler.record_function(trace_mark(micro_batch, "forward")):
            return loss_of(module, item)
    except Exception as error:
        raise ScheduleError("forward", micro_batch, error) from error


def _parallel_of(model: DenseParallel | nn.Module) -> DenseParallel:
    return model if isinstance(model, DenseParallel) else DenseParallel(model)


def forward_backward(model: DenseParallel | nn.Module, micro_batches: Sequence[T], loss_of: LossOf[T], *,
                     schedule: str = "sequential", lanes: Lanes | None = None) -> list[Any]:
    """Collective (the MoE layers' All-to-Alls; the dense reduction when ``model`` is a
    DenseParallel of several ranks). Forward and backward of every micro-batch of
    ``micro_batches`` by ``schedule`` (module docstring); returns the records of
    ``loss_of`` in micro-batch order. ``model``: a ``DenseParallel`` (its dense gradients
    are reduced over ranks) or a plain module (one rank, or the caller reduces).
    ``lanes``: from ``Lanes.create`` on this model, needed by "overlapped" with M >= 2.
    A failing micro-batch raises ``ScheduleError`` (its cause: the original error) after
    any backward in flight has finished; the gradients are then partial."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is unknown: choose one of {', '.join(SCHEDULES)}")
    parallel = _parallel_of(model)
    if schedule == "sequential" or len(micro_batches) < 2:
        return _sequential(parallel, micro_batches, loss_of)
    if lanes is None:
        raise ValueError("schedule='overlapped' needs lanes: give lanes=Lanes.create(model) (collective, once)")
    if parallel.world_size > 1 and parallel.mode != "ddp":
        raise ValueError(f"schedule='overlapped' needs DDP for the dense part, not {parallel.mode!r}: use the "
                         f"sequential schedule with shard_dense")
    return _overlapped(parallel, micro_batches, loss_of, lanes)


def _sequential(parallel: DenseParallel, micro_batches: Sequence[T], loss_of: LossOf[T]) -> list[Any]:
    records = []
    last = len(micro_batches) - 1
    for k, item in enumerate(micro_batches):
        with parallel.sync(last_micro_batch=k == last):
            loss, record = _forward(parallel.module, loss_of, item, k)
            records.append(record)
            _backward(loss, k)
            del loss
    return records


def _overlapped(parallel: DenseParallel, micro_batches: Sequence[T], loss_of: LossOf[T],
                lanes: Lanes) -> list[Any]:
    resolve_kernel_probes(lanes.device)  # (switch process-wide settings, sync): before the two threads
    with lanes.deferring_host_release():
        records = _overlapped_section(parallel, micro_batches, loss_of, lanes)
    parallel.reduce_dense_gradients()
    return records


def _overlapped_section(parallel: DenseParallel, micro_batches: Sequence[T], loss_of: LossOf[T],
                        lanes: Lanes) -> list[Any]:
    """The forwards and backwards of the overlapped schedule. Two host threads launch work from
    backward 0 to the last forward: the SM carve-out is held for that stretch only, so forward 0
    (where a layer measures its hardware profile) and the last backward run on every SM."""
    records = []
    in_flight: Future[None] | None = None  # the backward running on the helper thread
    last = len(micro_batches) - 1
    with contextlib.ExitStack() as carve_out:  # entered, and left, while the helper is idle
        try:
            for k, item in enumerate(micro_batches):
                with lanes.lane(k % lanes.count):
                    loss, record = _forward(parallel.model, loss_of, item, k)   # beside backward k-1
                records.append(record)
                if in_flight is not None:
                    in_flight.result()                                         # backward k-1 done
                if k == 0:
                    carve_out.enter_context(lanes.holding_sms())   # backward 0 runs beside forward 1
                if k == last:
                    carve_out.close()                              # the last backward runs alone
                in_flight = lanes.helper.submit(lanes.backward, loss, k)
                del loss
            assert in_flight is not None
            done, in_flight = in_flight, None
            done.result()
        finally:
            if in_flight is not None:  # a forward failed: let the backward in flight finish first
                with contextlib.suppress(ScheduleError):
                    in_flight.result()
            lanes.join()
    return records


def checkpointing_refusal(activation_checkpointing: str, expert_ranks: int) -> str | None:
    """Local. Why the overlapped schedule cannot run ``activation_checkpointing`` with expert
    groups of ``expert_ranks`` ranks (None: it can): a recomputed MoE layer's All-to-Alls
    would go to the lane the other thread is forwarding on."""
    if activation_checkpointing != "full" or expert_ranks <= 1:
        return None
    return (f"full activation checkpointing recomputes the MoE layers in backward, beside the next "
            f"micro-batch's forward, which with {expert_ranks} ranks per expert group would mix the two "
            f"lanes' All-to-Alls: use the sequential micro-batch schedule, or --activation-checkpointing "
            f"selective (the MoE layers are not recomputed)")


def choose_schedule(choice: str, micro_batches: int, *, shard_dense: bool = False, budget_bytes: int | None = None,
                    preset: Any = None, tokens: int = 0, world_size: int = 1,
                    dtype: torch.dtype = torch.bfloat16,
                    device: torch.device = torch.device("cpu"),
                    activation_checkpointing: str = "none") -> tuple[str, str]:
    """Local. (schedule, why) for ``choice`` ("sequential", "overlapped" or "auto"). "auto"
    is "overlapped" when a step has ``micro_batches`` >= 2, the dense part is under DDP (not
    ``shard_dense``) and, with an activation budget for the MoE layers (``budget_bytes``,
    --moe-memory-gib), the memory model says the leanest setting of ``preset``'s MoE layers
    fits it with two micro-batches of ``tokens`` tokens per rank in flight
    (lm.model.leanest_moe_memory, ``in_flight=2``), and ``device`` allows it
    (``overlap_refusal``); else "sequential". "overlapped" where ``device`` does not allow
    it raises ValueError naming why. Full ``activation_checkpointing`` recomputes the MoE
    layers in backward, which under the overlapped schedule runs beside the next forward
    on the other lane: with an expert group of several ranks (``world_size``) the MoE
    layer refuses that (moe_engine/layers.py ``_replay_lane``), so "auto" is "sequential"
    then and "overlapped" raises."""
    if choice != "sequential" and (why := checkpointing_refusal(activation_checkpointing, world_size)):
        if choice == "overlapped":
            raise ValueError(f"micro_batch_schedule='overlapped' is refused: {why}")
        return "sequential", why.split(":")[0]
    refusal = overlap_refusal(device) if choice != "sequential" and micro_batches >= 2 else None
    if choice == "overlapped" and refusal is not None:
        raise ValueError(f"micro_batch_schedule='overlapped' is refused: {refusal}")
    if choice != "auto":
        return choice, "asked for"
    if micro_batches < 2:
        return "sequential", "one micro-batch a step: nothing to overlap"
    if refusal is not None:
        return "sequential", refusal.split(":")[0]
    if shard_dense:
        return "sequential", "FSDP2 (shard_dense) takes the sequential schedule"
    if budget_bytes is not None:
        from lm.model import leanest_moe_memory

        need, n, strategy = leanest_moe_memory(preset, tokens, world_size, dtype, in_flight=LANES,
                                               activation_checkpointing=activation_checkpointing)
        if need > budget_bytes:
            return "sequential", (f"two micro-batches in flight need {need / 2**30:.3g} GiB of MoE activations "
                                  f"at least (n={n}, {strategy}), over the {budget_bytes / 2**30:.3g} GiB budget")
    return "overlapped", f"{micro_batches} micro-batches a step" + (
        "; two in flight fit the MoE memory budget" if budget_bytes is not None else "")
