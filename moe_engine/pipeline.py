"""The partitioned forward/backward schedule of MPipeMoE (docs/engine.md, "The method").

Legend (the engine's, see docs/engine.md): T tokens on this rank, D d_model, H d_hidden,
R rows this rank sends, N rows it receives, n partitions.

Forward, for each partition i (rows of one token range, one All-to-All each):

    1. dispatch  gather x rows (compute stream), All-to-All (comm stream)
    2. experts   group by expert → T_DI, GEMM1 → A, act, GEMM2 → T_DO  (compute stream)
    3. offload   T_DI and/or A to host, as the strategy says            (copy stream)
    4. combine   All-to-All of T_DO back into the output rows           (comm stream)

Partition i+1's dispatch is issued before partition i's experts, and partition i's
combine after them, so communication of one partition overlaps computation of the
next. With one rank there is no All-to-All: dispatch gathers the rows straight into
expert order and combine is a concatenation.

Backward runs the partitions in reverse order, fetching partition i−1's inputs (the
output gradient's All-to-All, restores by host copy or re-communication) while
partition i computes. Within a partition the input gradient is computed first and
sent back at once; the weight-gradient GEMMs then run while it travels.

Memory reuse: the grouped kernels allocate their outputs, and a partition's T_DI, A
and T_DO are dropped once partition i+2 starts (a strategy S1–S4) or kept for backward
("none"); the caching allocator hands the freed blocks to the next partition, so the
working set is a partition's, and backward restores what was dropped (memory.py).
Every tensor a side stream reads stays referenced until the stream that frees it has
waited for that read.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .comm import ExpertGroup
from .dispatcher import DispatchPlan, from_expert_major, to_expert_major
from .experts import Experts
from .granularity import PassTiming
from .memory import HostBufferPool, RestorePolicy
from .streams import Pending, StreamSet


@dataclass
class PipelineRun:
    """Everything one pipelined call needs besides tensors (built per forward).

    keep_activation: also keep act(A) for backward, as autograd would (the FastMoE
    baseline); otherwise backward recomputes it from A, elementwise."""

    experts: Experts
    group: ExpertGroup
    plan: DispatchPlan
    streams: StreamSet
    policy: RestorePolicy
    host_pool: HostBufferPool
    timing: PassTiming | None = None   # set while the granularity search measures this pass
    keep_activation: bool = False


@dataclass
class Saved:
    """What backward has of one partition's T_DI or A (a list of tensors): device
    tensors, or host copies (and the pool buffers behind them)."""

    device: list | None = None
    host: list | None = None
    host_bases: list = field(default_factory=list)
    copied: Pending = field(default_factory=Pending.done)


def _offload(run: PipelineRun, tensors: list) -> Saved:
    """Copy stream. Start copying `tensors` to host buffers of this micro-batch."""
    streams = run.streams
    hosts, bases = [], []
    with streams.on_copy():
        for tensor in tensors:
            base = run.host_pool.take(tensor.numel(), tensor.dtype, pin=streams.is_cuda,
                                      stream=streams.copy if streams.is_cuda else None)
            host = base[:tensor.numel()].view(tensor.shape)
            host.copy_(tensor, non_blocking=True)
            hosts.append(host)
            bases.append(base)
    return Saved(host=hosts, host_bases=bases, copied=streams.record_copy())


def _fetch_from_host(run: PipelineRun, saved: Saved) -> tuple[list, Pending]:
    """Copy stream. Start copying host copies back into new device tensors."""
    device = run.streams.device
    outs = [torch.empty(h.shape, dtype=h.dtype, device=device) for h in saved.host]
    with run.streams.on_copy():
        for out, host in zip(outs, saved.host):
            out.copy_(host, non_blocking=True)
    return outs, run.streams.record_copy()


def pipelined_forward(x_TD: torch.Tensor, run: PipelineRun, save: bool):
    """Returns (y_RD, saved_inputs, saved_preacts, saved_acts): combined rows in send
    order and, when `save`, what backward needs per partition."""
    plan, experts, group, streams, policy = run.plan, run.experts, run.group, run.streams, run.policy
    parts, n, D = plan.partitions, len(plan.partitions), x_TD.shape[1]
    offsets = plan.send_offsets
    keep_on_device = save and not policy.share_buffers
    offload_input = save and policy.offload_input
    offload_preact = save and policy.offload_preactivation

    y_RD = None if plan.single else x_TD.new_empty(offsets[-1], D)
    outputs: list = []                  # single rank: each partition's T_DO, concatenated at the end
    received: list = [None] * n         # the rows each dispatch brings (or, on one rank, gathers)
    in_flight: list = [None] * n        # tensors a side stream still reads, per partition
    dispatched = [Pending.done()] * n
    combined = [Pending.done()] * n
    saved_inputs = [Saved() for _ in range(n)]
    saved_preacts = [Saved() for _ in range(n)]
    saved_acts: list = [None] * n

    def dispatch(i: int) -> None:                                                     # 1. dispatch
        p = parts[i]
        x_RD = x_TD.index_select(0, p.token_index_R)
        if plan.single:
            received[i] = x_RD
            return
        received[i] = x_TD.new_empty(p.rows_received, D)
        in_flight[i] = [x_RD]
        dispatched[i] = group.all_to_all_async(received[i], x_RD, p.recv_splits, p.send_splits, streams)

    def compute(i: int) -> None:
        p = parts[i]
        dispatched[i].wait()
        if i >= 2:  # partition i-2's copies and combine are done: drop what they read
            saved_inputs[i - 2].copied.wait()
            saved_preacts[i - 2].copied.wait()
            combined[i - 2].wait()
            in_flight[i - 2] = None
        x_ND = to_expert_major(received[i], p.expert_order_N)                           # 2. experts
        received[i] = None
        A = experts.project_in(x_ND, p.segments)
        h_NH = experts.activate(A)
        y_ND = experts.project_out(h_NH, p.segments)
        if save and run.keep_activation:
            saved_acts[i] = h_NH
        del h_NH
        y_received_ND = from_expert_major(y_ND, p.source_order_N)
        if keep_on_device:
            saved_inputs[i], saved_preacts[i] = Saved(device=[x_ND]), Saved(device=A)
        keep = [y_received_ND]
        if offload_input:                                                              # 3. offload
            saved_inputs[i] = _offload(run, [x_ND])
            keep.append(x_ND)
        if offload_preact:
            saved_preacts[i] = _offload(run, A)
            keep.extend(A)
        if plan.single:                                                                # 4. combine
            outputs.append(y_received_ND)
        else:
            out_RD = y_RD[offsets[i]:offsets[i + 1]]
            combined[i] = group.all_to_all_async(out_RD, y_received_ND, p.send_splits, p.recv_splits, streams)
        in_flight[i] = keep

    if run.timing is not None:
        run.timing.forward.start()
    with torch.no_grad():
        if n:
            dispatch(0)
        for i in range(n):
            if i + 1 < n:
                dispatch(i + 1)
            compute(i)
        for pending in combined:
            pending.wait()
        for saved in saved_inputs + saved_preacts:
            saved.copied.wait()
        streams.join()
        if plan.single:
            y_RD = outputs[0] if n == 1 else torch.cat(outputs) if n else x_TD.new_empty(0, D)
    in_flight.clear()  # drop what side streams read: every stream has been joined
    if run.timing is not None:
        run.timing.forward.stop()
    return y_RD, saved_inputs, saved_preacts, saved_acts


def pipelined_backward(dy_RD: torch.Tensor, x_TD: torch.Tensor | None, run: PipelineRun,
                       saved_inputs: list[Saved], saved_preacts: list[Saved], saved_acts: list, tokens: int):
    """Backward of `pipelined_forward`, partitions in reverse order.

    For each partition: dy rows go to the experts' ranks (All-to-All), T_DI and A
    are restored per the strategy (fetched one partition ahead), the input gradient
    is computed and sent back (All-to-All) into its rows of dx_RD, and the weight
    gradients accumulate while it travels. At the end each token sums its K rows.
    """
    plan, experts, group, streams, policy = run.plan, run.experts, run.group, run.streams, run.policy
    parts, n, D = plan.partitions, len(plan.partitions), dy_RD.shape[1]
    offsets = plan.send_offsets
    order = list(reversed(range(n)))
    dy_RD = dy_RD.contiguous()
    grads = experts.grads()
    # dx of every row, in send order (several ranks: plus one zero row for dropped pairs);
    # summed per token at the end (DispatchPlan.sum_rows_per_token).
    dx_RD = None if plan.single and n == 1 else dy_RD.new_empty(offsets[-1] + (0 if plan.single else 1), D)
    if not plan.single:
        dx_RD[-1].zero_()

    dy_received: list = [None] * n
    inputs_fetched: list = [None] * n
    preacts_fetched: list = [None] * n
    in_flight: list = [None] * n
    fetched_dy = [Pending.done()] * n
    fetched_input = [Pending.done()] * n
    fetched_preact = [Pending.done()] * n
    returned = [Pending.done()] * n
    host_reads_done: list = []

    def fetch(step: int) -> None:
        """Comm + copy streams: everything partition order[step] needs, ahead of its compute."""
        i = order[step]
        p = parts[i]
        dy_slice = dy_RD[offsets[i]:offsets[i + 1]]
        if plan.single:
            dy_received[step] = dy_slice
        else:
            dy_received[step] = dy_RD.new_empty(p.rows_received, D)
            fetched_dy[step] = group.all_to_all_async(dy_received[step], dy_slice,
                                                      p.recv_splits, p.send_splits, streams)
        if policy.recommunicate_input and not plan.single:
            x_RD = x_TD.index_select(0, p.token_index_R)
            inputs_fetched[step] = x_TD.new_empty(p.rows_received, D)
            in_flight[step] = [x_RD]
            fetched_input[step] = group.all_to_all_async(inputs_fetched[step], x_RD,
                                                         p.recv_splits, p.send_splits, streams)
        elif saved_inputs[i].host is not None:
            (inputs_fetched[step],), fetched_input[step] = _fetch_from_host(run, saved_inputs[i])
            host_reads_done.append((saved_inputs[i], fetched_input[step]))
        if saved_preacts[i].host is not None:
            preacts_fetched[step], fetched_preact[step] = _fetch_from_host(run, saved_preacts[i])
            host_reads_done.append((saved_preacts[i], fetched_preact[step]))

    def compute(step: int) -> None:
        i = order[step]
        p = parts[i]
        fetched_input[step].wait()                                   # T_DI of this partition
        if saved_inputs[i].device is not None:
            (x_ND,) = saved_inputs[i].device
        elif policy.recommunicate_input and plan.single:
            x_ND = x_TD.index_select(0, p.token_index_R)
        elif policy.recommunicate_input:
            x_ND = to_expert_major(inputs_fetched[step], p.expert_order_N)
        else:
            x_ND = inputs_fetched[step]
        inputs_fetched[step] = None
        if saved_preacts[i].device is not None:                      # A of this partition
            A = saved_preacts[i].device
        elif policy.recompute_preactivation:
            A = experts.project_in(x_ND, p.segments)
        else:
            fetched_preact[step].wait()
            A = preacts_fetched[step]
        preacts_fetched[step] = None
        fetched_dy[step].wait()                                      # dy, grouped by expert
        dy_ND = to_expert_major(dy_received[step], p.expert_order_N)
        dy_received[step] = None
        done = experts.input_grad(A, dy_ND, p.segments)
        dx_received_ND = from_expert_major(done.dx_ND, p.source_order_N)
        nonlocal dx_RD
        if plan.single and n == 1:
            dx_RD = dx_received_ND
        elif plan.single:
            dx_RD[offsets[i]:offsets[i + 1]].copy_(dx_received_ND)
        else:
            if step >= 2:
                returned[step - 2].wait()
                in_flight[step - 2] = None
            returned[step] = group.all_to_all_async(dx_RD[offsets[i]:offsets[i + 1]], dx_received_ND,
                                                    p.send_splits, p.recv_splits, streams)
            in_flight[step] = [dx_received_ND]
        experts.weight_grads(x_ND, A, dy_ND, p.segments, done, grads, h_NH=saved_acts[i])
        saved_acts[i] = None


    if run.timing is not None:
        run.timing.backward.start()
    with torch.no_grad():
        if n:
            fetch(0)
        for step in range(n):
            if step + 1 < n:
                fetch(step + 1)
            compute(step)
        for pending in returned:
            pending.wait()
        streams.join()
        dx_TD = plan.sum_rows_per_token(dx_RD) if n else dy_RD.new_zeros(tokens, D)
    in_flight.clear()  # drop what side streams read: every stream has been joined
    if run.timing is not None:
        run.timing.backward.stop()
        run.timing.backward_done = True
    for saved, fetched in host_reads_done:
        for base in saved.host_bases:
            run.host_pool.give_back(base, in_use_until=fetched.event)
    return dx_TD, grads


class PipelinedExperts(torch.autograd.Function):
    """dispatch → experts → combine for all partitions, as one autograd node.

    Inputs: x_TD, the run, then the expert parameters (w1, b1, w2, b2, w3; None
    where absent). Output: the combined rows Y_s in send order (R × D).
    """

    @staticmethod
    def forward(ctx, x_TD, run: PipelineRun, w1, b1, w2, b2, w3):
        save = any(ctx.needs_input_grad)
        y_RD, saved_inputs, saved_preacts, saved_acts = pipelined_forward(x_TD, run, save)
        ctx.run, ctx.tokens = run, x_TD.shape[0]
        # Device tensors go through save_for_backward (visible to saved-tensor hooks);
        # host copies are plain attributes.
        device_lists = [s.device for s in saved_inputs + saved_preacts] + [
            None if a is None else [a] for a in saved_acts]
        ctx.layout = [0 if tensors is None else len(tensors) for tensors in device_lists]
        device_tensors = [t for tensors in device_lists if tensors is not None for t in tensors]
        if save and run.policy.needs_layer_input:
            device_tensors.append(x_TD)
        ctx.save_for_backward(*device_tensors)
        ctx.saved_host = [Saved(host=s.host, host_bases=s.host_bases) for s in saved_inputs + saved_preacts]
        return y_RD

    @staticmethod
    def backward(ctx, dy_RD):
        tensors = list(ctx.saved_tensors)
        x_TD = tensors.pop() if ctx.run.policy.needs_layer_input else None
        restored = []
        for count in ctx.layout:
            restored.append(tensors[:count] if count else None)
            tensors = tensors[count:]
        n = len(ctx.saved_host) // 2
        saved = ctx.saved_host
        for s, device in zip(saved, restored[:2 * n]):
            s.device = device
        acts = [None if a is None else a[0] for a in restored[2 * n:]]
        dx_TD, grads = pipelined_backward(dy_RD, x_TD, ctx.run, saved[:n], saved[n:], acts, ctx.tokens)
        experts = ctx.run.experts
        ctx.run = None
        return (dx_TD, None, *grads.for_parameters(experts))
