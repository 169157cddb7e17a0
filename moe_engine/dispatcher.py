"""Token dispatch: permute → exchange counts → dispatch → (experts) → combine → un-permute.

Shapes: see moe_engine's legend (moe_engine/__init__.py).

Each function is either purely local or one collective, never both, and its
docstring says which: that cut is what lets the pipeline overlap them.

Rows are sent in *partition-major, expert-minor* order: all rows of partition 0
sorted by global expert, then partition 1, ... . A partition is one All-to-All
over all ranks. How pairs are assigned to partitions is the caller's choice:
MPipeMoE splits the *tokens* into n contiguous ranges (`chunk_by_tokens`),
FasterMoE splits by *destination rank* (`chunk_by_peers`).

Host reads. With several ranks the send splits of every All-to-All must be known on the
host, so a pass reads the device exactly once: this rank's count table and the tables
it received, together with every rank's pass statistics (`PassStats`), which ride in the
same count exchange. Counts are exchanged per *chunk* (C of them); when the number of
partitions is chosen only after the statistics are known (the online search), C is a
multiple of every candidate n and a partition is a run of C/n chunks.

The sync-free capacity mode (`plan_capacity`, layers' ``sync_free_capacity``) reads
nothing with several ranks either: partition i sends every rank a fixed C_i rows per
expert (a capacity, the same on every rank), padded where fewer pairs go there, so every
All-to-All has equal, static splits and no counts are exchanged. A pair beyond its
expert's C_i rows overflows: it is dropped from the pass and counted on the device.

With one rank nothing is read: every pair of partition i (dropped ones too, placed in
the last expert's segment, where they compute harmless numbers and get zero gradient)
is a row, so the row counts are static (K × the partition's tokens) and the grouped
kernels take their expert offsets from the device. (On CUDA the rows per expert are also
copied to the host without waiting, `HostCountsCopy`: a per-expert fallback in backward,
for a torch whose grouped kernel cannot write float32 gradients, reads them from there.)
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from . import kernels
from .comm import ExpertGroup
from .experts import ExpertSegments, HostCountsCopy, PassRows
from .router import Routing, count_ids

STATS = 3  # PassStats fields riding in the count exchange (a planner's values may follow them)


@dataclass(frozen=True)
class PassStats:
    """Values every rank agrees on for one pass (max over ranks)."""

    nonfinite: bool      # some rank's input holds NaN or Inf
    max_tokens: int      # the largest token count of any rank
    skew_bucket: int     # round(log2(max expert load / mean load)) of the busiest rank


@dataclass(frozen=True)
class PartitionPlan:
    """One partition's All-to-All: what to send, what arrives, how to group it by expert."""

    token_index_R: torch.Tensor          # token of each row sent, in send order
    send_splits: list[int]               # rows to each rank
    recv_splits: list[int]               # rows from each rank
    segments: ExpertSegments             # received rows grouped by local expert
    expert_order_N: torch.Tensor | None  # expert-major row j is received row expert_order_N[j]; None: identity
    source_order_N: torch.Tensor | None  # received row i is expert-major row source_order_N[i]; None: identity

    @property
    def rows_sent(self) -> int:
        return sum(self.send_splits)

    @property
    def rows_received(self) -> int:
        return self.segments.rows


@dataclass(frozen=True)
class PaddedRows:
    """How the rows of a capacity plan (`plan_capacity`) map to pairs. Its pair_index_R
    holds P (no pair: a padding row, which gets a zero gradient) where a slot is empty.

    row_of_pair_P: the row of each (token, choice) pair; R (no row) for a pair the router
                   dropped or that overflowed its expert's capacity.
    keep_TK:       whether a pair has a row: the router's keep and the capacity's."""

    row_of_pair_P: torch.Tensor
    keep_TK: torch.Tensor


