"""Training job configuration and the worker's gradient rule (tiers 1 and 2, no Ray).

The gloo test runs the model on 2 processes (expert parallel + data parallel) and
checks the averaged gradients against one process holding all experts on the whole batch.
"""
from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from app.jobs.job import TrainJob, worker_config
from app.jobs.progress import summarize
from app.jobs.resume import save_job
from app.commands.train import add_arguments, job_from_args
from app.jobs.compare import comparison_table
from lm.data import MASK_ID, prepare_dataset
from lm.model import MoETransformer, get_preset, init_parameters, lm_batch, lm_loss
from workers.distributed import DenseParallel, clip_grad_norm, split_params
from workers.config import WorkerConfig
from workers.loop import learning_rate


@pytest.mark.parametrize("change, field", [
    ({"engine": "tutel"}, "engine"), ({"steps": 0}, "steps"), ({"partitions": 0}, "partitions"),
    ({"strategy": "S5"}, "strategy"), ({"lr": 0.0}, "lr"), ({"batch_size": 1.5}, "batch_size"),
    ({"cpus_per_worker": 0}, "cpus_per_worker"), ({"dtype": "int8"}, "dtype"), ({"dtype": "float16"}, "dtype"),
    ({"grad_accum": 0}, "grad_accum"), ({"keep_checkpoints": -1}, "keep_checkpoints"),
    ({"shard_dense": "yes"}, "shard_dense"), ({"param_dtype": "float16"}, "param_dtype"),
    ({"param_dtype": "bfloat16", "dtype": "float32"}, "dtype"),
])
def test_bad_job_names_the_field(change, field):
    with pytest.raises(ValueError, match=rf"TrainJob\.{field}="):
        TrainJob(**change)


def test_job_checks_experts_against_workers():
    """On CPU at once; with GPUs possible once Ray is up (the default degree is a node's GPUs:
    tests/app/test_train_expert_parallel.py)."""
    with pytest.raises(ValueError, match=r"num_experts=4 is invalid: .*expert-parallel degree \(3, the number of workers\)"):
        TrainJob(num_workers=3, use_gpu=False)
    TrainJob(num_workers=3, num_experts=6, use_gpu=False)
    TrainJob(num_workers=3)  # on 1-GPU nodes the default expert groups would be single GPUs


def test_job_defaults_are_absolute_and_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    job = TrainJob(partitions="3")
    assert job.partitions == 3
    assert job.storage_path == str(tmp_path / "ray_results")
    assert job.data_dir == str(tmp_path / "data" / "stdlib-bytes")
    assert job.tracking_uri == f"sqlite:///{tmp_path}/mlflow.db"
    assert job.name.startswith("tiny-gpt-mpipemoe-") and job.name != TrainJob().name


def test_worker_config_resolves_device_dtype_and_preset(tmp_path):
    prepare_dataset(tmp_path, max_bytes=50_000, row_len=1000)
    job = TrainJob(data_dir=str(tmp_path), seq_len=128, num_experts=8)
    cpu = worker_config(job, use_gpu=False)
    assert (cpu.dtype, cpu.cpus_per_worker, cpu.torch_threads) == ("float32", 0.9, 1)
    assert cpu.preset.seq_len == cpu.seq_len == 128 and cpu.preset.num_experts == 8
    assert worker_config(job, use_gpu=True).dtype == "bfloat16"
    assert cpu.moe_memory_budget_bytes is None
    budgeted = TrainJob(data_dir=str(tmp_path), moe_memory_gib=0.5)
    assert worker_config(budgeted, use_gpu=False).moe_memory_budget_bytes == 2**29


def test_a_capacity_search_setting_that_is_missing_is_named():
    config = WorkerConfig(get_preset("tiny-gpt"), "mpipemoe", data_dir="(tokens given)", steps_per_trial=2)
    assert config.search_setting("steps_per_trial") == 2
    with pytest.raises(ValueError, match=r"WorkerConfig.start_batch=None is invalid: the capacity search needs it"):
        config.search_setting("start_batch")


def test_cli_arguments_build_the_job(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--engine", "fastmoe", "--steps", "7", "--no-gpu", "--partitions", "2",
                              "--storage-path", str(tmp_path), "--name", "x"])
    job = job_from_args(args)
    assert (job.engine, job.steps, job.use_gpu, job.partitions, job.run_dir) == \
        ("fastmoe", 7, False, 2, tmp_path / "x")
    assert parser.parse_args([]).use_gpu is None
    assert job_from_args(parser.parse_args(["--storage-path", str(tmp_path)])).steps == TrainJob.steps
    with pytest.raises(ValueError, match="--resume gone: no run recorded at"):
        job_from_args(parser.parse_args(["--resume", "gone", "--storage-path", str(tmp_path)]))


