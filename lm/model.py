"""MoE transformer: GPT-style decoder (causal LM) and BERT-style encoder (masked LM).

    from lm.model import get_preset, MoETransformer
    model = MoETransformer(get_preset("tiny-gpt"), engine="mpipemoe")
    logits_BSV, aux_loss = model(tokens_BS)

Every block is pre-norm: ``x + attn(ln1(x))`` then ``x + moe(ln2(x))``; the feed-forward of
*every* block is a MoE layer from ``moe_engine`` (docs/design.md §4.1), so a preset with L
layers has L MoE layers. Attention uses ``F.scaled_dot_product_attention`` (causal for
GPT, bidirectional for BERT). The LM head is tied to the token embedding, or (``tied_head``
False, as Mixtral's checkpoints have it) a matrix of its own.

The architecture fields of a preset: ``norm`` (LayerNorm or RMSNorm), ``positions`` (learned
embeddings, or rotary on q and k in Hugging Face's layout: ``rotate_half`` pairs dimension i
with i + d/2), ``bias`` (on every linear layer and expert) and ``router_rule``. The
Mixtral-style presets (``MIXTRAL_STYLE``) export as a transformers ``MixtralForCausalLM``
(workers/hf_mixtral.py).

Mixed precision (the Trainer's ``torch.autocast`` over float32 parameters): the residual
stream, the LayerNorm outputs and every layer's input and output are in the autocast dtype
(bf16), as Megatron-Core and torchtitan run; LayerNorm statistics, the router's softmax
and the losses are float32. (Autocast alone keeps the stream float32 and casts it to bf16
again before every GEMM; with this and the other changes of results/training-h200-mfu2/ the
copy/cast and norm kernels of a gpt-xl step at batch 128 on an H200 fell from 93 to 57 ms.)

Initialisation does not depend on the engine nor on the world size: every parameter is
drawn from its own generator seeded by (seed, parameter name), and each expert by
(seed, parameter name, *global* expert index). So the three engines, and any expert
parallel layout, start from the same model and give the same loss.

Shapes: see moe_engine's legend (moe_engine/__init__.py).
"""
from __future__ import annotations

import dataclasses
import math
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import moe_engine
from moe_engine import HostBufferPool, MemoryBudget, MoEConfig, ProfileCache
from moe_engine.comm import ExpertGroup
from moe_engine.config import ACTIVATIONS, ENGINES, ROUTER_RULES, STRATEGIES
from moe_engine.granularity import DEFAULT_CANDIDATES
from moe_engine.memory import predict_memory

KINDS = ("gpt", "bert")
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rotary")
HEAD_ROWS_MULTIPLE = 8  # the LM head's product runs on rows padded to this (16 bytes of bf16)
PARTITION_CHOICES = "'auto' or an integer >= 1"
# Activation checkpointing per block (``MoETransformer(activation_checkpointing=...)``):
#   none:      every block keeps its activations for backward.
#   selective: the attention (with its norm) runs again in backward; the MoE layer keeps its
#              activations. Attention keeps ~5 d per token (norm output, q, k, v, SDPA output)
#              and recomputes with local GEMMs only; recomputing the MoE layer would repeat its
#              two All-to-Alls.
#   full:      the whole block runs again in backward; each block keeps only its input, and
#              one block's activations are live at a time (the MoE engine replays the
#              recorded plan of the forward it recomputes).
ACTIVATION_CHECKPOINTING = ("none", "selective", "full")
# torch.compile backends of ``compile_local_parts``: inductor generates fused kernels (C++ on CPU,
# Triton on GPU); aot_eager captures the same graphs (forward and backward) and runs them with
# eager kernels, compiling in seconds (a check that the graphs capture, as torchtitan offers).
COMPILE_BACKENDS = ("inductor", "aot_eager")


def _fail(field: str, value, fix: str) -> None:
    raise ValueError(f"ModelPreset.{field}={value!r} is invalid: {fix}")


