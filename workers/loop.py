"""What runs inside each Ray Train worker: ``train_fn_per_worker(config)``.

Ray Train's ``TorchTrainer`` has already created the default process group (gloo on CPU,
NCCL on GPU, with a timeout) before this function starts; that group is the
data-parallel group of the dense part, and ``Trainer`` cuts it into the expert groups of
``expert_parallel`` consecutive ranks (the MoE layers' group; the whole world by default)
and the expert-data-parallel groups across them (workers/distributed.py).

The model's parameters and AdamW state are float32 (master weights; ``param_dtype``
bfloat16 keeps them in bf16 instead, for comparison); ``Trainer`` wraps
the dense part in DDP (or FSDP2 with ``shard_dense``; ``workers.distributed``) and runs
the forward under autocast at ``config.dtype``. One step (numbers match the code):
  1. micro-batch j of ``grad_accum`` (K): batch (step-1)*K + j of this rank's data shard
  2. forward (autocast) -> lm_loss + aux_loss_weight * aux_loss + router_z_loss * z_loss
  3. collective: loss sums over ranks (with ``expert_bias_rate``: and the step's tokens per
     expert of every MoE layer), with each rank's flag of NaN/Inf met in a MoE layer's
     input (the layers flag it and run on: no rank leaves the step's collectives early,
     whatever its expert group saw); non-finite -> by ``on_nonfinite_loss``: "halt" raises
     on every rank, "skip" drops this step's update on every rank and goes on (no hang
     either way)
  4. backward of loss / K (the MoE layers run their own All-to-Alls; DDP/FSDP2 reduce the
     dense grads in float32 during the last micro-batch's backward); 1-4 per micro-batch
  5. expert grads / W
  6. collective: exact global grad norm (dense + every expert shard), clip; AdamW step; the
     learning-rate scheduler (``build_scheduler``) steps; the routers' expert bias moves by
     the counts of 3 (workers/balance.py)
  7. collective: max step time and peak memory over ranks, and whether the driver asked to
     stop (Ctrl-C; rank 0 polls the stop flag, the max carries its answer to every rank)
  8. every ``log_every`` steps and at the end: collective, the per-expert load since the last
     time (workers/load.py); every ``eval_every`` steps and at the end, with a validation
     split: collective, the validation loss (``Trainer.evaluate``);
     rank 0 puts the step's metrics on the driver's queue (live progress, MLflow); every
     ``checkpoint_every`` steps, at the end and when stopping, every rank writes its shard
     of a sharded checkpoint (``workers.checkpoint``) and ``ray.train.report``s it; after a
     stop, all ranks return.

Why not ``ray.train.report`` every step: in Ray Train V2 each report waits until the
controller has consumed the previous one, and the controller polls every
``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`` (2 s). Reporting per step capped training at one
step per 2 s (measured: 0.1 s steps took 2 s of wall time each on CPU and on an H200).
The queue actor carries every step instead; Ray Train sees the checkpointed steps.

``config`` is the driver's ``worker_config()`` (app/jobs/job.py, workers/config.py). One field is
for fault-injection tests only: ``fault = {"kind": ..., "step": s, "rank": r}`` (rank
default: the last) makes rank r, at step s,
  - "exit":     exit abruptly like a killed process (fresh start only, so the restarted
                group runs on): Ray Train must restart the group from the last checkpoint;
  - "stall":    stop participating while staying alive: the others' collectives must time out;
  - "nan_loss": produce a NaN loss.

Ray Train is imported inside the functions that run under it: the driver imports this
module (``train_fn_per_worker``) and the tests run its pieces without Ray.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import resource
import tempfile
import time
import uuid
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Sequence, cast

import torch

import torch.nn.functional as F

from lm.data import ValidationBatches, open_val_stream
from lm.model import (IGNORE_INDEX, ModelPreset, MoETransformer, check_token_ids, compile_local_parts, compile_seconds,
                      init_parameters, lm_batch, lm_loss, model_flops_per_token)
from moe_engine import HostBufferPool
from moe_engine.comm import CollectiveLog
from moe_engine.layers import MoELayerBase
from moe_engine.router import Router
from workers import checkpoint as ckpt
from workers.config import DECAY_FRACTION, WorkerConfig
from workers.reshard import rank_batches
from workers.control import HOLD_POLL_S, HOLD_TIMEOUT_S, StopPoller
from workers.distributed import (DenseParallel, ExpertLayout, all_reduce_sum_, check_expert_degree, expert_groups,
                                 new_group, reduce_max, reduce_sum)
from workers.balance import ExpertBalance, step_imbalance
from workers.load import ExpertLoad
from workers.schedules import LANES, Lanes, ScheduleError, choose_schedule, forward_backward


class StepError(RuntimeError):
    """A training step failed; the message names the step (and rank)."""


MAX_SKIPPED_IN_A_ROW = 10  # "skip": this many non-finite steps in a row halt (the model itself is broken)


def check_nonfinite_loss(step: int, mean_lm: float, mean_aux: float, policy: str, in_a_row: int,
                         config: WorkerConfig, input_ranks: Sequence[int] = (), mean_z: float = 0.0) -> str:
    """Called when step ``step`` is non-finite: its mean loss is NaN/Inf, or NaN/Inf reached
    the MoE layer input of ``input_ranks`` (``in_a_row``: such steps in a row, this one
    included). Raises StepError naming the step (and those ranks) under "halt", or under
    "skip" once MAX_SKIPPED_IN_A_ROW are reached; otherwise returns why the caller skips the
    update. Every rank sees the same values (reduced over all ranks), so every rank takes
    the same action."""
    z_loss = f", z_loss={mean_z}" if mean_z != 0 else ""  # (NaN included)
    losses = f"lm_loss={mean_lm}, aux_loss={mean_aux}{z_loss}, engine={config.engine}, lr={config.lr}"
    if input_ranks:
        what = f"NaN or Inf in the MoE layer input of rank(s) {', '.join(map(str, input_ranks))}"
    else:
        what = "non-finite loss"
    where = f"{what} at step {step} ({losses})"
    if policy == "halt":
        raise StepError(f"{where}: lower --lr, check the data, or use float32 "
                        f"(--on-nonfinite-loss skip skips such steps instead)")
    if in_a_row >= MAX_SKIPPED_IN_A_ROW:
        raise StepError(f"{where}: {in_a_row} non-finite steps in a row, so the model itself is "
                        f"broken: lower --lr, check the data, or use float32")
    return f"{what} ({losses})"


def fault_here(config: WorkerConfig, kind: str, step: int, rank: int, world_size: int) -> bool:
    """Fault-injection tests: whether ``config.fault`` asks for ``kind`` here and now."""
    fault = config.fault
    if not fault:
        return False
    return bool(fault["kind"] == kind and fault["step"] == step and rank == fault.get("rank", world_size - 1))


@dataclass(frozen=True)
class DecayPlan:
    """Where a "wsd" schedule decays: after the warm-up the rate holds ``level`` of the way
    from ``min_lr`` up to ``lr`` through step ``decay_start``, then falls linearly to ``min_lr``
    at step ``end``. A checkpoint records it (meta.json "lr_decay_plan"), so that a resume that
    extends the run continues the decay instead of starting it again (``extend_decay``)."""

    decay_start: int
    end: int
    level: float = 1.0

    def shape(self, step: int) -> float:
        """Local. The fraction of the way from ``min_lr`` to ``lr`` at ``step`` (after warm-up)."""
        progress = (step - self.decay_start) / max(1, self.end - self.decay_start)
        return self.level * (1 - min(1.0, max(0.0, progress)))


def wsd_plan(steps: int, warmup_steps: int, decay_fraction: float) -> DecayPlan:
    """Local. A fresh "wsd" plan: the decay takes the last ``decay_fraction`` of the steps after warm-up."""
    decay = max(1, round(decay_fraction * (steps - warmup_steps)))
    return DecayPlan(decay_start=steps - decay, end=steps)


def extend_decay(recorded: DecayPlan | None, step: int, steps: int, warmup_steps: int,
                 decay_fraction: float) -> DecayPlan:
    """Local. The plan of a run resumed after ``step`` with the target ``steps``: the recorded
    plan when the target is unchanged and its decay has begun (a restart keeps its course);
    otherwise the decay starts where the new target and ``decay_fraction`` put it (never before
    ``step``), from the rate the run had reached, so a run whose decay had begun keeps its lower
    rate instead of jumping back to the peak."""
    fresh = wsd_plan(steps, warmup_steps, decay_fraction)
    if recorded is None:
        return fresh
    if recorded.end == steps and step > recorded.decay_start:
        return recorded
    return DecayPlan(decay_start=min(max(fresh.decay_start, step), steps - 1), end=steps,
                     level=recorded.shape(step))


def learning_rate(step: int, lr: float, warmup_steps: int, schedule: str = "constant", steps: int = 1,
                  min_lr: float = 0.0, decay_fraction: float = DECAY_FRACTION,
                  plan: DecayPlan | None = None) -> float:
    """The learning rate of step ``step`` (1-based): linear warm-up to ``lr`` over
    ``warmup_steps``, then by ``schedule``:

    - "constant": ``lr`` (independent of the run length, so a run resumed with a larger
      ``steps`` follows the same schedule);
    - "cosine":   half a cosine from ``lr`` down to ``min_lr`` at step ``steps``;
    - "linear":   a straight line from ``lr`` down to ``min_lr`` at step ``steps``;
    - "wsd":      warm-up, stable at ``lr``, then a linear decay to ``min_lr`` over the last
      ``decay_fraction`` of the steps after warm-up, or as ``plan`` says (a resumed run's).
    Cosine and linear end at ``steps``: resuming with a larger ``steps`` stretches the rest."""
    if warmup_steps > 0 and step <= warmup_steps:
        return lr * step / warmup_steps
    if schedule == "constant":
        return lr
    if schedule == "wsd":
        shape = (plan or wsd_plan(steps, warmup_steps, decay_fraction)).shape(step)
    else:
        progress = min(1.0, max(0.0, (step - warmup_steps) / max(1, steps - warmup_steps)))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
    return min_lr + (lr - min_lr) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, config: WorkerConfig,
                    plan: DecayPlan | None = None) -> torch.optim.lr_scheduler.LambdaLR:
    """``torch.optim.lr_scheduler.LambdaLR`` following ``learning_rate``: its epoch e (0 at
    construction, +1 per ``step()``) sets the rate of training step e + 1, for every group."""
    def factor(epoch: int) -> float:
        return learning_rate(epoch + 1, config.lr, config.warmup_steps, config.lr_schedule, config.steps,
                             config.min_lr, config.decay_fraction, plan) / config.lr

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: max bytes allocated by tensors since the step began; CPU: the process's peak
    resident set size so far (it cannot be reset)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


# Dense (no sparsity) peak FLOP/s of SXM parts from the vendors' datasheets: the denominator
# of MFU. A GPU whose name holds none of these gets no MFU.
PEAK_FLOPS = (  # (name part, {compute dtype: FLOP/s})
    ("H200", {"bfloat16": 989e12, "float32": 67e12}),
    ("H100", {"bfloat16": 989e12, "float32": 67e12}),
    ("A100", {"bfloat16": 312e12, "float32": 19.5e12}),
)


def peak_flops(device: torch.device, dtype: str) -> float | None:
    """The device's dense peak FLOP/s at the compute dtype, None when unknown (CPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peaks.get(dtype) for part, peaks in PEAK_FLOPS if part in name), None)


def model_flops_metrics(tokens_per_s: float, preset: ModelPreset, device: torch.device, dtype: str) -> dict[str, float]:
    """``model_tflops_per_s`` of one worker training ``tokens_per_s`` tokens per second, and
    ``mfu`` (that over the device's dense peak at the compute dtype) where the peak is known."""
    flops_per_s = tokens_per_s * model_flops_per_token(preset)
    peak = peak_flops(device, dtype)
    return {"model_tflops_per_s": flops_per_s / 1e12, **({"mfu": flops_per_s / peak} if peak else {})}


def optimizer_kernels(impl: str, device: torch.device) -> dict[str, Any]:
    """AdamW's implementation keywords for ``impl`` (WorkerConfig.optimizer_impl): "auto" is
    the fused kernel on CUDA (one launch per group, the whole update in one pass over the
    state) and foreach elsewhere (a few multi-tensor kernels; CPU AdamW's default is the
    per-parameter loop)."""
    if impl == "auto":
        impl = "fused" if device.type == "cuda" else "foreach"
    return {"fused": {"fused": True}, "foreach": {"foreach": True},
            "for-loop": {"foreach": False, "fused": False}}[impl]


def build_optimizer(parallel: DenseParallel, lr: float, weight_decay: float, impl: str = "auto") -> torch.optim.AdamW:
    """AdamW over the float32 master parameters; weight decay on matrices (incl. expert
    weights), not on biases/norms. Dense and expert parameters sit in separate groups (under
    FSDP2 the dense ones are DTensors, which foreach kernels do not mix with plain tensors).
    ``impl``: see ``optimizer_kernels``."""
    groups = []
    for params in (parallel.dense, parallel.expert):
        for decay, wanted in ((weight_decay, True), (0.0, False)):
            chosen = [p for p in params if (p.dim() >= 2) == wanted]
            if chosen:
                groups.append({"params": chosen, "weight_decay": decay})
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, **optimizer_kernels(impl, parallel.device))


