"""What `mpipemoe bench --step` times (app/bench/step.py): its settings (StepSettings), validated
at construction with errors that name the flag, and the schedules --schedule may ask for."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from moe_sim.routing import check_routing
from lm.model import ModelPreset, get_preset
from moe_engine.granularity import SEARCH_SPLITS
from moe_sim.emulation import EmulatedCluster
from workers.schedules import SCHEDULES as RUN_SCHEDULES

SCHEDULES = (*RUN_SCHEDULES, "auto")  # --schedule's settings (run_micro_batches; auto: choose_schedule)


@dataclass
class StepSettings:
    """What `mpipemoe bench --step` times; validated at construction (errors name the flag)."""

    model: str
    tokens: list
    micro_batches: tuple = (1,)
    layers: int | None = None          # the preset's when None
    emulate: str = "8x8"
    network: str = "dgx-a100"
    transfer_ctas: int = 1
    num_experts: int | None = None     # the expert group's ranks (one expert per rank) when None
    expert_parallel: int | None = None  # E: rank 0's MoE layers run over an expert group of E ranks, the
                                       # experts replicated over W / E groups whose gradients are reduced
                                       # (GradientReduction); None: one group of all W ranks
    routings: tuple = ("uniform",)
    partitions: tuple = (1, 2, 4)
    strategies: tuple = ("none", "S4")
    splits: tuple = ("tokens",)        # the grid's splits of a pass (MPipeMoE's split): tokens, peers
    grid: bool = True
    schedule: str = "sequential"       # --schedule: a comma list of SCHEDULES, each timed (schedules)
    moe_memory_gib: float | None = None  # the MoE activation budget auto's choice keeps within
    dtype: str = "auto"
    warmup: int = 1
    repeats: int = 2
    rounds: int = 3
    seq_len: int | None = None
    trace: str | None = None
    seed: int = 0
    cluster: EmulatedCluster = field(init=False, repr=False)
    schedules: tuple = field(init=False)  # the settings of --schedule, in order, each once

    def __post_init__(self) -> None:
        preset = get_preset(self.model)  # names the presets
        try:
            self.cluster = EmulatedCluster.parse(self.emulate, self.network, transfer_ctas=self.transfer_ctas,
                                                 expert_parallel=self.expert_parallel)
        except ValueError as error:
            raise ValueError(f"--emulate {self.emulate!r} --network {self.network!r}: {error}") from None
        group = self.cluster.expert_ranks
        if self.num_experts is None:
            self.num_experts = group
        if self.num_experts % group:
            which = (f"the {group} ranks of an expert group (--expert-parallel {self.expert_parallel})"
                     if self.expert_parallel is not None else f"the {group} emulated ranks of --emulate {self.emulate}")
            raise ValueError(f"--experts {self.num_experts} must be a multiple of {which}: give --experts {group} "
                             f"or a multiple of it")
        for split in self.splits:
            if split not in SEARCH_SPLITS:
                raise ValueError(f"--splits {','.join(self.splits)} is invalid: {split!r} is not a split; give "
                                 f"tokens, peers or both (tokens,peers)")
        if self.layers is not None and self.layers < 1:
            raise ValueError(f"--layers {self.layers} is invalid: give the model's layers, >= 1")
        names = [name.strip() for name in str(self.schedule).split(",")]
        for name in names:
            if name not in SCHEDULES:
                raise ValueError(f"--schedule {name!r} is unknown: choose from {', '.join(SCHEDULES)} (a comma "
                                 f"list times each, e.g. sequential,overlapped)")
        self.schedules = tuple(dict.fromkeys(names))
        if self.moe_memory_gib is not None and not self.moe_memory_gib > 0:
            raise ValueError(f"moe_memory_gib={self.moe_memory_gib!r} is invalid: give the MoE layers' activation "
                             f"budget in GiB, > 0 (or None: auto's choice of schedule then ignores memory)")
        if not self.micro_batches or any(k < 1 for k in self.micro_batches):
            raise ValueError(f"--micro-batches {list(self.micro_batches)} is invalid: give counts >= 1, e.g. 1,2")
        seq_len = self.seq_len or preset.seq_len
        if seq_len > preset.seq_len:
            raise ValueError(f"--seq-len {seq_len} exceeds {self.model}'s {preset.seq_len}")
        for tokens in self.tokens:
            for k in self.micro_batches:
                if tokens < 1 or tokens % (k * seq_len):
                    raise ValueError(f"--tokens {tokens} with --micro-batches {k}: each micro-batch must hold whole "
                                     f"sequences of {seq_len} tokens; give a multiple of {k * seq_len}")
        for routing in self.routings:
            check_routing(routing)
        for name in ("repeats", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} {getattr(self, name)} is invalid: give at least 1")
        if self.warmup < 0:
            raise ValueError(f"--warmup {self.warmup} is invalid: give 0 or more")

    def preset(self) -> ModelPreset:
        base = get_preset(self.model)
        return base.replace(num_layers=self.layers, num_experts=self.num_experts, seq_len=self.seq_len)

    def compute_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[self.dtype]

    def to_json(self) -> dict:
        data = asdict(self)
        data.pop("cluster", None)
        return data