@dataclass(frozen=True)
class DispatchPlan:
    """Frozen metadata that dispatch produces and combine consumes.

    single: one rank, no collectives: rows go straight from the tokens to the experts.
    The partitions' index tensors are views into token_index_R / pair_index_R."""

    tokens: int
    top_k: int
    token_index_R: torch.Tensor
    pair_index_R: torch.Tensor
    partitions: list[PartitionPlan]
    single: bool
    stats: PassStats
    padded: PaddedRows | None = None  # a capacity plan's rows (`plan_capacity`); None: every row is a pair's

    @functools.cached_property
    def row_of_pair(self) -> torch.Tensor:
        """Row sent for each (token, choice) pair; row 0 for a pair without one (a dropped
        pair with several ranks: its gate weight is 0). Computed once per pass."""
        rows = self.pair_index_R.shape[0]
        if self.padded is not None:
            return self.padded.row_of_pair_P.clamp(max=max(rows - 1, 0))
        index_P = torch.zeros((self.tokens * self.top_k,), dtype=torch.long, device=self.pair_index_R.device)
        return index_P.index_copy_(0, self.pair_index_R, torch.arange(rows, device=self.pair_index_R.device))

    def sum_rows_per_token(self, rows_RD: torch.Tensor) -> torch.Tensor:
        """Local. out_t = Σ_k rows[row of pair (t, k)] (0 for a pair without a row): one
        gather and a sum over k, where an index_add over rows would serialise on atomics
        (`tools/profile_layer.py`, gpt-s at 16k tokens on an H200, engine of commit
        d3ea763: 279 µs per index_add of 32k rows of 1024). With several ranks `rows_RD`
        has one extra, zero row after the R rows (where dropped pairs point)."""
        if self.single:
            index_P = self.row_of_pair
        elif self.padded is not None:
            index_P = self.padded.row_of_pair_P
        else:
            rows = self.pair_index_R.shape[0]
            index_P = torch.full((self.tokens * self.top_k,), rows, dtype=torch.long, device=rows_RD.device)
            index_P.index_copy_(0, self.pair_index_R, torch.arange(rows, device=rows_RD.device))
        return rows_RD.index_select(0, index_P).view(self.tokens, self.top_k, rows_RD.shape[-1]).sum(1)

    @property
    def send_offsets(self) -> list[int]:
        offsets = [0]
        for p in self.partitions:
            offsets.append(offsets[-1] + p.rows_sent)
        return offsets

    @property
    def max_rows_received(self) -> int:
        return max((p.rows_received for p in self.partitions), default=0)

    @property
    def max_rows_sent(self) -> int:
        return max((p.rows_sent for p in self.partitions), default=0)