@dataclass(frozen=True)
class ParallelModel:
    """One rank's model as training builds it (``build_parallel_model``): its place among the
    expert groups, the micro-batch schedule (and why), the model and its data parallelism."""

    layout: ExpertLayout
    schedule: str
    schedule_reason: str
    model: MoETransformer
    parallel: DenseParallel


def build_parallel_model(config: WorkerConfig, rank: int, world_size: int, device: torch.device,
                         host_pool: HostBufferPool | None = None, batch_size: int | None = None) -> ParallelModel:
    """Collective (every rank of the default group): the expert groups of ``config.expert_parallel``
    consecutive ranks (the world when None) and the expert-data-parallel groups across them, the
    micro-batch schedule (``choose_schedule``, for micro-batches of ``batch_size`` sequences,
    default ``config.batch_size``), the model with this rank's experts (float32 master
    parameters, or ``param_dtype``; two micro-batches in flight under the overlapped schedule,
    which the MoE layers' memory budget counts) and its dense part under DDP or FSDP2. The
    trainer and the capacity search (workers/capacity.py) build alike, so a batch the search
    finds is one training runs."""
    preset = config.preset
    degree = config.expert_parallel or world_size
    check_expert_degree(degree, preset.num_experts, world_size)
    layout = ExpertLayout(rank, world_size, degree)
    assert config.seq_len is not None  # WorkerConfig sets it from the preset
    schedule, reason = choose_schedule(
        config.micro_batch_schedule, config.grad_accum, shard_dense=config.shard_dense,
        budget_bytes=config.moe_memory_budget_bytes, preset=preset,
        tokens=(batch_size or config.batch_size) * config.seq_len, world_size=degree,
        dtype=getattr(torch, config.dtype), device=device, activation_checkpointing=config.activation_checkpointing)
    expert_group, replica_group = expert_groups(layout, config.collective_timeout_s)
    model = MoETransformer(preset, engine=config.engine, group=expert_group, partitions=config.partitions,
                           strategy=config.strategy, split=config.split, host_pool=host_pool,
                           memory_budget=config.moe_memory_budget_bytes,
                           in_flight=LANES if schedule == "overlapped" else 1,
                           sync_free_capacity=config.sync_free_capacity,
                           activation_checkpointing=config.activation_checkpointing)
    model.to(device=device)  # float32 master parameters; compute dtype via autocast
    init_parameters(model, config.seed, layout.expert_rank)
    if config.init_from:  # a pretrained start: every rank reads what it holds, its experts only
        load_pretrained(model, config.init_from, layout.expert_rank)
    if config.param_dtype != "float32":  # pure low-precision training, for comparison
        model.to(dtype=getattr(torch, config.param_dtype))
        for router in (m for m in model.modules() if isinstance(m, Router)):
            router.expert_bias.data = router.expert_bias.data.float()  # (steps of 1e-3 would round away in bf16)
    if config.router_z_loss:  # the z-loss trains the routers (else its value is only logged)
        for router in (m for m in model.modules() if isinstance(m, Router)):
            router.z_loss_grad = True
    if config.compile:  # the blocks' local parts; compiled at the first step (compile_time_s)
        compile_local_parts(model, config.compile_backend)
    parallel = DenseParallel(model, mode="fsdp2" if config.shard_dense else "ddp", world_size=world_size,
                             device=device, compute_dtype=getattr(torch, config.dtype),
                             timeout_s=config.collective_timeout_s, replica_group=replica_group,
                             replicas=layout.replicas)
    return ParallelModel(layout, schedule, reason, model, parallel)


