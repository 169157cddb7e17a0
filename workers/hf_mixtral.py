"""A Mixtral-style model (``lm.model.is_mixtral_style``) as a Hugging Face ``MixtralForCausalLM``
checkpoint, and back: the ``config.json`` fields and the tensor names and layouts.

    tensors = to_mixtral(model.state_dict(), model.preset)     # the same tensors under HF's names
    state = from_mixtral(tensors, preset)                        # our state_dict again

The names are those of Mixtral's published checkpoints, which every transformers version
loads without remote code (5.x merges the experts into ``mlp.experts.gate_up_proj`` and
``down_proj`` on load, with its Mixtral conversion mapping):

    model.embed_tokens.weight                                  tok_embed.weight (the LM head: tied)
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
        "tie_word_embeddings": True, "attention_dropout": 0.0, "router_jitter_noise": 0.0,
        "bos_token_id": tokenizer.eos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id,
        "torch_dtype": "float32",
    }


def to_mixtral(state: dict[str, torch.Tensor], preset: ModelPreset) -> dict[str, torch.Tensor]:
    """Local. ``state`` (a model's ``state_dict``, every expert) under transformers' Mixtral names."""
    D = preset.d_model
    tensors = {"model.embed_tokens.weight": state["tok_embed.weight"], "model.norm.weight": state["ln_f.weight"]}
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


def from_mixtral(tensors: dict[str, torch.Tensor], preset: ModelPreset) -> dict[str, torch.Tensor]:
    """Local. Our ``state_dict`` from transformers' Mixtral tensors (``to_mixtral``'s inverse);
    raises ValueError naming a missing tensor."""
    def take(name: str) -> torch.Tensor:
        try:
            return tensors[name]
        except KeyError:
            raise ValueError(f"the Mixtral export lacks {name}: export the run again (mpipemoe export)") from None

    state = {"tok_embed.weight": take("model.embed_tokens.weight"), "ln_f.weight": take("model.norm.weight")}
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
                 for j in range(preset.num_experts)])
    return state
