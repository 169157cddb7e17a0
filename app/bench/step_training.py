"""The step the training-step bench times (app/bench/step.py, whose docstring describes it): one
optimizer step as workers/loop.py's Trainer.step takes it (`training_step`: its micro-batches
under a schedule, `run_micro_batches`), on what it runs on (StepParts), the data-parallel
reduction it models (GradientReduction: DDP's buckets) and its micro-batches (`step_batches`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lm.model import ModelPreset, MoETransformer, lm_loss
from moe_sim.emulation import EmulatedExpertGroup
from moe_sim.network import all_reduce_s
from workers.distributed import DenseParallel
from workers.schedules import SCHEDULES as RUN_SCHEDULES
from workers.schedules import Lanes, forward_backward

DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's default bucket_cap_mb
AUX_LOSS_WEIGHT = 0.01         # WorkerConfig's default
GRAD_CLIP = 1.0


# -- the data-parallel reduction -----------------------------------------------------------------

@dataclass
class Bucket:
    params: list
    nbytes: int
    seconds: float
    ready: int = 0


class GradientReduction:
    """DDP's bucketed all-reduce of the dense gradients, modelled (module docstring).

    Buckets follow DDP: parameters in reverse order of registration (the order backward
    produces their gradients), DDP_BUCKET_BYTES of float32 gradients each; a bucket's time is
    a ring all-reduce over the data-parallel ranks (moe_sim/network.py all_reduce_s). Armed
    for the last micro-batch only (DDP's no_sync for the others). The values are not changed
    (every emulated rank holds the same gradients); on CPU only the times are counted.

    Expert parameters are not reduced while each expert lives on one rank (the expert
    degree E = W). With an expert-parallel degree E < W (replicas across W / E groups) their
    gradients are all-reduced in float32 over the W / E replicas after the backward, as
    ``DenseParallel.finish_gradients`` does (``expert_seconds``, EmulatedCluster.
    expert_reduction_s), on the same link after the dense buckets.
    """

    def __init__(self, dense: list[nn.Parameter], group: EmulatedExpertGroup, device: torch.device,
                 expert: list[nn.Parameter] | None = None):
        self.group, self.device = group, device
        cluster = group.cluster
        expert_bytes = sum(param.numel() * 4 for param in expert or [])
        self.expert_seconds = cluster.expert_reduction_s(expert_bytes) if expert_bytes else 0.0
        self.buckets: list[Bucket] = []
        current: list[nn.Parameter] = []
        nbytes = 0
        for param in reversed(dense):
            current.append(param)
            nbytes += param.numel() * 4
            if nbytes >= DDP_BUCKET_BYTES:
                self.buckets.append(Bucket(current, nbytes, all_reduce_s(cluster.network, cluster.layout, nbytes)))
                current, nbytes = [], 0
        if current:
            self.buckets.append(Bucket(current, nbytes, all_reduce_s(cluster.network, cluster.layout, nbytes)))
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.armed = False
        self.scale = 1.0
        self.issued: list[float] = []
        self.handles = [p.register_post_accumulate_grad_hook(self._ready) for p in dense]

    @property
    def seconds(self) -> float:
        """Modelled seconds of one step's reduction (every bucket, and the expert replicas')."""
        return sum(b.seconds for b in self.buckets) + self.expert_seconds

    def arm(self) -> None:
        self.armed = True
        self.issued = []
        for bucket in self.buckets:
            bucket.ready = 0

    def _ready(self, param: nn.Parameter) -> None:
        if not self.armed:
            return
        bucket = self.bucket_of[id(param)]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._issue(bucket)

    def _issue(self, bucket: Bucket) -> None:
        self.issued.append(bucket.seconds)
        self.group.occupy_link(bucket.seconds * self.scale, self.device, wait=False)

    def finish(self) -> None:
        """End of backward: buckets whose gradients never came are issued now (DDP's
        finalize), and the caller's stream waits for the link."""
        if not self.armed:
            return
        for bucket in self.buckets:
            if bucket.ready < len(bucket.params):
                bucket.ready = len(bucket.params)
                self._issue(bucket)
        if self.expert_seconds:  # the expert replicas' all-reduce, after the backward
            self.issued.append(self.expert_seconds)
            self.group.occupy_link(self.expert_seconds * self.scale, self.device, wait=False)
        self.armed = False
        link = self.group.timing.link
        if link is not None:
            torch.cuda.current_stream(self.device).wait_stream(link)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