def load_pretrained(model: MoETransformer, directory: str, expert_rank: int) -> None:
    """Local. The weights of the Hugging Face Mixtral-style folder ``directory`` into ``model``,
    the experts of ``expert_rank`` (global experts rank·L .. (rank+1)·L - 1 of each layer, as
    ``init_parameters`` places them). Each rank reads its own tensors (memory-mapped, only
    those it holds) instead of rank 0 broadcasting them: no collective and no rank holding
    the whole model, and the folder is where the data already must be (shared storage or a
    copy on every node)."""
    from workers.hf_mixtral import read_mixtral_shard

    local = cast(MoELayerBase, model.blocks[0].moe).local_experts
    experts = range(expert_rank * local, (expert_rank + 1) * local)
    model.load_state_dict(read_mixtral_shard(directory, model.preset, experts), strict=True)


class Trainer:
    """One rank's model, optimizer and data (no Ray: tests drive it on gloo ranks).

    ``step(step)`` is one optimizer step over ``grad_accum`` micro-batches of
    ``batch_size`` sequences each; micro-batch j of step s is batch (s-1)*K + j of this
    rank's sampler, so K micro-batches of b sequences are exactly the batch of K*b
    sequences of the same step. Each micro-batch's forward and backward run before the
    next forward, so one micro-batch is in flight at a time and the MoE layers' host
    buffers (taken per forward, given back by its backward) are reused across them.
    """

    def __init__(self, config: WorkerConfig, rank: int, world_size: int, device: torch.device,
                 host_pool: HostBufferPool | None = None, collective_log: CollectiveLog | None = None):
        self.config, self.rank, self.world_size, self.device = config, rank, world_size, device
        self.preset = config.preset
        # Collective: the expert groups, the model, DDP/FSDP2 (build_parallel_model)
        built = build_parallel_model(config, rank, world_size, device, host_pool)
        self.layout, self.schedule, self.schedule_reason = built.layout, built.schedule, built.schedule_reason
        self.parallel, model = built.parallel, built.model
        self.model = model
        assert config.seq_len is not None  # WorkerConfig sets it from the preset
        # NaN/Inf in a MoE layer's input: flagged and carried by the step's loss all-reduce, so
        # every rank skips or halts together (a raise inside the layer would leave its expert
        # group's ranks in that all-reduce while the other groups wait in the dense reduction)
        self.moe_layers = cast("list[MoELayerBase]", model.moe_layers())
        for layer in self.moe_layers:
            layer.on_nonfinite_input = "flag"
        # Collective (every rank resolves the same schedule): the MoE layers' lanes
        # (``collective_log``: records the MoE layers' collectives on every lane, for tests)
        self.lanes = Lanes.create(model, timeout_s=config.collective_timeout_s, recorder=collective_log) \
            if self.schedule == "overlapped" else None
        self.optimizer = build_optimizer(self.parallel, config.lr, config.weight_decay, config.optimizer_impl)
        self.decay_plan = wsd_plan(config.steps, config.warmup_steps, config.decay_fraction) \
            if config.lr_schedule == "wsd" else None
        self.scheduler = build_scheduler(self.optimizer, config, self.decay_plan)
        window = config.seq_len + 1 if self.preset.kind == "gpt" else config.seq_len
        self.grad_accum = config.grad_accum
        # memory-mapped: a batch reads only its windows, so the corpus may exceed a worker's memory
        # (a run resumed on another worker count reads its slice of the same global batch)
        self.sampler = rank_batches(config.data_dir, rank, world_size, config.data_shards, config.batch_size,
                                    window, config.seed)
        # the fixed validation batches; None without a split, or one too small for every rank (the
        # driver says so: app/jobs/preflight.py ensure_data)
        val_stream = open_val_stream(config.data_dir) if config.eval_every else None
        self.validation = None if val_stream is None or len(val_stream) // window < world_size else \
            ValidationBatches(val_stream, config.batch_size, window, config.eval_batches, rank, world_size)
        self.load = ExpertLoad(model.moe_layers(), device)
        self.balance = ExpertBalance(model.moe_layers(), config.expert_bias_rate, device)
        self.nonfinite_in_a_row = 0
        # the next step's first micro-batch, read and queued for the device while this step's
        # backward runs (`step`): ((step, micro), (inputs_BS, targets_BS))
        self.prefetched: tuple[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] | None = None

    def schedule_state(self) -> dict[str, Any]:
        """The learning-rate scheduler's state, as a checkpoint's meta.json keeps it."""
        return self.scheduler.state_dict()

    def restore_schedule(self, meta: dict[str, Any]) -> None:
        """Local. Continue the schedule after the checkpoint ``meta`` (its scheduler state, or
        its step for checkpoints written before the state was saved). The rates themselves
        follow this run's settings (``--lr``, ``--lr-schedule``, ... may change on resume)."""
        state = meta.get("lr_scheduler") or {"last_epoch": meta["step"], "_step_count": meta["step"] + 1}
        if self.decay_plan is not None:  # wsd: continue the recorded decay (a longer run moves its end)
            recorded = meta.get("lr_decay_plan")
            config = self.config
            self.decay_plan = extend_decay(DecayPlan(**recorded) if recorded else None, meta["step"], config.steps,
                                           config.warmup_steps, config.decay_fraction)
            self.scheduler = build_scheduler(self.optimizer, config, self.decay_plan)
        self.scheduler.load_state_dict({**self.scheduler.state_dict(), **state,
                                        "base_lrs": self.scheduler.base_lrs})
        rates = [base * factor(self.scheduler.last_epoch)
                 for base, factor in zip(self.scheduler.base_lrs, self.scheduler.lr_lambdas)]
        for group, rate in zip(self.optimizer.param_groups, rates):
            group["lr"] = rate
        self.scheduler._last_lr = rates

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Collective: the validation loss, the exact mean over the tokens of every rank's
        fixed validation batches (summed on the device, one all-reduce at the end), and its
        perplexity. The model runs in eval mode without gradients (the MoE layers then keep
        nothing for backward) and is back in training mode afterwards."""
        config, validation = self.config, self.validation
        assert validation is not None  # evaluate runs only with a validation split
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        targets = torch.zeros((), dtype=torch.int64, device=self.device)
        self.model.eval()
        try:
            for index in range(len(validation)):
                window_BS = torch.from_numpy(validation.batch(index)).to(self.device)
                generator = torch.Generator().manual_seed(7_919 * self.rank + index)  # BERT masks: fixed
                inputs_BS, targets_BS = lm_batch(self.preset.kind, window_BS, config.mask_id,
                                                 self.preset.vocab_size, generator)
                with self.parallel.autocast():
                    logits_BSV, _ = self.model(inputs_BS)
                loss_sum += F.cross_entropy(logits_BSV.float().flatten(0, 1), targets_BS.flatten(),
                                            ignore_index=IGNORE_INDEX, reduction="sum").double()
                targets += (targets_BS != IGNORE_INDEX).sum()
        finally:
            self.model.train()
        total, count = reduce_sum(torch.stack([loss_sum, targets.double()]).tolist(), self.device, self.world_size)
        loss = total / count
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0))}

    def epoch_of(self, step: int) -> int:
        return self.sampler.epoch_of((step - 1) * self.grad_accum)

    def _micro_batch(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs_BS, targets_BS) of micro-batch ``micro`` of ``step``, on the device."""
        prefetched, self.prefetched = self.prefetched, None
        if prefetched is not None and prefetched[0] == (step, micro):
            return prefetched[1]
        window_BS = torch.from_numpy(self.sampler.batch((step - 1) * self.grad_accum + micro))
        check_token_ids(window_BS, self.preset.vocab_size, f"step {step}'s batch")  # on the host: no device wait
        if self.device.type == "cuda":  # pinned: the copy does not wait for the kernels queued before it
            window_BS = window_BS.pin_memory().to(self.device, non_blocking=True)
        seed = self.config.seed * 1_000_003 + self.rank * 7919 + step + 104_729 * micro
        return lm_batch(self.preset.kind, window_BS, self.config.mask_id, self.preset.vocab_size,
                        torch.Generator().manual_seed(seed))

    def step(self, step: int, nan_loss: bool = False) -> dict[str, Any]:
        """Collective: one optimizer step. Returns mean lm/aux loss over ranks and
        micro-batches, grad_norm (NaN when skipped), lr, skipped (and a skipped step's
        skip_reason: the non-finite loss, or the ranks whose MoE input held NaN/Inf)."""
        config, rank, K = self.config, self.rank, self.grad_accum
        capacity_mode = config.sync_free_capacity is not None
        self._moe_input_nonfinite()  # (a forward outside a step, evaluate's, may have flagged)

        def loss_of(module: torch.nn.Module, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
            # 1. the micro-batch; 2. forward under autocast (the ids were checked on the host:
            #    _micro_batch, and mask_id by WorkerConfig)
            inputs_BS, targets_BS = self._micro_batch(step, micro)
            with self.parallel.autocast():
                logits_BSV, aux_loss, z_loss = module(inputs_BS, ids_checked=True, with_z_loss=True)
                loss_lm = lm_loss(logits_BSV.float(), targets_BS)
            if nan_loss:
                loss_lm = loss_lm * float("nan")
            loss = loss_lm + config.aux_loss_weight * aux_loss.float()
            if config.router_z_loss:
                loss = loss + config.router_z_loss * z_loss.float()
            # 3. (below) backward of this micro-batch's share of the step's loss
            return loss / K, torch.stack([loss_lm.detach(), aux_loss.detach().float(), z_loss.detach().float()]).double()

        def micro_batches() -> torch.Tensor:
            """2-3 per micro-batch, by the schedule (workers/schedules.py): sequential, or the
            forward of micro-batch k+1 beside the backward of k. The dense gradients are reduced
            over ranks in the last backward (DDP/FSDP2) or after it (overlapped). Engine errors
            are re-raised naming the step; NaN/Inf in a MoE layer's input is flagged, not raised
            (every collective of the step runs on every rank). Returns, on the device,
            [lm, aux, z, pairs the sync-free capacity dropped, then one flag per rank: NaN/Inf met
            in its MoE layers' input] (this rank's; nothing is read: each micro-batch's losses
            stay on the device until every backward has been queued, one read per step); with
            the expert bias on, then this step's tokens per expert of every MoE layer, L x E."""
            flags = 4 + self.world_size
            counts = self.balance.counts_LE.numel() if self.balance.enabled else 0
            losses = torch.zeros(flags + counts, dtype=torch.float64, device=self.device)
            for layer in self.moe_layers if capacity_mode else ():
                layer.reset_capacity_counters()
            self.balance.start_step()
            try:
                for record in forward_backward(self.parallel, range(K), loss_of, schedule=self.schedule,
                                               lanes=self.lanes):
                    losses[:3] += record
            except ScheduleError as error:
                cause = error.__cause__
                where = "backward failed" if error.phase == "backward" else "failed"
                raise StepError(f"step {step} {where} on rank {rank} (engine {config.engine}): "
                                f"{type(cause).__name__}: {cause}") from cause
            if capacity_mode:  # the layers' device counters, added without a read
                losses[3] += sum(layer.overflowed.to(self.device) for layer in self.moe_layers)
                losses[4 + rank] += sum(layer.nonfinite_inputs.to(self.device) for layer in self.moe_layers)
            if self._moe_input_nonfinite():
                losses[4 + rank] = 1
            if self.balance.enabled:
                losses[flags:] = self.balance.counts_LE.flatten()
            return losses

        losses = micro_batches()
        # The next step's first batch, read from the data while the device runs this backward
        # (read after the losses, its host work left the GPU idle: 7 ms a step for gpt-xl at
        # batch 128 on an H200). A bad batch is not taken here: the next step reads it again
        # and names it.
        try:
            self.prefetched = ((step + 1, 0), self._micro_batch(step + 1, 0))
        except ValueError:
            self.prefetched = None
        # 4. global mean losses, the pairs the sync-free capacity dropped, the ranks whose
        #    MoE input was non-finite and, with the expert bias on, the step's tokens per expert
        #    (one all-reduce, one device read; the counts also stay on the device for the bias
        #    update, so every rank moves its bias by the same sums). A step whose capacity
        #    overflowed on any rank runs again dropless on every rank, its gradients dropped
        #    first (no token is ever dropped silently); on NaN/Inf every rank halts, or skips
        #    this update, together (a non-finite step still ran its backward: the gradients are
        #    dropped)
        summed = all_reduce_sum_(losses, self.world_size)
        reduced = summed.tolist()
        overflowed_pairs = int(reduced[3])
        if overflowed_pairs:
            self.optimizer.zero_grad(set_to_none=True)
            with contextlib.ExitStack() as dropless:
                for layer in self.moe_layers:
                    dropless.enter_context(layer.dropless())
                summed = all_reduce_sum_(micro_batches(), self.world_size)
                reduced = summed.tolist()
        flags = 4 + self.world_size
        lm_total, aux_total, z_total = (value / self.world_size / K for value in reduced[:3])
        input_ranks = [r for r, flag in enumerate(reduced[4:flags]) if flag]
        skip = bool(input_ranks) or not all(math.isfinite(v) for v in (lm_total, aux_total, z_total))
        self.nonfinite_in_a_row = self.nonfinite_in_a_row + 1 if skip else 0
        skip_reason = check_nonfinite_loss(step, lm_total, aux_total, config.on_nonfinite_loss,
                                           self.nonfinite_in_a_row, config, input_ranks, z_total) if skip else None
        grad_norm, lr = math.nan, self.optimizer.param_groups[0]["lr"]  # the scheduler's rate for this step
        if not skip:
            # 5. expert grads summed over the expert replicas, / W (dense ones were averaged by DDP/FSDP2)
            self.parallel.finish_gradients()
            # 6. global clip, update; the schedule advances on skipped steps too (rate = f(step))
            if self.optimizer.defaults.get("fused") and config.grad_clip > 0:
                # the fused AdamW divides the gradients by the clip's divisor as it reads them
                # (one pass over them fewer), and the norm is read only once the update is queued
                norm_t, divisor = self.parallel.clip_divisor(config.grad_clip)
                self.optimizer.grad_scale = divisor  # type: ignore[attr-defined]  # (read by AdamW.step)
                try:
                    self.optimizer.step()
                finally:
                    del self.optimizer.grad_scale  # type: ignore[attr-defined]
                grad_norm = float(norm_t)
            else:
                grad_norm = self.parallel.clip_grad_norm(config.grad_clip)
                self.optimizer.step()
            # 6b. the expert bias, from the step's counts summed over every rank (identical on all)
            if self.balance.enabled:
                self.balance.update(summed[flags:].view_as(self.balance.counts_LE))
        self.optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():  # a skipped first step: "scheduler.step() before optimizer.step()"
            warnings.simplefilter("ignore", UserWarning)
            self.scheduler.step()
        # (the sync-free capacity mode: the pairs its capacity dropped on the first try, summed over
        # ranks, and whether the step ran again dropless; MLflow sums the reruns)
        capacity = {"capacity_overflow_pairs": overflowed_pairs, "dropless_rerun": int(overflowed_pairs > 0)} \
            if capacity_mode else {}
        E = self.balance.num_experts
        balance = step_imbalance([reduced[i:i + E] for i in range(flags, len(reduced), E)])
        return {"lm_loss": lm_total, "aux_loss": aux_total, "z_loss": z_total, "grad_norm": grad_norm, "lr": lr,
                "skipped": int(skip), **({"skip_reason": skip_reason} if skip_reason else {}), **capacity,
                **balance}

    def _moe_input_nonfinite(self) -> bool:
        """Local. Whether a MoE layer met NaN/Inf in this rank's input since the last call
        (every layer's flag read and cleared)."""
        return any([layer.take_nonfinite_input() for layer in self.moe_layers])


def train_fn_per_worker(config: WorkerConfig) -> None:
    import ray.train
    import ray.train.torch

    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device() if config.use_gpu else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(config.torch_threads)
    seed = config.seed
    torch.manual_seed(seed + rank)

    # Model, optimizer, data ------------------------------------------------------------
    # Offload buffers may take a fair share of the node's free host memory (else S4); the
    # pool's cap defaults to the same share of the node's installed memory.
    host_pool = HostBufferPool(usable_fraction=0.8 / max(1, context.get_local_world_size()))
    checkpoint = ray.train.get_checkpoint()  # a restart within this run: the last one reported
    resume_from = config.resume_from  # a resumed run: the newest complete one (driver's choice)
    # --init-from's weights start a fresh run only (a checkpoint replaces them: not read)
    trainer = Trainer(config if checkpoint is None and not resume_from else config.replace(init_from=None),
                      rank, world_size, device, host_pool)

    start_step = 0
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            meta = ckpt.load(directory, rank, world_size, trainer.parallel, trainer.optimizer, config.preset_dict(),
                             config.data_shards)
        start_step = meta["step"]
        trainer.restore_schedule(meta)
    elif resume_from:
        meta = ckpt.load(resume_from, rank, world_size, trainer.parallel, trainer.optimizer, config.preset_dict(),
                         config.data_shards)
        start_step = meta["step"]
        trainer.restore_schedule(meta)

    tokens_per_step = world_size * config.batch_size * trainer.grad_accum * config.seq_len
    # --async-checkpoint: a checkpoint's shards are written while the next step trains,
    # then (after that step, on every rank) completed and reported to Ray Train.
    saver = CheckpointSaver(config, rank, world_size, trainer)
    queue = config.metrics_queue if rank == 0 else None
    stop = StopPoller(config.stop_flag if rank == 0 else None)
    attempt = uuid.uuid4().hex[:8]  # tells the driver when Ray Train restarted the workers
    fresh = checkpoint is None and not resume_from

    # Loop -------------------------------------------------------------------------------
    trainer.model.train()
    for step in range(start_step + 1, config.steps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if fresh and fault_here(config, "exit", step, rank, world_size):
            time.sleep(3)  # let the controller (2 s poll) register the last checkpoint first
            os._exit(1)    # a worker dies mid-run
        if fault_here(config, "stall", step, rank, world_size):
            time.sleep(3600)  # alive but silent: the other ranks' collectives time out
        started = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)  # peak_memory_bytes is this step's peak
        # 1-6. micro-batches at data position step-1: forward, losses, backward; clip, update
        result = trainer.step(step, nan_loss=fault_here(config, "nan_loss", step, rank, world_size))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        # 7. slowest rank's time, largest peak memory; stop (Ctrl-C) if rank 0 was asked to
        # (and the slowest rank's time in torch.compile so far, in the same reduction)
        step_time, peak, stopping, compiling = reduce_max(
            [time.perf_counter() - started, peak_memory_bytes(device), float(stop.requested()),
             compile_seconds() if config.compile else 0.0], device, world_size)
        # 8. report
        metrics = {
            "step": step,
            "loss": result["lm_loss"] + config.aux_loss_weight * result["aux_loss"]
            + config.router_z_loss * result["z_loss"],
            **result,
            "tokens_per_s": tokens_per_step / step_time,
            **model_flops_metrics(tokens_per_step / step_time / world_size, trainer.preset, device, config.dtype),
            "step_time_s": step_time,
            "peak_memory_bytes": int(peak),
            "host_pool_bytes": host_pool.bytes_held,  # pinned host buffers of the MoE layers (shared pool)
            "tokens_seen": step * tokens_per_step,
            "epoch": trainer.epoch_of(step),
            "attempt": attempt,
            **trainer.model.engine_choices(),
            "micro_batch_schedule": trainer.schedule,  # (auto's choice; a tag, not a metric)
            **({"compile_time_s": compiling} if config.compile else {}),  # this process's, so far
        }
        # 8a. collective, at log steps only: per-expert load since the last one (workers/load.py)
        last = step == config.steps or stopping
        if step % config.log_every == 0 or last:
            metrics.update(trainer.load.read(world_size))
            if trainer.balance.enabled:  # (local: the bias is the same on every rank)
                metrics.update(trainer.balance.bias_metrics())
        # 8b. collective, every eval_every steps and at the end: validation loss
        if trainer.validation is not None and (step % config.eval_every == 0 or last):
            metrics.update(trainer.evaluate())
        if queue is not None:
            queue.put(metrics)
        # 8c. at a hold step (a sweep's ASHA rung): every rank waits for the driver's decision on
        # these metrics (rank 0 asks); a pruned trial stops here (collective: hold_verdict)
        if step in config.hold_steps and not stopping and step < config.steps:
            stopping = hold_verdict(step, stop if rank == 0 else None, device, world_size,
                                    config.collective_timeout_s)
        saver.finish()  # the previous step's async checkpoint, if any
        every = config.checkpoint_every  # 0 = no checkpoints
        if every and (step % every == 0 or step == config.steps or stopping):
            saver.start(step, metrics)
        if stopping:
            break
    saver.finish()


def hold_verdict(step: int, stop: StopPoller | None, device: torch.device, world_size: int,
                 collective_timeout_s: float | None, hold_timeout_s: float = HOLD_TIMEOUT_S) -> bool:
    """Collective: whether the job stops after hold step ``step``, by the driver's decision,
    which rank 0 asks for (``stop``; None on the other ranks). Rank 0 waits in slices of at
    most HOLD_POLL_S and a quarter of ``collective_timeout_s``; after each, one max-reduction
    tells every rank whether the driver has answered (0: not yet, 1: go on, 2: stop). So no
    rank sits in a collective much longer than a slice, and a collective timeout shorter
    than the driver's answer takes does not end the job. Without an answer within
    ``hold_timeout_s`` the job goes on."""
    wait_s = min(HOLD_POLL_S, collective_timeout_s / 4) if collective_timeout_s else HOLD_POLL_S
    deadline = time.monotonic() + hold_timeout_s
    while True:
        answer = 0.0
        if stop is not None:
            verdict = stop.verdict(step, max(0.0, min(wait_s, deadline - time.monotonic())))
            answer = 1.0 if verdict is None and time.monotonic() >= deadline else \
                0.0 if verdict is None else 1.0 + float(verdict)
        decided = reduce_max([answer], device, world_size)[0]
        if decided:
            return decided == 2.0


class CheckpointSaver:
    """Writes a checkpoint and reports it to Ray Train (collective: every rank calls the
    same methods at the same steps). Synchronous by default; with
    ``config.async_checkpoint`` the shards are copied to host memory in ``start`` and
    written in the background, and ``finish`` (called after the next step) waits for them,
    writes ``meta.json`` and reports the checkpoint with the metrics of its step."""

    def __init__(self, config: WorkerConfig, rank: int, world_size: int, trainer: Trainer):
        self.config, self.rank, self.world_size, self.trainer = config, rank, world_size, trainer
        self.asynchronous = config.async_checkpoint
        self.group = new_group(config.collective_timeout_s, backend="gloo") \
            if self.asynchronous and world_size > 1 else None
        # (future, temporary directory, step, metrics, meta) of the checkpoint being written
        self.pending: tuple[Future[Any], tempfile.TemporaryDirectory[str], int, dict[str, Any], dict[str, Any]] | None = None

    def _meta(self, step: int) -> dict[str, Any]:
        """Taken when the save starts (the learning-rate scheduler moves on with the next step)."""
        config = self.config
        return {"step": step, "data_position": step, "world_size": self.world_size, "engine": config.engine,
                "seed": config.seed, "preset": config.preset_dict(), "grad_accum": self.trainer.grad_accum,
                "shard_dense": config.shard_dense, "lr_scheduler": self.trainer.schedule_state(),
                "lr_decay_plan": dataclasses.asdict(plan) if (plan := self.trainer.decay_plan) else None,
                "data_shards": config.data_shards or self.world_size, "batch_size": config.batch_size,
                "expert_parallel": self.trainer.layout.degree}

    def start(self, step: int, metrics: dict[str, Any]) -> None:
        with ckpt.write_errors_explained(step):  # a full disk: one line naming the file and the fix
            directory = tempfile.TemporaryDirectory()
            parallel, optimizer = self.trainer.parallel, self.trainer.optimizer
            if self.asynchronous:
                future = ckpt.save_async(directory.name, self.rank, self.world_size, parallel, optimizer, self.group)
                self.pending = (future, directory, step, metrics, self._meta(step))
                return
            with directory:
                ckpt.save(directory.name, self.rank, self.world_size, parallel, optimizer, self._meta(step))
                self._report(directory.name, step, metrics)

    def finish(self) -> None:
        if self.pending is None:
            return
        future, directory, step, metrics, meta = self.pending
        self.pending = None
        with ckpt.write_errors_explained(step), directory:
            future.result()
            ckpt.write_meta(directory.name, self.rank, self.world_size, meta)
            self._report(directory.name, step, metrics)

    @staticmethod
    def _report(directory: str, step: int, metrics: dict[str, Any]) -> None:
        import ray.train

        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory),
                         checkpoint_dir_name=ckpt.checkpoint_name(step))
