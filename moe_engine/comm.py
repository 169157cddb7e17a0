"""The only module that calls collectives.

`ExpertGroup` wraps the process group of the expert-parallel ranks. Its
methods are the collectives the MoE layers need: the token-count exchange,
All-to-All with uneven splits (blocking or returning a `Pending` handle), and
a few small agreements (max, sum, and `agree`: the planner's packed values).
With no process group (a single process), every collective degenerates to a
local copy, so the same layer code runs on one CPU process, on gloo ranks and
on NCCL ranks.

On CUDA an asynchronous All-to-All is issued on the communication stream the
caller names; its `Pending` is an event on that stream. On CPU (gloo) it is
the collective's work handle, which completes on gloo's own threads.

A `CollectiveLog` given to a group (``recorder``) records each collective it issues, by
communicator, before issuing it: a test compares the ranks' sequences (every rank must issue
the same collectives on a communicator in the same order, or they pair the wrong ones).

A collective that fails (a peer died, or the process group's timeout ended the
wait for a rank that stopped participating) raises `CollectiveError` naming the
collective and the rank, so a dead rank ends the job in bounded time with a
clear message instead of a hang.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, TypeVar

import torch
import torch.distributed as dist

from .streams import Pending, StreamSet

T = TypeVar("T")


class CollectiveError(RuntimeError):
    """A collective of the expert-parallel group failed (usually: another rank died or
    stopped participating and the process group's timeout ended the wait)."""


# SMs a pipelined pass leaves to NCCL's All-to-All kernels when NCCL_MAX_CTAS does not say:
# NCCL runs a collective on a few CTAs that hold their SMs for the whole transfer.
DEFAULT_COMM_SMS = 16


def nccl_comm_sms() -> int:
    """The SMs NCCL's collectives hold at most: NCCL_MAX_CTAS (or NCCL_MAX_NCHANNELS), NCCL's
    own settings, when set; else DEFAULT_COMM_SMS."""
    for name in ("NCCL_MAX_CTAS", "NCCL_MAX_NCHANNELS"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return DEFAULT_COMM_SMS


@dataclass(frozen=True)
class CollectiveEvent:
    """One collective as a rank issued it: its communicator (``group``, the process group's
    name, the same on every rank; ``ranks``, its global ranks), what it is, and its sizes
    (All-to-All: (output splits, input splits); others: the tensor's shape)."""

    group: str
    ranks: tuple[int, ...]
    op: str
    sizes: tuple[Any, ...]


@dataclass
class CollectiveLog:
    """The collectives a rank issued, in order, per communicator (``by_group``); given to
    `ExpertGroup` as its ``recorder``. Appends from several threads are safe (a list append
    holds the GIL)."""

    by_group: dict[str, list[CollectiveEvent]] = field(default_factory=dict)

    def record(self, event: CollectiveEvent) -> None:
        self.by_group.setdefault(event.group, []).append(event)


class ExpertGroup:
    """The ranks that share the experts of one MoE layer.

    group: a torch.distributed ProcessGroup; None means the default process
    group when one is initialised, else a single process.
    always_communicate: run every collective through the process group even when it
    has one rank (tests send the engine's real collectives through NCCL on one GPU);
    by default a one-rank group is treated as a single process (no collectives).
    comm_sms: SMs the expert GEMMs leave free while an All-to-All runs beside them
    (pipelined passes on CUDA; `StreamSet.reserving_sms`). The GEMMs are persistent
    kernels sized to the SMs they may use: one that finds an SM held by a communication
    kernel waits for it, and the GEMM then lasts as long as the transfer (measured on an
    H200: a 0.86 ms grouped GEMM took 1.75 ms beside a one-CTA 1.46 ms transfer). Default:
    what NCCL's collectives hold (`nccl_comm_sms`).
    recorder: a `CollectiveLog` that records every collective issued through the group (tests).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, always_communicate: bool = False,
                 comm_sms: int | None = None, recorder: CollectiveLog | None = None):
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        if always_communicate and group is None:
            raise ValueError("always_communicate=True needs a process group: initialise one "
                             "(torch.distributed.init_process_group) or pass it as group=")
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.always_communicate = always_communicate
        if comm_sms is not None and (isinstance(comm_sms, bool) or not isinstance(comm_sms, int) or comm_sms < 0):
            raise ValueError(f"comm_sms={comm_sms!r} is invalid: give the SMs to leave to communication "
                             f"kernels (>= 0; 0 leaves none), or None for NCCL's ({DEFAULT_COMM_SMS} unless "
                             f"NCCL_MAX_CTAS says)")
        self.comm_sms = nccl_comm_sms() if comm_sms is None else comm_sms
        self.recorder = recorder

    def _record(self, op: str, *sizes: Any) -> None:
        """Local. Note the collective ``op`` with ``sizes`` in the recorder, if any."""
        if self.recorder is not None and self.group is not None:
            self.recorder.record(CollectiveEvent(self.group.group_name, tuple(dist.get_process_group_ranks(self.group)),
                                                 op, sizes))

    @property
    def distributed(self) -> bool:
        """Whether collectives go through the process group."""
        return self.group is not None and (self.size > 1 or self.always_communicate)

    def _run(self, what: str, collective: Callable[[], T]) -> T:
        """``collective()``, with a failure re-raised as a `CollectiveError` naming it."""
        try:
            return collective()
        except RuntimeError as error:
            lines = str(error).strip().splitlines()
            raise CollectiveError(
                f"{what} failed on rank {self.rank} of {self.size}: another rank died or stopped "
                f"participating, and the process group's timeout ended the wait (set it with "
                f"init_process_group(timeout=...)); {type(error).__name__}: {lines[-1] if lines else ''}"
            ) from error

    # -- counts ---------------------------------------------------------------
    def exchange_counts(self, send_counts: torch.Tensor, stats_width: int | None = None) -> torch.Tensor:
        """Collective. send_counts[dst, ...] -> recv_counts[src, ...] (int64).

        Row r of the input goes to rank r; row r of the output came from rank r.
        stats_width: how many values at the end of each row are the sender's pass statistics
        (the same in every row; dispatcher.exchange_counts; None: dispatcher.STATS), for a
        stand-in group that builds the table (moe_sim/emulation.py).
        """
        if not self.distributed:
            return send_counts.clone()
        recv_counts = torch.empty_like(send_counts)
        self._record("token-count exchange", tuple(send_counts.shape))
        self._run("token-count exchange", lambda: dist.all_to_all_single(
            recv_counts, send_counts.contiguous(), group=self.group))
        return recv_counts

    # -- All-to-All -----------------------------------------------------------
    def all_to_all(self, output: torch.Tensor, input: torch.Tensor,
                   output_splits: Sequence[int], input_splits: Sequence[int]) -> None:
        """Collective, blocking. Rows input[sum(input_splits[:r]) ...] go to rank r."""
        if not self.distributed:
            output.copy_(input)
            return
        self._record("All-to-All", tuple(output_splits), tuple(input_splits))
        self._run("All-to-All", lambda: dist.all_to_all_single(
            output, input, list(output_splits), list(input_splits), group=self.group))

    def all_to_all_async(self, output: torch.Tensor, input: torch.Tensor,
                         output_splits: Sequence[int], input_splits: Sequence[int],
                         streams: StreamSet) -> Pending:
        """Collective, asynchronous: returns a `Pending` to wait on before reading `output`.

        On CUDA the collective is ordered on ``streams.comm`` (which first waits for
        whatever the caller recorded there); on CPU it runs on gloo's threads.
        """
        if not self.distributed:
            with streams.on_comm():
                output.copy_(input)
            return streams.record_comm()
        self._record("All-to-All", tuple(output_splits), tuple(input_splits))
        if streams.is_cuda:
            with streams.on_comm():
                self._run("All-to-All", lambda: dist.all_to_all_single(
                    output, input, list(output_splits), list(input_splits), group=self.group))
            return streams.record_comm()
        work = self._run("All-to-All", lambda: dist.all_to_all_single(
            output, input, list(output_splits), list(input_splits), group=self.group, async_op=True))
        return Pending(lambda: self._run("All-to-All", work.wait))

    # -- small agreements -------------------------------------------------------
    def all_reduce_max(self, values: torch.Tensor) -> torch.Tensor:
        """Collective. Elementwise max over ranks (used so all ranks agree on a choice)."""
        return self._all_reduce(values, dist.ReduceOp.MAX)

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Collective. Elementwise sum over ranks."""
        return self._all_reduce(values, dist.ReduceOp.SUM)

    def agree(self, values: Sequence[int], device: torch.device) -> list[int]:
        """Collective (several ranks), with one device read. The elementwise max over ranks
        of ``values`` (int64; negate a value to agree on its min), packed into one tensor on
        ``device``, the data's (NCCL rejects CPU tensors). With no process group: ``values``,
        no tensor, no read. The planner's one agreement per pass (planner.py)."""
        if not self.distributed:
            return list(values)
        packed = torch.tensor(list(values), dtype=torch.int64, device=device)
        return self.all_reduce_max(packed).tolist()

    def _all_reduce(self, values: torch.Tensor, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
        if not self.distributed:
            return values
        out = values.clone()
        self._record(f"all-reduce {op}", tuple(values.shape))
        self._run("all-reduce", lambda: dist.all_reduce(out, op=op, group=self.group))
        return out

    def broadcast(self, tensor: torch.Tensor, source: int) -> None:
        """Collective, blocking. ``tensor`` (contiguous; on the data's device) takes the
        values group rank ``source`` holds, on every rank (FasterMoE's shadowed experts'
        weights, shadowing.py)."""
        if not self.distributed:
            return
        self._record("broadcast", tuple(tensor.shape), source)
        self._run("broadcast", lambda: dist.broadcast(
            tensor, src=dist.get_global_rank(self.group, source), group=self.group))  # type: ignore[arg-type]  # (distributed: a group)

    def reduce_sum(self, tensor: torch.Tensor, destination: int) -> None:
        """Collective, blocking. Group rank ``destination``'s ``tensor`` becomes the sum of
        every rank's (the others' are left undefined): the gradients of FasterMoE's shadowed
        experts going back to their owner (shadowing.py)."""
        if not self.distributed:
            return
        self._record("reduce sum", tuple(tensor.shape), destination)
        self._run("reduce", lambda: dist.reduce(
            tensor, dst=dist.get_global_rank(self.group, destination), op=dist.ReduceOp.SUM,  # type: ignore[arg-type]  # (distributed: a group)
            group=self.group))

    def broadcast_object(self, obj: T) -> T:
        """Collective. Rank 0's Python object on every rank."""
        if not self.distributed:
            return obj
        holder = [obj]
        self._record("broadcast")
        self._run("broadcast", lambda: dist.broadcast_object_list(
            holder, src=dist.get_global_rank(self.group, 0), group=self.group))  # type: ignore[arg-type]  # (distributed: a group)
        return holder[0]


class _AllToAllFunction(torch.autograd.Function):
    """All-to-All whose backward is the All-to-All with the splits swapped."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, group: ExpertGroup, output_splits: list[int],
                input_splits: list[int]) -> torch.Tensor:
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        output = input.new_empty((sum(output_splits),) + tuple(input.shape[1:]))
        group.all_to_all(output, input.contiguous(), output_splits, input_splits)
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        grad_input = grad_output.new_empty((sum(ctx.input_splits),) + tuple(grad_output.shape[1:]))
        ctx.group.all_to_all(grad_input, grad_output.contiguous(), ctx.input_splits, ctx.output_splits)
        return grad_input, None, None, None


def all_to_all_with_grad(group: ExpertGroup, input: torch.Tensor,
                         output_splits: Sequence[int], input_splits: Sequence[int]) -> torch.Tensor:
    """Collective, blocking, tracked by autograd (used by the keep-everything baselines)."""
    return _AllToAllFunction.apply(  # type: ignore[no-untyped-call, no-any-return]  # (Function.apply is untyped)
        input, group, list(output_splits), list(input_splits))
