"""What runs inside each Ray Train worker: ``train_fn_per_worker(config)``.

Ray Train's ``TorchTrainer`` has already created the default process group (gloo on CPU,
NCCL on GPU, with a timeout) before this function starts; that group is the
expert-parallel group of every MoE layer and the data-parallel group of the dense part.

One step (numbers match the code):
  1. batch ``step-1`` of this rank's data shard (data position = steps done)
  2. forward -> lm_loss + aux_loss_weight * aux_loss
  3. collective: loss sums over ranks; non-finite (or NaN/Inf caught inside a MoE layer,
     which every rank raises together) -> by ``on_nonfinite_loss``: "halt" raises on every
     rank, "skip" drops this step's update on every rank and goes on (no hang either way)
  4. backward (the MoE layers run their own All-to-Alls)
  5. collective: average replicated grads (one flat all-reduce), scale expert grads by 1/W
  6. collective: global grad norm, clip; AdamW step at the step's learning rate
  7. collective: max step time and peak memory over ranks
  8. rank 0 puts the step's metrics on the driver's queue (live progress, MLflow); every
     ``checkpoint_every`` steps and at the end, all ranks ``ray.train.report`` the metrics
     with a per-rank checkpoint.

Why not ``ray.train.report`` every step: in Ray Train V2 each report waits until the
controller has consumed the previous one, and the controller polls every
``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`` (2 s). Reporting per step capped training at one
step per 2 s (measured: 0.1 s steps took 2 s of wall time each on CPU and on an H200).
The queue actor carries every step instead; Ray Train sees the checkpointed steps.

``config`` keys are written by ``app.train.worker_config()``. One key is for fault-injection
tests only: ``fault = {"kind": ..., "step": s, "rank": r}`` (rank default: the last) makes
rank r, at step s,
  - "exit":     exit abruptly like a killed process (fresh start only, so the restarted
                group runs on): Ray Train must restart the group from the last checkpoint;
  - "stall":    stop participating while staying alive: the others' collectives must time out;
  - "nan_loss": produce a NaN loss.
"""
from __future__ import annotations

import math
import os
import resource
import tempfile
import time
import uuid

import torch

from app.data import MASK_ID, BatchSampler, load_rank_tokens
from app.model import ModelPreset, MoETransformer, init_parameters, lm_batch, lm_loss
from moe_engine import HostBufferPool
from moe_engine.layers import NonFiniteInputError
from workers import checkpoint as ckpt
from workers.distributed import (average_gradients, clip_grad_norm, reduce_max, reduce_sum,
                                 split_params)


class StepError(RuntimeError):
    """A training step failed; the message names the step (and rank)."""


NONFINITE_POLICIES = ("halt", "skip")
MAX_SKIPPED_IN_A_ROW = 10  # "skip": this many non-finite steps in a row halt (the model itself is broken)


def check_nonfinite_loss(step: int, mean_lm: float, mean_aux: float, policy: str, in_a_row: int,
                         config: dict) -> None:
    """Called when step ``step``'s mean loss is NaN/Inf (``in_a_row``: such steps in a row,
    this one included). Raises StepError naming the step under "halt", or under "skip" once
    MAX_SKIPPED_IN_A_ROW are reached; otherwise returns and the caller skips the update.
    Every rank sees the same mean losses, so every rank takes the same action."""
    where = (f"non-finite loss at step {step} (lm_loss={mean_lm}, aux_loss={mean_aux}, "
             f"engine={config['engine']}, lr={config['lr']})")
    if policy == "halt":
        raise StepError(f"{where}: lower --lr, check the data, or use float32 "
                        f"(--on-nonfinite-loss skip skips such steps instead)")
    if in_a_row >= MAX_SKIPPED_IN_A_ROW:
        raise StepError(f"{where}: {in_a_row} non-finite steps in a row, so the model itself is "
                        f"broken: lower --lr, check the data, or use float32")


def fault_here(config: dict, kind: str, step: int, rank: int, world_size: int) -> bool:
    """Fault-injection tests: whether ``config["fault"]`` asks for ``kind`` here and now."""
    fault = config.get("fault")
    return bool(fault) and fault["kind"] == kind and fault["step"] == step \
        and rank == fault.get("rank", world_size - 1)


def learning_rate(step: int, lr: float, warmup_steps: int) -> float:
    """Linear warm-up over ``warmup_steps``, then constant (independent of the run length,
    so a run resumed with a larger ``steps`` follows the same schedule)."""
    if warmup_steps > 0 and step <= warmup_steps:
        return lr * step / warmup_steps
    return lr


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: max bytes allocated by tensors since the step began; CPU: the process's peak
    resident set size so far (it cannot be reset)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices (incl. expert weights), not on biases/norms."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8)


