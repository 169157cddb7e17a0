"""A training job's settings: ``TrainJob`` (validated and made absolute in ``__post_init__``), the
run-name rules, and what the workers are given (``worker_config``: every setting resolved;
``expert_degree``; ``model_memory``: the parameters and training state per worker).

    job = TrainJob(preset="tiny-gpt", steps=50)      # validated, paths made absolute

The checks against this machine and the data are app/jobs/preflight.py; those against a
recorded run, app/jobs/resume.py; running the job, app/jobs/launch.py.
"""
from __future__ import annotations

import math
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from app.tracking.store import check_store_form, resolve_tracking_uri
from lm import data as data_lib
from lm.model import (COMPILE_BACKENDS, MODEL_OVERRIDES, ModelPreset, MoETransformer, check_activation_checkpointing,
                      check_routing_overrides, get_preset, leanest_moe_memory, param_counts)
from moe_engine.config import ENGINES, SPLITS, STRATEGY_CHOICES
from workers.config import (DECAY_FRACTION, NONFINITE_POLICIES, SCHEDULE_CHOICES, WorkerConfig, check_optimisation,
                            sync_free_capacity_refusal)
from workers.distributed import check_expert_degree, default_expert_degree, training_state_bytes
from workers.schedules import checkpointing_refusal

DEFAULT_EXPERIMENT = "mpipemoe-train"
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")
PARAM_DTYPES = ("float32", "bfloat16")


def _fail(field: str, value, fix: str) -> None:
    raise ValueError(f"TrainJob.{field}={value!r} is invalid: {fix}")


MAX_NAME_BYTES = 200  # a folder name (255 bytes, not characters, on most file systems) with room for ".lock"
# Characters a run name may hold: letters and digits of any script and these, none of which a
# shell treats specially, so that the commands mpipemoe prints work when pasted.
NAME_PUNCTUATION = "-_.+=@,:%"


def run_name_problem(name) -> str | None:
    """Local. What makes ``name`` unusable as a run name, or None. A run name is one folder
    inside the storage path (its checkpoints, job file and lock are named after it; pruning
    deletes inside it): never a path that leaves it, nor a hidden name beside our lock folder."""
    if not isinstance(name, str) or not name.strip():
        return "it is empty"
    if name in (".", "..") or any(sep and sep in name for sep in (os.sep, os.altsep)):
        return "it is a path, not one folder name (no '/', not '.' or '..')"
    if name.startswith("."):
        return "it starts with '.' (hidden names are mpipemoe's own folders)"
    if not name.isprintable():
        return "it holds control characters"
    odd = sorted({c for c in name if not (c.isalnum() or c in NAME_PUNCTUATION)})
    if odd:
        return (f"it holds {' '.join(repr(c) for c in odd)} (a run name is letters, digits and "
                f"{' '.join(NAME_PUNCTUATION)}, so that the commands printed for it work in a shell)")
    size = len(name.encode("utf-8", "surrogateescape"))
    if size > MAX_NAME_BYTES:
        return (f"it is {size} bytes long in UTF-8 ({len(name)} characters), more than {MAX_NAME_BYTES} "
                f"(file systems count a folder name's bytes)")
    return None


def check_run_name(name, flag: str = "--name") -> None:
    """Raise ValueError naming the flag, the value and the fix unless ``name`` is a run name."""
    problem = run_name_problem(name)
    if problem:
        raise ValueError(f"{flag} {name!r} is not a run name: {problem}; give one folder name such as "
                         f"my-run-1 (it is created inside --storage-path)")


def base_preset(preset: str, init_from: str | None = None) -> ModelPreset:
    """Local. The model a job starts from before its overrides: the preset called ``preset``,
    or, with ``init_from`` (a Hugging Face Mixtral-style folder), the one its config.json
    describes (workers/hf_mixtral.py ``mixtral_preset``; raises ValueError naming the field)."""
    if init_from is None:
        return get_preset(preset)
    from workers.hf_mixtral import read_mixtral_config

    return read_mixtral_config(init_from)


# Overrides that would change the parameters' shapes or meaning, which a checkpoint's weights fix.
INIT_FROM_FIXED = ("num_experts", "num_layers", "activation")


# TrainJob fields that a resume sets from the recorded run, not a user: a config file or a
# sweep's space that sets them is refused before Ray starts.
RESUME_OWNED = ("data_shards",)


