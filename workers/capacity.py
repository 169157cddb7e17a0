"""What each Ray Train worker runs for ``mpipemoe capacity``: the largest batch that fits.

The worker caps its GPU memory (``torch.cuda.set_per_process_memory_fraction``), builds
the model as training does (``workers.loop.build_parallel_model``: the run's expert-parallel
degree, so each rank holds the experts it will train; its micro-batch schedule, so as many
micro-batches are in flight as in training), then tries batch sizes (per micro-batch, as
``--batch-size``) with real training steps (``grad_accum`` micro-batches' forwards and
backwards by the schedule, data-parallel gradient averaging, AdamW): it doubles from ``start_batch`` until a step runs out of memory (or
``max_batch`` is reached) and bisects between the last size that fitted and the first
that did not. Every trial's outcome is agreed over ranks, so all ranks walk the same
sizes. A trial at the largest fitting size is also the throughput measurement.

Limitation: a rank that runs out of memory inside an All-to-All leaves its peers waiting
in that collective until the process-group timeout ends the job; with one worker per
engine (the usual capacity question) this cannot happen.

Ray Train is imported inside the worker function only, as in workers/loop.py.
"""
from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from lm.data import BatchSampler, open_rank_stream
from lm.model import MoETransformer, lm_batch, lm_loss
from workers.config import WorkerConfig
from workers.distributed import DenseParallel, reduce_max
from workers.loop import ParallelModel, build_optimizer, build_parallel_model, model_flops_metrics, peak_memory_bytes
from workers.schedules import Lanes, ScheduleError, forward_backward


def largest_fitting(fits: Callable[[int], bool], start: int, limit: int) -> int:
    """The largest b in [1, limit] with ``fits(b)``, assuming fits is monotone (true up to
    some size, false beyond). Doubles from ``start``, then bisects; 0 if nothing fits."""
    if not 1 <= start <= limit:
        raise ValueError(f"start_batch={start} must lie in [1, max_batch={limit}]")
    low, high = 0, limit + 1           # fits(low) (or low == 0), not fits(high) (or high > limit)
    size = start
    while True:                        # grow
        if fits(size):
            low = size
            if size == limit:
                return size
            size = min(2 * size, limit)
        else:
            high = size
            break
    if low == 0:                       # even start failed: look below it
        low_bound = 0
        while high - low_bound > 1:
            mid = (low_bound + high) // 2
            if fits(mid):
                low_bound = mid
            else:
                high = mid
        return low_bound
    while high - low > 1:              # bisect
        mid = (low + high) // 2
        if fits(mid):
            low = mid
        else:
            high = mid
    return low


