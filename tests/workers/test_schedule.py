"""The optimisation settings of a run (tier 1: one process, no process group, no Ray):
learning-rate schedules, their state across a checkpoint, AdamW's kernels, the validation
loss and the per-expert load metrics of the worker's ``Trainer``."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from lm.data import prepare_dataset
from lm.model import get_preset
from workers.config import WorkerConfig
from workers.loop import DecayPlan, Trainer, extend_decay, learning_rate, optimizer_kernels, wsd_plan

N, K = 6, 3
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_schedules_warm_up_then_decay_to_min_lr_at_the_last_step():
    def rates(schedule):
        return [learning_rate(s, 1.0, 2, schedule, steps=12, min_lr=0.1) for s in range(1, 13)]

    for schedule in ("constant", "cosine", "linear", "wsd"):
        assert rates(schedule)[:2] == [0.5, 1.0]  # warm-up
    assert rates("constant")[2:] == [1.0] * 10
    cosine, linear, wsd = rates("cosine"), rates("linear"), rates("wsd")
    assert cosine[-1] == pytest.approx(0.1) and linear[-1] == pytest.approx(0.1) and wsd[-1] == pytest.approx(0.1)
    assert cosine[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))  # step 7: half-way
    assert linear[6] == pytest.approx(0.55)
    assert wsd[:10] == [0.5] + [1.0] * 9 and wsd[10] == pytest.approx(0.55)  # decay: the last 2 of 10 steps
    assert all(a >= b for a, b in zip(cosine[1:], cosine[2:]))


def test_wsd_decays_over_the_given_fraction():
    rates = [learning_rate(s, 1.0, 0, "wsd", steps=10, min_lr=0.0, decay_fraction=0.5) for s in range(1, 11)]
    assert rates[:5] == [1.0] * 5 and rates[5:] == pytest.approx([0.8, 0.6, 0.4, 0.2, 0.0])


def test_a_longer_wsd_run_starts_its_decay_where_the_new_target_puts_it():
    recorded = wsd_plan(100, 0, 0.2)  # decays over steps 81..100
    assert recorded == DecayPlan(decay_start=80, end=100)
    assert extend_decay(recorded, 50, 100, 0, 0.2) == recorded  # a restart: the same target, the same plan
    assert extend_decay(recorded, 50, 100, 0, 0.5) == DecayPlan(decay_start=50, end=100)  # a new fraction, in time
    assert extend_decay(recorded, 90, 100, 0, 0.5) == recorded  # too late: the decay has begun, it keeps its course
    # resumed at step 50 (stable) with 200 steps: the decay moves to the last 20% of the new target
    assert extend_decay(recorded, 50, 200, 0, 0.2) == DecayPlan(decay_start=160, end=200, level=1.0)
    # resumed at step 90, half-way down: the rate holds there, then decays from the new start
    extended = extend_decay(recorded, 90, 200, 0, 0.2)
    assert extended == DecayPlan(decay_start=160, end=200, level=0.5)
    assert [extended.shape(s) for s in (91, 160, 180, 200)] == [0.5, 0.5, 0.25, 0.0]
    # resumed at the end (fully decayed) with a start already passed: decays from the rate reached
    assert extend_decay(recorded, 100, 110, 0, 0.5) == DecayPlan(decay_start=100, end=110, level=0.0)
    assert extend_decay(None, 50, 200, 0, 0.2) == wsd_plan(200, 0, 0.2)  # nothing recorded: a fresh plan


@pytest.mark.parametrize("change, field, fix", [
    ({"lr_schedule": "step"}, "lr_schedule", "choose one of constant, cosine, linear, wsd"),
    ({"min_lr": 1.0}, "min_lr", "give at most the peak --lr"),
    ({"lr_schedule": "cosine", "warmup_steps": 6}, "warmup_steps", "a cosine schedule decays after the warm-up: give fewer than --steps 6"),
    ({"grad_clip": -1.0}, "grad_clip", r"give a finite number >= 0 \(0 turns clipping off\)"),
    ({"weight_decay": math.nan}, "weight_decay", "give a finite number >= 0"),
    ({"optimizer_impl": "apex"}, "optimizer_impl", "choose one of auto, fused, foreach, for-loop"),
    ({"eval_every": -1}, "eval_every", "give an integer >= 0"),
    ({"decay_fraction": 0.0}, "decay_fraction", r"give a fraction in \(0, 1\] .* \(--decay-fraction\)"),
])
def test_bad_optimisation_settings_name_the_field_and_the_fix(change, field, fix):
    with pytest.raises(ValueError, match=rf"WorkerConfig\.{field}=.* is invalid: {fix}"):
        WorkerConfig(preset=get_preset("tiny-gpt"), engine="mpipemoe", data_dir="d", steps=N, **change)


def test_a_bert_mask_id_outside_the_vocabulary_is_refused():
    """The masked LM writes mask_id into its inputs, which the training loop does not check on
    the device (only the data's ids, on the host): the config refuses an id the embedding lacks."""
    with pytest.raises(ValueError, match=r"WorkerConfig.mask_id=300 is invalid: the model's vocabulary has ids 0..258"):
        WorkerConfig(preset=get_preset("tiny-bert"), engine="mpipemoe", data_dir="d", mask_id=300)
    WorkerConfig(preset=get_preset("tiny-gpt"), engine="mpipemoe", data_dir="d", mask_id=300)  # gpt masks nothing


def test_adamw_kernels_auto_is_fused_on_cuda_and_foreach_elsewhere():
    assert optimizer_kernels("auto", torch.device("cuda", 0)) == {"fused": True}
    assert optimizer_kernels("auto", torch.device("cpu")) == {"foreach": True}
    assert optimizer_kernels("for-loop", torch.device("cuda", 0)) == {"foreach": False, "fused": False}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    prepare_dataset(out, max_bytes=2**17, row_len=1024, val_fraction=0.05)
    return str(out)


def _config(data_dir, **change) -> WorkerConfig:
    settings = dict(preset=get_preset("tiny-gpt"), engine="mpipemoe", data_dir=data_dir, steps=N, batch_size=2,
                    lr=3e-3, warmup_steps=2, lr_schedule="cosine", min_lr=3e-4, partitions=1, strategy="none",
                    eval_every=3)
    return WorkerConfig(**{**settings, **change})


def _steps(trainer, steps):
    return [(result["lm_loss"], result["lr"]) for result in map(trainer.step, steps)]


def test_k_steps_and_a_resume_equal_n_steps_straight_with_the_learning_rate(data_dir, tmp_path):
    from workers import checkpoint as ckpt

    cpu = torch.device("cpu")
    torch.manual_seed(0)
    straight = _steps(Trainer(_config(data_dir), 0, 1, cpu), range(1, N + 1))
    assert straight[-1][1] == pytest.approx(3e-4) and straight[1][1] == 3e-3  # min_lr at the end, after warm-up
    torch.manual_seed(0)
    first = Trainer(_config(data_dir), 0, 1, cpu)
    before = _steps(first, range(1, K + 1))
    ckpt.save(tmp_path, 0, 1, first.parallel, first.optimizer,
              {"step": K, "world_size": 1, "preset": first.config.preset_dict(), "lr_scheduler": first.schedule_state()})
    torch.manual_seed(1)  # the checkpoint's RNG state must win
    second = Trainer(_config(data_dir), 0, 1, cpu)
    second.restore_schedule(ckpt.load(tmp_path, 0, 1, second.parallel, second.optimizer))
    assert before + _steps(second, range(K + 1, N + 1)) == straight  # exactly, losses and rates
    # a checkpoint written before the scheduler state was kept: the step alone places the schedule
    third = Trainer(_config(data_dir), 0, 1, cpu)
    third.restore_schedule({"step": K})
    assert third.optimizer.param_groups[0]["lr"] == straight[K][1]


@pytest.mark.parametrize("preset", ["tiny-gpt", "tiny-bert"])
def test_the_batch_read_ahead_during_a_step_is_the_next_steps_first(data_dir, preset):
    trainer = Trainer(_config(data_dir, preset=get_preset(preset), grad_accum=2), 0, 1, torch.device("cpu"))
    trainer.step(1)
    assert trainer.prefetched is not None and trainer.prefetched[0] == (2, 0)
    ahead = trainer.prefetched[1]
    trainer.prefetched = None
    fresh = trainer._micro_batch(2, 0)
    assert all(torch.equal(a, b) for a, b in zip(ahead, fresh))
    trainer.prefetched = ((2, 0), ahead)
    assert trainer._micro_batch(2, 1) is not ahead and trainer.prefetched is None  # another micro-batch: read fresh
    trainer.prefetched = ((2, 0), ahead)
    assert trainer._micro_batch(2, 0) is ahead and trainer.prefetched is None      # taken once


def test_validation_loss_is_fixed_and_leaves_the_model_training(data_dir):
    trainer = Trainer(_config(data_dir), 0, 1, torch.device("cpu"))
    first = trainer.evaluate()
    assert trainer.model.training and first == trainer.evaluate()  # the same batches, no update
    assert first["val_ppl"] == pytest.approx(math.exp(first["val_loss"]))
    assert math.log(trainer.preset.vocab_size) - 0.5 < first["val_loss"] < math.log(trainer.preset.vocab_size) + 0.5
    assert not trainer.load.read(1)  # validation passes are not counted as load
    _steps(trainer, range(1, N + 1))
    assert trainer.evaluate()["val_loss"] < first["val_loss"]
    no_split = Trainer(_config(data_dir, eval_every=0), 0, 1, torch.device("cpu"))
    assert no_split.validation is None


def test_load_metrics_count_every_routed_pair_and_the_dropped_ones(data_dir):
    preset = get_preset("tiny-gpt")
    trainer = Trainer(_config(data_dir), 0, 1, torch.device("cpu"))
    _steps(trainer, range(1, 3))
    load = trainer.load.read(1)
    pairs = 2 * 2 * preset.seq_len * preset.top_k  # steps x sequences x tokens x choices
    for layer in range(preset.num_layers):
        tokens = [load[f"moe_load/l{layer}/tokens_e{e}"] for e in range(preset.num_experts)]
        assert sum(tokens) == pairs
        assert load[f"moe_load/l{layer}/imbalance"] == max(tokens) / (pairs / preset.num_experts)
    assert "moe_load/l0/dropped_fraction" not in load  # dropless
    assert trainer.load.read(1) == {}  # read once: the counts start afresh
    capped = dataclasses.replace(preset, capacity_factor=0.5)
    trainer = Trainer(_config(data_dir, preset=capped), 0, 1, torch.device("cpu"))
    _steps(trainer, [1])
    load = trainer.load.read(1)
    # at most ceil(0.5 * 2 * 128 / 4) = 32 pairs per expert of 256 kept: at least 1/2 dropped
    assert 0.5 <= load["moe_load/l0/dropped_fraction"] < 1
    assert load["moe_load/imbalance_max"] >= load["moe_load/l1/imbalance"]


def test_the_options_reach_the_workers_and_bad_ones_fail_before_ray(data_dir, tmp_path):
    import argparse

    from app.jobs.job import TrainJob, worker_config
    from app.commands.train import add_arguments, job_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--steps", "40", "--lr-schedule", "wsd", "--warmup-steps", "4", "--min-lr", "1e-5",
                              "--weight-decay", "0.05", "--grad-clip", "0", "--aux-loss-weight", "0.02",
                              "--optimizer-impl", "for-loop", "--eval-every", "10", "--eval-batches", "2",
                              "--log-every", "5", "--data-dir", data_dir, "--storage-path", str(tmp_path)])
    config = worker_config(job_from_args(args), use_gpu=False)
    assert (config.lr_schedule, config.warmup_steps, config.min_lr, config.weight_decay, config.grad_clip,
            config.aux_loss_weight, config.optimizer_impl, config.eval_every, config.eval_batches,
            config.log_every) == ("wsd", 4, 1e-5, 0.05, 0.0, 0.02, "for-loop", 10, 2, 5)
    with pytest.raises(ValueError, match=r"TrainJob\.min_lr=0\.1 is invalid: give at most the peak --lr 0\.001"):
        TrainJob(min_lr=0.1, storage_path=str(tmp_path))
    with pytest.raises(ValueError, match=r"TrainJob\.eval_batches=0 is invalid: give an integer >= 1"):
        TrainJob(eval_batches=0, storage_path=str(tmp_path))


