"""The partitioned forward/backward schedule of MPipeMoE (DESIGN.md §2).

Legend: T tokens on this rank, D d_model, A pre-activation width (H or 2H),
R rows this rank sends, N rows it receives, n partitions.

Forward, for each partition i (rows of one token range, one All-to-All each):

    1. gather    x rows of partition i into a send slot              (compute stream)
    2. dispatch  All-to-All → receive slot                           (comm stream)
    3. experts   group by expert → T_DI, GEMM1 → A, act, GEMM2 → T_DO (compute stream)
    4. offload   T_DI and/or A to host, as the strategy says          (copy stream)
    5. combine   All-to-All of T_DO back into the output rows         (comm stream)

Partition i+1's dispatch is issued before partition i's experts, and
partition i's combine after them, so communication of one partition overlaps
computation of the next. T_DI, A and T_DO live in slots sized for one
partition (two slots where a side stream may still read the previous one);
backward restores what the slots overwrote (memory.py) and runs the same
pipeline in reverse order, prefetching partition i−1 while computing i.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from .comm import ExpertGroup
from .dispatcher import DispatchPlan
from .experts import Experts, activate
from .granularity import PassTiming
from .memory import HostBufferPool, RestorePolicy
from .streams import Pending, StreamSet


@dataclass
class PipelineRun:
    """Everything one pipelined call needs besides tensors (built per forward)."""

    experts: Experts
    group: ExpertGroup
    plan: DispatchPlan
    streams: StreamSet
    policy: RestorePolicy
    host_pool: HostBufferPool
    timing: PassTiming | None = None   # set while the granularity search measures this pass

    @property
    def send_offsets(self) -> list[int]:
        return [0] + list(accumulate(p.rows_sent for p in self.plan.partitions))


class SlotRing:
    """Up to `count` working buffers of `rows × width`; step s uses buffer s % count.
    Buffers are allocated on first use, so a ring the schedule never touches (or
    touches once, with a single partition) costs nothing."""

    def __init__(self, count: int, rows: int, width: int, like: torch.Tensor):
        self.count, self.rows, self.width, self.like = count, rows, width, like
        self.buffers: dict[int, torch.Tensor] = {}

    def take(self, step: int, rows: int) -> torch.Tensor:
        slot = step % self.count
        if slot not in self.buffers:
            self.buffers[slot] = self.like.new_empty(self.rows, self.width)
        return self.buffers[slot][:rows]


@dataclass
class Restorable:
    """What backward has of one partition's T_DI or A: a device tensor, or a host copy."""

    device: torch.Tensor | None = None
    host: torch.Tensor | None = None
    host_base: torch.Tensor | None = None
    copied: Pending = field(default_factory=Pending.done)


def _offload(run: PipelineRun, tensor: torch.Tensor) -> Restorable:
    """Copy stream. Start copying `tensor` to a host buffer of this micro-batch."""
    base = run.host_pool.take(tensor.numel(), tensor.dtype, pin=run.streams.is_cuda)
    host = base[:tensor.numel()].view(tensor.shape)
    with run.streams.on_copy():
        host.copy_(tensor, non_blocking=True)
    return Restorable(host=host, host_base=base, copied=run.streams.record_copy())


def _fetch_from_host(run: PipelineRun, saved: Restorable, out: torch.Tensor) -> Pending:
    """Copy stream. Start copying a host copy back into a device slot."""
    with run.streams.on_copy():
        out.copy_(saved.host, non_blocking=True)
    return run.streams.record_copy()


