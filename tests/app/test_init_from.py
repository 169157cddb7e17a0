"""``--init-from DIR`` (tier 1, no internet): a Hugging Face Mixtral checkpoint read into our
model (workers/hf_mixtral.py ``read_mixtral``, the export's name mapping inverted). A tiny
random ``MixtralForCausalLM`` built here gives the same logits in both frameworks, and
export -> import -> export gives the same tensors; a checkpoint our model cannot hold is
refused naming the field."""
from __future__ import annotations

import json

import pytest
import torch

from lm.model import MoETransformer
from workers.hf_mixtral import mixtral_preset, read_mixtral, to_mixtral

transformers = pytest.importorskip("transformers")


def _tiny_mixtral(folder, **config):
    fields = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                  tie_word_embeddings=True, rope_theta=10000.0)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**{**fields, **config})).eval()
    with torch.no_grad():  # norms away from 1, so a swapped norm shows
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                param.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    return model


def _ours(folder) -> MoETransformer:
    preset, state = read_mixtral(folder)
    model = MoETransformer(preset, partitions=1, strategy="none").eval()
    model.load_state_dict(state, strict=True)
    return model


def test_a_hugging_face_mixtral_gives_the_same_logits_in_our_model(tmp_path):
    theirs = _tiny_mixtral(tmp_path / "hf")
    ours = _ours(tmp_path / "hf")
    p = ours.preset
    assert (p.d_model, p.d_hidden, p.num_layers, p.num_heads, p.num_experts, p.top_k, p.vocab_size, p.rope_theta,
            p.seq_len) == (64, 96, 2, 4, 4, 2, 300, 10000.0, 64)
    tokens_BS = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = theirs(tokens_BS).logits
        got, _ = ours(tokens_BS)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_export_import_export_gives_the_same_tensors(tmp_path):
    from lm.tokenizer import ByteTokenizer
    from workers.weights import export

    _tiny_mixtral(tmp_path / "hf")
    first = _ours(tmp_path / "hf")
    export(first, tmp_path / "once", ByteTokenizer(), {"run": "x"})
    again = _ours(tmp_path / "once")
    exported = to_mixtral(first.state_dict(), first.preset)
    for name, tensor in to_mixtral(again.state_dict(), again.preset).items():
        torch.testing.assert_close(tensor, exported[name], rtol=0, atol=0)
    assert set(exported) == set(to_mixtral(again.state_dict(), again.preset))


@pytest.mark.parametrize("change, field", [
    ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
    ({"model_type": "qwen2_moe"}, "model_type='qwen2_moe'"),
    ({"shared_expert_intermediate_size": 128}, "shared_expert_intermediate_size=128"),
    ({"norm_topk_prob": False}, "norm_topk_prob=False"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings=False"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
])
def test_a_checkpoint_that_is_not_mixtral_style_is_refused_naming_the_field(tmp_path, change, field):
    _tiny_mixtral(tmp_path / "hf")
    config = {**json.loads((tmp_path / "hf" / "config.json").read_text()), **change}
    with pytest.raises(ValueError, match=r"^--init-from: config.json's " + field.replace("(", r"\(")
                       + " is not Mixtral-style: "):
        mixtral_preset(config)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="no config.json there"):
        read_mixtral(tmp_path)
    _tiny_mixtral(tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no model.safetensors"):
        read_mixtral(tmp_path / "hf")