# -- one step ------------------------------------------------------------------------------------

@dataclass
class StepParts:
    """What a step runs on: the model, the shared optimizer and clip, the reduction, the group."""

    model: MoETransformer
    parallel: DenseParallel
    optimizer: torch.optim.Optimizer
    reduction: GradientReduction
    group: EmulatedExpertGroup
    device: torch.device
    dtype: torch.dtype
    lanes: Lanes | None = None  # the model's lanes (Lanes.create), for the overlapped schedule


def run_micro_batches(schedule: str, parts: StepParts, batches: list) -> torch.Tensor:
    """The step's forwards and backwards over its micro-batches by ``schedule``
    (workers/schedules.py forward_backward, as Trainer.step runs them), each micro-batch's
    share 1/K of the step's loss; returns the summed [lm, aux] losses (detached).

    The modelled dense reduction follows the trainer: "sequential" reduces in the last
    micro-batch's backward (DDP: each bucket issued when its gradients are ready);
    "overlapped" reduces once after the last backward (DenseParallel.reduce_dense_gradients:
    every bucket issued then). With one micro-batch both are the sequential schedule."""
    if schedule not in RUN_SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is unknown: choose from {', '.join(RUN_SCHEDULES)}")
    K = len(batches)
    in_backward = schedule == "sequential" or K < 2  # else after the last backward

    def loss_of(module: nn.Module, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs_BS, targets_BS = batches[index]
        if in_backward and index == K - 1:
            parts.reduction.arm()
        with parts.parallel.autocast():
            logits_BSV, aux_loss = module(inputs_BS, ids_checked=True)
            loss_lm = lm_loss(logits_BSV.float(), targets_BS)
        loss = loss_lm + AUX_LOSS_WEIGHT * aux_loss.float()
        return loss * (1.0 / K), torch.stack([loss_lm.detach(), aux_loss.detach().float()])

    records = forward_backward(parts.parallel, range(K), loss_of, schedule=schedule, lanes=parts.lanes)
    if not in_backward:
        parts.reduction.arm()  # nothing ready yet: finish issues every bucket, after the last backward
    parts.reduction.finish()
    return torch.stack(records).sum(0)


def training_step(schedule: str, parts: StepParts, batches: list) -> list[float]:
    """One optimizer step as Trainer.step takes it (module docstring); returns the mean losses."""
    group, device = parts.group, parts.device
    losses = run_micro_batches(schedule, parts, batches)
    group.occupy(group.cluster.small_collective_s(world=True), device)  # the losses' all-reduce
    values = (losses / len(batches)).tolist()                 # Trainer's one host read of the losses
    for param in parts.parallel.expert:                       # expert grads / W
        if param.grad is not None:
            param.grad.div_(group.size)
    group.occupy(group.cluster.small_collective_s(world=True), device)  # the global norm's all-reduce
    if parts.optimizer.defaults.get("fused"):
        _, divisor = parts.parallel.clip_divisor(GRAD_CLIP)
        parts.optimizer.grad_scale = divisor  # type: ignore[attr-defined]  # (read by the fused AdamW)
        try:
            parts.optimizer.step()
        finally:
            del parts.optimizer.grad_scale  # type: ignore[attr-defined]
    else:
        parts.parallel.clip_grad_norm(GRAD_CLIP)
        parts.optimizer.step()
    parts.optimizer.zero_grad(set_to_none=True)
    return values


def step_batches(preset: ModelPreset, tokens: int, micro_batches: int, device: torch.device, seed: int,
                 seq_len: int | None = None) -> list:
    """K micro-batches of (inputs_BS, targets_BS): random token ids (the routing is imposed
    by the pushes, not by the text); sequences of ``seq_len`` tokens (the preset's unless
    given: the host probe's are shorter)."""
    generator = torch.Generator().manual_seed(seed)
    seq_len = seq_len or preset.seq_len
    batch = tokens // (micro_batches * seq_len)
    batches = []
    for _ in range(micro_batches):
        window = torch.randint(0, preset.vocab_size, (batch, seq_len + 1), generator=generator)
        batches.append((window[:, :-1].contiguous().to(device), window[:, 1:].contiguous().to(device)))
    return batches