def train_fn_per_worker(config: dict) -> None:
    import ray.train
    import ray.train.torch

    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device() if config["use_gpu"] else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(config["torch_threads"])
    dtype = getattr(torch, config["dtype"])
    seed = config["seed"]
    torch.manual_seed(seed + rank)

    # Model, optimizer, data ------------------------------------------------------------
    preset = ModelPreset(**config["preset"])
    preset.check_world_size(world_size)
    # Offload buffers may take a fair share of the node's free host memory (else S4).
    host_pool = HostBufferPool(usable_fraction=0.8 / max(1, context.get_local_world_size()))
    model = MoETransformer(preset, engine=config["engine"], group=None,
                           partitions=config["partitions"], strategy=config["strategy"], host_pool=host_pool)
    model.to(device=device, dtype=dtype)
    init_parameters(model, seed, rank)
    replicated, expert = split_params(model)
    optimizer = build_optimizer(model, config["lr"], config["weight_decay"])

    start_step = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            meta = ckpt.load(directory, rank, world_size, model, optimizer, device, config["preset"])
        start_step = meta["step"]

    seq_len = config["seq_len"]
    window = seq_len + 1 if preset.kind == "gpt" else seq_len
    sampler = BatchSampler(load_rank_tokens(config["data_dir"], rank, world_size),
                           config["batch_size"], window, seed, rank)
    tokens_per_step = world_size * config["batch_size"] * seq_len
    queue = config.get("metrics_queue") if rank == 0 else None
    attempt = uuid.uuid4().hex[:8]  # tells the driver when Ray Train restarted the workers
    policy = config.get("on_nonfinite_loss", "halt")
    nonfinite_in_a_row = 0

    # Loop -------------------------------------------------------------------------------
    model.train()
    for step in range(start_step + 1, config["steps"] + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if start_step == 0 and fault_here(config, "exit", step, rank, world_size):
            time.sleep(3)  # let the controller (2 s poll) register the last checkpoint first
            os._exit(1)    # a worker dies mid-run
        if fault_here(config, "stall", step, rank, world_size):
            time.sleep(3600)  # alive but silent: the other ranks' collectives time out
        started = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)  # peak_memory_bytes is this step's peak
        # 1. this rank's batch at data position step-1
        window_BW = torch.from_numpy(sampler.batch(step - 1)).to(device)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + rank * 7919 + step)
        inputs_BS, targets_BS = lm_batch(preset.kind, window_BW, MASK_ID, preset.vocab_size, generator)
        # 2. forward (engine errors are re-raised naming the step; NaN/Inf in a MoE layer's
        #    input, raised on every rank together, counts as a non-finite loss)
        try:
            logits_BSV, aux_loss = model(inputs_BS)
            loss_lm = lm_loss(logits_BSV, targets_BS)
            if fault_here(config, "nan_loss", step, rank, world_size):
                loss_lm = loss_lm * float("nan")
            loss = loss_lm + config["aux_loss_weight"] * aux_loss
            local_losses = [loss_lm.item(), aux_loss.item()]
        except NonFiniteInputError:
            loss, local_losses = None, [math.nan, math.nan]
        except Exception as error:
            raise StepError(f"step {step} failed on rank {rank} (engine {config['engine']}): "
                            f"{type(error).__name__}: {error}") from error
        # 3. global losses; on NaN/Inf every rank halts, or skips this update, together
        lm_sum, aux_sum = reduce_sum(local_losses, device, world_size)
        mean_lm, mean_aux = lm_sum / world_size, aux_sum / world_size
        skip = not (math.isfinite(mean_lm) and math.isfinite(mean_aux))
        nonfinite_in_a_row = nonfinite_in_a_row + 1 if skip else 0
        if skip:
            check_nonfinite_loss(step, mean_lm, mean_aux, policy, nonfinite_in_a_row, config)
        grad_norm, lr = math.nan, learning_rate(step, config["lr"], config["warmup_steps"])
        if skip:
            loss = None  # drop the graph: no backward, no update
        else:
            # 4. backward
            try:
                loss.backward()
            except Exception as error:
                raise StepError(f"step {step} backward failed on rank {rank} (engine {config['engine']}): "
                                f"{type(error).__name__}: {error}") from error
            # 5. data-parallel averaging of replicated grads; expert grads / W
            average_gradients(replicated, expert, world_size)
            # 6. clip, update
            grad_norm = clip_grad_norm(replicated, expert, config["grad_clip"], world_size)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        # 7. slowest rank's time, largest peak memory
        step_time, peak = reduce_max([time.perf_counter() - started, peak_memory_bytes(device)],
                                     device, world_size)
        # 8. report
        metrics = {
            "step": step,
            "loss": mean_lm + config["aux_loss_weight"] * mean_aux,
            "lm_loss": mean_lm,
            "aux_loss": mean_aux,
            "tokens_per_s": tokens_per_step / step_time,
            "step_time_s": step_time,
            "peak_memory_bytes": int(peak),
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens_seen": step * tokens_per_step,
            "epoch": sampler.epoch_of(step - 1),
            "skipped": int(skip),
            "attempt": attempt,
            **model.engine_choices(),
        }
        if queue is not None:
            queue.put(metrics)
        every = config["checkpoint_every"]  # 0 = no checkpoints
        if every and (step % every == 0 or step == config["steps"]):
            meta = {"step": step, "data_position": step, "world_size": world_size,
                    "engine": config["engine"], "seed": seed, "preset": config["preset"]}
            with tempfile.TemporaryDirectory() as directory:
                ckpt.save(directory, rank, model, optimizer, meta)
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory),
                                 checkpoint_dir_name=f"checkpoint_{step:06d}")
