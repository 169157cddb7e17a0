"""The partitioned forward/backward schedule of MPipeMoE, described once (docs/engine.md,
"The method").

`forward_schedule` and `backward_schedule` list, in the order the host issues them, the
operations of one pipelined pass. pipeline.py executes this list (one handler per op
name), the simulator (moe_sim/simulator.py) prices it, and the performance model
(perf_model.py) takes its per-partition terms from it; tests/moe_engine/test_schedule.py checks
that the engine runs exactly these operations.

Shapes: see moe_engine's legend (moe_engine/__init__.py).

Forward, for each partition i (rows of one token range, one All-to-All each):

    1. gather    x rows of the partition                                (compute stream)
       dispatch  All-to-All of those rows (several ranks)               (comm stream)
    2. experts   group by expert → T_DI, GEMM1 → A, act, GEMM2 → T_DO  (compute stream)
    3. offload   T_DI and/or A to host, as the strategy says            (copy stream)
    4. combine   All-to-All of T_DO back into the output rows           (comm stream)

Partition i+1's dispatch is issued before partition i's experts, and partition i's
combine after them, so communication of one partition overlaps computation of the
next. With one rank there is no All-to-All: gather takes the rows straight into
expert order and the partitions' outputs are concatenated at the end.

Backward runs the partitions in reverse order (step s is partition n−1−s), fetching
step s+1's inputs while step s computes:

    fetch_dy               All-to-All of the output gradient's rows (several ranks)   (comm)
    regather, redispatch   T_DI again from the layer input x (S2, S4; several ranks)  (compute, comm)
    restore_input          T_DI from its host copy (S1, S3)                           (copy)
    restore_preactivation  A from its host copy (S1, S2)                              (copy)
    recover_input          T_DI in expert order (one rank, S2/S4: gathered from x)    (compute)
    recompute              A = GEMM1(T_DI) (S3, S4)                                   (compute)
    dgrad                  the input gradient dx of the partition's rows              (compute)
    return_dx              dx back to its rows: All-to-All (several ranks), or a copy (comm/compute)
    wgrad                  the weight gradients, accumulated, while dx travels        (compute)

Within a partition the input gradient is computed first and sent back at once; the
weight-gradient GEMMs then run while it travels. Keeping act(A) (FastMoE's
keep_activation) changes what wgrad reads, not which operations run.

Memory reuse: partition i (backward: step i) works in slot i % 2. The grouped kernels
allocate their outputs; what partition i's side-stream operations read (its T_DI, A
and T_DO in forward, its dx in backward) stays referenced until partition i+2 takes
the slot, and that operation waits (`after`) for those reads first. With a strategy
S1–S4 T_DI and A are then dropped, so the caching allocator hands the freed blocks to
the next partition and the working set is a partition's, and backward restores what
was dropped (memory.py); with "none" they are also kept for backward.

Waits: every operation on a side stream (comm, copy) first waits for everything
issued on the compute stream before it (StreamSet.on_comm / on_copy); `after` names
these compute operations too, for the reader. A wait for a side-stream operation is
made on the compute stream (Pending.wait), so it also orders every later compute
operation.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .memory import RestorePolicy

COMPUTE, COMM, COPY = "compute", "comm", "copy"


@dataclass(frozen=True)
class Op:
    """One operation of a pipelined pass.

    name:      what it does (see the module docstring)
    partition: the partition it works on (backward: the partition, not the step)
    stream:    compute, comm or copy
    after:     indices (into the schedule's list) of the earlier operations it waits for
    slot:      the working slot (0 or 1) its partition uses
    """

    name: str
    partition: int
    stream: str
    after: tuple[int, ...] = ()
    slot: int = 0


class _Builder:
    """Appends ops and finds earlier ones by (name, partition)."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.index: dict[tuple[str, int], int] = {}

    def add(self, name: str, partition: int, stream: str, after: Iterable[tuple[str, int]], slot: int) -> None:
        found = tuple(sorted({self.index[key] for key in after if key in self.index}))
        self.index[(name, partition)] = len(self.ops)
        self.ops.append(Op(name, partition, stream, found, slot))


def forward_schedule(partitions: int, policy: RestorePolicy, several: bool, save: bool = True) -> list[Op]:
    """The operations of pipeline.pipelined_forward, in issue order.

    several: more than one rank (All-to-Alls); save: backward will run (offloads only then)."""
    build = _Builder()
    offloads = [name for name, wanted in (("offload_input", policy.offload_input),
                                          ("offload_preactivation", policy.offload_preactivation))
                if wanted and save]

    def dispatch(i: int) -> None:
        build.add("gather", i, COMPUTE, (), i % 2)
        if several:
            build.add("dispatch", i, COMM, [("gather", i)], i % 2)

    def compute(i: int) -> None:
        # Partition i takes slot i % 2 once partition i-2's copies and combine have read it.
        reused = [(name, i - 2) for name in (*offloads, "combine")]
        build.add("experts", i, COMPUTE, [("dispatch", i), *reused], i % 2)
        for name in offloads:
            build.add(name, i, COPY, [("experts", i)], i % 2)
        if several:
            build.add("combine", i, COMM, [("experts", i)], i % 2)

    _one_ahead(partitions, dispatch, compute)
    return build.ops


def backward_schedule(partitions: int, policy: RestorePolicy, several: bool) -> list[Op]:
    """The operations of pipeline.pipelined_backward, in issue order (partitions in reverse)."""
    build = _Builder()
    order = list(reversed(range(partitions)))

    def fetch(step: int) -> None:
        i = order[step]
        if several:
            build.add("fetch_dy", i, COMM, [], step % 2)
        if policy.recommunicate_input and several:
            build.add("regather", i, COMPUTE, [], step % 2)
            build.add("redispatch", i, COMM, [("regather", i)], step % 2)
        elif policy.offload_input:
            build.add("restore_input", i, COPY, [], step % 2)
        if policy.offload_preactivation:
            build.add("restore_preactivation", i, COPY, [], step % 2)

    def compute(step: int) -> None:
        i, slot = order[step], step % 2
        build.add("recover_input", i, COMPUTE, [("redispatch", i), ("restore_input", i)], slot)
        if policy.recompute_preactivation:
            build.add("recompute", i, COMPUTE, [("recover_input", i)], slot)
        build.add("dgrad", i, COMPUTE, [("restore_preactivation", i), ("fetch_dy", i)], slot)
        # dx of partition i takes the slot once the dx of two steps earlier has arrived.
        earlier = [("return_dx", order[step - 2])] if step >= 2 and several else []
        build.add("return_dx", i, COMM if several else COMPUTE, [("dgrad", i), *earlier], slot)
        build.add("wgrad", i, COMPUTE, [("dgrad", i)], slot)

    _one_ahead(partitions, fetch, compute)
    return build.ops


def _one_ahead(steps: int, communicate: Callable[[int], None], compute: Callable[[int], None]) -> None:
    """The pipeline's order: step s+1's communication is issued before step s computes."""
    if steps:
        communicate(0)
    for step in range(steps):
        if step + 1 < steps:
            communicate(step + 1)
        compute(step)

