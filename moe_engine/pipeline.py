"""Executes the partitioned forward/backward schedule of MPipeMoE (schedule.py describes it:
the operations, their streams, what each waits for and the slots they use).

`pipelined_forward` and `pipelined_backward` walk the schedule's list of operations and
call one handler per op name; the handlers hold the tensors. Before a handler runs, the
compute stream (CUDA) or the host (CPU) waits for the side-stream operations the op is
`after`; every side-stream operation itself first waits for the compute stream
(StreamSet.on_comm / on_copy). Every tensor a side stream reads stays referenced until
the stream that frees it has waited for that read.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .comm import ExpertGroup
from .dispatcher import DispatchPlan, from_expert_major, to_expert_major
from .experts import Experts
from .granularity import PassTiming
from .memory import HostBufferPool, RestorePolicy
from .schedule import COMM, COMPUTE, COPY, Op, backward_schedule, forward_schedule
from .streams import Pending, StreamSet


@dataclass
class PipelineRun:
    """Everything one pipelined call needs besides tensors (built per forward).

    keep_activation: also keep act(A) for backward, as autograd would (the FastMoE
    baseline); otherwise backward recomputes it from A, elementwise.
    reserved_sms: SMs the GEMMs leave to the All-to-Alls running beside them
    (StreamSet.reserving_sms; ExpertGroup.comm_sms when partitions overlap, else 0), for
    the compute operations issued while an All-to-All is in flight (`_execute`).
    recorder: a list that gets (op name, partition, stream) for every operation as it is
    issued (tests/moe_engine/test_schedule.py); None records nothing."""

    experts: Experts
    group: ExpertGroup
    plan: DispatchPlan
    streams: StreamSet
    policy: RestorePolicy
    host_pool: HostBufferPool
    timing: PassTiming | None = None   # set while the granularity search measures this pass
    keep_activation: bool = False
    reserved_sms: int = 0
    recorder: list | None = None

    def issued(self, op: Op, stream: str) -> None:
        """Note that `op` was issued on `stream` (for the recorder)."""
        if self.recorder is not None:
            self.recorder.append((op.name, op.partition, stream))


@dataclass
class Saved:
    """What backward has of one partition's T_DI or A (a list of tensors): device
    tensors, or host copies (and the buffers behind them: the pool's, given back after
    backward; the pool ignores any other)."""

    device: list | None = None
    host: list | None = None
    host_bases: list = field(default_factory=list)
    copied: Pending = field(default_factory=Pending.done)


def _offload(run: PipelineRun, op: Op, tensors: list) -> Saved:
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
    run.issued(op, COPY)
    return Saved(host=hosts, host_bases=bases, copied=streams.record_copy())


def _fetch_from_host(run: PipelineRun, op: Op, saved: Saved) -> tuple[list, Pending]:
    """Copy stream. Start copying host copies back into new device tensors."""
    device = run.streams.device
    outs = [torch.empty(h.shape, dtype=h.dtype, device=device) for h in saved.host]  # type: ignore[union-attr]  # (saved.host is set when offloaded)
    with run.streams.on_copy():
        for out, host in zip(outs, saved.host):  # type: ignore[arg-type]  # (saved.host is set when offloaded)
            out.copy_(host, non_blocking=True)
    run.issued(op, COPY)
    return outs, run.streams.record_copy()


def _execute(ops: list[Op], handlers: dict, streams: StreamSet | None = None, reserved_sms: int = 0
             ) -> list[Pending]:
    """Issue `ops` in order: wait for the side-stream operations each is after, then run
    its handler. Returns what each op issued (done for compute operations).

    A compute operation issued while an All-to-All is in flight (issued, and not yet
    waited for by the compute stream) runs with ``reserved_sms`` SMs left to it
    (`StreamSet.reserving_sms`); the others, the pass's fill and drain among them, run on
    every SM."""
    issued: list[Pending] = []
    comm_in_flight: set[int] = set()
    for index, op in enumerate(ops):
        for earlier in op.after:
            if ops[earlier].stream != COMPUTE:
                issued[earlier].wait()
                comm_in_flight.discard(earlier)
        if reserved_sms and streams is not None and op.stream == COMPUTE and comm_in_flight:
            with streams.reserving_sms(reserved_sms):
                issued.append(handlers[op.name](op) or Pending.done())
        else:  # (no context manager: a pass issues tens of operations, each one's host time counts)
            issued.append(handlers[op.name](op) or Pending.done())
        if op.stream == COMM:
            comm_in_flight.add(index)
    return issued


def pipelined_forward(x_TD: torch.Tensor, run: PipelineRun, save: bool):
    """Returns (y_RD, saved_inputs, saved_preacts, saved_acts): combined rows in send
    order and, when `save`, what backward needs per partition."""
    plan, experts, group, streams, policy = run.plan, run.experts, run.group, run.streams, run.policy
    parts, n, D = plan.partitions, len(plan.partitions), x_TD.shape[1]
    offsets = plan.send_offsets
    keep_on_device = save and not policy.share_buffers

    y_RD = None if plan.single else x_TD.new_empty(offsets[-1], D)
    outputs: list = []                  # single rank: each partition's T_DO, concatenated at the end
    received: list = [None] * n         # the rows each dispatch brings (or, on one rank, gathers)
    sent: list = [None] * n             # the rows each dispatch sends, until experts waited for it
    in_flight: list = [None, None]      # per slot: tensors the slot's side-stream operations read
    saved_inputs = [Saved() for _ in range(n)]
    saved_preacts = [Saved() for _ in range(n)]
    saved_acts: list = [None] * n
    kept: dict = {}                     # T_DI and A of the partition being offloaded

    def gather(op: Op) -> None:                                                        # 1. gather
        x_RD = x_TD.index_select(0, parts[op.partition].token_index_R)
        run.issued(op, COMPUTE)
        if plan.single:
            received[op.partition] = x_RD
        else:
            sent[op.partition] = x_RD

    def dispatch(op: Op) -> Pending:                                                   #    dispatch
        i, p = op.partition, parts[op.partition]
        received[i] = x_TD.new_empty(p.rows_received, D)
        pending = group.all_to_all_async(received[i], sent[i], p.recv_splits, p.send_splits, streams)
        run.issued(op, COMM)
        return pending

    def compute(op: Op) -> None:                                                       # 2. experts
        i, p = op.partition, parts[op.partition]
        in_flight[op.slot] = None  # partition i-2's copies and combine are done: drop what they read
        sent[i] = None
        x_ND = to_expert_major(received[i], p.expert_order_N)
        received[i] = None
        A = experts.project_in(x_ND, p.segments)
        h_NH = experts.activate(A)
        y_ND = experts.project_out(h_NH, p.segments)
        if save and run.keep_activation:
            saved_acts[i] = h_NH
        del h_NH
        y_received_ND = from_expert_major(y_ND, p.source_order_N)
        run.issued(op, COMPUTE)
        if keep_on_device:
            saved_inputs[i], saved_preacts[i] = Saved(device=[x_ND]), Saved(device=A)
        kept.update(input=[x_ND], preactivation=A, output=y_received_ND)
        in_flight[op.slot] = [y_received_ND]
        if plan.single:
            outputs.append(y_received_ND)

    def offload_input(op: Op) -> Pending:                                              # 3. offload
        saved_inputs[op.partition] = _offload(run, op, kept["input"])
        in_flight[op.slot].extend(kept["input"])
        return saved_inputs[op.partition].copied

    def offload_preactivation(op: Op) -> Pending:
        saved_preacts[op.partition] = _offload(run, op, kept["preactivation"])
        in_flight[op.slot].extend(kept["preactivation"])
        return saved_preacts[op.partition].copied

    def combine(op: Op) -> Pending:                                                    # 4. combine
        i, p = op.partition, parts[op.partition]
        pending = group.all_to_all_async(y_RD[offsets[i]:offsets[i + 1]], kept["output"],  # type: ignore[index]  # (y_RD exists unless plan.single)
                                         p.send_splits, p.recv_splits, streams)
        run.issued(op, COMM)
        return pending

    handlers = {"gather": gather, "dispatch": dispatch, "experts": compute, "offload_input": offload_input,
                "offload_preactivation": offload_preactivation, "combine": combine}
    ops = forward_schedule(n, policy, several=not plan.single, save=save)
    if run.timing is not None:
        run.timing.forward.start()
    with torch.no_grad():
        issued = _execute(ops, handlers, streams, run.reserved_sms)
        kept.clear()
        for op, pending in zip(ops, issued):  # the combines and copies
            if op.name != "dispatch":
                pending.wait()
        streams.join()
        if plan.single:
            y_RD = outputs[0] if n == 1 else torch.cat(outputs) if n else x_TD.new_empty(0, D)
    in_flight.clear()  # drop what side streams read: every stream has been joined
    if run.timing is not None:
        run.timing.forward.stop()
    return y_RD, saved_inputs, saved_preacts, saved_acts


def pipelined_backward(dy_RD: torch.Tensor, x_TD: torch.Tensor | None, run: PipelineRun,
                       saved_inputs: list[Saved], saved_preacts: list[Saved], saved_acts: list, tokens: int):
    """Backward of `pipelined_forward`, partitions in reverse order (schedule.backward_schedule).

    For each partition: dy rows go to the experts' ranks (All-to-All), T_DI and A
    are restored per the strategy (fetched one partition ahead), the input gradient
    is computed and sent back (All-to-All) into its rows of dx_RD, and the weight
    gradients accumulate while it travels. At the end each token sums its K rows.
    """
    plan, experts, group, streams, policy = run.plan, run.experts, run.group, run.streams, run.policy
    parts, n, D = plan.partitions, len(plan.partitions), dy_RD.shape[1]
    offsets = plan.send_offsets
    dy_RD = dy_RD.contiguous()
    grads = experts.grads()
    # dx of every row, in send order (several ranks: plus one zero row for dropped pairs);
    # summed per token at the end (DispatchPlan.sum_rows_per_token).
    dx_RD = None if plan.single and n == 1 else dy_RD.new_empty(offsets[-1] + (0 if plan.single else 1), D)
    if not plan.single:
        dx_RD[-1].zero_()  # type: ignore[index]  # (dx_RD exists for n > 1)

    # Per partition, from its fetch to its compute:
    dy_received: list = [None] * n
    sent: list = [None] * n             # the x rows a re-dispatch sends
    inputs_fetched: list = [None] * n
    preacts_fetched: list = [None] * n
    in_flight: list = [None, None]      # per slot: the dx rows the slot's All-to-All reads
    host_reads_done: list = []
    # The partition being computed: T_DI, A, dy by expert and its input gradient.
    current: dict = {}

    def fetch_dy(op: Op) -> Pending:
        i, p = op.partition, parts[op.partition]
        dy_received[i] = dy_RD.new_empty(p.rows_received, D)
        pending = group.all_to_all_async(dy_received[i], dy_RD[offsets[i]:offsets[i + 1]],
                                         p.recv_splits, p.send_splits, streams)
        run.issued(op, COMM)
        return pending

    def regather(op: Op) -> None:
        sent[op.partition] = x_TD.index_select(0, parts[op.partition].token_index_R)  # type: ignore[union-attr]  # (x_TD is given when not plan.single)
        run.issued(op, COMPUTE)

    def redispatch(op: Op) -> Pending:
        i, p = op.partition, parts[op.partition]
        inputs_fetched[i] = x_TD.new_empty(p.rows_received, D)  # type: ignore[union-attr]  # (x_TD is given when not plan.single)
        pending = group.all_to_all_async(inputs_fetched[i], sent[i], p.recv_splits, p.send_splits, streams)
        run.issued(op, COMM)
        return pending

    def restore_input(op: Op) -> Pending:
        (inputs_fetched[op.partition],), fetched = _fetch_from_host(run, op, saved_inputs[op.partition])
        host_reads_done.append((saved_inputs[op.partition], fetched))
        return fetched

    def restore_preactivation(op: Op) -> Pending:
        preacts_fetched[op.partition], fetched = _fetch_from_host(run, op, saved_preacts[op.partition])
        host_reads_done.append((saved_preacts[op.partition], fetched))
        return fetched

    def recover_input(op: Op) -> None:                               # T_DI of this partition
        i, p = op.partition, parts[op.partition]
        sent[i] = None
        if saved_inputs[i].device is not None:
            (x_ND,) = saved_inputs[i].device  # type: ignore[misc]  # (the slot holds the inputs here)
        elif policy.recommunicate_input and plan.single:
            x_ND = x_TD.index_select(0, p.token_index_R)  # type: ignore[union-attr]  # (x_TD is given when not plan.single)
        elif policy.recommunicate_input:
            x_ND = to_expert_major(inputs_fetched[i], p.expert_order_N)
        else:
            x_ND = inputs_fetched[i]
        inputs_fetched[i] = None
        run.issued(op, COMPUTE)
        current.clear()
        current["x_ND"] = x_ND
        if saved_preacts[i].device is not None:                      # A of this partition, when kept
            current["A"] = saved_preacts[i].device

    def recompute(op: Op) -> None:
        current["A"] = experts.project_in(current["x_ND"], parts[op.partition].segments)
        run.issued(op, COMPUTE)

    def dgrad(op: Op) -> None:
        i, p = op.partition, parts[op.partition]
        if "A" not in current:                                       # A restored from host
            current["A"] = preacts_fetched[i]
        preacts_fetched[i] = None
        dy_ND = to_expert_major(dy_RD[offsets[i]:offsets[i + 1]] if plan.single else dy_received[i],
                                p.expert_order_N)                    # dy, grouped by expert
        dy_received[i] = None
        done = experts.input_grad(current["A"], dy_ND, p.segments, activation_kept=saved_acts[i] is not None)
        run.issued(op, COMPUTE)
        current.update(dy_ND=dy_ND, done=done, dx_received_ND=from_expert_major(done.dx_ND, p.source_order_N))

    def return_dx(op: Op) -> Pending | None:
        nonlocal dx_RD
        i, p = op.partition, parts[op.partition]
        dx_received_ND = current["dx_received_ND"]
        if plan.single and n == 1:
            dx_RD = dx_received_ND
        elif plan.single:
            dx_RD[offsets[i]:offsets[i + 1]].copy_(dx_received_ND)  # type: ignore[index]  # (dx_RD exists for n > 1)
        if plan.single:
            run.issued(op, COMPUTE)
            return None
        in_flight[op.slot] = None  # the dx of two steps earlier has arrived
        pending = group.all_to_all_async(dx_RD[offsets[i]:offsets[i + 1]], dx_received_ND,  # type: ignore[index]  # (dx_RD exists for n > 1)
                                         p.send_splits, p.recv_splits, streams)
        run.issued(op, COMM)
        in_flight[op.slot] = [dx_received_ND]
        return pending

    def wgrad(op: Op) -> None:
        i, p = op.partition, parts[op.partition]
        experts.weight_grads(current["x_ND"], current["A"], current["dy_ND"], p.segments, current["done"], grads,
                             h_NH=saved_acts[i])
        saved_acts[i] = None
        current.clear()
        run.issued(op, COMPUTE)

    handlers = {"fetch_dy": fetch_dy, "regather": regather, "redispatch": redispatch, "restore_input": restore_input,
                "restore_preactivation": restore_preactivation, "recover_input": recover_input,
                "recompute": recompute, "dgrad": dgrad, "return_dx": return_dx, "wgrad": wgrad}
    ops = backward_schedule(n, policy, several=not plan.single)
    if run.timing is not None:
        run.timing.backward.start()
    with torch.no_grad():
        issued = _execute(ops, handlers, streams, run.reserved_sms)
        for op, pending in zip(ops, issued):
            if op.name == "return_dx":
                pending.wait()
        streams.join()
        dx_TD = plan.sum_rows_per_token(dx_RD) if n else dy_RD.new_zeros(tokens, D)  # type: ignore[arg-type]  # (dx_RD exists when n > 0)
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
        # Everything backward needs goes through save_for_backward, device tensors and host
        # copies alike, and nothing else holds them: saved-tensor hooks see all of it, so a
        # user's activation checkpointing (torch.utils.checkpoint) drops it after forward
        # and has it recomputed, as for any layer. (Host copies kept as ctx attributes
        # outlived a checkpointed forward; the pool forgets a buffer so dropped.)
        saved = saved_inputs + saved_preacts
        ctx.on_host = [s.device is None and s.host is not None for s in saved]
        lists = [s.host if on_host else s.device for s, on_host in zip(saved, ctx.on_host)] + [
            None if a is None else [a] for a in saved_acts]
        ctx.layout = [0 if tensors is None else len(tensors) for tensors in lists]
        tensors = [t for ts in lists if ts is not None for t in ts]
        if save and run.policy.needs_layer_input:
            tensors.append(x_TD)
        ctx.save_for_backward(*tensors)
        return y_RD

    @staticmethod
    def backward(ctx, dy_RD):
        tensors = list(ctx.saved_tensors)
        x_TD = tensors.pop() if ctx.run.policy.needs_layer_input else None
        restored = []
        for count in ctx.layout:
            restored.append(tensors[:count] if count else None)
            tensors = tensors[count:]
        n = len(ctx.on_host) // 2
        saved = [Saved(host=ts, host_bases=[t if t._base is None else t._base for t in ts])
                 if on_host and ts is not None else Saved(device=ts) for ts, on_host in zip(restored, ctx.on_host)]
        acts = [None if a is None else a[0] for a in restored[2 * n:]]
        dx_TD, grads = pipelined_backward(dy_RD, x_TD, ctx.run, saved[:n], saved[n:], acts, ctx.tokens)
        experts = ctx.run.experts
        ctx.run = None
        return (dx_TD, None, *grads.for_parameters(experts))
