"""What the driver hands each Ray Train worker: one frozen, validated ``WorkerConfig``.

The driver builds it with ``app.jobs.job.worker_config(job, use_gpu)`` (all settings resolved:
device, dtype, threads, the data's mask id); ``workers/loop.py`` (training) and
``workers/capacity.py`` (the batch-size search) read its attributes. Ray pickles it to the
workers like any value. Tests build one directly, with the defaults below.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, NoReturn

from lm.data import MASK_ID
from lm.model import COMPILE_BACKENDS, ModelPreset, check_activation_checkpointing
from moe_engine.config import ENGINES, SPLITS, STRATEGY_CHOICES

SCHEDULE_CHOICES = ("sequential", "overlapped", "auto")  # micro-batch schedules (workers/schedules.py)

NONFINITE_POLICIES = ("halt", "skip")
LR_SCHEDULES = ("constant", "cosine", "linear", "wsd")
DECAY_FRACTION = 0.2  # "wsd": the decay takes the last 20% of the steps after warm-up
OPTIMIZER_IMPLS = ("auto", "fused", "foreach", "for-loop")
DTYPES = ("float32", "bfloat16", "float16")
# Fields only some runs set; logged to MLflow only when set (app/jobs/launch.py ``_run_params``).
RUN_SPECIFIC = ("resume_from", "data_shards", "fault", "memory_cap_bytes", "start_batch", "max_batch", "steps_per_trial")
HANDLES = ("metrics_queue", "stop_flag")  # Ray actor handles, not settings


def _fail(field: str, value: object, fix: str) -> NoReturn:
    raise ValueError(f"WorkerConfig.{field}={value!r} is invalid: {fix}")


def sync_free_capacity_refusal(factor: object, engine: str, partitions: object, strategy: str,
                               split: str | None) -> str | None:
    """Why the MoE layers' sync-free capacity mode cannot run with these settings (the fix,
    in words), or None. It needs a factor > 0, an engine that has it and fixed settings: its
    passes exchange no counts, so nothing can be agreed per pass."""
    if factor is None:
        return None
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
        return "give a capacity factor > 0 (e.g. 1.5), or leave it unset for the dropless exchange"
    if engine == "fastermoe":
        return ("the fastermoe engine splits by peers and has no sync-free mode: use the mpipemoe or fastmoe "
                "engine, or leave it unset")
    if engine == "mpipemoe" and (partitions == "auto" or strategy == "auto"):
        return ("its passes agree on nothing, so it needs a fixed partitions count and strategy (none, S1-S4), "
                "not auto")
    if split not in (None, "tokens"):
        return f"it splits the partitions by tokens: drop split={split}"
    return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_optimisation(settings: Any, fail: Callable[[str, object, str], NoReturn]) -> None:
    """The optimisation settings of ``settings`` (a WorkerConfig or an app.jobs.job.TrainJob):
    ``fail(field, value, fix)`` raises for the first bad one."""
    for name in ("lr", "min_lr", "weight_decay", "grad_clip", "aux_loss_weight"):
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value < 0 or (name == "lr" and value == 0):
            fail(name, value, "give a finite number > 0, e.g. 1e-3" if name == "lr" else
                 "give a finite number >= 0" + (" (0 turns clipping off)" if name == "grad_clip" else ""))
    if settings.lr_schedule not in LR_SCHEDULES:
        fail("lr_schedule", settings.lr_schedule, f"choose one of {', '.join(LR_SCHEDULES)}")
    fraction = settings.decay_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        fail("decay_fraction", fraction, "give a fraction in (0, 1] of the steps after warm-up that the wsd "
             f"decay takes, e.g. {DECAY_FRACTION} (--decay-fraction)")
    if settings.min_lr > settings.lr:
        fail("min_lr", settings.min_lr, f"give at most the peak --lr {settings.lr:g} (the schedule decays to it)")
    if settings.lr_schedule != "constant" and settings.warmup_steps >= settings.steps:
        fail("warmup_steps", settings.warmup_steps, f"a {settings.lr_schedule} schedule decays after the warm-up: "
             f"give fewer than --steps {settings.steps} warm-up steps, or --lr-schedule constant")
    if settings.optimizer_impl not in OPTIMIZER_IMPLS:
        fail("optimizer_impl", settings.optimizer_impl, f"choose one of {', '.join(OPTIMIZER_IMPLS)}")
    check_balancing(settings, fail)


def _is_number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def check_balancing(settings: Any, fail: Callable[[str, object, str], NoReturn]) -> None:
    """The routers' balancing settings of ``settings`` (a WorkerConfig or a TrainJob):
    ``fail(field, value, fix)`` raises for the first bad one."""
    rate = settings.expert_bias_rate
    if not (_is_number(rate) and 0 <= rate < 1):
        fail("expert_bias_rate", rate, "give a step size in [0, 1) for the routers' expert bias (--expert-bias-rate; "
             "e.g. 1e-3 as DeepSeek-V3; 0 turns the auxiliary-loss-free balancing off)")
    coefficient = settings.router_z_loss
    if not (_is_number(coefficient) and coefficient >= 0):
        fail("router_z_loss", coefficient, "give a finite coefficient >= 0 (--router-z-loss; e.g. 1e-3 as ST-MoE; "
             "0 turns the z-loss off)")


@dataclass(frozen=True)
class WorkerConfig:
    """Settings of one training (or capacity-search) worker.

    preset:              the model (a ``ModelPreset``; its dict, as checkpoints store it, is accepted).
    engine, partitions, strategy: the MoE engine and its pipeline settings (lm.model).
    moe_memory_budget_bytes: activation bytes for all MoE layers together (MemoryBudget), or None.
    seed, lr, weight_decay, warmup_steps, grad_clip, aux_loss_weight: the optimisation.
    expert_bias_rate:    auxiliary-loss-free balancing: each MoE layer's expert bias moves by this
                         after every optimizer step (workers/balance.py); 0: off.
    router_z_loss:       the router z-loss's weight in the loss (ST-MoE); 0: off.
    lr_schedule, min_lr, decay_fraction: the learning rate after warm-up (workers/loop.py
                         ``learning_rate``; decay_fraction: the share of the wsd decay).
    optimizer_impl:      AdamW's kernels: "auto" (fused on CUDA, foreach elsewhere), "fused",
                         "foreach" or "for-loop" (workers/loop.py ``build_optimizer``).
    eval_every, eval_batches: validation loss every N steps and at the end (0: never), over
                         this many fixed batches per worker (lm.data ``ValidationBatches``).
    log_every:           steps between the per-expert load metrics (and the driver's lines).
    steps, batch_size, seq_len, grad_accum: the run's length and each worker's batch.
    checkpoint_every:    steps between checkpoints (0: none); async_checkpoint writes them
                         while the next step trains.
    data_dir:            the prepared dataset (lm.data); mask_id is its tokenizer's mask token.
    use_gpu, dtype, param_dtype: device, autocast dtype and parameter dtype.
    torch_threads, cpus_per_worker: CPU threads per worker and the CPUs Ray reserves.
    on_nonfinite_loss:   "halt" or "skip" (workers/loop.py ``check_nonfinite_loss``).
    shard_dense:         FSDP2 for the dense part instead of DDP.
    micro_batch_schedule: "sequential", "overlapped" (the forward of micro-batch k+1 beside the
                         backward of k; DDP only) or "auto" (workers/schedules.py ``choose_schedule``).
    activation_checkpointing: what each transformer block runs again in backward: "none",
                         "selective" (the attention) or "full" (the block; lm.model
                         ACTIVATION_CHECKPOINTING).
    expert_parallel:     the expert-parallel degree P: expert groups of P consecutive ranks, each
                         holding every expert once (workers/distributed.py); None: the world.
    collective_timeout_s: timeout of the checkpoint's gloo group (None: the default).
    metrics_queue, stop_flag: Ray actor handles (the driver's queue and Ctrl-C flag) or None.
    hold_steps:          steps after which rank 0 waits for the driver's decision to go on or stop
                         (``stop_flag``): a sweep's ASHA rungs, so a pruned trial ends at its rung.
    resume_from:         a checkpoint directory a resumed run starts from (the driver's choice).
    compile, compile_backend: torch.compile of each block's norms, attention and router (the MoE
                         dispatch eager; lm.model ``compile_local_parts``) with this backend.
    init_from:           a Hugging Face Mixtral-style folder whose weights a fresh run starts from
                         (each rank reads its own experts: workers/hf_mixtral.py ``read_mixtral_shard``).
    data_shards:         rank streams the data is read as (None: one per worker); a run resumed on
                         another worker count keeps its first count (workers/reshard.py).
    fault:               fault-injection tests only (workers/loop.py ``fault_here``).
    memory_cap_bytes, start_batch, max_batch, steps_per_trial: the capacity search only
                         (app/commands/capacity.py ``CapacitySearch``).
    """

    preset: ModelPreset
    engine: str
    data_dir: str
    partitions: int | str = "auto"
    strategy: str = "auto"
    split: str | None = None          # MPipeMoE's split of its partitions (None: the layer's default)
    sync_free_capacity: float | None = None  # the MoE layers' sync-free capacity mode (None: dropless)
    moe_memory_budget_bytes: int | None = None
    seed: int = 0
    lr: float = 3e-4
    weight_decay: float = 0.1
    warmup_steps: int = 0
    grad_clip: float = 1.0
    aux_loss_weight: float = 0.01
    expert_bias_rate: float = 0.0
    router_z_loss: float = 0.0
    steps: int = 1
    batch_size: int = 1
    seq_len: int | None = None
    checkpoint_every: int = 0
    use_gpu: bool = False
    dtype: str = "float32"
    param_dtype: str = "float32"
    torch_threads: int = 1
    cpus_per_worker: float = 1.0
    on_nonfinite_loss: str = "halt"
    shard_dense: bool = False
    grad_accum: int = 1
    async_checkpoint: bool = False
    collective_timeout_s: float | None = None
    mask_id: int = MASK_ID
    metrics_queue: Any = None  # (Ray actor handles: typed by Ray as Any)
    stop_flag: Any = None
    hold_steps: tuple[int, ...] = ()
    resume_from: str | None = None
    data_shards: int | None = None
    fault: dict[str, Any] | None = None
    memory_cap_bytes: int | None = None
    start_batch: int | None = None
    max_batch: int | None = None
    steps_per_trial: int | None = None
    lr_schedule: str = "constant"
    min_lr: float = 0.0
    decay_fraction: float = DECAY_FRACTION
    optimizer_impl: str = "auto"
    eval_every: int = 0
    eval_batches: int = 4
    log_every: int = 10
    micro_batch_schedule: str = "sequential"
    expert_parallel: int | None = None
    activation_checkpointing: str = "none"
    init_from: str | None = None
    compile: bool = False
    compile_backend: str = "inductor"

    def __post_init__(self) -> None:
        if not isinstance(self.compile, bool):
            _fail("compile", self.compile, "give True or False")
        if self.compile_backend not in COMPILE_BACKENDS:
            _fail("compile_backend", self.compile_backend, f"choose one of {', '.join(COMPILE_BACKENDS)}")
        if isinstance(self.preset, dict):  # as checkpoints and older callers give it
            object.__setattr__(self, "preset", ModelPreset(**self.preset))
        if not isinstance(self.preset, ModelPreset):
            _fail("preset", self.preset, "give a lm.model.ModelPreset (or its dict)")
        if self.seq_len is None:
            object.__setattr__(self, "seq_len", self.preset.seq_len)
        if self.engine not in ENGINES:
            _fail("engine", self.engine, f"choose one of {', '.join(ENGINES)}")
        if self.strategy not in STRATEGY_CHOICES:
            _fail("strategy", self.strategy, f"choose one of {', '.join(STRATEGY_CHOICES)}")
        if self.split is not None and self.split not in SPLITS:
            _fail("split", self.split, f"choose one of {', '.join(SPLITS)} or None")
        refusal = sync_free_capacity_refusal(self.sync_free_capacity, self.engine, self.partitions, self.strategy,
                                             self.split)
        if refusal:
            _fail("sync_free_capacity", self.sync_free_capacity, refusal)
        if self.partitions != "auto" and not (isinstance(self.partitions, int) and _is_int(self.partitions)
                                               and self.partitions >= 1):
            _fail("partitions", self.partitions, 'give an integer >= 1 or "auto"')
        if self.moe_memory_budget_bytes is not None and not (_is_int(self.moe_memory_budget_bytes)
                                                             and self.moe_memory_budget_bytes >= 1):
            _fail("moe_memory_budget_bytes", self.moe_memory_budget_bytes, "give an integer >= 1 or None")
        if not isinstance(self.data_dir, str) or not self.data_dir:
            _fail("data_dir", self.data_dir, "give the prepared dataset's directory (mpipemoe data)")
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "torch_threads", "eval_batches", "log_every"):
            if not (_is_int(getattr(self, name)) and getattr(self, name) >= 1):
                _fail(name, getattr(self, name), "give an integer >= 1")
        for name in ("seed", "warmup_steps", "checkpoint_every", "mask_id", "eval_every"):
            if not (_is_int(getattr(self, name)) and getattr(self, name) >= 0):
                _fail(name, getattr(self, name), "give an integer >= 0")
        if self.preset.kind == "bert" and self.mask_id >= self.preset.vocab_size:
            # the masked LM writes it into the inputs, which the training loop does not check on
            # the device (only the data's ids, on the host)
            _fail("mask_id", self.mask_id, f"the model's vocabulary has ids 0..{self.preset.vocab_size - 1}; prepare "
                                           f"the data with a tokenizer that has a mask token")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                _fail(name, getattr(self, name), f"choose one of {', '.join(DTYPES)}")
        if self.on_nonfinite_loss not in NONFINITE_POLICIES:
            _fail("on_nonfinite_loss", self.on_nonfinite_loss, f"choose one of {', '.join(NONFINITE_POLICIES)}")
        check_optimisation(self, _fail)
        if self.micro_batch_schedule not in SCHEDULE_CHOICES:
            _fail("micro_batch_schedule", self.micro_batch_schedule, f"choose one of {', '.join(SCHEDULE_CHOICES)}")
        if self.micro_batch_schedule == "overlapped" and self.shard_dense:
            _fail("micro_batch_schedule", self.micro_batch_schedule, "FSDP2 (shard_dense) gathers and frees parameters "
                  "per micro-batch, which two in flight would interleave: use sequential (or auto), or DDP")
        check_activation_checkpointing(self.activation_checkpointing, _fail)
        if self.data_shards is not None and not (_is_int(self.data_shards) and self.data_shards >= 1):
            _fail("data_shards", self.data_shards, "give an integer >= 1, or None (one rank stream per worker)")
        if self.expert_parallel is not None and not (_is_int(self.expert_parallel) and self.expert_parallel >= 1
                                                      and self.preset.num_experts % self.expert_parallel == 0):
            _fail("expert_parallel", self.expert_parallel, f"give a divisor of the {self.preset.num_experts} experts "
                  f"per MoE layer that divides the worker count, or None (the world)")
        for name in ("start_batch", "max_batch", "steps_per_trial"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and value >= 1):
                _fail(name, value, "give an integer >= 1, or None outside the capacity search")

    def search_setting(self, name: str) -> int:
        """The capacity-search setting ``name`` (start_batch, max_batch or steps_per_trial),
        which the search needs set."""
        value = getattr(self, name)
        if value is None:
            _fail(name, value, "the capacity search needs it (app/commands/capacity.py CapacitySearch sets it)")
        return int(value)

    def replace(self, **changes: Any) -> WorkerConfig:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)

    def preset_dict(self) -> dict[str, Any]:
        """The model preset as checkpoints store it (``meta.json``'s "preset")."""
        return self.preset.as_dict()

    def settings(self) -> dict[str, Any]:
        """The resolved settings as MLflow logs them: every field but the preset (logged as
        the model) and the actor handles; the run-specific ones only when set."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)
                if field.name not in ("preset", *HANDLES)
                and not (field.name in RUN_SPECIFIC and getattr(self, field.name) is None)}