@dataclass(frozen=True)
class ModelPreset:
    """Shape of a MoE transformer; validated at construction.

    kind:            "gpt" (decoder, causal LM) or "bert" (encoder, masked LM).
    d_model:         token width D.
    d_hidden:        hidden width of each expert FFN.
    num_layers:      transformer blocks; every block's FFN is a MoE layer.
    num_heads:       attention heads; must divide d_model.
    num_experts:     experts per MoE layer; a multiple of the expert-parallel degree (the
                     workers of one expert group, ``check_world_size``).
    seq_len:         default training sequence length (and the position-embedding size).
    top_k:           experts per token.
    capacity_factor: None = dropless routing.
    activation:      expert activation ("relu", "gelu", "swiglu").
    vocab_size:      tokens in the vocabulary (the byte tokenizer of lm.data has 259).
    norm:            "layernorm" or "rmsnorm" (every norm of the model), with epsilon ``norm_eps``.
    positions:       "learned" (an embedding of seq_len positions added to the tokens) or
                     "rotary" (q and k rotated per head, base ``rope_theta``; no parameters).
    bias:            biases on the attention projections and the experts (b1, b2).
    router_rule:     how the gate weights come from the router's logits (moe_engine ROUTER_RULES).
    tied_head:       the LM head is the token embedding (True), or a [vocab_size, d_model]
                     matrix of its own, ``lm_head.weight`` (False: transformers'
                     ``tie_word_embeddings=False``, Mixtral's default).
    """

    kind: str
    d_model: int
    d_hidden: int
    num_layers: int
    num_heads: int
    num_experts: int = 8
    seq_len: int = 1024
    top_k: int = 2
    capacity_factor: float | None = None
    activation: str = "gelu"
    vocab_size: int = 259
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    positions: str = "learned"
    rope_theta: float = 10000.0
    bias: bool = True
    router_rule: str = "softmax-then-topk"
    tied_head: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            _fail("kind", self.kind, f"choose one of {', '.join(KINDS)}")
        for name in ("d_model", "d_hidden", "num_layers", "num_heads", "num_experts",
                     "seq_len", "top_k", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                _fail(name, value, "give a positive integer")
        if self.d_model % self.num_heads:
            _fail("num_heads", self.num_heads, f"it must divide d_model={self.d_model}")
        if self.top_k > self.num_experts:
            _fail("top_k", self.top_k, f"use at most num_experts={self.num_experts}")
        self._check_architecture()

    def _check_architecture(self) -> None:
        for name, choices in (("norm", NORMS), ("positions", POSITIONS), ("router_rule", ROUTER_RULES),
                              ("activation", ACTIVATIONS)):
            if getattr(self, name) not in choices:
                _fail(name, getattr(self, name), f"choose one of {', '.join(choices)}")
        for name in ("norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                _fail(name, value, "give a finite number > 0 (e.g. 1e-5 for norm_eps, 10000.0 for rope_theta)")
        for name in ("bias", "tied_head"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "give True or False")
        if self.positions == "rotary" and (self.d_model // self.num_heads) % 2:
            _fail("positions", self.positions, f"rotary positions rotate pairs of a head's dimensions: choose "
                  f"num_heads so that d_model / num_heads (now {self.d_model // self.num_heads}) is even, "
                  f"or positions='learned'")

    def as_dict(self) -> dict:
        """The preset as checkpoints store it (``meta.json``'s "preset"): every field, but the
        architecture fields only where they differ from the defaults, so a model of the
        original architecture records (and compares with its older checkpoints) as before."""
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name in ARCHITECTURE_FIELDS}
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in defaults or v != defaults[k]}

    def replace(self, **changes) -> "ModelPreset":
        """A copy with some fields changed (validated again); None values are ignored."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def check_world_size(self, world_size: int, expert_parallel: int | None = None) -> None:
        """Raise unless ``world_size`` workers can run this model with expert-parallel degree
        ``expert_parallel`` (None: the world): the degree divides both the workers (whole
        expert groups) and ``num_experts`` (whole experts per worker). The error names the
        valid ``--expert-parallel`` values."""
        degree = world_size if expert_parallel is None else expert_parallel
        if self.num_experts % degree == 0 and world_size % degree == 0:
            return
        valid = ", ".join(str(p) for p in valid_expert_degrees(self.num_experts, world_size))
        which = "the number of workers" if expert_parallel is None else "--expert-parallel"
        _fail("num_experts", self.num_experts,
              f"it must be a multiple of the expert-parallel degree ({degree}, {which}), which must divide "
              f"the {world_size} workers; use --expert-parallel {valid} (expert groups of that many workers, "
              f"the experts replicated across the groups), or --num-experts "
              f"{world_size * max(1, self.num_experts // world_size)} with one expert group over all workers")


def valid_expert_degrees(num_experts: int, world_size: int) -> list[int]:
    """Local. The expert-parallel degrees P that ``world_size`` ranks can run ``num_experts``
    experts per MoE layer with: P divides both (whole experts per rank, whole expert groups)."""
    return [p for p in range(1, world_size + 1) if world_size % p == 0 and num_experts % p == 0]


# Fields added after the first checkpoints were written; `ModelPreset.as_dict` leaves them out at
# their defaults.
ARCHITECTURE_FIELDS = ("norm", "norm_eps", "positions", "rope_theta", "bias", "router_rule", "tied_head")
# Mixtral's architecture: RMSNorm, rotary positions, no biases, SwiGLU experts, top-k-then-softmax gate.
MIXTRAL_STYLE: Mapping[str, Any] = MappingProxyType({
    "norm": "rmsnorm", "positions": "rotary", "rope_theta": 1e6, "bias": False, "activation": "swiglu",
    "router_rule": "topk-then-softmax"})

# The paper's models (docs/design.md §6) plus tiny ones that train on 2 CPU cores in a minute.
PRESETS: dict[str, ModelPreset] = {
    "gpt-s": ModelPreset("gpt", d_model=1024, d_hidden=4096, num_layers=24, num_heads=16, seq_len=1024),
    "gpt-xl": ModelPreset("gpt", d_model=2048, d_hidden=8192, num_layers=24, num_heads=16, seq_len=1024),
    "bert-l": ModelPreset("bert", d_model=1024, d_hidden=4096, num_layers=24, num_heads=16, seq_len=512),
    "tiny-gpt": ModelPreset("gpt", d_model=128, d_hidden=256, num_layers=2, num_heads=4, num_experts=4,
                            seq_len=64),
    "tiny-bert": ModelPreset("bert", d_model=128, d_hidden=256, num_layers=2, num_heads=4, num_experts=4,
                             seq_len=64),
    # Mixtral-style (export loads in transformers as MixtralForCausalLM): 8 experts, top-2
    "mixtral-s": ModelPreset("gpt", d_model=1024, d_hidden=3584, num_layers=24, num_heads=16, num_experts=8,
                             seq_len=1024, **MIXTRAL_STYLE),
    "tiny-mixtral": ModelPreset("gpt", d_model=128, d_hidden=256, num_layers=2, num_heads=4, num_experts=4,
                                seq_len=64, **MIXTRAL_STYLE),
}


def is_mixtral_style(preset: ModelPreset) -> bool:
    """True when ``preset`` has Mixtral's architecture (a decoder, dropless: transformers'
    Mixtral drops no token): its export is a transformers ``MixtralForCausalLM``."""
    return preset.kind == "gpt" and preset.capacity_factor is None and all(
        getattr(preset, k) == v for k, v in MIXTRAL_STYLE.items() if k != "rope_theta")


# Preset fields a training run may override (``mpipemoe train --num-experts``, ``--top-k``, ...);
# the routing ones change no parameter shape but the checkpoint records them with the rest.
ROUTING_OVERRIDES = ("top_k", "capacity_factor", "activation")
MODEL_OVERRIDES = ("seq_len", "num_experts", "num_layers") + ROUTING_OVERRIDES


def check_routing_overrides(settings, fail) -> None:
    """The routing overrides of ``settings`` (an app.jobs.job.TrainJob, with ``base_preset()``:
    None keeps the preset's): ``fail(field, value, fix)`` raises for the first bad one, naming its flag."""
    top_k, factor, activation = settings.top_k, settings.capacity_factor, settings.activation
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        fail("top_k", top_k, "give an integer >= 1 (--top-k, experts per token), or leave it unset for the preset's")
    experts = settings.num_experts or settings.base_preset().num_experts
    if top_k is not None and top_k > experts:
        fail("top_k", top_k, f"choose at most the {experts} experts per MoE layer (--top-k), or more --num-experts")
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float))
                               or not 0 < factor < math.inf):
        fail("capacity_factor", factor, "give a number > 0 (--capacity-factor, e.g. 1.25: each expert takes at "
             "most 1.25x its even share of the tokens), or leave it unset for the preset's dropless routing")
    if activation is not None and activation not in ACTIVATIONS:
        fail("activation", activation, f"choose one of {', '.join(ACTIVATIONS)} (--activation), or leave it unset "
             f"for the preset's")


