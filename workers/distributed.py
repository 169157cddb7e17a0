"""Gradient and metric collectives of the training loop (each function is one or two collectives).

Parallel layout (docs/design.md §3): W ranks in the default process group, which is also the
expert-parallel group. The dense part (embeddings, attention, norms, routers) is
replicated and data parallel; each rank holds E/W experts of every MoE layer.

Gradient rule, so the update equals that of the mean loss over all W ranks' tokens:
- replicated parameters: all-reduce (sum) in one flat bucket, then divide by W;
- expert parameters (name contains ``experts.``): the MoE layer already summed the
  gradient over every rank's tokens; only divide by W. Never all-reduce them.

We do not use DistributedDataParallel: it would all-reduce the expert shards too.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from app.model import is_expert_param


def world() -> tuple[int, int]:
    """(rank, world_size) of the default group, (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def split_params(model: torch.nn.Module) -> tuple[list, list]:
    """(replicated, expert) parameter lists, in a fixed order (same on every rank)."""
    replicated, expert = [], []
    for name, param in model.named_parameters():
        (expert if is_expert_param(name) else replicated).append(param)
    return replicated, expert


def average_gradients(replicated: list, expert: list, world_size: int) -> None:
    """Collective: one all-reduce of the replicated grads (flat bucket); scales all by 1/W."""
    if world_size == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in replicated]
    if grads:
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        flat.div_(world_size)
        for param, synced in zip(replicated, _unflatten_dense_tensors(flat, grads)):
            if param.grad is None:
                param.grad = synced
            else:
                param.grad.copy_(synced)
    for param in expert:
        if param.grad is not None:
            param.grad.div_(world_size)


def clip_grad_norm(replicated: list, expert: list, max_norm: float, world_size: int) -> float:
    """Collective: global gradient norm (expert shards summed over ranks); clips to ``max_norm``.

    Returns the norm before clipping (the same on every rank). ``max_norm <= 0`` only measures.
    """
    def sq(params):
        grads = [p.grad.float() for p in params if p.grad is not None]
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=params[0].device if params else "cpu")
        return torch.stack([g.pow(2).sum() for g in grads]).sum()

    device = (replicated or expert)[0].device
    expert_sq = sq(expert).to(device)
    if world_size > 1:
        dist.all_reduce(expert_sq)
    total = (sq(replicated).to(device) + expert_sq).sqrt()
    norm = float(total)
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for param in replicated + expert:
            if param.grad is not None:
                param.grad.mul_(scale)
    return norm


def reduce_sum(values: list[float], device, world_size: int) -> list[float]:
    """Collective: element-wise sum over ranks (float64)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if world_size > 1:
        dist.all_reduce(tensor)
    return tensor.tolist()


def reduce_max(values: list[float], device, world_size: int) -> list[float]:
    """Collective: element-wise max over ranks (float64)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()
