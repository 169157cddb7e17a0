"""A trained model in one process: from a sharded checkpoint, to and from an exported folder.

    model, meta = load_checkpoint_model(checkpoint_dir)          # every expert in this process
    export(model, out_dir, tokenizer, source={...})              # model.safetensors, config.json, tokenizer.json
    model, config = load_exported(out_dir)                       # the same weights again

A checkpoint (workers/checkpoint.py) holds the global ``[E, ...]`` expert tensors as slices
written by each rank; DCP loads them whole into a model built for one process, whatever
the number of workers that trained it. Only the model's tensors are read (not AdamW's).

The exported folder:
- ``model.safetensors``: every tensor of the model's ``state_dict`` by its name (float32,
  experts whole: ``blocks.L.moe.experts.w1`` is ``[E, d_model, d_hidden]``; the LM head
  is ``tok_embed.weight``, tied), with the format ``{"format": "pt"}`` in its metadata;
  a Mixtral-style model (``lm.model.is_mixtral_style``) under transformers' Mixtral names
  instead (workers/hf_mixtral.py), so ``AutoModelForCausalLM.from_pretrained`` loads it;
- ``config.json``: Hugging Face-style names (``hidden_size``, ``num_local_experts``,
  ``num_experts_per_tok`` ...) and the whole architecture (norm, positions, biases,
  activation, router rule; a Mixtral-style model: a ``MixtralConfig``), the
  ``mpipemoe_preset`` that rebuilds the model exactly, the special token ids and where the
  weights came from;
- ``tokenizer.json``: the run's tokenizer as a Hugging Face ``tokenizers`` file (the byte
  tokenizer too: byte-level, no merges).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from lm.model import ModelPreset, MoETransformer, is_mixtral_style
from lm.tokenizer import TOKENIZER_FILE, ByteTokenizer, byte_tokenizer_as_hf

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
# One process, no pipelining to tune: the engine's plainest setting (any engine loads any
# checkpoint: they share the parameter layout, docs/engine.md).
INFERENCE_ENGINE: dict[str, Any] = {"engine": "mpipemoe", "partitions": 1, "strategy": "none"}


def build_model(preset: ModelPreset) -> MoETransformer:
    """Local. An untrained single-process model of ``preset`` in eval mode."""
    return MoETransformer(preset, group=None, **INFERENCE_ENGINE).eval()


def load_checkpoint_model(directory: str | Path) -> tuple[MoETransformer, dict[str, Any]]:
    """Local (no process group needed). The model in checkpoint ``directory`` with all its
    experts, and the checkpoint's meta dict (step, preset, world size ...)."""
    import torch.distributed.checkpoint as dcp

    from workers.checkpoint import META, drop_absent_expert_bias, validate

    directory = Path(directory)
    problem = validate(directory)  # the verifier every checkpoint reader shares
    if problem:
        raise ValueError(f"checkpoint {directory} is damaged: {problem}; give the run (--run), whose newest "
                         f"intact checkpoint is chosen, or move the damaged one out of the run folder")
    meta = json.loads((directory / META).read_text())
    model = build_model(ModelPreset(**meta["preset"]))
    state = {"model": model.state_dict()}
    drop_absent_expert_bias(state["model"], directory)
    dcp.load(state, storage_reader=dcp.FileSystemReader(directory), no_dist=True)
    model.load_state_dict(state["model"])
    return model, meta


# transformers' name (ACT2FN) of each expert activation: "gelu" is the exact (erf) GELU, as F.gelu
# computes it; SwiGLU is SiLU on the gate w1 times the up projection w3.
HF_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "swiglu": "silu"}