def get_preset(name: str) -> ModelPreset:
    """The preset called ``name``; the error lists the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"preset={name!r} is unknown: choose one of {', '.join(PRESETS)}") from None


def model_flops_per_token(preset: ModelPreset) -> float:
    """Model FLOPs per trained token (forward + backward, no recomputation), the numerator
    of MFU as PaLM and torchtitan count it: 6 FLOPs per active weight (2 forward, 4
    backward) plus 12 L d S for the attention scores and their use on the values.

    Active weights per token: per layer the attention projections (4 d^2), the router
    (d E) and top_k experts (2 d h each; 3 d h with SwiGLU); plus the output head (d V).
    Embeddings are lookups and cost nothing. Full (non-causal) attention is counted for
    GPT as well, as PaLM does. Derivation: docs/training.md, "Throughput and MFU"."""
    d, h = preset.d_model, preset.d_hidden
    expert = (3 if preset.activation == "swiglu" else 2) * d * h
    per_layer = 4 * d * d + d * preset.num_experts + preset.top_k * expert
    weights = preset.num_layers * per_layer + d * preset.vocab_size
    return 6.0 * weights + 12.0 * preset.num_layers * d * preset.seq_len


def is_expert_param(name: str) -> bool:
    """True for expert-parallel parameters (sharded over ranks, never all-reduced)."""
    return "experts." in name


def rotary_cos_sin(seq_len: int, head_dim: int, theta: float, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos_Sd, sin_Sd), float32: position s, dimension i turns by s / theta^(2(i mod d/2)/d),
    the two halves of a head repeating the d/2 frequencies (Hugging Face's rotary layout, in
    its arithmetic: the same float32 numbers as transformers' Mixtral)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim))
    freqs_Sh = torch.arange(seq_len, device=device).float()[:, None] * inv_freq[None, :]
    angles_Sd = torch.cat((freqs_Sh, freqs_Sh), dim=-1)
    return angles_Sd.cos(), angles_Sd.sin()


def apply_rotary(x_BMSd: torch.Tensor, cos_Sd: torch.Tensor, sin_Sd: torch.Tensor) -> torch.Tensor:
    """``x`` rotated: x · cos + rotate_half(x) · sin, rotate_half(x) = [-x2, x1] for the halves x1, x2."""
    x1, x2 = x_BMSd.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x_BMSd * cos_Sd.to(x_BMSd.dtype) + rotated * sin_Sd.to(x_BMSd.dtype)


class Attention(nn.Module):
    """Multi-head attention; ``rope_theta`` set: rotary positions on q and k."""

    def __init__(self, d_model: int, num_heads: int, causal: bool, bias: bool = True,
                 rope_theta: float | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.causal = causal
        self.rope_theta = rope_theta
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        # 1. project to q, k, v with heads split out: (B, M, S, d) each
        q_BMSd, k_BMSd, v_BMSd = (
            t.view(B, S, self.num_heads, D // self.num_heads).transpose(1, 2)
            for t in self.qkv(x_BSD).chunk(3, dim=-1))
        if self.rope_theta is not None:  # rotary positions
            cos_Sd, sin_Sd = rotary_cos_sin(S, D // self.num_heads, self.rope_theta, x_BSD.device)
            q_BMSd, k_BMSd = apply_rotary(q_BMSd, cos_Sd, sin_Sd), apply_rotary(k_BMSd, cos_Sd, sin_Sd)
        # 2. attention (flash/memory-efficient kernels where available)
        out_BMSd = F.scaled_dot_product_attention(q_BMSd, k_BMSd, v_BMSd, is_causal=self.causal)
        # 3. merge heads, output projection
        return self.proj(out_BMSd.transpose(1, 2).reshape(B, S, D))


class LayerNorm(nn.LayerNorm):
    """LayerNorm whose output has its input's dtype also under autocast (which would run it,
    and return it, in float32); the statistics are float32 either way (the kernel's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_autocast_enabled(x.device.type) or x.dtype == torch.float32:
            return super().forward(x)
        with torch.autocast(x.device.type, enabled=False):
            return F.layer_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · weight, the statistics in float32 and the output in the
    input's dtype (the arithmetic of transformers' MixtralRMSNorm)."""

    def __init__(self, d_model: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(x.dtype) * normed.to(x.dtype)


def make_norm(preset: ModelPreset) -> nn.Module:
    """The norm ``preset`` names, over d_model."""
    if preset.norm == "rmsnorm":
        return RMSNorm(preset.d_model, preset.norm_eps)
    return LayerNorm(preset.d_model, eps=preset.norm_eps)


STAGE_MARKS = ("mpipemoe.block.attention", "mpipemoe.block.moe")  # a block's stages in a trace


def recomputed(function, *inputs):
    """``function(*inputs)`` under activation checkpointing: nothing of its inside is kept for
    backward, which runs it again (torch.utils.checkpoint, non-reentrant: it composes with
    autocast, DDP/FSDP2 and the MoE engine's plan replay; the random state is restored)."""
    return checkpoint(function, *inputs, use_reentrant=False)


def check_activation_checkpointing(value, fail=None) -> None:
    """``fail(field, value, fix)`` (default: a ValueError naming the field) unless ``value`` is
    one of ACTIVATION_CHECKPOINTING."""
    def plain_fail(field, value, fix):
        raise ValueError(f"{field}={value!r} is invalid: {fix}")

    if value not in ACTIVATION_CHECKPOINTING:
        (fail or plain_fail)("activation_checkpointing", value, f"choose one of {', '.join(ACTIVATION_CHECKPOINTING)} "
             f"(--activation-checkpointing)")


def moe_layers_kept(preset: ModelPreset, activation_checkpointing: str = "none") -> int:
    """How many MoE layers keep their saved tensors at once over a forward and backward: every
    layer, but one under "full" checkpointing (a block's activations live only while backward
    recomputes it). What ``MemoryBudget.layers`` counts for the model's MoE layers."""
    return 1 if activation_checkpointing == "full" else preset.num_layers


class Block(nn.Module):
    """``x + attn(ln1(x))`` then ``x + moe(ln2(x))``; ``checkpointing`` (ACTIVATION_CHECKPOINTING)
    says what runs again in backward."""

    def __init__(self, preset: ModelPreset, moe: nn.Module, checkpointing: str = "none"):
        super().__init__()
        check_activation_checkpointing(checkpointing)
        self.ln1 = make_norm(preset)
        self.attn = Attention(preset.d_model, preset.num_heads, causal=preset.kind == "gpt", bias=preset.bias,
                              rope_theta=preset.rope_theta if preset.positions == "rotary" else None)
        self.ln2 = make_norm(preset)
        self.moe = moe
        self.checkpointing = checkpointing

    def forward(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(output, the MoE layer's load-balance loss, its router z-loss)."""
        if self.checkpointing == "full" and torch.is_grad_enabled():
            return recomputed(self._stages, x_BSD)
        return self._stages(x_BSD)

    def _attention(self, x_BSD: torch.Tensor) -> torch.Tensor:
        return self.attn(self.ln1(x_BSD))

    def _stages(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # The two stages as named ranges of a profiler trace (the overlapped micro-batch
        # schedule's timeline: app/bench/timeline.py; a no-op without a profiler)
        with torch.profiler.record_function(STAGE_MARKS[0]):
            if self.checkpointing == "selective" and torch.is_grad_enabled():
                x_BSD = x_BSD + recomputed(self._attention, x_BSD)           # local
            else:
                x_BSD = x_BSD + self._attention(x_BSD)                       # local
        with torch.profiler.record_function(STAGE_MARKS[1]):
            moe_out_BSD, aux_loss, z_loss = self.moe(self.ln2(x_BSD), with_z_loss=True)  # collective (All-to-Alls)
        return x_BSD + moe_out_BSD, aux_loss, z_loss


def compile_local_parts(model: MoETransformer, backend: str = "inductor") -> None:
    """torch.compile, in place (``nn.Module.compile``: parameter names and checkpoints are
    unchanged), of what each block runs locally with static shapes: its two norms, its
    attention and its MoE layer's router; and the final norm. The MoE dispatch stays eager:
    its All-to-Alls, the token counts it reads on the host and the expert GEMMs of
    data-dependent shapes would break the graph or recompile at every step. Compiling
    happens at the first forward and backward (``compile_seconds`` counts it)."""
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"compile_backend={backend!r} is invalid: choose one of {', '.join(COMPILE_BACKENDS)}")
    for block in cast("list[Block]", list(model.blocks)):
        for module in (block.ln1, block.attn, block.ln2, cast(nn.Module, block.moe.router)):
            module.compile(backend=backend)
    model.ln_f.compile(backend=backend)


def compile_seconds() -> float:
    """Wall seconds this process has spent in torch.compile so far (Dynamo's capture, AOT
    autograd and the backend, forward and backward graphs; torch's own counter)."""
    from torch._dynamo.utils import calculate_time_spent

    return float(calculate_time_spent().get("total_wall_time", 0.0))


def preset_moe_config(preset: ModelPreset) -> MoEConfig:
    """The MoE layers' configuration of a model of ``preset``."""
    return MoEConfig(d_model=preset.d_model, d_hidden=preset.d_hidden, num_experts=preset.num_experts,
                     top_k=preset.top_k, capacity_factor=preset.capacity_factor, activation=preset.activation,
                     bias=preset.bias, router_rule=preset.router_rule)


def leanest_moe_memory(preset: ModelPreset, tokens: int, world_size: int, dtype: torch.dtype,
                       candidates: tuple[int, ...] = DEFAULT_CANDIDATES, in_flight: int = 1,
                       activation_checkpointing: str = "none") -> tuple[int, int, str]:
    """(bytes, n, strategy): the least activation memory the MoE layers of ``preset``
    need together for ``tokens`` per rank (balanced routing), over the partition search's
    ``candidates`` and every strategy — what a `MemoryBudget` for them must hold at least,
    with ``in_flight`` micro-batches live at once (2: the overlapped schedule) and the MoE
    layers that keep their tensors at once under ``activation_checkpointing`` (``moe_layers_kept``)."""
    config = preset_moe_config(preset)
    layers = moe_layers_kept(preset, activation_checkpointing)
    needs = []
    for n in candidates:
        for strategy in STRATEGIES:
            e = predict_memory(config, tokens, world_size, n, strategy, dtype=dtype)
            needs.append((MemoryBudget(1, layers, in_flight).need_of(e), n, strategy))
    return min(needs)


def expert_ranks(group) -> int:
    """Ranks of the expert-parallel group ``group`` (a process group or an ExpertGroup; None:
    the default group if initialised, else one rank)."""
    return ExpertGroup(group).size if not isinstance(group, ExpertGroup) else group.size


class MoETransformer(nn.Module):
    """Decoder or encoder with a MoE FFN in every block; returns (logits, mean aux loss).

    group:     the expert-parallel process group (None = default group if initialised).
    partitions: MPipeMoE's n ("auto": the online search; with one rank and no memory
               budget there is nothing to overlap nor to save, and n is 1).
    split:     MPipeMoE's split of its partitions ("tokens", "peers", "auto"; None: the
               layer's default, "auto" with the online search, layers.MPipeMoE).
    host_pool: host buffers for offloads, shared by the MoE layers (default: a new pool).
    memory_budget: bytes of activations for all MoE layers together (mpipemoe): each layer
               gets MemoryBudget(memory_budget, layers=moe_layers_kept(...), in_flight=in_flight)
               (num_layers; 1 under full checkpointing); None: no budget.
    in_flight: micro-batches whose activations are live at once (2 under the overlapped
               micro-batch schedule, workers/schedules.py).
    sync_free_capacity: the MoE layers' sync-free capacity mode (a capacity factor; None:
               the dropless exchange): no host read per layer, pairs past the capacity
               dropped and counted (`MoELayerBase.overflowed`) for the caller to rerun the
               step dropless (workers/loop.py does).
    activation_checkpointing: what each block runs again in backward (ACTIVATION_CHECKPOINTING).
    """

    def __init__(self, preset: ModelPreset, engine: str = "mpipemoe", group=None,
                 partitions="auto", strategy="auto", host_pool=None, memory_budget: int | None = None,
                 in_flight: int = 1, split: str | None = None, sync_free_capacity: float | None = None,
                 activation_checkpointing: str = "none"):
        super().__init__()
        if engine not in ENGINES:
            raise ValueError(f"engine={engine!r} is unknown: choose one of {', '.join(ENGINES)}")
        self.preset = preset
        self.engine = engine
        moe_config = preset_moe_config(preset)
        self.tok_embed = nn.Embedding(preset.vocab_size, preset.d_model)
        # learned positions; rotary ones live in the attention and have no parameters
        self.pos_embed = nn.Embedding(preset.seq_len, preset.d_model) if preset.positions == "learned" else None
        profiles = ProfileCache()  # one hardware profile for all MoE layers, measured once
        host_pool = host_pool if host_pool is not None else HostBufferPool()
        check_activation_checkpointing(activation_checkpointing)
        budget = None if memory_budget is None else MemoryBudget(
            memory_budget, layers=moe_layers_kept(preset, activation_checkpointing), in_flight=in_flight)
        if partitions == "auto" and memory_budget is None and expert_ranks(group) == 1:
            # One rank sends no All-to-All for partitions to hide, and without a budget they
            # save no memory that is needed: one partition, the largest GEMMs (on an H200 the
            # online search's trial passes at n = 8 and 16 took 0.675 and 0.722 s a gpt-xl
            # batch-128 step, against n = 1's 0.635 s: results/training-h200-mfu/).
            partitions = 1
        layer_options: dict[str, object] = {} if split is None else {"split": split}
        if sync_free_capacity is not None:
            layer_options["sync_free_capacity"] = sync_free_capacity
        self.blocks = nn.ModuleList(
            Block(preset, moe_engine.build_layer(engine, moe_config, group, partitions=partitions, strategy=strategy,
                                                   profile=profiles, host_pool=host_pool, memory_budget=budget,
                                                   **layer_options), activation_checkpointing)
            for _ in range(preset.num_layers))
        self.ln_f = make_norm(preset)
        self.lm_head = None if preset.tied_head else nn.Linear(preset.d_model, preset.vocab_size, bias=False)

    def forward(self, tokens_BS: torch.Tensor, ids_checked: bool = False,
                with_z_loss: bool = False) -> tuple[torch.Tensor, ...]:
        """``(logits_BSV, aux_loss)``: the logits and the mean load-balance loss of the MoE
        layers; with ``with_z_loss``, ``(logits_BSV, aux_loss, z_loss)`` (the mean router
        z-loss, unweighted). ids_checked: the caller has checked the token ids against the
        vocabulary (on the host; the check here reads the device, a wait the training loop
        need not pay)."""
        B, S = tokens_BS.shape
        if S > self.preset.seq_len:
            raise ValueError(f"sequence length {S} exceeds the model's seq_len={self.preset.seq_len}")
        if not ids_checked:
            check_token_ids(tokens_BS, self.preset.vocab_size)
        x_BSD = self.tok_embed(tokens_BS)
        if self.pos_embed is not None:
            x_BSD = x_BSD + self.pos_embed(torch.arange(S, device=tokens_BS.device))
        if torch.is_autocast_enabled(x_BSD.device.type):  # the residual stream in the compute dtype
            x_BSD = x_BSD.to(torch.get_autocast_dtype(x_BSD.device.type))
        aux_losses, z_losses = [], []
        for block in self.blocks:
            x_BSD, aux_loss, z_loss = block(x_BSD)
            aux_losses.append(aux_loss.float())
            z_losses.append(z_loss.float())
        logits_BSV = self._lm_head(self.ln_f(x_BSD))
        if with_z_loss:
            return logits_BSV, torch.stack(aux_losses).mean(), torch.stack(z_losses).mean()
        return logits_BSV, torch.stack(aux_losses).mean()

    def _lm_head(self, x_BSD: torch.Tensor) -> torch.Tensor:
        """Logits of the LM head (the token embedding, or ``lm_head`` when untied). Its rows
        are padded with zeros to a multiple of HEAD_ROWS_MULTIPLE for the product and the
        padding's logits are cut off: with a row count like the byte tokenizer's 259, each
        row of the logits starts off the 16-byte alignment, and cuBLAS fell back to slow
        kernels (6 ms of a gpt-xl step at batch 128 on an H200). The logits of the real
        rows are the same numbers."""
        head_VD = self.tok_embed.weight if self.lm_head is None else self.lm_head.weight
        vocab = head_VD.shape[0]
        padding = -vocab % HEAD_ROWS_MULTIPLE
        if padding:
            head_VD = F.pad(head_VD, (0, 0, 0, padding))
        return F.linear(x_BSD, head_VD)[..., :vocab]

    def moe_layers(self) -> list[nn.Module]:
        return [block.moe for block in self.blocks]

    def engine_choices(self) -> dict:
        """Settings the engine chose at the last step (first MoE layer), where it exposes them."""
        first = self.blocks[0].moe
        choices = {}
        for key, attr in (("partitions", "last_partitions"), ("strategy", "last_strategy"), ("split", "last_split")):
            value = getattr(first, attr, None)
            if value is not None:
                choices[key] = value
        return choices


def check_token_ids(tokens: torch.Tensor, vocab_size: int, where: str = "the batch") -> None:
    """Raise ValueError unless every id lies in [0, vocab_size) (an embedding lookup would
    fail with an index error on CPU and a device-side assert, fatal to the process, on CUDA)."""
    if tokens.numel() == 0:
        return
    low, high = torch.stack(torch.aminmax(tokens)).tolist()
    if low < 0 or high >= vocab_size:
        raise ValueError(f"token ids outside the vocabulary in {where}: found {low}..{high}, the model has "
                         f"vocab_size={vocab_size} (ids 0..{vocab_size - 1}); prepare the data with the "
                         f"same tokenizer, or set the vocabulary to cover it")


def param_counts(model: nn.Module) -> dict[str, int]:
    """Parameters on this rank: total, expert (sharded) and replicated."""
    expert = sum(p.numel() for n, p in model.named_parameters() if is_expert_param(n))
    total = sum(p.numel() for p in model.parameters())
    return {"params_total": total, "params_expert": expert, "params_replicated": total - expert}


def _seed_for(seed: int, name: str, index: int = 0) -> int:
    return (seed * 1_000_003 + zlib.crc32(f"{name}#{index}".encode())) % (2**63)


@torch.no_grad()
def init_parameters(model: MoETransformer, seed: int, rank: int = 0) -> None:
    """GPT-2 style init, reproducible per parameter name, independent of engine and layout.

    Weights ~ N(0, 0.02) (residual output projections scaled by 1/sqrt(2 · num_layers)), position
    embeddings ~ N(0, 0.01), biases 0, LayerNorm weight 1. Expert weight slice i on
    ``rank`` is global expert ``rank * L + i`` and gets that expert's generator.
    """
    num_layers = model.preset.num_layers
    for name, param in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        if owner.rpartition(".")[2].startswith("ln"):  # LayerNorm
            param.fill_(1.0 if leaf == "weight" else 0.0)
            continue
        if leaf == "bias" or re.fullmatch(r"b\d+", leaf):  # Linear bias, expert b1/b2
            param.zero_()
            continue
        std = 0.01 if name.startswith("pos_embed") else 0.02
        if name.endswith("attn.proj.weight") or name.endswith("experts.w2"):
            std /= math.sqrt(2 * num_layers)
        if is_expert_param(name):
            local_experts = param.shape[0]
            for i in range(local_experts):
                _normal_(param[i], std, _seed_for(seed, name, rank * local_experts + i))
        else:
            _normal_(param, std, _seed_for(seed, name))


def _normal_(tensor: torch.Tensor, std: float, seed: int) -> None:
    generator = torch.Generator(device=tensor.device).manual_seed(seed)
    values = torch.empty(tensor.shape, dtype=torch.float32, device=tensor.device)
    values.normal_(0.0, std, generator=generator)
    tensor.copy_(values)


IGNORE_INDEX = -100


def lm_batch(kind: str, window_BS: torch.Tensor, mask_id: int, vocab_size: int,
             generator: torch.Generator | None = None, mask_prob: float = 0.15
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs_BS, targets_BS) of one batch of token windows.

    gpt:  windows of S+1 tokens; inputs = window[:, :-1], targets = window[:, 1:].
    bert: windows of S tokens; ``mask_prob`` of positions (at least one per batch) are
          chosen: 80% become ``mask_id``, 10% a random byte, 10% stay; targets are the
          original tokens there and IGNORE_INDEX elsewhere. Draws from ``generator`` (CPU);
          on CUDA the draws are copied from pinned memory without waiting (a copy from
          pageable memory made the host wait for the previous step's backward before
          every micro-batch).
    """
    if kind == "gpt":
        return window_BS[:, :-1], window_BS[:, 1:]
    shape = window_BS.shape
    chosen_BS = torch.rand(shape, generator=generator) < mask_prob
    if not chosen_BS.any():
        chosen_BS[0, 0] = True
    action_BS = torch.rand(shape, generator=generator)
    random_BS = torch.randint(0, min(256, vocab_size), shape, generator=generator)
    chosen_BS, action_BS, random_BS = (_to_device_async(t, window_BS.device) for t in (chosen_BS, action_BS, random_BS))
    inputs_BS = torch.where(chosen_BS & (action_BS < 0.8), torch.full_like(window_BS, mask_id), window_BS)
    inputs_BS = torch.where(chosen_BS & (action_BS >= 0.8) & (action_BS < 0.9), random_BS, inputs_BS)
    targets_BS = torch.where(chosen_BS, window_BS, torch.full_like(window_BS, IGNORE_INDEX))
    return inputs_BS, targets_BS


def _to_device_async(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``: to CUDA through pinned memory, without a host sync (the
    pinned block goes back to torch's host allocator once the copy has run)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def lm_loss(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (fp32) over positions whose target is not IGNORE_INDEX."""
    return F.cross_entropy(logits_BSV.float().flatten(0, 1), targets_BS.flatten(),
                           ignore_index=IGNORE_INDEX)


def estimate_worker_bytes(preset: ModelPreset, batch_size: int, world_size: int, dtype_bytes: int,
                          base_bytes: int, activation_checkpointing: str = "none") -> dict[str, int]:
    """Rough peak memory of one training worker (a lower bound that errs low, for refusing
    settings that cannot fit, not for packing): ``base_bytes`` for the process itself,
    parameters with their gradients and AdamW's two float32 states (replicated part plus
    this rank's experts), and activations kept for backward over ``batch_size`` sequences
    of ``preset.seq_len`` tokens (attention through SDPA is linear in the sequence; the
    LM head's logits in float32). Under ``activation_checkpointing`` a block keeps what it
    really keeps: "selective" drops the attention's 6 d per token (norm output, q, k, v, SDPA
    output, projection input), "full" keeps every block's input and one block's whole set.
    Returns the parts and ``total``."""
    d, h, layers, experts, k = (preset.d_model, preset.d_hidden, preset.num_layers, preset.num_experts,
                                preset.top_k)
    ffn = 3 if preset.activation == "swiglu" else 2
    head = (1 if preset.tied_head else 2) * preset.vocab_size * d  # the embedding, and an untied head
    dense = head + preset.seq_len * d + layers * (4 * d * d + experts * d + 9 * d) + 2 * d
    expert = layers * (experts // max(1, world_size)) * (ffn * d * h + h + d)
    params = (dense + expert) * (2 * dtype_bytes + 8)
    tokens = batch_size * preset.seq_len
    attention, moe = 6 * d, 4 * d + k * (2 * d + 2 * h)  # per token and block
    per_token = {"none": layers * (attention + moe), "selective": layers * (d + moe),
                 "full": layers * d + attention + moe}[activation_checkpointing]
    activations = tokens * per_token * dtype_bytes + tokens * preset.vocab_size * (dtype_bytes + 8)
    return {"base": base_bytes, "params": params, "activations": activations,
            "total": base_bytes + params + activations}


def estimate_step_flops(preset: ModelPreset, batch_size: int) -> float:
    """Forward+backward FLOPs of one worker's step over ``batch_size`` sequences of
    ``preset.seq_len`` tokens: 6 x (active parameters per token) per token, plus attention's
    12 x seq_len^2 x d_model per sequence and layer (it grows with the square of seq_len)."""
    d, h, layers, k, s = preset.d_model, preset.d_hidden, preset.num_layers, preset.top_k, preset.seq_len
    ffn = 3 if preset.activation == "swiglu" else 2
    active = layers * (4 * d * d + k * ffn * d * h) + preset.vocab_size * d
    return 6.0 * active * batch_size * s + 12.0 * layers * batch_size * s * s * d
