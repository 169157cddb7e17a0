"""A Mixtral-style model (``lm.model.is_mixtral_style``) as a Hugging Face ``MixtralForCausalLM``
checkpoint, and back: the ``config.json`` fields and the tensor names and layouts.

    tensors = to_mixtral(model.state_dict(), model.preset)     # the same tensors under HF's names
    state = from_mixtral(tensors, preset)                        # our state_dict again
    preset, state = read_mixtral("checkpoints/mixtral")          # a Hugging Face folder, every tensor
    state = read_mixtral_shard(folder, preset, experts=range(4, 8))  # one rank's experts (train --init-from)

The names are those of Mixtral's published checkpoints, which every transformers version
loads without remote code (5.x merges the experts into ``mlp.experts.gate_up_proj`` and
``down_proj`` on load, with its Mixtral conversion mapping):

    model.embed_tokens.weight                                  tok_embed.weight (the LM head when tied)
    lm_head.weight                                             lm_head.weight (tie_word_embeddings false)
    model.layers.L.input_layernorm.weight                      blocks.L.ln1.weight
    model.layers.L.self_attn.{q,k,v}_proj.weight               blocks.L.attn.qkv.weight, rows cut in 3
    model.layers.L.self_attn.o_proj.weight                     blocks.L.attn.proj.weight
    model.layers.L.post_attention_layernorm.weight             blocks.L.ln2.weight
    model.layers.L.block_sparse_moe.gate.weight                blocks.L.moe.router.weight   [E, D]
    model.layers.L.block_sparse_moe.experts.J.w1.weight        blocks.L.moe.experts.w1[J]ᵀ  [H, D] (gate)
    model.layers.L.block_sparse_moe.experts.J.w3.weight        blocks.L.moe.experts.w3[J]ᵀ  [H, D] (up)
    model.layers.L.block_sparse_moe.experts.J.w2.weight        blocks.L.moe.experts.w2[J]ᵀ  [D, H] (down)
    model.norm.weight                                          ln_f.weight

Heads split q and k the same way on both sides (head m is rows m·d .. (m+1)·d), and our
rotary positions use transformers' layout (``rotate_half``), so no permutation is needed.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from lm.model import ModelPreset

PREFIX = "model.layers"
PROJECTIONS = ("q_proj", "k_proj", "v_proj")
EXPERT_WEIGHTS = ("w1", "w2", "w3")  # the same letters on both sides; HF's are our [D, H] transposed


def mixtral_config(preset: ModelPreset, tokenizer: Any) -> dict[str, Any]:
    """The ``MixtralConfig`` fields of a model of ``preset`` (both transformers 4.x's
    ``rope_theta`` and 5.x's ``rope_parameters``). The byte tokenizer and ours have no
    beginning-of-text token: documents are joined by the end-of-text one, which is therefore
    ``bos_token_id`` as well (as GPT-2 does)."""
    return {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "vocab_size": preset.vocab_size, "hidden_size": preset.d_model, "intermediate_size": preset.d_hidden,
        "num_hidden_layers": preset.num_layers, "num_attention_heads": preset.num_heads,
        "num_key_value_heads": preset.num_heads, "head_dim": preset.d_model // preset.num_heads,
        "hidden_act": "silu", "max_position_embeddings": preset.seq_len, "rms_norm_eps": preset.norm_eps,
        "rope_theta": preset.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": preset.rope_theta},
        "sliding_window": None, "num_local_experts": preset.num_experts, "num_experts_per_tok": preset.top_k,
        "tie_word_embeddings": preset.tied_head, "attention_dropout": 0.0, "router_jitter_noise": 0.0,
        "bos_token_id": tokenizer.eos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id,
        "torch_dtype": "float32",
    }


def to_mixtral(state: dict[str, torch.Tensor], preset: ModelPreset) -> dict[str, torch.Tensor]:
    """Local. ``state`` (a model's ``state_dict``, every expert) under transformers' Mixtral names.
    Refuses (ValueError) a model whose routers hold a non-zero expert bias (trained with
    ``--expert-bias-rate``): Mixtral's router has no bias, so transformers would choose other
    experts for some tokens than the model trained with."""
    biased = [name for name, tensor in state.items() if name.endswith("router.expert_bias") and bool(tensor.any())]
    if biased:
        raise ValueError(f"this model's routers select experts with a learned expert bias ({biased[0]}, from "
                         f"--expert-bias-rate), which transformers' Mixtral has no place for: exported as "
                         f"MixtralForCausalLM it would route tokens by the unbiased scores, not as it trained, so it "
                         f"is not exported; generate from the run itself (mpipemoe generate), or train with "
                         f"--expert-bias-rate 0 for a Mixtral export (a preset that is not Mixtral-style exports "
                         f"in mpipemoe's own format, which keeps the bias)")
    D = preset.d_model
    tensors = {"model.embed_tokens.weight": state["tok_embed.weight"], "model.norm.weight": state["ln_f.weight"]}
    if not preset.tied_head:
        tensors["lm_head.weight"] = state["lm_head.weight"]
    for layer in range(preset.num_layers):
        ours, theirs = f"blocks.{layer}", f"{PREFIX}.{layer}"
        tensors[f"{theirs}.input_layernorm.weight"] = state[f"{ours}.ln1.weight"]
        tensors[f"{theirs}.post_attention_layernorm.weight"] = state[f"{ours}.ln2.weight"]
        qkv = state[f"{ours}.attn.qkv.weight"]
        for i, name in enumerate(PROJECTIONS):
            tensors[f"{theirs}.self_attn.{name}.weight"] = qkv[i * D:(i + 1) * D]
        tensors[f"{theirs}.self_attn.o_proj.weight"] = state[f"{ours}.attn.proj.weight"]
        tensors[f"{theirs}.block_sparse_moe.gate.weight"] = state[f"{ours}.moe.router.weight"]
        for weight in EXPERT_WEIGHTS:
            for expert, matrix in enumerate(state[f"{ours}.moe.experts.{weight}"]):
                tensors[f"{theirs}.block_sparse_moe.experts.{expert}.{weight}.weight"] = matrix.t()
    return tensors


def from_mixtral(tensors: Mapping[str, torch.Tensor], preset: ModelPreset,
                 experts: range | None = None) -> dict[str, torch.Tensor]:
    """Local. Our ``state_dict`` from transformers' Mixtral tensors (``to_mixtral``'s inverse),
    with the experts ``experts`` (None: all) of each layer; raises ValueError naming a missing
    tensor. ``tensors`` may be lazy (``LazyTensors``): only the tensors taken are read."""
    def take(name: str) -> torch.Tensor:
        try:
            return tensors[name]
        except KeyError:
            raise ValueError(f"the Mixtral checkpoint lacks {name}: give a complete one (an mpipemoe export: export "
                             f"the run again)") from None

    experts = range(preset.num_experts) if experts is None else experts
    state = {"tok_embed.weight": take("model.embed_tokens.weight"), "ln_f.weight": take("model.norm.weight")}
    if not preset.tied_head:
        state["lm_head.weight"] = take("lm_head.weight")
    for layer in range(preset.num_layers):
        ours, theirs = f"blocks.{layer}", f"{PREFIX}.{layer}"
        state[f"{ours}.ln1.weight"] = take(f"{theirs}.input_layernorm.weight")
        state[f"{ours}.ln2.weight"] = take(f"{theirs}.post_attention_layernorm.weight")
        state[f"{ours}.attn.qkv.weight"] = torch.cat([take(f"{theirs}.self_attn.{n}.weight") for n in PROJECTIONS])
        state[f"{ours}.attn.proj.weight"] = take(f"{theirs}.self_attn.o_proj.weight")
        state[f"{ours}.moe.router.weight"] = take(f"{theirs}.block_sparse_moe.gate.weight")
        for weight in EXPERT_WEIGHTS:
            state[f"{ours}.moe.experts.{weight}"] = torch.stack(
                [take(f"{theirs}.block_sparse_moe.experts.{j}.{weight}.weight").t()
                 for j in experts])
    return state


# Fields of other MoE families' configs (Qwen-MoE, DeepSeek, ...) that Mixtral's lacks: our
# model has no shared experts.
SHARED_EXPERT_FIELDS = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts",
                        "moe_shared_expert_intermediate_size")


def _refuse(field: str, value: Any, fix: str) -> None:
    raise ValueError(f"--init-from: config.json's {field}={value!r} is not Mixtral-style: {fix}")


def mixtral_preset(config: dict[str, Any]) -> ModelPreset:
    """Local. The preset of a transformers ``MixtralConfig`` (``config.json``'s dict):
    dimensions, experts, top-k, rotary base, vocabulary, norm epsilon; seq_len is
    ``max_position_embeddings``. Raises ValueError naming the first field our model cannot
    hold (``mixtral_config``'s inverse)."""
    from lm.model import MIXTRAL_STYLE

    if config.get("model_type") != "mixtral":
        _refuse("model_type", config.get("model_type"), "give a MixtralForCausalLM checkpoint (model_type mixtral)")
    for field in SHARED_EXPERT_FIELDS:
        if config.get(field):
            _refuse(field, config[field], "our MoE layers have no shared experts")
    heads = config["num_attention_heads"]
    if config.get("num_key_value_heads", heads) != heads:
        _refuse("num_key_value_heads", config["num_key_value_heads"], f"grouped-query attention is not supported: "
                f"our attention has as many key/value heads as query heads ({heads})")
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim * heads != config["hidden_size"]:
        _refuse("head_dim", head_dim, f"our heads are hidden_size / num_attention_heads = "
                f"{config['hidden_size'] // heads} wide")
    if config.get("hidden_act", "silu") != "silu":
        _refuse("hidden_act", config["hidden_act"], "Mixtral's experts are SwiGLU (silu)")
    for field, plain in (("router_jitter_noise", 0.0), ("attention_bias", False), ("mlp_bias", False)):
        if config.get(field, plain) != plain:
            _refuse(field, config[field], f"our router and projections take {field}={plain!r}")
    if config.get("norm_topk_prob", True) is not True or config.get("scoring_func", "softmax") != "softmax":
        field = "norm_topk_prob" if config.get("norm_topk_prob", True) is not True else "scoring_func"
        _refuse(field, config[field], "our router is Mixtral's: a softmax over the top-k logits")
    rope = config.get("rope_parameters") or {"rope_type": "default", "rope_theta": config.get("rope_theta", 1e6)}
    if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
        _refuse("rope_parameters", rope, "only unscaled rotary positions (rope_type default)")
    return ModelPreset(
        "gpt", d_model=config["hidden_size"], d_hidden=config["intermediate_size"],
        num_layers=config["num_hidden_layers"], num_heads=heads, num_experts=config["num_local_experts"],
        top_k=config["num_experts_per_tok"], seq_len=config.get("max_position_embeddings", 4096),
        vocab_size=config["vocab_size"], norm_eps=config.get("rms_norm_eps", 1e-5),
        tied_head=bool(config.get("tie_word_embeddings", False)),  # MixtralConfig's default: an untied head
        **{**MIXTRAL_STYLE, "rope_theta": float(rope.get("rope_theta", 1e6))})


def read_mixtral_config(directory: str | Path) -> ModelPreset:
    """Local. The preset of the Hugging Face Mixtral checkpoint folder ``directory`` (its
    ``config.json``, ``mixtral_preset``); raises ValueError naming a missing file or field."""
    import json

    folder = Path(directory)
    if not (folder / "config.json").is_file():
        raise ValueError(f"--init-from {directory}: no config.json there: give a Hugging Face Mixtral "
                         f"checkpoint folder (config.json and safetensors)")
    return mixtral_preset(json.loads((folder / "config.json").read_text()))


def weight_files(directory: str | Path) -> list[Path]:
    """Local. The safetensors files of a checkpoint folder: ``model.safetensors``, or the shards
    that ``model.safetensors.index.json`` lists; raises ValueError naming a missing one."""
    import json

    folder = Path(directory)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        names = ["model.safetensors"]
    else:
        raise ValueError(f"--init-from {directory}: no model.safetensors (nor model.safetensors.index.json) "
                         f"there: give the folder with the checkpoint's weights")
    for name in names:
        if not (folder / name).is_file():
            raise ValueError(f"--init-from {directory}: {name} is missing (model.safetensors.index.json names it)")
    return [folder / name for name in names]


class LazyTensors(Mapping[str, torch.Tensor]):
    """The tensors of safetensors files by name, each read (memory-mapped) only when taken, in
    float32: a rank reads its own experts, not the whole checkpoint."""

    def __init__(self, files: list[Path]):
        from safetensors import safe_open

        self.handles = [safe_open(str(path), framework="pt") for path in files]
        names = [(handle, handle.keys()) for handle in self.handles]  # type: ignore[no-untyped-call]
        self.where = {name: handle for handle, keys in names for name in keys}

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor: torch.Tensor = self.where[name].get_tensor(name)  # type: ignore[no-untyped-call]
        return tensor.float()

    def __iter__(self) -> Iterator[str]:
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


def read_mixtral_shard(directory: str | Path, preset: ModelPreset, experts: range) -> dict[str, torch.Tensor]:
    """Local. Our ``state_dict`` (float32) with the experts ``experts`` of each layer, read from
    the checkpoint folder ``directory`` of ``preset`` (``read_mixtral_config``'s): only those
    tensors are read. Raises ValueError naming a missing file or tensor."""
    return from_mixtral(LazyTensors(weight_files(directory)), preset, experts)


def read_mixtral(directory: str | Path) -> tuple[ModelPreset, dict[str, torch.Tensor]]:
    """Local. (preset, our state_dict, every expert) of a Hugging Face Mixtral checkpoint
    folder: ``config.json`` and ``model.safetensors`` (or the shards that
    ``model.safetensors.index.json`` lists). Raises ValueError naming a missing file or
    field."""
    preset = read_mixtral_config(directory)
    return preset, read_mixtral_shard(directory, preset, range(preset.num_experts))
