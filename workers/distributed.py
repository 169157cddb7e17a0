"""Data parallelism of the dense part, the global gradient clip and metric collectives.

Parallel layout (docs/design.md §3): W ranks in the default process group, cut into W / P
expert groups of P consecutive ranks (P, the expert-parallel degree, divides W; P = W: one
group, the whole world). Rank r is expert rank ``r % P`` of expert group ``r // P``; each
holds num_experts / P experts of every MoE layer, and the MoE layers' count exchange,
All-to-Alls and agreements run on its expert group. The ranks holding the same experts
(``r % P`` equal: one per expert group) form an expert-data-parallel group of W / P ranks
(``ExpertLayout``). The dense part (embeddings, attention, norms, routers) is replicated (or,
with ``shard_dense``, sharded) and data parallel over all W ranks.

Gradient rule, so the update equals that of the mean loss over all W ranks' tokens:
- dense parameters: PyTorch's data parallelism averages them over ranks:
  ``DistributedDataParallel`` (bucketed all-reduce overlapped with backward), or FSDP2's
  ``fully_shard`` (reduce-scatter; parameters, gradients and AdamW state sharded);
- expert parameters (marked where they are created, see ``lm.model.is_expert_param``):
  the MoE layer already summed the gradient over its expert group's tokens; they are
  excluded from DDP/FSDP2, summed over the expert-data-parallel group (its own process
  group; nothing when P = W) and divided by W (``DenseParallel.finish_gradients``).

Mixed precision: parameters and AdamW state stay float32 (the master weights); the
forward runs under ``torch.autocast`` at the compute dtype, so gradients arrive in float32
and are reduced in float32 (FSDP2: ``MixedPrecisionPolicy(param_dtype=compute,
reduce_dtype=float32)``).

The dense collectives run on their own process group (same ranks): the MoE layers'
All-to-Alls and DDP's bucket all-reduces are issued from different places during backward,
and on one gloo group two ranks issuing them in a different order would pair the wrong
collectives.

DTensor and FSDP2 (``torch.distributed.tensor``, ``.fsdp``) are imported where they are used:
importing them costs about 0.5 s, which the driver (app/jobs/job.py reads ``training_state_bytes``
here) and DDP runs need not pay.
"""
from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel as DDP

from lm.model import is_expert_param, valid_expert_degrees

DENSE_MODES = ("ddp", "fsdp2")


def world() -> tuple[int, int]:
    """(rank, world_size) of the default group, (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def cpu_threads_per_process(processes: int) -> int:
    """The intra-op threads each of ``processes`` CPU processes of one machine should use: its
    share of the cores this process may run on, at least 1. torch's default (every core in
    every process) oversubscribes the cores, and the idle threads of each process's pool spin
    on cores the others need: 4 gloo ranks on 2 cores ran the engine reference matrix 2.2x
    slower (31.8 and 34.5 s against 15.6 and 13.9 s)."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, processes))