def test_a_wsd_run_resumed_with_more_steps_keeps_the_rate_it_had_reached(data_dir, tmp_path):
    """4 wsd steps (decay over steps 3-4 to min_lr), then a resume to 8 steps: the rate stays at
    min_lr (it does not jump back to the peak) and the checkpoint records the decay plan."""
    from workers import checkpoint as ckpt

    cpu = torch.device("cpu")
    config = _config(data_dir, steps=4, warmup_steps=0, lr_schedule="wsd", decay_fraction=0.5, eval_every=0)
    first = Trainer(config, 0, 1, cpu)
    assert [lr for _, lr in _steps(first, range(1, 5))] == pytest.approx([3e-3, 3e-3, 1.65e-3, 3e-4])
    assert first.decay_plan is not None
    plan = dataclasses.asdict(first.decay_plan)
    ckpt.save(tmp_path, 0, 1, first.parallel, first.optimizer,
              {"step": 4, "world_size": 1, "preset": config.preset_dict(), "lr_scheduler": first.schedule_state(),
               "lr_decay_plan": plan})
    second = Trainer(config.replace(steps=8), 0, 1, cpu)
    second.restore_schedule(ckpt.load(tmp_path, 0, 1, second.parallel, second.optimizer))
    assert second.decay_plan == DecayPlan(decay_start=4, end=8, level=0.0)  # 8 steps: the decay would start at 4
    assert [lr for _, lr in _steps(second, range(5, 9))] == pytest.approx([3e-4] * 4)
