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
from tests.train_cli import train_job
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


def test_an_untied_lm_head_is_read_and_gives_the_same_logits(tmp_path):
    theirs = _tiny_mixtral(tmp_path / "hf", tie_word_embeddings=False)
    ours = _ours(tmp_path / "hf")
    assert ours.preset.tied_head is False
    torch.testing.assert_close(ours.lm_head.weight, theirs.lm_head.weight, rtol=0, atol=0)
    assert not torch.equal(ours.lm_head.weight, ours.tok_embed.weight)
    tokens_BS = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens_BS)[0], theirs(tokens_BS).logits, rtol=0, atol=1e-5)


def test_a_rank_reads_only_its_experts(tmp_path):
    from workers.hf_mixtral import read_mixtral_config, read_mixtral_shard

    _tiny_mixtral(tmp_path / "hf")
    preset, whole = read_mixtral(tmp_path / "hf")
    assert read_mixtral_config(tmp_path / "hf") == preset
    second = read_mixtral_shard(tmp_path / "hf", preset, range(2, 4))
    assert second["blocks.1.moe.experts.w1"].shape[0] == 2
    torch.testing.assert_close(second["blocks.1.moe.experts.w2"], whole["blocks.1.moe.experts.w2"][2:4], rtol=0, atol=0)
    torch.testing.assert_close(second["tok_embed.weight"], whole["tok_embed.weight"], rtol=0, atol=0)


@pytest.mark.parametrize("tied", [True, False])
def test_export_import_export_gives_the_same_tensors(tmp_path, tied):
    from lm.tokenizer import ByteTokenizer
    from workers.weights import export

    _tiny_mixtral(tmp_path / "hf", tie_word_embeddings=tied)
    first = _ours(tmp_path / "hf")
    export(first, tmp_path / "once", ByteTokenizer(), {"run": "x"})
    again = _ours(tmp_path / "once")
    exported = to_mixtral(first.state_dict(), first.preset)
    for name, tensor in to_mixtral(again.state_dict(), again.preset).items():
        torch.testing.assert_close(tensor, exported[name], rtol=0, atol=0)
    assert set(exported) == set(to_mixtral(again.state_dict(), again.preset))
    assert ("lm_head.weight" in exported) is not tied
    assert json.loads((tmp_path / "once" / "config.json").read_text())["tie_word_embeddings"] is tied


@pytest.mark.parametrize("change, field", [
    ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
    ({"model_type": "qwen2_moe"}, "model_type='qwen2_moe'"),
    ({"shared_expert_intermediate_size": 128}, "shared_expert_intermediate_size=128"),
    ({"norm_topk_prob": False}, "norm_topk_prob=False"),
    ({"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
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


def test_train_init_from_takes_the_model_from_the_folder_by_flag_or_config_key(tmp_path):
    _tiny_mixtral(tmp_path / "hf", tie_word_embeddings=False)
    job = train_job(tmp_path, "--init-from", str(tmp_path / "hf"), "--seq-len", "32")
    assert job.init_from == str((tmp_path / "hf").resolve()) and job.name.startswith("hf-mpipemoe-")
    preset = job.model_preset(vocab_size=1000)  # the checkpoint's embedding fixes the vocabulary
    assert (preset.d_model, preset.num_experts, preset.top_k, preset.vocab_size, preset.seq_len, preset.tied_head) \
        == (64, 4, 2, 300, 32, False)
    assert train_job(tmp_path, config=f'init-from = "{tmp_path / "hf"}"\n').init_from == job.init_from
    assert train_job(tmp_path, "--init-from", str(tmp_path / "hf"), "--top-k", "3").model_preset().top_k == 3


def test_train_init_from_refuses_overrides_that_change_the_weights_and_non_mixtral_folders(tmp_path):
    _tiny_mixtral(tmp_path / "hf")
    with pytest.raises(ValueError, match=r"TrainJob.num_experts=8 is invalid: --init-from .*hf fixes it to 4 "
                                         r"\(its config.json\): drop --num-experts"):
        train_job(tmp_path, "--init-from", str(tmp_path / "hf"), "--num-experts", "8")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 2}))
    with pytest.raises(ValueError, match=r"^--init-from: config.json's num_key_value_heads=2 is not Mixtral-style"):
        train_job(tmp_path, "--init-from", str(tmp_path / "hf"))
    with pytest.raises(ValueError, match=r"no config.json there"):
        train_job(tmp_path, "--init-from", str(tmp_path))


def test_data_prepare_with_a_checkpoints_tokenizer_says_how_to_start_from_it(tmp_path, capsys):
    from app import cli
    from lm.tokenizer import byte_tokenizer_as_hf

    _tiny_mixtral(tmp_path / "hf")
    byte_tokenizer_as_hf().save(tmp_path / "hf")
    (tmp_path / "text.txt").write_text("def main():\n    return 1\n" * 200)
    assert cli.main(["data", "prepare", "--source", str(tmp_path / "text.txt"), "--tokenizer", str(tmp_path / "hf"),
                     "--out", str(tmp_path / "data"), "--row-len", "64"]) == 0
    printed = capsys.readouterr().out
    assert f"train on it with: mpipemoe train --init-from {(tmp_path / 'hf').resolve()} --data-dir " \
           f"{tmp_path / 'data'}" in printed
