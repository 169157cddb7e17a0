"""Token dispatch: permute → exchange counts → dispatch → (experts) → combine → un-permute.

Legend: T tokens on this rank, K top_k, D d_model, E global experts,
L local experts (E / P), P ranks, R rows this rank sends (kept (token, choice)
pairs), N rows this rank receives, n partitions.

Each function is either purely local or one collective, never both, and its
docstring says which: that cut is what lets the pipeline overlap them.

Rows are sent in *partition-major, expert-minor* order: all rows of partition 0
sorted by global expert, then partition 1, ... . A partition is one All-to-All
over all ranks. How rows are assigned to partitions is the caller's choice:
MPipeMoE splits the *tokens* into n contiguous ranges (`partition_by_tokens`),
FasterMoE splits by *destination rank* (`partition_by_peers`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .comm import ExpertGroup
from .router import Routing, count_ids


@dataclass(frozen=True)
class PartitionPlan:
    """One partition's All-to-All: what to send, what arrives, how to group it by expert."""

    token_index_R: torch.Tensor        # token of each row sent, in send order
    pair_index_R: torch.Tensor         # (token * K + choice) of each row sent
    send_splits: list[int]             # rows to each rank
    recv_splits: list[int]             # rows from each rank
    expert_order_N: torch.Tensor       # expert-major row j is received row expert_order_N[j]
    source_order_N: torch.Tensor       # received row i is expert-major row source_order_N[i]
    expert_counts: list[int]           # rows per local expert, expert-major

    @property
    def rows_sent(self) -> int:
        return sum(self.send_splits)

    @property
    def rows_received(self) -> int:
        return sum(self.recv_splits)


@dataclass(frozen=True)
class DispatchPlan:
    """Frozen metadata that dispatch produces and combine consumes.
    The partitions' index tensors are views into token_index_R / pair_index_R."""

    tokens: int
    top_k: int
    token_index_R: torch.Tensor
    pair_index_R: torch.Tensor
    partitions: list[PartitionPlan]

    @property
    def row_of_pair(self) -> torch.Tensor:
        """Row sent for each (token, choice) pair; row 0 for a dropped pair (weighted by 0)."""
        rows = self.pair_index_R.shape[0]
        index_P = torch.zeros((self.tokens * self.top_k,), dtype=torch.long, device=self.pair_index_R.device)
        index_P[self.pair_index_R] = torch.arange(rows, device=self.pair_index_R.device)
        return index_P

    @property
    def max_rows_received(self) -> int:
        return max((p.rows_received for p in self.partitions), default=0)

    @property
    def max_rows_sent(self) -> int:
        return max((p.rows_sent for p in self.partitions), default=0)


