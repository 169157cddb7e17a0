"""``mpipemoe train --activation-checkpointing`` (tier 1: no process group, no Ray): the option
and its config key, the refusals before Ray starts, the schedule it leaves, the memory it
prices, and what each block keeps for backward. The gloo tier (the losses equal the plain
run's) is tests/workers/test_training_parallel.py."""
from __future__ import annotations

import argparse

import pytest
import torch

from app.commands.train import add_arguments
from lm.model import (MoETransformer, estimate_worker_bytes, get_preset, init_parameters, leanest_moe_memory,
                      lm_loss, moe_layers_kept)
from tests.train_cli import train_job
from workers.config import WorkerConfig
from workers.schedules import choose_schedule


def test_the_flag_and_the_config_key_set_it_and_none_is_the_default(tmp_path):
    assert train_job(tmp_path).activation_checkpointing == "none"
    assert train_job(tmp_path, "--activation-checkpointing", "full").activation_checkpointing == "full"
    assert train_job(tmp_path, config='activation-checkpointing = "selective"\n').activation_checkpointing == "selective"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--activation-checkpointing", "all"])


def test_a_bad_value_is_refused_naming_the_field_and_the_choices(tmp_path):
    with pytest.raises(ValueError, match=r"TrainJob.activation_checkpointing='all' is invalid: choose one of "
                                         r"none, selective, full"):
        train_job(tmp_path, config='activation-checkpointing = "all"\n')
    with pytest.raises(ValueError, match=r"WorkerConfig.activation_checkpointing='yes'"):
        WorkerConfig(preset=get_preset("tiny-gpt"), engine="mpipemoe", data_dir="d", activation_checkpointing="yes")
    with pytest.raises(ValueError, match=r"activation_checkpointing='on' is invalid"):
        MoETransformer(get_preset("tiny-gpt"), activation_checkpointing="on")


def test_full_with_the_overlapped_schedule_on_several_workers_is_refused_before_ray(tmp_path):
    flags = ("--activation-checkpointing", "full", "--micro-batch-schedule", "overlapped", "--grad-accum", "2")
    with pytest.raises(ValueError, match=r"TrainJob.micro_batch_schedule='overlapped' is invalid: full activation "
                                         r"checkpointing recomputes the MoE layers .* --micro-batch-schedule "
                                         r"sequential \(or auto\)"):
        train_job(tmp_path, *flags, "--num-workers", "2")
    # one worker per expert group (the MoE layers send nothing), or selective (the MoE layers
    # are not recomputed): allowed
    assert train_job(tmp_path, *flags, "--num-workers", "2", "--expert-parallel", "1").activation_checkpointing == "full"
    assert train_job(tmp_path, *flags[2:], "--activation-checkpointing", "selective").micro_batch_schedule == "overlapped"


def test_auto_schedule_takes_sequential_under_full_checkpointing_with_several_ranks():
    schedule, why = choose_schedule("auto", 2, world_size=2, activation_checkpointing="full")
    assert schedule == "sequential" and why.startswith("full activation checkpointing recomputes the MoE layers")
    assert choose_schedule("auto", 2, world_size=1, activation_checkpointing="full")[0] == "overlapped"
    assert choose_schedule("auto", 2, world_size=2, activation_checkpointing="selective")[0] == "overlapped"
    with pytest.raises(ValueError, match="use the sequential micro-batch schedule"):
        choose_schedule("overlapped", 2, world_size=2, activation_checkpointing="full")


def test_the_moe_memory_budget_counts_one_layer_under_full_checkpointing(tmp_path):
    preset = get_preset("gpt-s")
    plain = leanest_moe_memory(preset, 8 * 1024, 2, torch.bfloat16)[0]
    full = leanest_moe_memory(preset, 8 * 1024, 2, torch.bfloat16, activation_checkpointing="full")[0]
    assert full < plain
    assert leanest_moe_memory(preset, 8 * 1024, 2, torch.bfloat16, activation_checkpointing="selective")[0] == plain
    assert (moe_layers_kept(preset), moe_layers_kept(preset, "full")) == (24, 1)
    gib = round((full + plain) / 2 / 2**30, 3)  # between the two: too small for every layer's activations
    flags = ("--preset", "gpt-s", "--batch-size", "8", "--moe-memory-gib", str(gib), "--no-gpu")
    with pytest.raises(ValueError, match=r"or --activation-checkpointing full"):
        train_job(tmp_path, *flags)
    assert train_job(tmp_path, *flags, "--activation-checkpointing", "full").moe_memory_gib == gib
    model = MoETransformer(get_preset("tiny-gpt"), memory_budget=2**30, activation_checkpointing="full")
    assert model.blocks[0].moe.memory_budget.layers == 1


def test_the_worker_estimate_counts_what_checkpointed_blocks_keep():
    preset = get_preset("gpt-s")
    none, selective, full = (estimate_worker_bytes(preset, 8, 2, 2, 0, mode)["activations"]
                             for mode in ("none", "selective", "full"))
    assert full < selective < none


def _saved_bytes(model, tokens_BS) -> int:
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        logits, aux = model(tokens_BS[:, :-1])
    lm_loss(logits, tokens_BS[:, 1:]).backward()
    return sum(saved)


def test_checkpointed_blocks_keep_less_for_backward_and_give_the_same_gradients():
    """What autograd keeps between forward and backward falls from none to selective to full
    (the recomputation's own tensors are not counted: they live only inside backward), and
    the gradients are the plain ones."""
    tokens_BS = torch.randint(0, 259, (2, 33), generator=torch.Generator().manual_seed(0))
    kept, grads = {}, {}
    for mode in ("none", "selective", "full"):
        model = MoETransformer(get_preset("tiny-gpt"), partitions=2, strategy="S1", activation_checkpointing=mode)
        init_parameters(model, 0)
        kept[mode] = _saved_bytes(model, tokens_BS)
        grads[mode] = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert kept["full"] < kept["selective"] < kept["none"]
    for mode in ("selective", "full"):
        torch.testing.assert_close(grads[mode], grads["none"], rtol=0, atol=0)