# -- chunk assignment (local) ---------------------------------------------------------
def chunk_by_tokens(tokens: int, top_k: int, chunks: int, device: torch.device | str | None) -> torch.Tensor:
    """Local. Chunk of each (token, choice) pair: token t is in chunk t * C // T. For n
    dividing C, partition t * n // T is chunk // (C / n)."""
    token_T = torch.arange(tokens, device=device)
    return (token_T * chunks // max(tokens, 1)).repeat_interleave(top_k)


def chunk_by_peers(expert_ids_TK: torch.Tensor, experts_per_rank: int, rank: int,
                   world_size: int, group_size: int) -> torch.Tensor:
    """Local. FasterMoE's split along the device dimension: a pair destined for rank d
    is in step ((d - rank) mod W) // group_size, so step s exchanges with one group of
    `group_size` peers."""
    dest_rank = expert_ids_TK.flatten() // experts_per_rank
    return ((dest_rank - rank) % world_size) // group_size


def tokens_of_partition(tokens: int, partitions: int, i: int) -> int:
    """Local, host arithmetic. Tokens t with t * n // T == i."""
    def first(j: int) -> int:
        return -(-j * tokens // partitions)
    return first(i + 1) - first(i)


# -- pass statistics and counts (local) ---------------------------------------------
def pass_stats(x_TD: torch.Tensor, skew_bucket: torch.Tensor | int, extra: Sequence[int] = ()) -> torch.Tensor:
    """Local. [nonfinite, tokens, skew bucket, *extra] as int64 on the input's device (fills,
    and for `extra`, a planner's values, one non-blocking copy): the values every rank must
    agree on, sent with the counts."""
    stats = torch.zeros(STATS, dtype=torch.int64, device=x_TD.device)
    stats[0], stats[1], stats[2] = (~torch.isfinite(x_TD)).any(), x_TD.shape[0], skew_bucket
    if not extra:
        return stats
    return torch.cat([stats, torch.tensor(list(extra), dtype=torch.int64).to(x_TD.device, non_blocking=True)])


def count_rows(routing: Routing, chunk_P: torch.Tensor, chunks: int, num_experts: int, single: bool
               ) -> torch.Tensor:
    """Local. Rows per (chunk, expert) [C, E], int64 on the device. With several ranks
    dropped pairs are not counted (they are not sent); with one rank they count in the
    last expert of their chunk (see the module docstring)."""
    return count_ids(_pair_keys(routing, chunk_P, chunks, num_experts, single),
                     chunks * num_experts + 1)[:-1].view(chunks, num_experts)


def _pair_keys(routing: Routing, chunk_P: torch.Tensor, chunks: int, num_experts: int, single: bool) -> torch.Tensor:
    """Sort key of each pair: chunk * E + expert; a dropped pair sorts last (several
    ranks) or into its chunk's last expert (one rank)."""
    expert_P = routing.expert_ids_TK.flatten()
    keep_P = routing.keep_TK.flatten()
    if single:
        return chunk_P * num_experts + torch.where(keep_P, expert_P, num_experts - 1)
    return torch.where(keep_P, chunk_P * num_experts + expert_P, chunks * num_experts)


def exchange_counts(counts_CE: torch.Tensor, stats: torch.Tensor, group: ExpertGroup) -> torch.Tensor:
    """Collective. Every rank sends each rank its counts for that rank's experts and its
    pass statistics (S ≥ STATS int64 values: `PassStats` first, then whatever else the
    ranks must agree on); returns [W(source), C·L + S] (int64, on the counts' device)."""
    chunks, num_experts = counts_CE.shape
    local = num_experts // group.size
    send_WCL = counts_CE.view(chunks, group.size, local).transpose(0, 1).reshape(group.size, chunks * local)
    send = torch.cat([send_WCL, stats.expand(group.size, stats.numel())], dim=1)
    return group.exchange_counts(send, stats_width=stats.numel())


@dataclass(frozen=True)
class CountTables:
    """The pass's one device read, on the host (numpy int64)."""

    sent_CE: np.ndarray       # this rank's rows per (chunk, global expert)
    received_WCL: np.ndarray  # rows per (source rank, chunk, local expert)
    stats_W: np.ndarray       # every rank's pass statistics [W, S] (PassStats in the first STATS)

    @property
    def stats(self) -> PassStats:
        """The agreed statistics: the maximum over ranks."""
        top = self.stats_W[:, :STATS].max(axis=0)
        return PassStats(bool(top[0]), int(top[1]), int(top[2]))


def without_experts(tables: CountTables, experts: Sequence[int], rank: int) -> CountTables:
    """Local, host arithmetic. ``tables`` with no rows for the global ``experts`` (FasterMoE's
    shadowed experts, computed where their tokens are: shadowing.py), in what this rank
    sends and in what it receives for the ones it owns (``rank``: its rank in the group)."""
    local = tables.received_WCL.shape[2]
    sent_CE = tables.sent_CE.copy()
    sent_CE[:, list(experts)] = 0
    received_WCL = tables.received_WCL.copy()
    received_WCL[:, :, [e % local for e in experts if e // local == rank]] = 0
    return CountTables(sent_CE, received_WCL, tables.stats_W)


def read_counts(counts_CE: torch.Tensor, received: torch.Tensor, stats_width: int = STATS) -> CountTables:
    """Local. The one blocking device-to-host read of a pass with several ranks.
    stats_width: S, the statistics each rank sent (`exchange_counts`)."""
    chunks, _ = counts_CE.shape
    world = received.shape[0]
    both = torch.cat([counts_CE.flatten(), received.flatten()]).cpu().numpy()
    sent = both[:counts_CE.numel()].reshape(counts_CE.shape)
    table = both[counts_CE.numel():].reshape(world, -1)
    return CountTables(sent, table[:, :-stats_width].reshape(world, chunks, -1), table[:, -stats_width:])


# -- plans (local) --------------------------------------------------------------------
def plan_single(routing: Routing, chunk_P: torch.Tensor, partitions: int, num_experts: int,
                stats: PassStats) -> DispatchPlan:
    """Local, no device reads. The plan on one rank (chunks = partitions)."""
    tokens, top_k = routing.expert_ids_TK.shape
    keys_P = _pair_keys(routing, chunk_P, partitions, num_experts, single=True)
    pair_order = torch.argsort(keys_P, stable=True)
    counts_nE = count_ids(keys_P, partitions * num_experts).view(partitions, num_experts)
    ends_nE = counts_nE.cumsum(1).to(torch.int32)
    copies = HostCountsCopy.start(counts_nE)  # for a backward that needs them on the host
    token_index_R = pair_order // top_k
    rows_n = [top_k * tokens_of_partition(tokens, partitions, i) for i in range(partitions)]
    pass_rows = PassRows(counts_nE, rows_n)
    parts, start = [], 0
    for i, rows in enumerate(rows_n):
        segments = ExpertSegments(rows, ends_nE[i], counts_nE[i], counts_copy=copies[i] if copies else None,
                                  pass_rows=pass_rows, partition=i)
        parts.append(PartitionPlan(token_index_R[start:start + rows], [rows], [rows], segments, None, None))
        start += rows
    return DispatchPlan(tokens, top_k, token_index_R, pair_order, parts, True, stats)


def plan_exchanged(routing: Routing, chunk_P: torch.Tensor, partitions: int, tables: CountTables,
                   group: ExpertGroup) -> DispatchPlan:
    """Local, no device reads (the counts are on the host). The plan with several ranks:
    the C chunks of the count exchange merge into `partitions` runs of C/n chunks."""
    chunks, num_experts = tables.sent_CE.shape
    world, local, n = group.size, num_experts // group.size, partitions
    if chunks % n:
        raise ValueError(f"partitions={n} must divide the {chunks} count chunks of this pass")
    per = chunks // n
    partition_P = chunk_P // per if per > 1 else chunk_P
    sent_nWL = tables.sent_CE.reshape(n, per, world, local).sum(axis=1)
    recv_nWL = tables.received_WCL.reshape(world, n, per, local).sum(axis=2).transpose(1, 0, 2)
    return _plan_from_tables(routing, partition_P, sent_nWL, recv_nWL, tables.stats)


def plan_exchanged_by_peers(routing: Routing, partitions: int, tables: CountTables, group: ExpertGroup
                            ) -> DispatchPlan:
    """Local, no device reads (the counts are on the host). The plan with several ranks
    when the n partitions split the *destinations* (FasterMoE's split, `chunk_by_peers`
    with groups of W/n peers) whatever the chunks the counts were exchanged in: a pair's
    partition follows from its expert, so the per-expert totals of the count tables say
    what each partition sends and receives. A rank sends rank d its rows in partition
    ((d − rank) mod W) // (W/n) and receives source s's in ((rank − s) mod W) // (W/n)."""
    num_experts = tables.sent_CE.shape[1]
    world, local, n, rank = group.size, num_experts // group.size, partitions, group.rank
    if n < 1 or world % n:
        raise ValueError(f"partitions={n} must divide the expert-parallel world size {world} to split by peers")
    peers_per_partition = world // n
    partition_P = chunk_by_peers(routing.expert_ids_TK, local, rank, world, peers_per_partition)
    ranks = np.arange(world)
    sent_nWL = np.zeros((n, world, local), dtype=np.int64)
    sent_nWL[((ranks - rank) % world) // peers_per_partition, ranks] = tables.sent_CE.sum(axis=0).reshape(world, local)
    recv_nWL = np.zeros((n, world, local), dtype=np.int64)
    recv_nWL[((rank - ranks) % world) // peers_per_partition, ranks] = tables.received_WCL.sum(axis=1)
    return _plan_from_tables(routing, partition_P, sent_nWL, recv_nWL, tables.stats)


def _plan_from_tables(routing: Routing, partition_P: torch.Tensor, sent_nWL: np.ndarray, recv_nWL: np.ndarray,
                      stats: PassStats) -> DispatchPlan:
    """Local. The plan from each pair's partition and the rows each partition sends to and
    receives from every rank, per local expert ([n, W, L] on the host)."""
    tokens, top_k = routing.expert_ids_TK.shape
    n, world, local = sent_nWL.shape
    num_experts = world * local
    device = partition_P.device
    keys_P = _pair_keys(routing, partition_P, n, num_experts, single=False)
    pair_order = torch.argsort(keys_P, stable=True)

    send_splits_nW = sent_nWL.sum(axis=2)
    recv_splits_nW = recv_nWL.sum(axis=2)
    rows_received_n = recv_splits_nW.sum(axis=1)
    counts_nL = recv_nWL.sum(axis=1)
    total_sent = int(send_splits_nW.sum())
    total_received = int(rows_received_n.sum())
    pair_index_R = pair_order[:total_sent]  # the kept pairs (dropped ones sort last)
    token_index_R = pair_index_R // top_k

    # Everything the device needs from the host tables, in one host-to-device copy.
    starts_n = np.concatenate([[0], np.cumsum(rows_received_n)[:-1]])
    packed = np.concatenate([counts_nL.cumsum(axis=1).ravel(), counts_nL.ravel(), recv_nWL.ravel(),
                             starts_n, rows_received_n])
    packed_dev = torch.from_numpy(packed).to(device, non_blocking=True)
    nL = n * local
    ends_nL = packed_dev[:nL].view(n, local).to(torch.int32)
    counts_dev = packed_dev[nL:2 * nL].view(n, local)
    expert_order, source_order = None, None
    if local > 1 and total_received:
        repeats = packed_dev[2 * nL:2 * nL + n * world * local]
        starts_dev = packed_dev[2 * nL + n * world * local:2 * nL + n * world * local + n]
        sizes_dev = packed_dev[2 * nL + n * world * local + n:]
        block_key = torch.arange(nL, device=device).view(n, 1, local).expand(n, world, local).reshape(-1)
        key_N = block_key.repeat_interleave(repeats, output_size=total_received)
        order_N = torch.argsort(key_N, stable=True)
        start_of_row_N = starts_dev.repeat_interleave(sizes_dev, output_size=total_received)
        expert_order = order_N - start_of_row_N
        source_order = torch.empty_like(order_N).index_copy_(
            0, order_N, torch.arange(total_received, device=device)) - start_of_row_N

    pass_rows = PassRows(counts_dev, rows_received_n.tolist())
    parts, sent, received = [], 0, 0
    for i in range(n):
        rows_sent, rows_received = int(send_splits_nW[i].sum()), int(rows_received_n[i])
        received_rows = slice(received, received + rows_received)
        parts.append(PartitionPlan(
            token_index_R=token_index_R[sent:sent + rows_sent],
            send_splits=send_splits_nW[i].tolist(),
            recv_splits=recv_splits_nW[i].tolist(),
            segments=ExpertSegments(rows_received, ends_nL[i], counts_dev[i], counts_nL[i].tolist(),
                                    pass_rows=pass_rows, partition=i),
            expert_order_N=None if expert_order is None else expert_order[received_rows],
            source_order_N=None if source_order is None else source_order[received_rows],
        ))
        sent += rows_sent
        received += rows_received
    return DispatchPlan(tokens, top_k, token_index_R, pair_index_R, parts, False, stats)


def capacity_slots(factor: float, top_k: int, tokens: int, num_experts: int) -> int:
    """Host arithmetic. C = ⌈factor · K · T / E⌉: the rows a partition of T tokens sends each
    global expert in the sync-free capacity mode (its even share K·T/E times the factor)."""
    return math.ceil(factor * top_k * tokens / num_experts)


class CapacityLayout:
    """Local, no device reads. The static part of the capacity plans of one pass shape: T
    tokens on every rank, n partitions split by tokens, W ranks of L local experts, the
    capacity factor. Partition i (T_i tokens) sends C_i = `capacity_slots` rows per global
    expert: E·C_i rows in (destination rank, local expert, slot) order, L·C_i to each rank,
    and receives L·C_i from each rank, which regroup by local expert by a fixed permutation
    into segments of W·C_i rows. Built once per shape (fills and aranges on the device, no
    host-to-device copy, so a CUDA graph can capture a pass that builds it) and kept by the
    layer; its `PassRows` (the bias operands) are then built once for every pass of the shape.

    slots_n:        C_i per partition (host).
    rows_n:         rows each partition sends and receives, E·C_i (host); `rows` their sum R.
    capacity_key:   [n·E + 1] int64 on the device: C_i for sort key i·E + e (`_pair_keys`),
                    0 for the last key (pairs the router dropped).
    first_row_key:  [n·E + 1]: the row of key k's slot 0 in the pass's send order; R for the last.
    """

    def __init__(self, tokens: int, partitions: int, factor: float, top_k: int, world: int, local: int,
                 device: torch.device):
        E, n = world * local, partitions
        self.partitions, self.num_experts, self.world, self.local = n, E, world, local
        self.slots_n = [capacity_slots(factor, top_k, tokens_of_partition(tokens, n, i), E) for i in range(n)]
        self.rows_n = [E * slots for slots in self.slots_n]
        self.rows = sum(self.rows_n)
        capacity_key = torch.zeros(n * E + 1, dtype=torch.int64, device=device)
        for i, slots in enumerate(self.slots_n):
            capacity_key[i * E:(i + 1) * E].fill_(slots)
        self.capacity_key = capacity_key
        self.first_row_key = capacity_key.cumsum(0) - capacity_key
        counts_nL = capacity_key[:n * E].view(n, E)[:, :local] * world  # W·C_i rows per local expert
        ends_nL = counts_nL.cumsum(1).to(torch.int32)
        pass_rows = PassRows(counts_nL, self.rows_n)
        self.segments = [ExpertSegments(rows, ends_nL[i], counts_nL[i], [world * slots] * local,
                                        pass_rows=pass_rows, partition=i)
                         for i, (rows, slots) in enumerate(zip(self.rows_n, self.slots_n))]
        # received row (source w, local expert l, slot c) is expert-major row (l, w, c)
        self.expert_order_n: list[torch.Tensor | None] = []
        self.source_order_n: list[torch.Tensor | None] = []
        for rows, slots in zip(self.rows_n, self.slots_n):
            if local == 1 or not rows:
                self.expert_order_n.append(None)
                self.source_order_n.append(None)
                continue
            index_N = torch.arange(rows, device=device)
            self.expert_order_n.append(index_N.view(world, local, slots).transpose(0, 1).reshape(-1))
            self.source_order_n.append(index_N.view(local, world, slots).transpose(0, 1).reshape(-1))


def plan_capacity(routing: Routing, chunk_P: torch.Tensor, layout: CapacityLayout
                  ) -> tuple[DispatchPlan, torch.Tensor]:
    """Local, no device reads: the plan of the sync-free capacity mode (see `CapacityLayout`)
    and how many kept pairs overflowed (an int64 scalar on the device). Each kept pair takes
    the next slot of its (partition, expert), in pair order (the dropless plan's row order);
    a pair past the expert's C_i slots overflows: it gets no row and no weight this pass.
    Empty slots are padding rows: they gather token 0 (harmless values that no pair reads)
    and get a zero output gradient, so the parameter gradients are the dropless pass's when
    nothing overflows. chunk_P: each pair's partition (`chunk_by_tokens` with n chunks)."""
    tokens, top_k = routing.expert_ids_TK.shape
    n, E, R = layout.partitions, layout.num_experts, layout.rows
    pairs, device = tokens * top_k, chunk_P.device
    keys_P = _pair_keys(routing, chunk_P, n, E, single=False)
    pair_order = torch.argsort(keys_P, stable=True)
    keys_sorted = keys_P.index_select(0, pair_order)
    counts_key = count_ids(keys_P, n * E + 1)
    first_of_key = counts_key.cumsum(0).sub_(counts_key)
    slot_sorted = torch.arange(pairs, device=device).sub_(first_of_key.index_select(0, keys_sorted))
    fits_sorted = slot_sorted < layout.capacity_key.index_select(0, keys_sorted)
    row_sorted = torch.where(fits_sorted, layout.first_row_key.index_select(0, keys_sorted).add_(slot_sorted), R)
    overflowed = torch.logical_xor(keys_sorted < n * E, fits_sorted).sum()  # kept and not fitting
    # one spare entry at R takes the pairs without a row, then is cut off
    token_index_R = torch.zeros(R + 1, dtype=torch.int64, device=device).scatter_(
        0, row_sorted, pair_order // top_k)[:R]
    pair_index_R = torch.full((R + 1,), pairs, dtype=torch.int64, device=device).scatter_(
        0, row_sorted, pair_order)[:R]
    row_of_pair_P = torch.empty(pairs, dtype=torch.int64, device=device).index_copy_(0, pair_order, row_sorted)
    padded = PaddedRows(row_of_pair_P, (row_of_pair_P < R).view(tokens, top_k))
    parts, start = [], 0
    for i, rows in enumerate(layout.rows_n):
        splits = [layout.local * layout.slots_n[i]] * layout.world
        parts.append(PartitionPlan(token_index_R[start:start + rows], splits, splits, layout.segments[i],
                                   layout.expert_order_n[i], layout.source_order_n[i]))
        start += rows
    plan = DispatchPlan(tokens, top_k, token_index_R, pair_index_R, parts, False, PassStats(False, tokens, 0), padded)
    return plan, overflowed


def plan_dispatch(routing: Routing, chunk_P: torch.Tensor, partitions: int, num_experts: int,
                  group: ExpertGroup) -> DispatchPlan:
    """Permute + exchange counts for a partition count known beforehand (local, one
    collective with several ranks, local). The layers run the same steps with their
    pass statistics riding along (layers.MoELayerBase.plan)."""
    tokens = routing.expert_ids_TK.shape[0]
    if not group.distributed:
        return plan_single(routing, chunk_P, partitions, num_experts, PassStats(False, tokens, 0))
    counts_CE = count_rows(routing, chunk_P, partitions, num_experts, single=False)
    stats = torch.zeros(STATS, dtype=torch.int64, device=chunk_P.device)
    tables = read_counts(counts_CE, exchange_counts(counts_CE, stats, group))
    return plan_exchanged(routing, chunk_P, partitions, tables, group)


# -- moving rows (local) -------------------------------------------------------------
def gather_rows(x_TD: torch.Tensor, token_index_R: torch.Tensor) -> torch.Tensor:
    """Local. The permute step: row r is token token_index_R[r]."""
    return x_TD.index_select(0, token_index_R)


def to_expert_major(received_ND: torch.Tensor, expert_order_N: torch.Tensor | None) -> torch.Tensor:
    """Local. Received rows (source rank, local expert) → grouped by local expert."""
    return received_ND if expert_order_N is None else received_ND.index_select(0, expert_order_N)


def from_expert_major(rows_ND: torch.Tensor, source_order_N: torch.Tensor | None) -> torch.Tensor:
    """Local. Inverse of `to_expert_major` (give the partition's source_order_N)."""
    return rows_ND if source_order_N is None else rows_ND.index_select(0, source_order_N)


class _WeightedCombine(torch.autograd.Function):
    """y_t = Σ_k w_tk · rows[row_of_pair[t, k]]: one gather, K multiply-adds; backward
    is one broadcast product for the rows' gradient, gathered back into row order by
    the inverse permutation (no atomic scatter), and one product-sum for the weights'.
    Autograd's own graph for the same expression runs a dozen kernels (select and
    index_select backwards that scatter into zeroed buffers). A capacity plan's padding
    rows (pair index P, `PaddedRows`) belong to no pair and get a zero gradient.

    Mixed precision: the rows stay in the experts' dtype (bf16 under autocast) and the
    sum is formed in the weights' dtype (the router's float32, never rounded to the rows'
    or the output's bf16), so the gather moves half the bytes of an upcast copy and the
    values are the same (a bf16 number is exact in float32); the sum is rounded once, to
    ``out_dtype`` (the fused kernel writes it so; the PyTorch path returns the sum and the
    caller casts it). The rows' gradient is rounded to their dtype once, after the
    product, as a cast of the rows would round it.

    On CUDA both directions are one Triton kernel each (`kernels.weighted_combine`): the
    K rows are read where they lie and summed in float32, so neither the gathered P × D
    copy nor the broadcast products are written (the PyTorch kernels above took 21 ms of
    a gpt-xl step at batch 128 on an H200, three times a copy's time)."""

    @staticmethod
    def forward(ctx: Any, y_RD: torch.Tensor, weights_TK: torch.Tensor, row_of_pair_P: torch.Tensor,
                pair_index_R: torch.Tensor, tokens: int, top_k: int, out_dtype: torch.dtype,
                padded: bool = False) -> torch.Tensor:
        ctx.fused = kernels.fused_kernels_run_on(y_RD, weights_TK)
        ctx.padded = padded
        if ctx.fused:  # one kernel each way; autograd keeps the rows as they are (R ≤ P rows)
            ctx.save_for_backward(y_RD, weights_TK, pair_index_R)
            return kernels.weighted_combine(y_RD, weights_TK, row_of_pair_P, out_dtype)
        y_TKD = y_RD.index_select(0, row_of_pair_P).view(tokens, top_k, -1)
        weights_TK1 = weights_TK.unsqueeze(-1)
        y_TD = y_TKD[:, 0] * weights_TK1[:, 0]
        for k in range(1, top_k):
            y_TD.addcmul_(y_TKD[:, k], weights_TK1[:, k])
        ctx.save_for_backward(y_TKD, weights_TK, pair_index_R)
        ctx.rows = y_RD.shape[0]
        return y_TD

    @staticmethod
    def backward(ctx: Any, dy_TD: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.fused:
            y_RD, weights_TK, pair_index_R = ctx.saved_tensors
            d_rows, d_weights = kernels.weighted_combine_backward(dy_TD, y_RD, weights_TK, pair_index_R,
                                                                  *ctx.needs_input_grad[:2])
            return d_rows, d_weights, None, None, None, None, None, None
        y_TKD, weights_TK, pair_index_R = ctx.saved_tensors
        dy_TD = dy_TD.unsqueeze(1)
        d_rows = d_weights = None
        if ctx.needs_input_grad[0]:
            # the product in the weights' dtype, written in the rows' (one rounding); padded
            # rows (pair index P, `PaddedRows`) read one more pair's place, a zero row
            pairs, D = y_TKD.shape[0] * y_TKD.shape[1], y_TKD.shape[-1]
            d_pairs_PD = y_TKD.new_empty(pairs + ctx.padded, D)
            torch.mul(dy_TD, weights_TK.unsqueeze(-1), out=d_pairs_PD[:pairs].view(y_TKD.shape))
            if ctx.padded:
                d_pairs_PD[pairs].zero_()
            # Each row belongs to one pair (pair_index_R); a pair without a row has weight 0.
            d_rows = d_pairs_PD.index_select(0, pair_index_R)
        if ctx.needs_input_grad[1]:
            d_weights = (y_TKD * dy_TD).sum(-1)
        return d_rows, d_weights, None, None, None, None, None, None


def unpermute(y_RD: torch.Tensor, plan: DispatchPlan, weights_TK: torch.Tensor, keep_TK: torch.Tensor,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Local. y_t = Σ_k weight_tk × (expert output of pair (t, k)), 0 for a dropped pair,
    in ``out_dtype`` (default: the rows'; the layers give their input's, float32 under
    autocast while the rows are bf16).

    Rows go back to (token, choice) order (one gather) and the K choices are weighted
    and summed elementwise (`_WeightedCombine`; a batched (1 × K) @ (K × D) product per
    token runs as T tiny GEMMs: 1.5 ms forward and 1.3 ms backward at 16k tokens,
    d_model 1024, on an H200, by `tools/profile_layer.py` on the engine of commit
    190f888). Autograd keeps the K rows per token once, for the gate weights' gradient. A dropped pair's row is weighted by 0 (so it adds nothing
    and gets no gradient).
    """
    tokens, top_k, D = plan.tokens, plan.top_k, y_RD.shape[-1]
    out_dtype = out_dtype or y_RD.dtype
    if plan.padded is not None:  # a capacity plan: overflowed pairs are dropped too
        keep_TK = plan.padded.keep_TK
    # the weights in the dtype of the sum: never narrower than their own (the router's
    # float32), the rows' or out_dtype, so a bf16 output rounds the sum once and the
    # weights not at all
    sum_dtype = torch.promote_types(torch.promote_types(out_dtype, y_RD.dtype), weights_TK.dtype)
    weights_TK = (weights_TK * keep_TK).to(sum_dtype)
    if y_RD.shape[0] == 0:
        # Nothing kept on this rank. y_RD stays in the graph all the same: its backward
        # runs collectives that the other ranks wait for.
        return y_RD.new_zeros(tokens, D, dtype=out_dtype) + ((y_RD.sum() + weights_TK.sum()) * 0).to(out_dtype)
    y_TD = _WeightedCombine.apply(  # type: ignore[no-untyped-call]  # (Function.apply is untyped)
        y_RD, weights_TK, plan.row_of_pair, plan.pair_index_R, tokens, top_k, out_dtype, plan.padded is not None)
    return y_TD.to(out_dtype)  # type: ignore[no-any-return]  # (Function.apply is untyped; .to is a no-op but for bf16 rows, fp16 out)