# -- partition assignment (local) ---------------------------------------------------
def partition_by_tokens(tokens: int, top_k: int, partitions: int, device) -> torch.Tensor:
    """Local. Partition of each (token, choice) pair: token t is in partition t * n // T."""
    token_T = torch.arange(tokens, device=device)
    return (token_T * partitions // max(tokens, 1)).repeat_interleave(top_k)


def partition_by_peers(expert_ids_TK: torch.Tensor, experts_per_rank: int, rank: int,
                       world_size: int, group_size: int) -> torch.Tensor:
    """Local. FasterMoE's split along the device dimension: a pair destined for rank d
    is in step ((d - rank) mod P) // group_size, so step s exchanges with one group of
    `group_size` peers."""
    dest_rank = expert_ids_TK.flatten() // experts_per_rank
    return ((dest_rank - rank) % world_size) // group_size


# -- plan (local, one collective, local) ---------------------------------------------------
def count_rows(routing: Routing, partition_P: torch.Tensor, num_partitions: int, num_experts: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Local. Sort pairs by (partition, expert), dropped pairs last; count the kept rows
    per partition and expert. No reads from the device: the caller learns how many
    pairs are kept from the counts it reads anyway (`build_plan`).

    Returns (all pair indices, the kept ones first in send order; counts [n, E]).
    """
    expert_P = routing.expert_ids_TK.flatten()
    keep_P = routing.keep_TK.flatten()
    dropped_key = num_partitions * num_experts  # sorts after every kept pair
    kept_key_P = partition_P * num_experts + expert_P
    pair_order = torch.argsort(torch.where(keep_P, kept_key_P, dropped_key), stable=True)
    counts_nE = count_ids(kept_key_P, dropped_key, weights=keep_P)
    return pair_order, counts_nE.reshape(num_partitions, num_experts)


def exchange_counts(counts_nE: torch.Tensor, group: ExpertGroup) -> torch.Tensor:
    """Collective. Send counts [n, E] → received counts [P(src), n, L]."""
    num_partitions, num_experts = counts_nE.shape
    local = num_experts // group.size
    send_PnL = counts_nE.reshape(num_partitions, group.size, local).transpose(0, 1).contiguous()
    return group.exchange_counts(send_PnL)


def build_plan(pair_order: torch.Tensor, counts_nE: torch.Tensor, recv_PnL: torch.Tensor,
               top_k: int, tokens: int) -> DispatchPlan:
    """Local. Split the sorted pairs into partitions and derive every split size."""
    world_size, num_partitions, local = recv_PnL.shape
    # One device-to-host read for both count tables (each read waits for the device).
    both_host = torch.cat([counts_nE.flatten(), recv_PnL.flatten()]).cpu()
    counts_host = both_host[:counts_nE.numel()].reshape(num_partitions, world_size, local)
    recv_host = both_host[counts_nE.numel():].reshape(world_size, num_partitions, local)
    pair_index_R = pair_order[:int(counts_host.sum())]  # the kept pairs (dropped ones sort last)
    device = pair_index_R.device
    local_ids = torch.arange(local, device=device).repeat(world_size)
    token_index_R = pair_index_R // top_k
    partitions, start = [], 0
    for i in range(num_partitions):
        send_splits = counts_host[i].sum(-1).tolist()
        recv_PL = recv_host[:, i, :]
        rows = sum(send_splits)
        rows_in_partition = slice(start, start + rows)
        start += rows
        expert_counts = recv_PL.sum(0).tolist()
        # output_size known on the host: no device-to-host read of the repeats' sum; the
        # repeats go up with a non-blocking copy (staged at once, no stream synchronisation)
        expert_of_received_N = local_ids.repeat_interleave(recv_PL.flatten().to(device, non_blocking=True),
                                                           output_size=sum(expert_counts))
        expert_order_N = torch.argsort(expert_of_received_N, stable=True)
        partitions.append(PartitionPlan(
            token_index_R=token_index_R[rows_in_partition],
            pair_index_R=pair_index_R[rows_in_partition],
            send_splits=send_splits,
            recv_splits=recv_PL.sum(-1).tolist(),
            expert_order_N=expert_order_N,
            source_order_N=torch.argsort(expert_order_N),
            expert_counts=expert_counts,
        ))
    return DispatchPlan(tokens, top_k, token_index_R, pair_index_R, partitions)


def plan_dispatch(routing: Routing, partition_P: torch.Tensor, num_partitions: int,
                  num_experts: int, group: ExpertGroup) -> DispatchPlan:
    """Permute + exchange counts: the three steps above (local, collective, local)."""
    tokens, top_k = routing.expert_ids_TK.shape
    pair_order, counts_nE = count_rows(routing, partition_P, num_partitions, num_experts)
    recv_PnL = exchange_counts(counts_nE, group)
    return build_plan(pair_order, counts_nE, recv_PnL, top_k, tokens)


# -- moving rows (local) -------------------------------------------------------------
def gather_rows(x_TD: torch.Tensor, token_index_R: torch.Tensor) -> torch.Tensor:
    """Local. The permute step: row r is token token_index_R[r]."""
    return x_TD.index_select(0, token_index_R)


def to_expert_major(received_ND: torch.Tensor, expert_order_N: torch.Tensor) -> torch.Tensor:
    """Local. Received rows (source rank, local expert) → grouped by local expert."""
    return received_ND.index_select(0, expert_order_N)


def from_expert_major(rows_ND: torch.Tensor, source_order_N: torch.Tensor) -> torch.Tensor:
    """Local. Inverse of `to_expert_major` (give the partition's source_order_N)."""
    return rows_ND.index_select(0, source_order_N)


def unpermute(y_RD: torch.Tensor, plan: DispatchPlan, weights_TK: torch.Tensor, keep_TK: torch.Tensor) -> torch.Tensor:
    """Local. y_t = Σ_k weight_tk × (expert output of pair (t, k)), 0 for a dropped pair.

    Rows go back to (token, choice) order, then one batched (1 × K) @ (K × D) product
    per token weights and sums them; autograd keeps the K rows per token once, for the
    gate weights' gradient. A dropped pair reads any row with weight 0 (so it adds
    nothing and gets no gradient).
    """
    tokens, top_k, D = plan.tokens, plan.top_k, y_RD.shape[-1]
    weights_T1K = (weights_TK * keep_TK).to(y_RD.dtype).unsqueeze(1)
    if y_RD.shape[0] == 0:
        # Nothing kept on this rank. y_RD stays in the graph all the same: its backward
        # runs collectives that the other ranks wait for.
        return y_RD.new_zeros(tokens, D) + (y_RD.sum() + weights_T1K.sum()) * 0
    y_TKD = y_RD.index_select(0, plan.row_of_pair).view(tokens, top_k, D)
    return torch.bmm(weights_T1K, y_TKD).squeeze(1)