def model_config(model: MoETransformer, tokenizer: Any, source: dict[str, Any]) -> dict[str, Any]:
    """The ``config.json`` of an exported ``model``: a ``MixtralConfig`` for a Mixtral-style
    model (workers/hf_mixtral.py), else ours (``model_type`` "mpipemoe"), stating the whole
    architecture."""
    from workers.hf_mixtral import mixtral_config

    preset = model.preset
    ours = {"mask_token_id": tokenizer.mask_id, "mpipemoe_preset": dataclasses.asdict(preset),
            "mpipemoe_source": source}
    if is_mixtral_style(preset):
        return {**mixtral_config(preset, tokenizer), **ours}
    return {
        "architectures": ["MoETransformer"], "model_type": "mpipemoe",
        "is_decoder": preset.kind == "gpt", "vocab_size": preset.vocab_size, "hidden_size": preset.d_model,
        "intermediate_size": preset.d_hidden, "num_hidden_layers": preset.num_layers,
        "num_attention_heads": preset.num_heads, "num_local_experts": preset.num_experts,
        "num_experts_per_tok": preset.top_k, "max_position_embeddings": preset.seq_len,
        "hidden_act": HF_ACTIVATIONS[preset.activation], "expert_activation": preset.activation,
        "gated_experts": preset.activation == "swiglu", "norm_type": preset.norm, "norm_eps": preset.norm_eps,
        "pre_norm": True, "position_embedding_type": preset.positions,
        "rope_theta": preset.rope_theta if preset.positions == "rotary" else None,
        "attention_bias": preset.bias, "expert_bias": preset.bias, "router_rule": preset.router_rule,
        "capacity_factor": preset.capacity_factor, "tie_word_embeddings": preset.tied_head,
        "torch_dtype": "float32",
        "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id, **ours,
    }


def export_tensors(model: MoETransformer) -> dict[str, torch.Tensor]:
    """Local. The tensors ``model.safetensors`` holds: the ``state_dict`` in float32 (a
    Mixtral-style model: under transformers' names, workers/hf_mixtral.py)."""
    from workers.hf_mixtral import to_mixtral

    state = model.state_dict()
    if is_mixtral_style(model.preset):
        state = to_mixtral(state, model.preset)
    return {name: tensor.detach().to("cpu", torch.float32).contiguous() for name, tensor in state.items()}


def export(model: MoETransformer, out_dir: str | Path, tokenizer: Any, source: dict[str, Any]) -> dict[str, int]:
    """Local. Write ``model`` (its ``state_dict``), its config and ``tokenizer`` (a
    ``lm.tokenizer`` tokenizer) to ``out_dir``; returns {file name: bytes}.
    The files are written into a new hidden folder beside ``out_dir`` and moved in only when all
    three are whole (a full disk or a read-only ``out_dir`` leaves what was there as it was);
    each gets the mode the user's umask gives a new file (safetensors writes 0600)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    stage = out_dir.parent / f".{out_dir.name}.exporting-{uuid.uuid4().hex[:8]}"
    stage.mkdir()
    try:
        tensors = export_tensors(model)
        (stage / CONFIG_FILE).write_text(json.dumps(model_config(model, tokenizer, source), indent=1) + "\n")
        save_file(tensors, str(stage / WEIGHTS_FILE), metadata={"format": "pt"})
        os.chmod(stage / WEIGHTS_FILE, (stage / CONFIG_FILE).stat().st_mode & 0o777)
        (byte_tokenizer_as_hf() if isinstance(tokenizer, ByteTokenizer) else tokenizer).save(stage)
        if not out_dir.exists():
            os.replace(stage, out_dir)
        else:
            for name in (WEIGHTS_FILE, TOKENIZER_FILE, CONFIG_FILE):  # config.json last: it names the run
                os.replace(stage / name, out_dir / name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return {name: (out_dir / name).stat().st_size for name in (WEIGHTS_FILE, CONFIG_FILE, TOKENIZER_FILE)}


def load_exported(out_dir: str | Path) -> tuple[MoETransformer, dict[str, Any]]:
    """Local. The model of an exported folder (every tensor must be there, none extra) and its config."""
    from safetensors.torch import load_file

    from workers.hf_mixtral import from_mixtral

    out_dir = Path(out_dir)
    config = json.loads((out_dir / CONFIG_FILE).read_text())
    preset = ModelPreset(**config["mpipemoe_preset"])
    model = build_model(preset)
    tensors = load_file(str(out_dir / WEIGHTS_FILE))
    model.load_state_dict(from_mixtral(tensors, preset) if config.get("model_type") == "mixtral" else tensors,
                          strict=True)
    return model, config