def pipelined_forward(x_TD: torch.Tensor, run: PipelineRun, save: bool):
    """Returns (y_RD, saved_inputs, saved_preacts): combined rows in send order and,
    when `save`, what backward needs per partition (as `Restorable`s)."""
    parts, experts, group, streams = run.plan.partitions, run.experts, run.group, run.streams
    policy = run.policy
    n, D, A_width = len(parts), x_TD.shape[1], experts.pre_activation_width
    max_sent, max_recv = run.plan.max_rows_sent, run.plan.max_rows_received
    offsets = run.send_offsets
    keep_on_device = save and not policy.share_buffers
    offload_input = save and policy.offload_input
    offload_preact = save and policy.offload_preactivation

    y_RD = x_TD.new_empty(offsets[-1], D)
    send = SlotRing(2, max_sent, D, x_TD)
    recv = SlotRing(2, max_recv, D, x_TD)
    expert_out = SlotRing(1, max_recv, D, x_TD)
    combine_in = SlotRing(2, max_recv, D, x_TD)
    inputs = None if keep_on_device else SlotRing(2 if offload_input else 1, max_recv, D, x_TD)
    preacts = None if keep_on_device else SlotRing(2 if offload_preact else 1, max_recv, A_width, x_TD)

    dispatched: list[Pending] = [Pending.done()] * n
    combined: list[Pending] = [Pending.done()] * n
    saved_inputs = [Restorable() for _ in range(n)]
    saved_preacts = [Restorable() for _ in range(n)]

    def issue_dispatch(i: int) -> None:
        p = parts[i]
        if i >= 2:
            dispatched[i - 2].wait()  # its send slot is ours now
        send_RD = send.take(i, p.rows_sent)
        torch.index_select(x_TD, 0, p.token_index_R, out=send_RD)                       # 1. gather
        dispatched[i] = group.all_to_all_async(recv.take(i, p.rows_received), send_RD,  # 2. dispatch
                                               p.recv_splits, p.send_splits, streams)

    def run_experts(i: int) -> None:
        p, N = parts[i], parts[i].rows_received
        dispatched[i].wait()
        if i >= 2:  # slots of partition i-2 are ours once its offload and combine are done
            saved_inputs[i - 2].copied.wait()
            saved_preacts[i - 2].copied.wait()
            combined[i - 2].wait()
        if keep_on_device:
            x_ND, A_NA = x_TD.new_empty(N, D), x_TD.new_empty(N, A_width)
        else:
            x_ND, A_NA = inputs.take(i, N), preacts.take(i, N)
        torch.index_select(recv.take(i, N), 0, p.expert_order_N, out=x_ND)              # 3. T_DI
        experts.project_in(x_ND, p.expert_counts, A_NA)                                  #    GEMM1
        h_NH = activate(A_NA, experts.config.activation)                                 #    act
        y_ND = experts.project_out(h_NH, p.expert_counts, expert_out.take(i, N))         #    GEMM2
        del h_NH
        y_received_ND = torch.index_select(y_ND, 0, p.source_order_N, out=combine_in.take(i, N))
        if keep_on_device:
            saved_inputs[i], saved_preacts[i] = Restorable(device=x_ND), Restorable(device=A_NA)
        if offload_input:                                                                # 4. offload
            saved_inputs[i] = _offload(run, x_ND)
        if offload_preact:
            saved_preacts[i] = _offload(run, A_NA)
        out_RD = y_RD[offsets[i]:offsets[i + 1]]                                         # 5. combine
        combined[i] = group.all_to_all_async(out_RD, y_received_ND, p.send_splits, p.recv_splits, streams)

    if run.timing is not None:
        run.timing.forward.start()
    with torch.no_grad():
        if n:
            issue_dispatch(0)
        for i in range(n):
            if i + 1 < n:
                issue_dispatch(i + 1)
            run_experts(i)
        for pending in combined:
            pending.wait()
        for saved in saved_inputs + saved_preacts:
            saved.copied.wait()
        streams.join()
    if run.timing is not None:
        run.timing.forward.stop()
    return y_RD, saved_inputs, saved_preacts