class BatchTrials:
    """``fits(batch_size)``: a few real training steps at that size, agreed over ranks.

    Every trial is appended to ``trials`` (and passed to ``on_trial``): batch_size, fits,
    peak_memory_bytes (max over ranks), step_time_s and tokens_per_s (the fastest step
    after the first, slowest rank), model_tflops_per_s and mfu (per worker, where the GPU's
    peak is known), and the engine's choices (partitions, strategy).

    ``built``: the model as training builds it (``capacity_trials``); without it ``model``
    runs as one expert group of every rank, one micro-batch a step.
    """

    def __init__(self, model: MoETransformer, tokens: np.ndarray[Any, Any], device: torch.device, world_size: int,
                 rank: int, config: WorkerConfig, on_trial: Callable[[dict[str, Any]], None] | None = None,
                 built: ParallelModel | None = None):
        self.model, self.tokens, self.device = model, tokens, device
        self.world_size, self.rank, self.config, self.on_trial = world_size, rank, config, on_trial
        self.preset = model.preset
        self.seq_len = config.seq_len or self.preset.seq_len  # (training's windows: workers/loop.py)
        self.window = self.seq_len + 1 if self.preset.kind == "gpt" else self.seq_len
        self.parallel = built.parallel if built is not None else \
            DenseParallel(model, mode="fsdp2" if config.shard_dense else "ddp", world_size=world_size, device=device,
                          compute_dtype=getattr(torch, config.dtype), timeout_s=config.collective_timeout_s)
        self.micro_batches = config.grad_accum if built is not None else 1
        self.schedule = built.schedule if built is not None else "sequential"
        # Collective (every rank resolves the same schedule): the MoE layers' lanes
        self.lanes = Lanes.create(model, timeout_s=config.collective_timeout_s) \
            if self.schedule == "overlapped" else None
        self.optimizer = build_optimizer(self.parallel, config.lr, config.weight_decay, config.optimizer_impl)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.trials: list[dict[str, Any]] = []

    def _train_step(self, sampler: BatchSampler, index: int) -> None:
        """Collective: one training step of ``micro_batches`` micro-batches by the schedule."""
        K = self.micro_batches

        def loss_of(module: torch.nn.Module, micro: int) -> tuple[torch.Tensor, None]:
            window_BS = torch.from_numpy(sampler.batch(index * K + micro)).to(self.device)
            inputs_BS, targets_BS = lm_batch(self.preset.kind, window_BS, self.config.mask_id,
                                             self.preset.vocab_size, self.generator)
            with self.parallel.autocast():
                logits_BSV, aux_loss = module(inputs_BS)
                loss = lm_loss(logits_BSV.float(), targets_BS) + self.config.aux_loss_weight * aux_loss.float()
            return loss / K, None

        try:
            forward_backward(self.parallel, range(K), loss_of, schedule=self.schedule, lanes=self.lanes)
        except ScheduleError as error:  # an out-of-memory inside a micro-batch is the trial's answer
            if isinstance(error.__cause__, torch.OutOfMemoryError):
                raise error.__cause__ from None
            raise
        self.parallel.finish_gradients()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def fits(self, batch_size: int) -> bool:
        """False (on every rank) if any rank ran out of memory at ``batch_size``."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        out_of_memory, times = False, []
        try:
            sampler = BatchSampler(self.tokens, batch_size, self.window, self.config.seed, self.rank)
            for index in range(self.config.search_setting("steps_per_trial")):
                started = time.perf_counter()
                self._train_step(sampler, index)
                if cuda:
                    torch.cuda.synchronize(self.device)
                times.append(time.perf_counter() - started)
        except torch.OutOfMemoryError:
            out_of_memory = True
        if out_of_memory:  # free what the failed step held before the next trial
            self.optimizer.zero_grad(set_to_none=True)
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        step_time = min(times[1:] or times) if times else float("nan")
        failed, step_time, peak = reduce_max([float(out_of_memory), step_time, peak_memory_bytes(self.device)],
                                             self.device, self.world_size)
        tokens = self.world_size * batch_size * self.micro_batches * self.seq_len
        trial = {"batch_size": batch_size, "fits": not failed, "peak_memory_bytes": int(peak),
                 "step_time_s": step_time, "tokens_per_s": 0.0 if failed else tokens / step_time,
                 **self.model.engine_choices()}
        if not failed:
            trial.update(model_flops_metrics(tokens / step_time / self.world_size, self.preset, self.device,
                                             self.config.dtype))
        self.trials.append(trial)
        if self.on_trial is not None:
            self.on_trial(trial)
        return not failed


def capacity_fn_per_worker(config: WorkerConfig) -> None:
    import ray.train
    import ray.train.torch

    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device() if config.use_gpu else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        total = torch.cuda.get_device_properties(device).total_memory
        if config.memory_cap_bytes:
            torch.cuda.set_per_process_memory_fraction(min(1.0, config.memory_cap_bytes / total), device)
    torch.set_num_threads(config.torch_threads)
    torch.manual_seed(config.seed + rank)

    queue = config.metrics_queue if rank == 0 else None
    trials = capacity_trials(config, rank, world_size, device, on_trial=queue.put if queue is not None else None)
    largest = largest_fitting(trials.fits, config.search_setting("start_batch"), config.search_setting("max_batch"))
    if queue is not None:
        queue.put({"largest_batch_size": largest})


def capacity_trials(config: WorkerConfig, rank: int, world_size: int, device: torch.device,
                    on_trial: Callable[[dict[str, Any]], None] | None = None) -> BatchTrials:
    """Collective: the trials of this rank, on the model as training builds it
    (``build_parallel_model``, its schedule chosen for ``start_batch``)."""
    built = build_parallel_model(config, rank, world_size, device, batch_size=config.search_setting("start_batch"))
    built.model.train()
    return BatchTrials(built.model, open_rank_stream(config.data_dir, rank, world_size), device, world_size, rank,
                       config, on_trial=on_trial, built=built)
