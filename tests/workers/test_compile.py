"""``mpipemoe train --compile``: each block's norms, attention and router under torch.compile,
the MoE dispatch eager (lm.model ``compile_local_parts``).

Tier 1: the option and its config key, which modules are compiled (parameter names unchanged),
the progress line's compile time. Tier 2 (2 gloo ranks, no Ray): the worker's ``Trainer`` with
``compile`` gives the eager run's float32 losses, also under selective and full activation
checkpointing (the compiled attention runs again in backward; the MoE engine replays its plan).
The gloo runs use the aot_eager backend: the same graphs (forward and backward) as inductor,
captured by Dynamo and AOT autograd, compiled in seconds; inductor's C++ kernels took 81 s
on this machine's 2 loaded cores for a one-layer model (docs/training.md has a measured run)."""
from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from app.jobs.progress import _format_step
from lm.data import prepare_dataset
from lm.model import MoETransformer, compile_local_parts, get_preset
from tests.distributed import run_on_ranks
from tests.train_cli import train_job
from workers.config import WorkerConfig

N = 3


def test_the_flag_and_the_config_keys_set_it_and_off_is_the_default(tmp_path):
    assert train_job(tmp_path).compile is False
    job = train_job(tmp_path, "--compile")
    assert (job.compile, job.compile_backend) == (True, "inductor")
    job = train_job(tmp_path, config='compile = true\ncompile-backend = "aot_eager"\n')
    assert (job.compile, job.compile_backend) == (True, "aot_eager")
    with pytest.raises(ValueError, match=r"TrainJob.compile_backend='cudagraphs' is invalid: choose one of "
                                         r"inductor, aot_eager"):
        train_job(tmp_path, config='compile-backend = "cudagraphs"\n')
    with pytest.raises(ValueError, match=r"WorkerConfig.compile='yes' is invalid"):
        WorkerConfig(preset=get_preset("tiny-gpt"), engine="mpipemoe", data_dir="d",
                     compile="yes")  # type: ignore[arg-type]


def test_the_local_parts_are_compiled_and_the_dispatch_and_names_are_not():
    model = MoETransformer(get_preset("tiny-mixtral"), partitions=1, strategy="none")
    names = [name for name, _ in model.named_parameters()]
    compile_local_parts(model, "aot_eager")
    assert [name for name, _ in model.named_parameters()] == names  # checkpoints load as before
    for block in model.blocks:
        for module in (block.ln1, block.attn, block.ln2, block.moe.router):
            assert module._compiled_call_impl is not None
        assert block.moe._compiled_call_impl is None and block._compiled_call_impl is None
    assert model.ln_f._compiled_call_impl is not None


def test_the_progress_line_shows_the_compile_time():
    metrics = {"step": 1, "loss": 5.0, "lm_loss": 5.0, "aux_loss": 1.0, "lr": 1e-3, "grad_norm": 1.0,
               "tokens_per_s": 100.0, "step_time_s": 9.0, "peak_memory_bytes": 2**20}
    assert "compile" not in _format_step(metrics, 10, 9.0)
    assert "  compile 7.5s" in _format_step({**metrics, "compile_time_s": 7.5}, 10, 9.0)


def _config(data_dir: str, **change) -> WorkerConfig:
    preset = get_preset("tiny-mixtral").replace(vocab_size=259, seq_len=32)
    config: dict[str, Any] = {"preset": dataclasses.asdict(preset), "engine": "mpipemoe", "partitions": 2,
                              "strategy": "S1", "seed": 3, "lr": 3e-3, "warmup_steps": 1, "steps": N,
                              "batch_size": 2, "data_dir": data_dir, "dtype": "float32"}
    return WorkerConfig(**{**config, **change})


def _train_ways(rank: int, world_size: int, data_dir: str) -> dict:
    from lm.model import compile_seconds
    from workers.loop import Trainer

    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for name, change in (("eager", {}), ("compiled", {"compile": True}),
                         ("eager_full", {"activation_checkpointing": "full"}),
                         ("compiled_full", {"compile": True, "activation_checkpointing": "full"}),
                         ("compiled_selective", {"compile": True, "activation_checkpointing": "selective"})):
        torch.manual_seed(rank)
        before = compile_seconds()
        trainer = Trainer(_config(data_dir, compile_backend="aot_eager", **change), rank, world_size,
                          torch.device("cpu"))
        results[name] = [trainer.step(step)["lm_loss"] for step in range(1, N + 1)]
        results[f"{name}_compile_s"] = compile_seconds() - before
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile")
    prepare_dataset(root / "data", max_bytes=2**17, row_len=1024)
    return run_on_ranks(2, _train_ways, str(root / "data"), timeout=600)


@pytest.mark.gloo
@pytest.mark.parametrize("compiled, eager", [("compiled", "eager"), ("compiled_full", "eager_full"),
                                             ("compiled_selective", "eager")])
def test_compiled_blocks_give_the_eager_losses_also_with_activation_checkpointing(runs, compiled, eager):
    for rank in range(2):
        assert runs[rank][compiled] == pytest.approx(runs[rank][eager], rel=1e-5)
    # torch's counter: the first compiled run compiled the graphs, the later ones reuse them (one
    # code object per module class, guards passed); eager runs compile nothing
    assert min(runs[rank]["compiled_compile_s"] for rank in range(2)) > 0
    assert runs[0]["eager_compile_s"] == runs[0]["eager_full_compile_s"] == 0
