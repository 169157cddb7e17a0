"""``mpipemoe generate`` and ``mpipemoe export`` on a tiny trained run (no Ray).

The run is made as a worker makes it, in this process: a ``TrainJob`` recorded in its run
folder (``save_job``), a ``Trainer`` on one rank for 3 steps on BPE-tokenized text, and a
sharded checkpoint (``workers.checkpoint.save``). The commands then load its newest
checkpoint and the run's tokenizer.
"""
from __future__ import annotations

import json

import pytest
import torch

from app import cli
from app.jobs.job import TrainJob, worker_config
from app.jobs.resume import save_job
from lm.data import prepare_dataset
from lm.tokenizer import ByteTokenizer, byte_tokenizer_as_hf

STEPS = 3


def train_run(root, preset: str, name: str, tokenizer: str) -> dict:
    """A run ``name`` of ``preset``, trained STEPS steps in this process on data tokenized by
    ``tokenizer``, with its checkpoint; and the trained model's logits on one batch."""
    from workers import checkpoint as ckpt
    from workers.loop import Trainer

    prepare_dataset(root / "data", max_bytes=2**17, row_len=512, tokenizer=tokenizer)
    job = TrainJob(preset=preset, name=name, steps=STEPS, num_workers=1, batch_size=4, seq_len=32,
                   lr=3e-3, storage_path=str(root / "runs"), data_dir=str(root / "data"), tracking_uri="none")
    save_job(job)
    config = worker_config(job, use_gpu=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = Trainer(config, 0, 1, torch.device("cpu"))
        losses = [trainer.step(step)["lm_loss"] for step in range(1, STEPS + 1)]
        ckpt.save(job.run_dir / ckpt.checkpoint_name(STEPS), 0, 1, trainer.parallel, trainer.optimizer,
                  {"step": STEPS, "world_size": 1, "engine": job.engine, "preset": config.preset_dict()})
        window_BS = torch.from_numpy(trainer.sampler.batch(0))[:, :-1]
        trainer.model.eval()
        with torch.no_grad():
            logits = trainer.model(window_BS)[0]
    finally:
        torch.set_num_threads(threads)
    return {"job": job, "losses": losses, "window": window_BS, "logits": logits, "root": root}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return train_run(tmp_path_factory.mktemp("trained"), "tiny-gpt", "tiny", "bpe:300")


def _cli(argv, capsys):
    status = cli.main(argv)
    out, err = capsys.readouterr()
    return status, out, err


def test_generate_continues_the_prompt_greedily_from_the_newest_checkpoint(trained, capsys):
    storage = trained["job"].storage_path
    argv = ["generate", "--run", "tiny", "--prompt", "def main(", "--max-new-tokens", "12", "--storage-path", storage]
    status, out, err = _cli(argv, capsys)
    assert status == 0
    assert err.startswith("[mpipemoe] tiny at step 3 (checkpoint_000003), ") and "greedy" in err
    assert out.startswith("def main(") and len(out) > len("def main(\n")
    assert _cli(argv, capsys)[1] == out  # greedy: the same text again
    assert _cli(argv[:-2] + ["--temperature", "0", "--top-k", "50", *argv[-2:]], capsys)[1] == out


def test_generate_samples_top_k_reproducibly_by_seed(trained, capsys):
    storage = trained["job"].storage_path
    base = ["generate", "--run", "tiny", "--prompt", "import ", "--max-new-tokens", "24", "--top-k", "50",
            "--temperature", "1.5", "--storage-path", storage]
    texts = {seed: _cli(base + ["--seed", str(seed)], capsys)[1] for seed in (1, 2, 3)}
    assert _cli(base + ["--seed", "1"], capsys)[1] == texts[1]
    assert len(set(texts.values())) > 1  # other seeds, other samples
    assert all(text.startswith("import ") for text in texts.values())


def test_generate_names_the_fix_for_a_missing_run_or_bad_options(trained, capsys):
    storage = trained["job"].storage_path
    status, _, err = _cli(["generate", "--run", "nope", "--prompt", "x", "--storage-path", storage], capsys)
    assert status == 1 and "--run nope: no run recorded at" in err and "check the name and --storage-path" in err
    status, _, err = _cli(["generate", "--run", "tiny", "--prompt", "x", "--temperature", "-1"], capsys)
    assert status == 1 and "--temperature -1.0 is invalid: give a number >= 0 (0: greedy)" in err


def test_export_round_trips_to_the_same_logits(trained, capsys):
    from tokenizers import Tokenizer

    from lm.tokenizer import load_prepared
    from workers.weights import load_exported

    out = trained["root"] / "exported"
    status, printed, _ = _cli(["export", "--run", "tiny", "--out", str(out),
                               "--storage-path", trained["job"].storage_path], capsys)
    assert status == 0 and printed.startswith(f"[mpipemoe] exported tiny at step 3 to {out}: model.safetensors (")
    model, config = load_exported(out)
    with torch.no_grad():
        logits = model(trained["window"])[0]
    assert torch.equal(logits, trained["logits"])  # the trained model's weights, whole
    assert (config["num_local_experts"], config["hidden_size"], config["vocab_size"]) == (4, 128, 300)
    assert config["mpipemoe_source"]["step"] == 3 and config["mpipemoe_preset"]["seq_len"] == 32
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as weights:
        assert tuple(weights.get_slice("blocks.0.moe.experts.w1").get_shape()) == (4, 128, 256)
    run_tokenizer = load_prepared(trained["job"].data_dir, "tokenizer.json")
    exported = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = "def f(x):\n    return x + 1\n"
    assert exported.encode(text, add_special_tokens=False).ids == run_tokenizer.encode(text).tolist()
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == run_tokenizer.eos_id


def test_an_export_config_states_the_whole_architecture(trained, capsys):
    out = trained["root"] / "exported-architecture"
    assert _cli(["export", "--run", "tiny", "--out", str(out), "--storage-path", trained["job"].storage_path],
                capsys)[0] == 0
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in ("model_type", "norm_type", "norm_eps", "position_embedding_type", "rope_theta",
                                   "attention_bias", "expert_bias", "hidden_act", "gated_experts", "router_rule")} == {
        "model_type": "mpipemoe", "norm_type": "layernorm", "norm_eps": 1e-5, "position_embedding_type": "learned",
        "rope_theta": None, "attention_bias": True, "expert_bias": True, "hidden_act": "gelu",
        "gated_experts": False, "router_rule": "softmax-then-topk"}