def pipelined_backward(dy_RD: torch.Tensor, x_TD: torch.Tensor | None, run: PipelineRun,
                       saved_inputs: list[Restorable], saved_preacts: list[Restorable], tokens: int):
    """Backward of `pipelined_forward`, partitions in reverse order.

    For each partition: dy rows go to the experts' ranks (All-to-All), T_DI and A
    are restored per the strategy (prefetched one partition ahead), the expert
    backward accumulates parameter gradients, and the input gradient rows come
    back (All-to-All) and are added into dx_TD.
    """
    parts, experts, group, streams, policy = (run.plan.partitions, run.experts, run.group,
                                              run.streams, run.policy)
    n, D, A_width = len(parts), dy_RD.shape[1], experts.pre_activation_width
    max_sent, max_recv = run.plan.max_rows_sent, run.plan.max_rows_received
    offsets = run.send_offsets
    order = list(reversed(range(n)))
    dy_RD = dy_RD.contiguous()
    grads = experts.new_grads()
    dx_TD = dy_RD.new_zeros(tokens, D)

    dy_recv = SlotRing(2, max_recv, D, dy_RD)
    input_slots = SlotRing(2, max_recv, D, dy_RD)        # restored T_DI (host copy or re-dispatch)
    input_recv = SlotRing(2, max_recv, D, dy_RD)         # re-dispatch arrivals (source order)
    input_send = SlotRing(2, max_sent, D, dy_RD)         # re-dispatch gathers
    preact_slots = SlotRing(2 if policy.offload_preactivation else 1, max_recv, A_width, dy_RD)
    dy_expert = SlotRing(1, max_recv, D, dy_RD)
    dx_expert = SlotRing(1, max_recv, D, dy_RD)
    dx_send = SlotRing(2, max_recv, D, dy_RD)
    dx_rows = SlotRing(2, max_sent, D, dy_RD)

    fetched_dy: list[Pending] = [Pending.done()] * n
    fetched_input: list[Pending] = [Pending.done()] * n
    fetched_preact: list[Pending] = [Pending.done()] * n
    returned: list[Pending] = [Pending.done()] * n

    def issue_fetch(step: int) -> None:
        """Comm + copy streams: everything partition order[step] needs, ahead of its compute."""
        i = order[step]
        p = parts[i]
        fetched_dy[step] = group.all_to_all_async(dy_recv.take(step, p.rows_received),
                                                  dy_RD[offsets[i]:offsets[i + 1]],
                                                  p.recv_splits, p.send_splits, streams)
        if policy.recommunicate_input:
            if step >= 2:
                fetched_input[step - 2].wait()
            send_RD = input_send.take(step, p.rows_sent)
            torch.index_select(x_TD, 0, p.token_index_R, out=send_RD)
            fetched_input[step] = group.all_to_all_async(input_recv.take(step, p.rows_received), send_RD,
                                                         p.recv_splits, p.send_splits, streams)
        elif saved_inputs[i].host is not None:
            fetched_input[step] = _fetch_from_host(run, saved_inputs[i], input_slots.take(step, p.rows_received))
        if saved_preacts[i].host is not None:
            fetched_preact[step] = _fetch_from_host(run, saved_preacts[i], preact_slots.take(step, p.rows_received))

    def restore_and_backward(step: int) -> None:
        i = order[step]
        p, N = parts[i], parts[i].rows_received
        # T_DI of this partition
        fetched_input[step].wait()
        if saved_inputs[i].device is not None:
            x_ND = saved_inputs[i].device
        elif policy.recommunicate_input:
            x_ND = input_slots.take(step, N)
            torch.index_select(input_recv.take(step, N), 0, p.expert_order_N, out=x_ND)
        else:
            x_ND = input_slots.take(step, N)
        # A of this partition
        if saved_preacts[i].device is not None:
            A_NA = saved_preacts[i].device
        elif policy.recompute_preactivation:
            A_NA = experts.project_in(x_ND, p.expert_counts, preact_slots.take(step, N))
        else:
            fetched_preact[step].wait()
            A_NA = preact_slots.take(step, N)
        # dy of this partition, grouped by expert
        fetched_dy[step].wait()
        dy_ND = dy_expert.take(step, N)
        torch.index_select(dy_recv.take(step, N), 0, p.expert_order_N, out=dy_ND)
        dx_ND = experts.backward_rows(x_ND, A_NA, dy_ND, p.expert_counts, grads, dx_expert.take(step, N))
        if step >= 2:
            returned[step - 2].wait()  # its dx_send slot is ours now
        dx_received_ND = torch.index_select(dx_ND, 0, p.source_order_N, out=dx_send.take(step, N))
        returned[step] = group.all_to_all_async(dx_rows.take(step, p.rows_sent), dx_received_ND,
                                                p.send_splits, p.recv_splits, streams)

    def accumulate_input_grad(step: int) -> None:
        i = order[step]
        returned[step].wait()
        dx_TD.index_add_(0, parts[i].token_index_R, dx_rows.take(step, parts[i].rows_sent))

    if run.timing is not None:
        run.timing.backward.start()
    with torch.no_grad():
        if n:
            issue_fetch(0)
        for step in range(n):
            if step + 1 < n:
                issue_fetch(step + 1)
            restore_and_backward(step)
            if step >= 1:
                accumulate_input_grad(step - 1)
        if n:
            accumulate_input_grad(n - 1)
        streams.join()
    if run.timing is not None:
        run.timing.backward.stop()
        run.timing.backward_done = True
    for saved in saved_inputs + saved_preacts:
        if saved.host_base is not None:
            run.host_pool.give_back(saved.host_base)
    return dx_TD, grads


class PipelinedExperts(torch.autograd.Function):
    """dispatch → experts → combine for all partitions, as one autograd node.

    Inputs: x_TD, the run, then the expert parameters (w1, b1, w2, b2, w3; None
    where absent). Output: the combined rows Y_s in send order (R × D).
    """

    @staticmethod
    def forward(ctx, x_TD, run: PipelineRun, w1, b1, w2, b2, w3):
        save = any(ctx.needs_input_grad)
        y_RD, saved_inputs, saved_preacts = pipelined_forward(x_TD, run, save)
        ctx.run, ctx.tokens = run, x_TD.shape[0]
        # Device tensors go through save_for_backward (visible to saved-tensor hooks);
        # host copies are plain attributes.
        device_tensors = [s.device for s in saved_inputs + saved_preacts if s.device is not None]
        if save and run.policy.needs_layer_input:
            device_tensors.append(x_TD)
        ctx.save_for_backward(*device_tensors)
        ctx.saved_inputs = [Restorable(host=s.host, host_base=s.host_base) for s in saved_inputs]
        ctx.saved_preacts = [Restorable(host=s.host, host_base=s.host_base) for s in saved_preacts]
        ctx.layout = [s.device is not None for s in saved_inputs + saved_preacts]
        ctx.param_present = [t is not None for t in (w1, b1, w2, b2, w3)]
        return y_RD

    @staticmethod
    def backward(ctx, dy_RD):
        tensors = list(ctx.saved_tensors)
        x_TD = tensors.pop() if ctx.run.policy.needs_layer_input else None
        n = len(ctx.saved_inputs)
        restorables = ctx.saved_inputs + ctx.saved_preacts
        for restorable, on_device in zip(restorables, ctx.layout):
            if on_device:
                restorable.device = tensors.pop(0)
        dx_TD, grads = pipelined_backward(dy_RD, x_TD, ctx.run, restorables[:n], restorables[n:], ctx.tokens)
        ctx.run = None
        param_grads = [grads.w1, grads.b1, grads.w2, grads.b2, grads.w3]
        return (dx_TD, None, *[g if present else None for g, present in zip(param_grads, ctx.param_present)])
