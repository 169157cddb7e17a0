"""What `mpipemoe bench` times (app/bench/layer.py): its settings (BenchSettings), validated at
construction with errors that name the flag. measure.py and layer_bound.py read them too, so they
live apart from the bench that runs them (as the step bench's do, app/bench/step_settings.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from app.bench.peers import check_peers
from moe_sim.routing import check_routing
from app.bench.shapes import DTYPES, LAYER_SHAPES
from app.bench.stack import CHECKPOINTING, DEFAULT_BUDGET_SHARE
from moe_engine.comm import DEFAULT_COMM_SMS
from moe_engine.config import STRATEGIES
from moe_engine.granularity import SEARCH_SPLITS
from moe_sim.emulation import EmulatedCluster


@dataclass
class BenchSettings:
    """What `mpipemoe bench` times (app/bench/layer.py); validated at construction (errors name the flag)."""

    models: list
    tokens: list
    num_experts: int = 8
    top_k: int = 2
    activation: str = "gelu"
    dtype: str = "auto"
    partitions: tuple = (1, 2, 4, 8)
    strategies: tuple = STRATEGIES
    splits: tuple = ("tokens",)   # the grid's splits of a pass (MPipeMoE's split): tokens, peers
    grid: bool = True
    warmup: int = 1
    repeats: int = 3
    rounds: int = 5
    world_size: int = 1
    routings: tuple = ("uniform",)  # moe_sim/routing.py's names
    seed: int = 0           # the routing's: zipf's ranking of the experts, the imposed tokens' order
    bias: bool = True       # expert FFN biases b1, b2 (MoEConfig.bias); --no-bias drops them
    peers: tuple = ()       # other libraries' layers timed beside ours (app/bench/peers.py)
    emulate: str | None = None  # NODESxGPUS: one process as rank 0 of that cluster (moe_sim/emulation.py)
    network: str = "dgx-a100"   # the emulated cluster's network (moe_sim/network.py presets, or a JSON file)
    transfer_ctas: int = 1      # thread blocks each emulated transfer holds (EmulatedCluster.transfer_ctas)
    comm_sms: int | None = None  # SMs the emulated cluster's GEMMs leave to communication (default: NCCL's 16)
    trace: str | None = None    # a folder: one torch.profiler timeline per engine and setting (app/bench/timeline.py)
    layers: int = 1             # > 1: time stacks of residual layers, setting by setting (app/bench/stack.py)
    checkpointing: str | None = None  # stacks: off, on or both (default both)
    memory_budget_share: float | None = None  # stacks: auto@budget's budget, a share of the reference's memory
    memory_budget_gib: float | None = None    # ... or in GiB

    def __post_init__(self):
        for m in self.models:
            if m not in LAYER_SHAPES:
                raise ValueError(f"--model {m!r} is unknown: choose from {', '.join(LAYER_SHAPES)}")
        if not self.tokens or any(t < 1 for t in self.tokens):
            raise ValueError(f"--tokens {self.tokens} is invalid: give positive token counts, e.g. 4096,8192")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r} is invalid: choose auto, bf16, fp16 or fp32")
        for routing in self.routings:
            check_routing(routing)  # moe_sim/routing.py
        for split in self.splits:
            if split not in SEARCH_SPLITS:
                raise ValueError(f"--splits {','.join(self.splits)} is invalid: {split!r} is not a split; give "
                                 f"tokens, peers or both (tokens,peers)")
        if self.layers > 1 and tuple(self.splits) != ("tokens",):
            raise ValueError(f"--splits {','.join(self.splits)} with --layers {self.layers}: stacks time the grid "
                             f"split by tokens (and auto, which times both); drop --splits")
        for name in ("repeats", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} {getattr(self, name)} is invalid: give at least 1")
        if self.warmup < 0:
            raise ValueError(f"--warmup {self.warmup} is invalid: give 0 or more")
        if self.num_experts % self.world_size:
            raise ValueError(f"--experts {self.num_experts} must be a multiple of --world-size {self.world_size}")
        cluster = self.emulated_cluster()
        if cluster is not None:
            if self.world_size != 1:
                raise ValueError(f"--emulate {self.emulate} runs one process as rank 0 of the emulated cluster: "
                                 f"drop --world-size {self.world_size} (or drop --emulate to use real ranks)")
            if self.peers:
                raise ValueError(f"--emulate cannot time --peers {','.join(self.peers)}: other libraries' layers do "
                                 f"not run on the emulated group; drop --peers or --emulate")
            if self.num_experts % cluster.ranks:
                raise ValueError(f"--experts {self.num_experts} must be a multiple of the {cluster.ranks} emulated "
                                 f"ranks of --emulate {self.emulate}: give e.g. --experts "
                                 f"{cluster.ranks * max(1, self.num_experts // cluster.ranks)}")
        elif self.comm_sms is not None:
            raise ValueError(f"--comm-sms {self.comm_sms} sets the SMs an emulated cluster leaves to communication: "
                             f"give --emulate NODESxGPUS too (real ranks leave NCCL what NCCL_MAX_CTAS says)")
        check_peers(self.peers, activation=self.activation, bias=self.bias, world_size=self.world_size)
        self._check_stack()

    def _check_stack(self) -> None:
        if self.layers < 1:
            raise ValueError(f"--layers {self.layers} is invalid: give 1 or more")
        stack_options = [f"--{name.replace('_', '-')}" for name in ("checkpointing", "memory_budget_share",
                                                                    "memory_budget_gib")
                         if getattr(self, name) is not None]
        if self.layers == 1:
            if stack_options:
                raise ValueError(f"{' and '.join(stack_options)} time stacks of layers: give --layers L (L >= 2)")
            return
        if self.checkpointing is None:
            self.checkpointing = "both"
        if self.checkpointing not in CHECKPOINTING:
            raise ValueError(f"--checkpointing {self.checkpointing!r} is invalid: choose {', '.join(CHECKPOINTING)}")
        for option in ("emulate", "trace"):
            if getattr(self, option) is not None:
                raise ValueError(f"--{option} times single layers: drop it or drop --layers {self.layers}")
        if self.memory_budget_share is not None and self.memory_budget_gib is not None:
            raise ValueError("give one of --memory-budget-share and --memory-budget-gib")
        for name, value in (("share", self.memory_budget_share), ("gib", self.memory_budget_gib)):
            if value is not None and not value > 0:
                raise ValueError(f"--memory-budget-{name} {value} is invalid: give a number > 0")

    def budgeted(self) -> bool:
        """Whether a stacked bench times auto@budget: a budget was given, or a peer runs."""
        return bool(self.peers) or self.memory_budget_share is not None or self.memory_budget_gib is not None

    def budget_share(self) -> float:
        return DEFAULT_BUDGET_SHARE if self.memory_budget_share is None else self.memory_budget_share

    def emulated_cluster(self) -> EmulatedCluster | None:
        if self.emulate is None:
            return None
        try:
            return EmulatedCluster.parse(self.emulate, self.network, transfer_ctas=self.transfer_ctas,
                                         comm_sms=DEFAULT_COMM_SMS if self.comm_sms is None else self.comm_sms)
        except ValueError as error:
            raise ValueError(f"--emulate {self.emulate!r} --network {self.network!r}: {error}") from None

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]