def split_params(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(dense, expert) parameter lists, in a fixed order (same on every rank)."""
    dense: list[torch.nn.Parameter] = []
    expert: list[torch.nn.Parameter] = []
    for name, param in model.named_parameters():
        (expert if is_expert_param(name) else dense).append(param)
    return dense, expert


def expert_param_names(model: torch.nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters() if is_expert_param(name)]


def expert_bias_names(model: torch.nn.Module) -> list[str]:
    """The routers' ``expert_bias`` buffers (moe_engine/router.py) by name."""
    return [name for name, _ in model.named_buffers() if name.endswith("router.expert_bias")]


def new_group(timeout_s: float | None = None, backend: str | None = None) -> dist.ProcessGroup:
    """Collective: a process group of all ranks, with ``timeout_s`` (None: torch's default)."""
    timeout = timedelta(seconds=timeout_s) if timeout_s else None
    group: dist.ProcessGroup = dist.new_group(ranks=list(range(dist.get_world_size())), timeout=timeout,
                                              backend=backend)
    return group


def divisors(n: int) -> list[int]:
    """Local. The divisors of ``n`` (>= 1), ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def check_expert_degree(degree: int, num_experts: int, world_size: int, what: str = "expert_parallel") -> None:
    """Local. Raise ValueError naming the valid degrees unless ``degree`` divides both the
    ``world_size`` and ``num_experts``."""
    if isinstance(degree, int) and not isinstance(degree, bool) and degree >= 1 \
            and world_size % degree == 0 and num_experts % degree == 0:
        return
    valid = ", ".join(str(p) for p in valid_expert_degrees(num_experts, world_size))
    raise ValueError(f"{what}={degree!r} is invalid: the expert-parallel degree must divide both the "
                     f"{world_size} workers and the {num_experts} experts per MoE layer; use --expert-parallel "
                     f"{valid} (or another --num-workers / --num-experts)")


def default_expert_degree(num_experts: int, world_size: int, gpus_per_node: int | None = None) -> int:
    """Local. The expert-parallel degree a run gets unless it names one: the GPUs of one node
    where they divide the experts and the workers (every All-to-All then stays inside a node),
    else the world (also on CPU: ``gpus_per_node`` None)."""
    if gpus_per_node and gpus_per_node < world_size and world_size % gpus_per_node == 0 \
            and num_experts % gpus_per_node == 0:
        return gpus_per_node
    return world_size


@dataclass(frozen=True)
class ExpertLayout:
    """Where rank ``rank`` of ``world_size`` sits with expert-parallel degree ``degree``
    (the module docstring): expert groups of ``degree`` consecutive ranks, expert-data-
    parallel groups of the ranks ``degree`` apart."""

    rank: int
    world_size: int
    degree: int

    def __post_init__(self) -> None:
        if not (isinstance(self.degree, int) and self.degree >= 1 and self.world_size % self.degree == 0):
            raise ValueError(f"ExpertLayout.degree={self.degree!r} is invalid: it must divide the world size "
                             f"{self.world_size}; use one of {', '.join(map(str, divisors(self.world_size)))}")

    @property
    def expert_rank(self) -> int:
        """This rank's place in its expert group (which experts it holds)."""
        return self.rank % self.degree

    @property
    def replicas(self) -> int:
        """Expert groups (copies of every expert): W / P."""
        return self.world_size // self.degree

    def expert_group_ranks(self, group: int) -> list[int]:
        return [group * self.degree + j for j in range(self.degree)]

    def replica_group_ranks(self, expert_rank: int) -> list[int]:
        return [g * self.degree + expert_rank for g in range(self.replicas)]


def expert_groups_across_nodes(node_of_rank: Sequence[str], degree: int) -> list[list[int]]:
    """Local. The expert groups (as their ranks) whose ranks sit on more than one node, given
    each rank's node (``node_of_rank[r]``); empty when every group's All-to-All stays inside a
    node. Ray Train numbers its workers node by node (2.60: ``WorkerGroup.
    _sort_workers_by_gpu_id_grouped_by_node``), so groups of ``degree`` consecutive ranks stay
    on one node whenever each node holds a multiple of ``degree`` workers (8 GPUs, P = 8)."""
    layout = ExpertLayout(0, len(node_of_rank), degree)
    groups = [layout.expert_group_ranks(g) for g in range(layout.replicas)]
    return [ranks for ranks in groups if len({node_of_rank[r] for r in ranks}) > 1]


def expert_groups(layout: ExpertLayout, timeout_s: float | None = None
                  ) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """Collective (every rank of the default group, in the same order): (expert group,
    expert-data-parallel group) of this rank. The expert group is the default group when
    P = W (None without one: a single process); the expert-data-parallel group is None
    when P = W (nothing to reduce). ``timeout_s``: their collective timeout (a new group does
    not inherit the default group's)."""
    if layout.world_size == 1 or not dist.is_initialized():
        return None, None
    if layout.degree == layout.world_size:
        return dist.group.WORLD, None
    timeout = timedelta(seconds=timeout_s) if timeout_s else None
    mine: dict[str, dist.ProcessGroup] = {}
    # every rank creates every group (torch.distributed's rule), the expert groups first
    for kind, count, ranks_of in (("expert", layout.replicas, layout.expert_group_ranks),
                                  ("replica", layout.degree, layout.replica_group_ranks)):
        for index in range(count):
            ranks = ranks_of(index)
            group = dist.new_group(ranks=ranks, timeout=timeout)
            if layout.rank in ranks:
                mine[kind] = group
    return mine["expert"], mine["replica"]


class DenseParallel:
    """The model wrapped for data parallelism of its dense part (collective at construction).

    ``module`` is what to call (DDP wrapper, or the model itself: FSDP2 and W=1 change it in
    place); ``model`` the plain model. ``mode``: "ddp" or "fsdp2"; with W=1 nothing is
    wrapped. ``compute_dtype``: the autocast dtype of ``autocast()`` (float32: none).
    ``timeout_s``: the dense group's collective timeout; give the default group's (a new
    group does not inherit it: DDP's bucket rebuild in the second forward would otherwise
    wait 30 minutes for a dead rank). ``replica_group``: the expert-data-parallel group
    (``expert_groups``; None: each expert on one rank, P = W) with ``replicas`` ranks.
    """

    def __init__(self, model: torch.nn.Module, *, mode: str = "ddp", world_size: int = 1,
                 device: torch.device = torch.device("cpu"), compute_dtype: torch.dtype = torch.float32,
                 timeout_s: float | None = None, replica_group: dist.ProcessGroup | None = None,
                 replicas: int = 1):
        if mode not in DENSE_MODES:
            raise ValueError(f"dense parallelism {mode!r} is unknown: choose one of {', '.join(DENSE_MODES)}")
        self.model, self.mode, self.world_size, self.device = model, mode, world_size, device
        self.compute_dtype = compute_dtype
        self.replica_group, self.replicas = replica_group, replicas
        self.checkpoint_mesh: DeviceMesh | None = None  # the experts' mesh of workers/checkpoint.py, made once
        self.dense, self.expert = split_params(model)
        self.module = model
        self.group: dist.ProcessGroup | None = None
        if world_size == 1:
            return
        # Collective: a group of its own for the dense collectives (see the module docstring).
        group = self.group = new_group(timeout_s)
        if mode == "ddp":
            # (the routers' expert bias too: DDP would broadcast rank 0's buffers before every
            # forward, a collective the overlapped schedule's plain-model forwards skip; each rank
            # moves its own copy by the same summed counts instead, workers/balance.py)
            DDP._set_params_and_buffers_to_ignore_for_model(model, expert_param_names(model)
                                                            + expert_bias_names(model))
            self.module = DDP(model, process_group=group,
                              device_ids=[device.index] if device.type == "cuda" else None)
        else:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mesh = DeviceMesh.from_group(group, device.type)
            policy = MixedPrecisionPolicy(param_dtype=None if compute_dtype == torch.float32 else compute_dtype,
                                          reduce_dtype=torch.float32)
            for block in model.blocks:  # type: ignore[union-attr]  # (an MoETransformer) one all-gather / reduce-scatter unit per block
                fully_shard(block, mesh=mesh, mp_policy=policy, ignored_params=set(split_params(block)[1]))
            fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=set(self.expert))
            self.dense, self.expert = split_params(model)  # the sharded (DTensor) parameters

    def autocast(self) -> AbstractContextManager[Any]:
        """Local. The forward's mixed-precision context (a no-op for float32)."""
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def sync(self, last_micro_batch: bool) -> AbstractContextManager[Any]:
        """Local. Around a micro-batch's forward and backward: the dense gradients are reduced
        only in the last micro-batch of a step (earlier ones accumulate locally)."""
        if self.world_size == 1:
            return contextlib.nullcontext()
        if self.mode == "ddp":
            assert isinstance(self.module, DDP)
            return contextlib.nullcontext() if last_micro_batch else self.module.no_sync()
        self.model.set_requires_gradient_sync(last_micro_batch)  # type: ignore[operator]  # (FSDP2 added it)
        return contextlib.nullcontext()

    def reduce_dense_gradients(self) -> None:
        """Collective (DDP mode): the dense gradients averaged over ranks as DDP would, in
        one all-reduce per dtype, for a schedule that ran its forwards on the plain
        ``model`` (workers/schedules.py: DDP's reducer prepares each backward in its
        forward, which two micro-batches in flight on two threads would break)."""
        if self.world_size == 1:
            return
        if self.mode != "ddp":
            raise ValueError(f"reduce_dense_gradients needs mode 'ddp', not {self.mode!r}: FSDP2 reduces "
                             f"its own gradients (use the sequential micro-batch schedule)")
        grads = [p.grad for p in self.dense if p.grad is not None]
        all_reduce_in_buckets(grads, self.group, divide_by=self.world_size)

    def finish_gradients(self) -> None:
        """Collective with expert replicas (else local). Expert grads summed over the
        expert-data-parallel group, then / W (the MoE layer summed them over its expert
        group's tokens; the dense ones were averaged by DDP/FSDP2)."""
        if self.world_size == 1:
            return
        if self.replica_group is not None:
            reduce_expert_grads(self.expert, self.replica_group)
        for param in self.expert:
            if param.grad is not None:
                param.grad.div_(self.world_size)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Collective: exact global gradient norm over the dense part and every rank's expert
        shard; clips to ``max_norm``. Returns the norm before clipping (the same on every
        rank). ``max_norm <= 0`` only measures."""
        return clip_grad_norm(self.dense, self.expert, max_norm, self.world_size, self.replicas)

    def clip_divisor(self, max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Collective, no host reads: (norm, divisor) as 0-dim float32 device tensors, the
        divisor ``(norm + 1e-6) / max_norm`` where the norm exceeds ``max_norm``, else 1. The
        gradients stay as they are: the fused AdamW divides them by it as it reads them
        (its ``grad_scale``), saving clip_grad_norm's pass over every gradient."""
        return clip_divisor(self.dense, self.expert, max_norm, self.world_size, self.replicas)