def test_the_split_flag_reaches_the_workers_model(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    job = job_from_args(parser.parse_args(["--split", "peers", "--partitions", "2", "--storage-path",
                                           str(tmp_path), "--name", "x"]))
    assert (job.split, job.partitions) == ("peers", 2)
    config = WorkerConfig(get_preset("tiny-gpt"), "mpipemoe", data_dir="(tokens given)", partitions=2, split="peers")
    assert config.split == "peers"
    with pytest.raises(ValueError, match=r"WorkerConfig.split='rows' is invalid: choose one of tokens, peers, auto"):
        WorkerConfig(get_preset("tiny-gpt"), "mpipemoe", data_dir="(tokens given)", split="rows")


def test_resume_takes_the_recorded_settings(tmp_path):
    save_job(TrainJob(preset="tiny-bert", lr=0.01, storage_path=str(tmp_path), name="r", parent_run_id="p"))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    job = job_from_args(parser.parse_args(["--resume", "r", "--storage-path", str(tmp_path), "--steps", "90"]))
    assert (job.preset, job.lr, job.steps, job.name, job.parent_run_id) == ("tiny-bert", 0.01, 90, "r", "p")
    compare = job_from_args(parser.parse_args(["--engines", "mpipemoe,fastmoe", "--preset", "tiny-bert"]))
    assert compare.name.startswith("tiny-bert-compare-")


def test_a_run_without_checkpoints_cannot_be_resumed(tmp_path):
    save_job(TrainJob(checkpoint_every=0, storage_path=str(tmp_path), name="bench"))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ValueError, match=r"--resume bench: that run wrote no checkpoints \(--checkpoint-every 0\)"):
        job_from_args(parser.parse_args(["--resume", "bench", "--storage-path", str(tmp_path)]))


def test_summary_and_table():
    history = [{"step": s, "loss": 5.0 - s, "lm_loss": 4.9 - s, "aux_loss": 1.0, "tokens_per_s": t,
                "step_time_s": 1 / t, "peak_memory_bytes": 2**20 * m, "strategy": "S2"}
               for s, t, m in ((1, 10.0, 9), (2, 100.0, 5), (3, 300.0, 3), (4, 200.0, 4))]
    summary = summarize(history)
    assert summary["tokens_per_s"] == 200.0           # median without step 1
    assert summary["peak_memory_bytes"] == 9 * 2**20 and summary["final_loss"] == 1.0
    assert summary["settled_peak_memory_bytes"] == 4 * 2**20  # steps 3-4, after the search
    assert summary["strategy"] == "S2" and summary["first_loss"] == 4.0
    table = comparison_table({"mpipemoe": summary, "fastmoe": dict(summary, tokens_per_s=100.0,
                                                                    settled_peak_memory_bytes=8 * 2**20)},
                             "mpipemoe")
    assert table.splitlines()[2].split()[-3:] == ["2.00", "1.00", "0.50"]  # speed, memory, settled


def test_learning_rate_schedule_does_not_depend_on_run_length():
    assert [learning_rate(s, 1.0, 4) for s in (1, 2, 4, 5, 1000)] == [0.25, 0.5, 1.0, 1.0, 1.0]


# ---- tier 2: two gloo processes --------------------------------------------------------

def _batch():
    return torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(11))


def _grads_on_rank(rank: int, world_size: int, port: int, out: str, mode: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    try:
        model = MoETransformer(get_preset("tiny-gpt"), engine="mpipemoe")
        init_parameters(model, seed=0, rank=rank)
        parallel = DenseParallel(model, mode=mode, world_size=world_size)
        per_rank = 4 // world_size
        inputs_BS, targets_BS = lm_batch("gpt", _batch()[rank * per_rank:(rank + 1) * per_rank], MASK_ID, 259)
        logits_BSV, _ = parallel.module(inputs_BS)
        lm_loss(logits_BSV, targets_BS).backward()
        parallel.finish_gradients()
        divisor_norm, divisor = parallel.clip_divisor(1e-3)  # device-side: the same norm, no clipping yet
        norm = parallel.clip_grad_norm(0.0)
        assert float(divisor_norm) == pytest.approx(norm, rel=1e-6)
        assert float(divisor) == pytest.approx((norm + 1e-6) / 1e-3, rel=1e-6)
        grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                 for n, p in model.named_parameters()}
        torch.save({"norm": norm, "grads": grads}, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.gloo
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_rank_gradients_equal_one_process_on_the_whole_batch(tmp_path, mode):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_grads_on_rank, args=(2, port, str(tmp_path), mode), nprocs=2, join=True)

    model = MoETransformer(get_preset("tiny-gpt"), engine="fastmoe")
    init_parameters(model, seed=0)
    inputs_BS, targets_BS = lm_batch("gpt", _batch(), MASK_ID, 259)
    logits_BSV, _ = model(inputs_BS)
    lm_loss(logits_BSV, targets_BS).backward()
    replicated, expert = split_params(model)
    reference_norm = clip_grad_norm(replicated, expert, 0.0, 1)
    for rank in range(2):
        saved = torch.load(tmp_path / f"rank{rank}.pt")
        assert saved["norm"] == pytest.approx(reference_norm, rel=1e-4)
        for name, param in model.named_parameters():
            expected = param.grad
            if "experts." in name:  # rank r holds global experts 2r, 2r+1 of 4
                expected = expected[2 * rank:2 * rank + 2]
            torch.testing.assert_close(saved["grads"][name], expected, rtol=1e-4, atol=1e-6,
                                       msg=f"rank {rank} {name}")