def test_the_byte_tokenizer_exports_as_a_tokenizers_file_with_the_same_ids(tmp_path):
    from tokenizers import Tokenizer

    byte_tokenizer_as_hf().save(tmp_path)
    exported = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    text = "naïve café ✓ def f():\n\treturn 0\n"
    ids = exported.encode(text, add_special_tokens=False).ids
    assert ids == ByteTokenizer().encode(text).tolist() and exported.decode(ids) == text
    assert [exported.token_to_id(t) for t in ("<eos>", "<mask>", "<pad>")] == [256, 257, 258]


def test_sampling_rules():
    from lm.sampling import next_token

    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    assert next_token(logits, 1, 1.0, None) == 1 and next_token(logits, 0, 0.0, None) == 1
    generator = torch.Generator().manual_seed(0)
    drawn = {next_token(logits, 2, 1.0, generator) for _ in range(200)}
    assert drawn == {1, 3}  # only the 2 most likely tokens
    assert len({next_token(logits, 0, 5.0, generator) for _ in range(400)}) == 4


@pytest.fixture(scope="module")
def trained_mixtral(tmp_path_factory):
    return train_run(tmp_path_factory.mktemp("mixtral"), "tiny-mixtral", "mixtral", "bytes")


def test_a_mixtral_style_export_loads_in_transformers_and_generates_the_same_tokens(trained_mixtral, capsys):
    """transformers (a test-only dependency) loads the export as a MixtralForCausalLM without
    remote code, with every tensor used and none missing; its logits are ours within float32
    rounding, and its greedy generation is ``mpipemoe generate``'s, token for token."""
    transformers = pytest.importorskip("transformers")
    from lm.sampling import generate
    from lm.tokenizer import ByteTokenizer
    from workers.weights import load_exported

    out, storage = trained_mixtral["root"] / "exported", trained_mixtral["job"].storage_path
    assert _cli(["export", "--run", "mixtral", "--out", str(out), "--storage-path", storage], capsys)[0] == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["architectures"], config["hidden_act"]) == \
        ("mixtral", ["MixtralForCausalLM"], "silu")
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["vocab_size"]) == (4, 2, 259)
    assert (config["max_position_embeddings"], config["eos_token_id"], config["tie_word_embeddings"]) == \
        (32, ByteTokenizer.eos_id, True)

    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(hf).__name__ == "MixtralForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    hf.eval()
    with torch.no_grad():
        theirs = hf(trained_mixtral["window"]).logits
    torch.testing.assert_close(theirs, trained_mixtral["logits"], rtol=1e-5, atol=1e-5)

    model, _ = load_exported(out)  # our loader reads the Mixtral names back
    with torch.no_grad():
        assert torch.equal(model(trained_mixtral["window"])[0], trained_mixtral["logits"])

    prompt = "def main("
    prompt_ids = ByteTokenizer().encode(prompt).tolist()
    new = 20  # the prompt and these within max_position_embeddings (32): both see the whole window
    with torch.no_grad():
        hf_ids = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=new, do_sample=False,
                             eos_token_id=None)[0, len(prompt_ids):].tolist()
        ours = generate(model, prompt_ids, max_new_tokens=new)
    assert ours == hf_ids and len(hf_ids) == new
    status, printed, _ = _cli(["generate", "--run", "mixtral", "--prompt", prompt, "--max-new-tokens", str(new),
                               "--storage-path", storage], capsys)
    assert status == 0 and printed == prompt + ByteTokenizer().decode(hf_ids) + "\n"