@dataclass
class TrainJob:
    """One training job; validated and made absolute in ``__post_init__``.

    Paths (storage_path, data_dir, tracking_uri) are resolved against the current
    directory when the job is created: inside a Ray Tune trial pass them explicitly.
    """

    preset: str = "tiny-gpt"           # model shape, see lm.model.PRESETS
    engine: str = "mpipemoe"           # mpipemoe | fastmoe | fastermoe
    steps: int = 50                    # total optimizer steps (a resumed run continues to this)
    num_workers: int = 2               # Ray Train workers
    expert_parallel: int | None = None  # expert-parallel degree E: expert groups of E consecutive workers, the
                                       # experts replicated over W / E groups; None: default_expert_degree
                                       # (the GPUs of one node where they divide the experts, else the workers)
    use_gpu: bool | None = None        # None: GPUs when the Ray cluster has any
    batch_size: int = 8                # sequences per worker per step
    seq_len: int | None = None         # None: the preset's seq_len
    partitions: str | int = "auto"     # mpipemoe pipeline partitions n: "auto" or int >= 1
    strategy: str = "auto"             # mpipemoe memory strategy: auto | none | S1..S4
    split: str | None = None           # mpipemoe partitions split by tokens | peers | auto (None: the engine's
                                       # default, auto with --partitions auto; docs/engine.md)
    sync_free_capacity: float | None = None  # the MoE layers' sync-free capacity mode: a capacity factor
                                       # (no host read per layer; a step that overflows reruns dropless)
    moe_memory_gib: float | None = None  # mpipemoe: GiB of activations for all MoE layers of a worker's
                                       # micro-batch together; "auto" n and strategy then fit it
    seed: int = 0                      # model init and data order
    lr: float = 1e-3                   # peak AdamW learning rate
    checkpoint_every: int = 25         # steps between checkpoints (and at the last step); 0 = none
    storage_path: str | None = None    # Ray Train storage (absolute); default ./ray_results
    name: str | None = None            # Ray Train run name; an existing name resumes it
    tracking_uri: str | None = None    # MLflow store; default MLFLOW_TRACKING_URI or ./mlflow.db; "none": off
    experiment: str = DEFAULT_EXPERIMENT
    parent_run_id: str | None = None   # nest the MLflow run under this run
    data_dir: str | None = None        # prepared data; default ./data/stdlib-bytes (auto-prepared)
    cpus_per_worker: float | None = None  # None: 0.9 on CPU (2 workers fit 2 cores), 1 on GPU
    num_experts: int | None = None     # override the preset's experts per MoE layer
    num_layers: int | None = None      # override the preset's layer count
    top_k: int | None = None           # override the preset's experts per token
    capacity_factor: float | None = None  # override the preset's expert capacity (None: the preset's; its
                                       # default is dropless routing)
    activation: str | None = None      # override the preset's expert activation: relu | gelu | swiglu
    dtype: str = "auto"                # compute dtype (autocast): auto (bfloat16 on GPU, float32 on CPU) |
                                       # float32 | bfloat16; parameters and AdamW state are always float32
    param_dtype: str = "float32"       # parameters, gradients and AdamW state: float32 (master weights) |
                                       # bfloat16 (half the memory; small updates round away; for comparison)
    shard_dense: bool = False          # FSDP2 for the dense part (params, grads, AdamW state sharded); else DDP
    grad_accum: int = 1                # micro-batches of batch_size per optimizer step
    micro_batch_schedule: str = "sequential"  # sequential | overlapped (forward of k+1 beside backward of k) |
                                       # auto (workers/schedules.py choose_schedule)
    keep_checkpoints: int = 2          # complete checkpoints kept (older ones are deleted); 0 = all
    async_checkpoint: bool = False     # write checkpoint shards in the background while the next step trains
    weight_decay: float = 0.1
    warmup_steps: int = 5
    grad_clip: float = 1.0             # global grad-norm clip; 0 = off
    aux_loss_weight: float = 0.01      # loss = lm_loss + aux_loss_weight * load-balance loss
    expert_bias_rate: float = 0.0      # auxiliary-loss-free balancing: the routers' expert bias moves by this
                                       # after each step, toward the less loaded experts; 0 = off
    router_z_loss: float = 0.0         # loss += this * router z-loss (mean logsumexp(logits)^2); 0 = off
    max_failures: int = 0              # Ray Train restarts from the last checkpoint
    collective_timeout_s: int = 600    # a dead or stalled rank ends the job after this long
    on_nonfinite_loss: str = "halt"    # NaN/Inf loss: "halt" the job, or "skip" that step's update
    log_every: int = 10                # progress line (and per-expert load metrics) every N steps
    lr_schedule: str = "constant"      # after warm-up: constant | cosine | linear | wsd (decay to min_lr)
    min_lr: float = 0.0                # where cosine / linear / wsd end, at the last step
    decay_fraction: float = DECAY_FRACTION  # wsd: the share of the steps after warm-up that decays
    optimizer_impl: str = "auto"       # AdamW kernels: auto (fused on CUDA, else foreach) | fused | foreach | for-loop
    eval_every: int = 25               # validation loss every N steps and at the end; 0: never
    eval_batches: int = 4              # fixed validation batches (of batch_size sequences) per worker
    activation_checkpointing: str = "none"  # per block, run again in backward: none | selective (the
                                       # attention) | full (the whole block; lm.model ACTIVATION_CHECKPOINTING)
    data_shards: int | None = None     # rank streams the data is read as; None: num_workers (a run
                                       # resumed on another worker count keeps its first; workers/reshard.py)
    compile: bool = False              # torch.compile each block's norms, attention and router (the MoE
                                       # dispatch eager; lm.model compile_local_parts)
    compile_backend: str = "inductor"  # inductor (fused kernels) | aot_eager (graphs captured, eager kernels)
    init_from: str | None = None       # a Hugging Face Mixtral-style folder (config.json, safetensors,
                                       # tokenizer.json): the model's shape and first weights (not --preset's)

    def __post_init__(self) -> None:
        get_preset(self.preset)
        if self.init_from is not None:
            self._check_init_from()
        if self.engine not in ENGINES:
            _fail("engine", self.engine, f"choose one of {', '.join(ENGINES)}")
        for field in ("steps", "num_workers", "batch_size", "log_every", "collective_timeout_s", "grad_accum"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                _fail(field, value, "give an integer >= 1")
        for field in ("seq_len", "num_experts", "num_layers", "data_shards"):
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                _fail(field, value, "give an integer >= 1, or leave it unset for the preset's value")
        for field in ("warmup_steps", "max_failures", "seed", "checkpoint_every", "keep_checkpoints"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                _fail(field, value, "give an integer >= 0")
        check_routing_overrides(self, _fail)
        if isinstance(self.partitions, str) and self.partitions.isdigit():
            self.partitions = int(self.partitions)
        if self.partitions != "auto" and (isinstance(self.partitions, bool)
                                          or not isinstance(self.partitions, int) or self.partitions < 1):
            _fail("partitions", self.partitions, "give 'auto' or an integer >= 1")
        if self.strategy not in STRATEGY_CHOICES:
            _fail("strategy", self.strategy, f"choose one of {', '.join(STRATEGY_CHOICES)}")
        if self.split is not None:
            if self.split not in SPLITS:
                _fail("split", self.split, f"choose one of {', '.join(SPLITS)}")
            if self.engine != "mpipemoe":
                _fail("split", self.split, f"only the mpipemoe engine splits its partitions; drop --split or use "
                      f"--engine mpipemoe (not {self.engine})")
            if self.split == "auto" and self.partitions != "auto":
                _fail("split", self.split, "the search chooses the split with --partitions auto; give --split "
                      "tokens or peers with a fixed --partitions")
        refusal = sync_free_capacity_refusal(self.sync_free_capacity, self.engine, self.partitions, self.strategy,
                                             self.split)
        if refusal:
            _fail("sync_free_capacity", self.sync_free_capacity, f"{refusal} (--sync-free-capacity)")
        if self.moe_memory_gib is not None:
            if isinstance(self.moe_memory_gib, bool) or not isinstance(self.moe_memory_gib, (int, float)) \
                    or not 0 < self.moe_memory_gib < math.inf:
                _fail("moe_memory_gib", self.moe_memory_gib, "give a number of GiB > 0, e.g. 6 (--moe-memory-gib)")
            if self.engine != "mpipemoe":
                _fail("moe_memory_gib", self.moe_memory_gib, f"only the mpipemoe engine trades time for memory; "
                      f"drop --moe-memory-gib or use --engine mpipemoe (not {self.engine})")
            if self.partitions != "auto" and self.strategy != "auto":
                _fail("moe_memory_gib", self.moe_memory_gib, "the budget steers the automatic choices: give "
                      "--partitions auto or --strategy auto (or drop --moe-memory-gib)")
        if self.dtype == "float16":
            _fail("dtype", self.dtype, "float16 compute needs loss scaling, which this trainer does not do; "
                  "use --dtype bfloat16 (same memory and speed, no scaling needed) or float32")
        if self.dtype not in COMPUTE_DTYPES:
            _fail("dtype", self.dtype, f"choose {', '.join(COMPUTE_DTYPES)} (the compute dtype; parameters and "
                  f"optimizer state are float32)")
        if self.param_dtype not in PARAM_DTYPES:
            _fail("param_dtype", self.param_dtype, f"choose {' or '.join(PARAM_DTYPES)} (float32 keeps master "
                  f"weights; bfloat16 trains the parameters themselves in bf16)")
        if self.param_dtype == "bfloat16" and self.dtype == "float32":
            _fail("dtype", self.dtype, "bfloat16 parameters compute in bfloat16: use --dtype bfloat16 or auto")
        for field in ("shard_dense", "async_checkpoint"):
            if not isinstance(getattr(self, field), bool):
                _fail(field, getattr(self, field), "give True or False")
        if self.micro_batch_schedule not in SCHEDULE_CHOICES:
            _fail("micro_batch_schedule", self.micro_batch_schedule, f"choose one of {', '.join(SCHEDULE_CHOICES)}")
        if self.micro_batch_schedule == "overlapped" and self.shard_dense:
            _fail("micro_batch_schedule", self.micro_batch_schedule, "--shard-dense (FSDP2) takes the sequential "
                  "schedule: drop --shard-dense, or use --micro-batch-schedule sequential or auto")
        check_activation_checkpointing(self.activation_checkpointing, _fail)
        if not isinstance(self.compile, bool):
            _fail("compile", self.compile, "give true or false (--compile)")
        if self.compile_backend not in COMPILE_BACKENDS:
            _fail("compile_backend", self.compile_backend, f"choose one of {', '.join(COMPILE_BACKENDS)} "
                  f"(--compile-backend)")
        if self.micro_batch_schedule == "overlapped" and (why := checkpointing_refusal(
                self.activation_checkpointing, self.expert_parallel or self.num_workers)):
            _fail("micro_batch_schedule", self.micro_batch_schedule, why.replace(
                "the sequential micro-batch schedule", "--micro-batch-schedule sequential (or auto)"))
        if self.on_nonfinite_loss not in NONFINITE_POLICIES:
            _fail("on_nonfinite_loss", self.on_nonfinite_loss, f"choose {' or '.join(NONFINITE_POLICIES)}")
        check_optimisation(self, _fail)
        for field, least in (("eval_every", 0), ("eval_batches", 1)):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                _fail(field, value, f"give an integer >= {least}" + (" (0: no validation)" if not least else ""))
        if self.cpus_per_worker is not None and not 0 < self.cpus_per_worker < math.inf:
            _fail("cpus_per_worker", self.cpus_per_worker, "give a number > 0, e.g. 0.45 to fit 4 workers on 2 cores")
        if self.expert_parallel is not None and (isinstance(self.expert_parallel, bool)
                                                 or not isinstance(self.expert_parallel, int)):
            _fail("expert_parallel", self.expert_parallel, "give an integer >= 1 (--expert-parallel) or leave it "
                  "unset for the default")
        if self.expert_parallel is not None:
            check_expert_degree(self.expert_parallel, self.model_preset().num_experts, self.num_workers,
                                "TrainJob.expert_parallel")
        if self.expert_parallel is not None or self.use_gpu is False:
            self.model_preset().check_world_size(self.num_workers, self.expert_parallel)
            self.check_peer_partitions(self.expert_parallel or self.num_workers)
        # Else the default degree is the GPUs of one node where they divide the experts: known once
        # Ray is up (ray_start.build_trainer checks it), so gpt-s (8 experts) may ask for 64 GPUs.
        if self.moe_memory_gib is not None:
            self._check_moe_memory_budget()
        self.storage_path = str(Path(self.storage_path or "ray_results").expanduser().resolve())
        self.data_dir = str(Path(self.data_dir).expanduser().resolve()) if self.data_dir \
            else str(data_lib.default_data_dir())
        self.tracking_uri = resolve_tracking_uri(self.tracking_uri)
        check_store_form(self.tracking_uri)  # before anything is prepared or written
        if self.name is None:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            model = Path(self.init_from).name if self.init_from else self.preset
            self.name = f"{model}-{self.engine}-{stamp}-{uuid.uuid4().hex[:4]}"
        if (problem := run_name_problem(self.name)) is not None:
            _fail("name", self.name, f"{problem}: give one folder name such as my-run-1 (--name; it is "
                  f"created inside --storage-path)")
        if not isinstance(self.experiment, str) or not self.experiment.strip():
            _fail("experiment", self.experiment, f"give an MLflow experiment name (--experiment; default "
                  f"{DEFAULT_EXPERIMENT})")
        if isinstance(self.partitions, int):
            tokens = self.batch_size * self.model_preset().seq_len
            if self.partitions > tokens:
                _fail("partitions", self.partitions,
                      f"a worker's micro-batch has {tokens} tokens (--batch-size {self.batch_size} x seq_len "
                      f"{tokens // self.batch_size}) and each partition needs at least one: use --partitions "
                      f"{min(tokens, 8)} (at most {tokens}) or auto, or a larger --batch-size")

    def _check_init_from(self) -> None:
        """--init-from: an absolute folder whose config.json is Mixtral-style (read here, so a
        refusal comes before anything starts), and no override that changes the weights' shapes."""
        if not isinstance(self.init_from, str) or not self.init_from.strip():
            _fail("init_from", self.init_from, "give the folder of a Hugging Face Mixtral-style checkpoint "
                  "(config.json and safetensors), e.g. --init-from checkpoints/mixtral")
        self.init_from = str(Path(self.init_from).expanduser().resolve())
        preset = base_preset(self.preset, self.init_from)
        for field in INIT_FROM_FIXED:
            if getattr(self, field) is not None and getattr(self, field) != getattr(preset, field):
                _fail(field, getattr(self, field), f"--init-from {self.init_from} fixes it to {getattr(preset, field)} "
                      f"(its config.json): drop --{field.replace('_', '-')}")

    def _check_moe_memory_budget(self) -> None:
        """Refuse a --moe-memory-gib that no setting meets (priced in bfloat16, the smallest
        compute dtype, for a worker's micro-batch under balanced routing), before Ray starts."""
        preset = self.model_preset()
        tokens = self.batch_size * preset.seq_len
        # the overlapped schedule has two micro-batches' activations live (MemoryBudget.in_flight)
        in_flight = 2 if self.micro_batch_schedule == "overlapped" and self.grad_accum > 1 else 1
        need, n, strategy = leanest_moe_memory(preset, tokens, self.num_workers, torch.bfloat16, in_flight=in_flight,
                                               activation_checkpointing=self.activation_checkpointing)
        assert self.moe_memory_gib is not None
        if self.moe_memory_gib * 2**30 < need:
            _fail("moe_memory_gib", self.moe_memory_gib,
                  f"the leanest MPipeMoE setting (n={n}, {strategy}) needs {need / 2**30:.3g} GiB for the "
                  f"{preset.num_layers} MoE layers of {'two' if in_flight > 1 else 'a'} {tokens}-token "
                  f"micro-batch{'es in flight (--micro-batch-schedule overlapped)' if in_flight > 1 else ''} "
                  f"({self.preset}, --batch-size {self.batch_size}): give --moe-memory-gib "
                  f"{math.ceil(need / 2**30 * 1000) / 1000:g} or more, or a smaller --batch-size"
                  + (", or --micro-batch-schedule auto" if in_flight > 1 else "")
                  + (", or --activation-checkpointing full (one MoE layer's activations live at a time)"
                     if self.activation_checkpointing != "full" else ""))

    @property
    def model_label(self) -> str:
        """How lines and tags name the model: the preset, or the --init-from folder's name."""
        return f"{Path(self.init_from).name} (--init-from)" if self.init_from else self.preset

    def base_preset(self) -> ModelPreset:
        """The model before this job's overrides: --preset's, or --init-from's config.json."""
        return base_preset(self.preset, self.init_from)

    def model_preset(self, vocab_size: int | None = None) -> ModelPreset:
        """The preset with this job's overrides (seq_len, experts, layers, vocabulary: the
        data's, or with --init-from the checkpoint's, whose embedding fixes it)."""
        return self.base_preset().replace(vocab_size=None if self.init_from else vocab_size,
                                          **{k: getattr(self, k) for k in MODEL_OVERRIDES})

    def check_peer_partitions(self, degree: int) -> None:
        """Raise ValueError unless a fixed n split by peers divides the expert-parallel degree
        (each partition is degree / n destination ranks); the degree is known here once
        ``--expert-parallel`` is given or the run is on CPU, else when the trainer is built."""
        if self.split == "peers" and isinstance(self.partitions, int) and degree % self.partitions:
            divisors = [str(d) for d in range(1, degree + 1) if degree % d == 0]
            _fail("partitions", self.partitions, f"with --split peers give a divisor of the expert-parallel degree "
                  f"{degree} ({', '.join(divisors)}): each partition is {degree}/n destination ranks")

    @property
    def run_dir(self) -> Path:
        return Path(self.storage_path) / self.name


def expert_degree(job: TrainJob, gpus_per_node: int | None = None) -> int:
    """The expert-parallel degree E of ``job``'s workers: ``--expert-parallel``, else
    ``default_expert_degree`` (the ``gpus_per_node`` of one node where they divide the
    experts and the workers, else all workers; on CPU ``gpus_per_node`` is None)."""
    if job.expert_parallel is not None:
        return job.expert_parallel
    return default_expert_degree(job.model_preset().num_experts, job.num_workers, gpus_per_node)


def worker_config(job: TrainJob, use_gpu: bool, metrics_queue=None, gpus_per_node: int | None = None) -> WorkerConfig:
    """What ``train_fn_per_worker`` reads (all settings resolved)."""
    manifest = data_lib.Manifest.load(job.data_dir)
    preset = job.model_preset(vocab_size=manifest.vocab_size)
    cpus = job.cpus_per_worker or (1.0 if use_gpu else 0.9)
    dtype = job.dtype if job.dtype != "auto" else ("bfloat16" if use_gpu else "float32")
    return WorkerConfig(
        preset=preset, engine=job.engine, partitions=job.partitions,
        strategy=job.strategy, split=job.split, sync_free_capacity=job.sync_free_capacity, moe_memory_budget_bytes=(None if job.moe_memory_gib is None
                                                        else int(job.moe_memory_gib * 2**30)),
        expert_parallel=expert_degree(job, gpus_per_node),
        seed=job.seed, lr=job.lr, weight_decay=job.weight_decay,
        warmup_steps=job.warmup_steps, grad_clip=job.grad_clip,
        aux_loss_weight=job.aux_loss_weight, expert_bias_rate=job.expert_bias_rate,
        router_z_loss=job.router_z_loss, steps=job.steps, batch_size=job.batch_size,
        seq_len=preset.seq_len, checkpoint_every=job.checkpoint_every,
        data_dir=str(job.data_dir), use_gpu=use_gpu, dtype=dtype, param_dtype=job.param_dtype,
        torch_threads=max(1, int(cpus)), cpus_per_worker=cpus,
        on_nonfinite_loss=job.on_nonfinite_loss, metrics_queue=metrics_queue,
        shard_dense=job.shard_dense, grad_accum=job.grad_accum, async_checkpoint=job.async_checkpoint,
        micro_batch_schedule=job.micro_batch_schedule, activation_checkpointing=job.activation_checkpointing,
        collective_timeout_s=job.collective_timeout_s, data_shards=job.data_shards,
        mask_id=manifest.mask_id,  # the data's tokenizer decides its special ids
        lr_schedule=job.lr_schedule, min_lr=job.min_lr, optimizer_impl=job.optimizer_impl,
        decay_fraction=job.decay_fraction, init_from=job.init_from, compile=job.compile,
        compile_backend=job.compile_backend,
        eval_every=job.eval_every, eval_batches=job.eval_batches, log_every=job.log_every,
    )


def model_memory(job: TrainJob, config: WorkerConfig) -> dict:
    """Parameter counts of the whole model and the training state per worker in bytes
    (master weights, gradients and AdamW's two moments in ``param_dtype``, the compute copy
    under bf16 autocast; the dense part divided by W under ``shard_dense``). Activations are
    the MoE engine's memory model (docs/engine.md)."""
    with torch.device("meta"):
        model = MoETransformer(config.preset, engine=job.engine)
    counts = param_counts(model)  # one process: every expert
    compute_bytes, param_bytes = (torch.empty((), dtype=getattr(torch, name)).element_size()
                                  for name in (config.dtype, config.param_dtype))
    degree = config.expert_parallel or job.num_workers  # each worker holds the experts of its group's share
    return {**counts, **training_state_bytes(counts["params_replicated"], counts["params_expert"] // degree,
                                             job.num_workers, job.shard_dense, compute_bytes, param_bytes)}