def reduce_expert_grads(expert: list[torch.nn.Parameter], group: dist.ProcessGroup) -> None:
    """Collective (the expert-data-parallel ``group``): every expert gradient summed over the
    group, in place; one all-reduce per dtype over the gradients flattened into one buffer.
    A missing gradient counts as zeros (every rank must send the same buffer)."""
    for param in expert:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    all_reduce_in_buckets([param.grad for param in expert if param.grad is not None], group)


# DDP's default bucket (bucket_cap_mb=25): a reduction's extra memory is two buckets, not a copy
# of every gradient (1 GB a rank for mixtral-s at expert-parallel 8 when flattened whole).
BUCKET_BYTES = 25 * 2**20


def gradient_buckets(grads: Sequence[torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> list[list[torch.Tensor]]:
    """Local. `grads` cut into buckets of one dtype each, in their order, each up to
    `bucket_bytes` (a larger gradient is a bucket alone). The same on every rank that holds
    the same parameters: the buckets decide the collectives."""
    buckets: list[list[torch.Tensor]] = []
    for dtype in sorted({g.dtype for g in grads}, key=str):
        size = 0
        for grad in (g for g in grads if g.dtype == dtype):
            nbytes = grad.numel() * grad.element_size()
            if not buckets or buckets[-1][0].dtype != dtype or size + nbytes > bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(grad)
            size += nbytes
    return buckets


def all_reduce_in_buckets(grads: Sequence[torch.Tensor], group: dist.ProcessGroup | None, *,
                          divide_by: int = 1, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Collective (`group`): every gradient summed over the group in place (then divided by
    `divide_by`), one all-reduce per bucket (`gradient_buckets`), issued in bucket order on
    every rank. Two buckets are in flight at a time: the next one is packed while the last
    one is reduced, and a bucket's sums are copied back once it is done."""
    pending: tuple[dist.Work | None, torch.Tensor, list[torch.Tensor]] | None = None

    def unpack(work: dist.Work | None, flat: torch.Tensor, bucket: list[torch.Tensor]) -> None:
        if work is not None:
            work.wait()
        parts = flat.split([g.numel() for g in bucket])
        torch._foreach_copy_(bucket, [part.view_as(g) for part, g in zip(parts, bucket)])

    for bucket in gradient_buckets(grads, bucket_bytes):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        if divide_by != 1:
            flat.div_(divide_by)
        work = dist.all_reduce(flat, group=group, async_op=True)
        if pending is not None:
            unpack(*pending)
        pending = (work, flat, bucket)
    if pending is not None:
        unpack(*pending)


def _square_sum(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Σ g² over ``grads`` in float32: one multi-tensor norm kernel per group of tensors
    (``torch._foreach_norm``), where a pow and a sum per tensor read every gradient twice
    and launched 2 kernels per parameter (5.6 ms per gpt-xl step on an H200). The squares of
    the per-tensor norms differ from the per-tensor sums of squares by float32 rounding."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
    return torch.stack(norms).square().sum()


def _global_norm(dense: list[torch.nn.Parameter], expert: list[torch.nn.Parameter],
                 world_size: int, replicas: int = 1) -> torch.Tensor:
    """Collective: the global gradient norm as a 0-dim float32 tensor on the device. Each
    expert is held by ``replicas`` ranks (the same reduced gradient): its square counts once."""
    from torch.distributed.tensor import DTensor

    device = (dense or expert)[0].device
    sharded = [p.grad.to_local() for p in dense if isinstance(p.grad, DTensor)]
    replicated = [p.grad for p in dense if p.grad is not None and not isinstance(p.grad, DTensor)]
    expert_grads = [p.grad for p in expert if p.grad is not None]
    summed = _square_sum(sharded, device) + _square_sum(expert_grads, device) / replicas if replicas > 1 \
        else _square_sum(sharded + expert_grads, device)
    if world_size > 1:
        dist.all_reduce(summed)
    return (_square_sum(replicated, device) + summed).sqrt()


def _local_grads(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]


def clip_grad_norm(dense: list[torch.nn.Parameter], expert: list[torch.nn.Parameter], max_norm: float,
                   world_size: int, replicas: int = 1) -> float:
    """Collective: global gradient norm (expert shards and FSDP2-sharded dense grads summed
    over ranks, replicated dense grads counted once); clips to ``max_norm``.

    Returns the norm before clipping (the same on every rank). ``max_norm <= 0`` only measures.
    """
    norm = float(_global_norm(dense, expert, world_size, replicas))
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        grads = _local_grads(dense + expert)
        for dtype in {g.dtype for g in grads}:  # one multi-tensor kernel per dtype, not one per gradient
            torch._foreach_mul_([g for g in grads if g.dtype == dtype], scale)
    return norm


def clip_divisor(dense: list[torch.nn.Parameter], expert: list[torch.nn.Parameter], max_norm: float,
                 world_size: int, replicas: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Collective, no host reads: (norm, divisor) of ``DenseParallel.clip_divisor``; dividing
    by the divisor clips as ``clip_grad_norm`` does (its factor's reciprocal: the same
    gradients up to float32 rounding). ``max_norm <= 0``: the divisor is 1."""
    norm = _global_norm(dense, expert, world_size, replicas)
    if max_norm <= 0:
        return norm, torch.ones_like(norm)
    return norm, torch.where(norm > max_norm, (norm + 1e-6) / max_norm, torch.ones_like(norm))


def reduce_sum(values: list[float], device: torch.device, world_size: int) -> list[float]:
    """Collective: element-wise sum over ranks (float64)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if world_size > 1:
        dist.all_reduce(tensor)
    return tensor.tolist()


def all_reduce_sum_(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    """Collective: ``tensor`` summed over ranks, in place (on its own device: NCCL rejects
    CPU tensors); nothing with one rank."""
    if world_size > 1:
        dist.all_reduce(tensor)
    return tensor


def reduce_max(values: list[float], device: torch.device, world_size: int) -> list[float]:
    """Collective: element-wise max over ranks (float64)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def training_state_bytes(dense_numel: int, expert_numel: int, world_size: int, shard_dense: bool,
                         compute_bytes: int, param_bytes: int = 4) -> dict[str, int]:
    """Local. Bytes per rank of the training state (not activations): master parameters,
    their gradients and AdamW's two moments (``param_bytes`` each: 4 for float32, 2 for
    pure bf16 training), and the compute-dtype copy of the parameters that autocast /
    FSDP2 materialise per step (0 when it is the parameters' own dtype).
    ``dense_numel`` / ``expert_numel``: unsharded dense and this rank's expert elements."""
    dense_here = -(-dense_numel // world_size) if shard_dense else dense_numel
    params = param_bytes * (dense_here + expert_numel)
    compute_copy = 0 if compute_bytes == param_bytes else compute_bytes * (dense_numel + expert_numel)
    return {"master_params_bytes": params, "grads_bytes": params, "optimizer_state_bytes": 2 * params,
            "compute_copy_bytes": compute_copy, "training_state_bytes": 4 * params + compute_copy}
