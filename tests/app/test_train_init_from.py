"""``mpipemoe train --init-from DIR`` on Ray (tier 3: embedded Ray, 2 gloo workers, MLflow).

A tiny random transformers ``MixtralForCausalLM`` (untied LM head, as Mixtral's default) is
saved with a tokenizer.json; the data is prepared with that folder's tokenizer; the run's
first step's loss is the loss transformers computes on the same batches (fp32), and the run
resumes and exports as any run does (the export loads in transformers with the trained
model's logits)."""
from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import torch

from app.commands import export as export_command
from app.commands.train import add_arguments, run
from app.jobs.job import TrainJob
from app.jobs.launch import run_job
from lm.data import prepare_dataset
from lm.model import lm_batch, lm_loss
from lm.tokenizer import byte_tokenizer_as_hf
from workers.reshard import rank_batches

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.ray

SEED, BATCH, SEQ = 3, 2, 32


def _tiny_mixtral(folder):
    config = transformers.MixtralConfig(
        vocab_size=259, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        tie_word_embeddings=False, rope_theta=10000.0)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).eval()
    model.save_pretrained(folder)
    byte_tokenizer_as_hf().save(folder)  # byte-level: <eos> 256 lies inside the 259 rows
    return model


@pytest.fixture(scope="module")
def started(ray_local, tmp_path_factory):
    root = tmp_path_factory.mktemp("init")
    theirs = _tiny_mixtral(root / "hf")
    prepare_dataset(root / "data", max_bytes=2**17, tokenizer=str(root / "hf"))
    job = TrainJob(init_from=str(root / "hf"), steps=2, num_workers=2, use_gpu=False, batch_size=BATCH,
                   seq_len=SEQ, lr=1e-3, warmup_steps=0, checkpoint_every=2, seed=SEED, partitions=1,
                   strategy="none", aux_loss_weight=0.0, eval_every=0, dtype="float32",
                   data_dir=str(root / "data"), storage_path=str(root / "ray_results"),
                   tracking_uri=f"sqlite:///{root / 'mlflow.db'}", name="pretrained", experiment="test-init")
    summary = run_job(job, echo=lambda line: None)
    return root, theirs, job, summary


def test_the_first_step_loss_is_the_loss_transformers_computes_on_the_same_batches(started):
    root, theirs, job, summary = started
    assert job.model_preset().tied_head is False and job.model_preset().num_experts == 4
    losses = []
    for rank in range(2):  # each rank's first batch, as workers/loop.py Trainer._micro_batch reads it
        sampler = rank_batches(job.data_dir, rank, 2, None, BATCH, SEQ + 1, SEED)
        inputs_BS, targets_BS = lm_batch("gpt", torch.from_numpy(sampler.batch(0)).long(), 0, 259)
        with torch.no_grad():
            losses.append(lm_loss(theirs(inputs_BS).logits, targets_BS).item())
    first = summary["history"][0]
    assert first["lm_loss"] == pytest.approx(sum(losses) / 2, rel=1e-5)


def test_the_run_resumes_and_exports_to_transformers(started, tmp_path):
    root, theirs, job, _ = started
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    summary_json = tmp_path / "summary.json"
    assert run(parser.parse_args(["--resume", job.name, "--storage-path", job.storage_path, "--steps", "3",
                                  "--summary-json", str(summary_json)])) == 0
    resumed = json.loads(summary_json.read_text())
    assert [m["step"] for m in resumed["history"]] == [3]
    recorded = json.loads((job.run_dir / "mpipemoe_job.json").read_text())
    assert recorded["init_from"] == job.init_from

    export_parser = argparse.ArgumentParser()
    export_command.add_arguments(export_parser)
    out = root / "exported"
    assert export_command.run(export_parser.parse_args(["--run", job.name, "--out", str(out), "--storage-path",
                                                        job.storage_path])) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["model_type"] == "mixtral"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    from app.jobs.trained import trained_run

    ours = trained_run(job.name, job.storage_path).model.eval()
    tokens_BS = torch.randint(0, 259, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens_BS)[0], loaded(tokens_BS).logits, rtol=0, atol=1e-5)
        moved = (loaded.lm_head.weight - theirs.lm_head.weight).abs().max().item()
    assert moved > 0  # three steps trained it


def test_data_of_another_tokenizer_is_refused_naming_the_prepare_command(started, tmp_path):
    root, _, job, _ = started
    prepare_dataset(tmp_path / "bytes", max_bytes=2**16)
    from app.jobs.preflight import ensure_data

    other = dataclasses.replace(job, data_dir=str(tmp_path / "bytes"), name="other")
    with pytest.raises(ValueError, match=r"--init-from .*hf: the data at .* was prepared with tokenizer bytes-v1 .*"
                                         r"data prepare --source YOUR_TEXT --tokenizer .*hf --out data/hf"):
        ensure_data(other)