def test_build_trainer_gpu_uses_nccl_one_gpu_per_worker_and_bf16(tmp_path):
    pytest.importorskip("ray")
    from app.jobs.ray_start import build_trainer

    prepare_dataset(tmp_path / "data", max_bytes=50_000, row_len=1000)
    job = TrainJob(use_gpu=True, num_workers=4, data_dir=str(tmp_path / "data"),
                   storage_path=str(tmp_path / "rr"), collective_timeout_s=120)
    trainer = build_trainer(job)
    assert (trainer.backend_config.backend, trainer.backend_config.timeout_s) == ("nccl", 120)
    assert trainer.scaling_config.num_workers == 4 and trainer.scaling_config.use_gpu
    assert trainer.scaling_config.resources_per_worker == {"CPU": 1.0, "GPU": 1}
    assert trainer.train_loop_config.dtype == "bfloat16" and trainer.train_loop_config.use_gpu
    cpu = build_trainer(TrainJob(use_gpu=False, data_dir=str(tmp_path / "data"), storage_path=str(tmp_path / "rr")))
    assert cpu.backend_config.backend == "gloo" and cpu.scaling_config.resources_per_worker == {"CPU": 0.9}


def test_metrics_pump_keeps_the_last_attempt_of_replayed_steps():
    from app.tracking.store import NullRun
    from app.jobs.progress import _MetricsPump

    lines = []
    pump = _MetricsPump(None, NullRun(), TrainJob(steps=4, log_every=1), lines.append, None)
    for step, loss in ((1, 4.0), (2, 3.0), (3, 2.9), (2, 3.0), (3, 2.5), (4, 2.0)):
        pump._handle({"step": step, "loss": loss, "lm_loss": loss, "aux_loss": 1.0, "tokens_per_s": 1.0,
                      "step_time_s": 1.0, "peak_memory_bytes": 1, "lr": 1e-3, "grad_norm": 1.0})
    assert [(m["step"], m["loss"]) for m in pump.history] == [(1, 4.0), (2, 3.0), (3, 2.5), (4, 2.0)]
    assert any("restarted" in line for line in lines)


def test_the_step_line_shows_load_imbalance_tokens_seen_and_the_eta(monkeypatch):
    from app.tracking.store import NullRun
    from app.jobs import progress

    now = [0.0]  # steps 1, 10 and 20 arrive 30 s apart
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    lines: list[str] = []
    pump = progress._MetricsPump(None, NullRun(), TrainJob(steps=20, log_every=10), lines.append, None)
    for step, load in ((1, {}), (10, {"moe_load/imbalance_max": 1.314}), (20, {"moe_load/imbalance_max": 1.2})):
        now[0] = 30.0 * (step // 10)
        pump._handle({"step": step, "loss": 3.0, "lm_loss": 3.0, "aux_loss": 1.0, "tokens_per_s": 1.0,
                      "step_time_s": 1.0, "peak_memory_bytes": 1, "lr": 1e-3, "grad_norm": 1.0,
                      "tokens_seen": 1024 * step, **load})
    first, tenth, last = lines
    assert first.endswith("peak 0 MiB  seen 1,024 tok")  # no load read yet, no pace to measure
    assert tenth.endswith("peak 0 MiB  load 1.31  seen 10.2k tok  ETA 33s")  # 30 s for 9 steps, 10 to go
    assert last.endswith("peak 0 MiB  load 1.20  seen 20.5k tok")  # done: no ETA


def test_clip_divisor_in_fused_adamw_equals_clipping_then_stepping():
    """Trainer.step with the fused AdamW divides the gradients by the clip's divisor inside the
    update (``grad_scale``) instead of scaling them first: the same parameters up to float32
    rounding, clipping or not, and the same norm."""
    from workers.distributed import clip_divisor

    torch.manual_seed(0)
    for max_norm in (0.5, 1e6):
        models = []
        for _ in range(2):
            torch.manual_seed(1)
            dense = [torch.nn.Parameter(torch.randn(33, 17)), torch.nn.Parameter(torch.randn(5))]
            expert = [torch.nn.Parameter(torch.randn(4, 8, 8))]
            torch.manual_seed(2)
            for p in dense + expert:
                p.grad = torch.randn_like(p)
            models.append((dense, expert, torch.optim.AdamW(dense + expert, lr=1e-2, fused=True)))
        (d1, e1, o1), (d2, e2, o2) = models
        norm = clip_grad_norm(d1, e1, max_norm, 1)
        o1.step()
        norm_t, divisor = clip_divisor(d2, e2, max_norm, 1)
        o2.grad_scale = divisor  # type: ignore[attr-defined]  # (read by AdamW.step)
        o2.step()
        assert float(norm_t) == pytest.approx(norm, rel=1e-6)
        assert (float(divisor) == 1.0) == (norm <= max_norm)
        for a, b in zip(d1 + e1, d2 + e2):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
