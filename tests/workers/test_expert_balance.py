"""Auxiliary-loss-free balancing (the routers' expert bias) and the router z-loss.

Tier 1 (no process group): the bias update rule, the bias's effect on the selection only,
every engine against the reference with a bias, the z-loss against a hand computation, the
settings' validation, a state without the bias, the Mixtral export's refusal.
Tier 2 (2 gloo ranks, no Ray): training from a router skewed toward expert 0; the bias is
bitwise the same on both ranks after every step though their routing differs, the load ends
more even than the same run without it, and a checkpoint carries the bias to a resumed trainer.
"""
from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from lm.data import prepare_dataset
from lm.model import get_preset
from moe_engine import MoEConfig, build_layer
from moe_engine.reference import reference_moe
from moe_engine.router import Router, update_expert_bias, z_loss
from tests.distributed import run_on_ranks
from workers.config import WorkerConfig

# ---- tier 1 -------------------------------------------------------------------------------


def test_the_bias_moves_by_the_rate_toward_the_experts_below_the_mean_count():
    bias_E = torch.tensor([0.5, 0.0, -0.25, 0.0])
    update_expert_bias(bias_E, torch.tensor([10, 2, 6, 4]), rate=0.125)  # mean 5.5
    assert bias_E.tolist() == [0.375, 0.125, -0.375, 0.125]
    update_expert_bias(bias_E, torch.tensor([3.0, 3.0, 3.0, 3.0]), rate=0.125)  # all at the mean: unchanged
    assert bias_E.tolist() == [0.375, 0.125, -0.375, 0.125]


@pytest.mark.parametrize("rule", ["softmax-then-topk", "topk-then-softmax"])
def test_the_bias_changes_the_selection_only_never_the_gate_weights(rule):
    torch.manual_seed(0)
    config = MoEConfig(d_model=16, d_hidden=8, num_experts=4, top_k=2, router_rule=rule)
    router = Router(config)
    x_TD = torch.randn(32, 16)
    plain = router(x_TD)
    with torch.no_grad():
        router.expert_bias.fill_(0.3)  # the same shift for every expert: the same choice
    shifted = router(x_TD)
    assert torch.equal(shifted.expert_ids_TK, plain.expert_ids_TK)
    assert torch.equal(shifted.weights_TK, plain.weights_TK)
    with torch.no_grad():
        router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 100.0]))  # expert 3 always chosen
    forced = router(x_TD)
    assert (forced.expert_ids_TK == 3).any(dim=1).all() and not (plain.expert_ids_TK == 3).any(dim=1).all()
    logits_TE = (x_TD @ router.weight.t()).detach()
    chosen_TK = logits_TE.gather(1, forced.expert_ids_TK)  # gates from the unbiased scores of the choice
    if rule == "topk-then-softmax":
        expected_TK = torch.softmax(chosen_TK, dim=-1)
    else:
        probs_TK = torch.softmax(logits_TE, dim=-1).gather(1, forced.expert_ids_TK)
        expected_TK = probs_TK / probs_TK.sum(-1, keepdim=True)
    torch.testing.assert_close(forced.weights_TK.detach(), expected_TK)
    # the balance loss and the z-loss read the scores, not the bias
    torch.testing.assert_close(forced.z_loss, plain.z_loss)


@pytest.mark.parametrize("engine", ["mpipemoe", "fastmoe", "fastermoe"])
def test_every_engine_routes_with_the_bias_as_the_reference(engine):
    torch.manual_seed(1)
    config = MoEConfig(d_model=12, d_hidden=16, num_experts=4, top_k=2)
    layer = build_layer(engine, config, None, dtype=torch.float64)
    x_TD = torch.randn(24, 12, dtype=torch.float64)
    bias_E = torch.tensor([0.0, 0.2, -0.1, 0.35])
    with torch.no_grad():
        layer.router.expert_bias.copy_(bias_E)
    y_TD, aux = layer(x_TD)
    e = layer.experts
    expected_TD, expected_aux = reference_moe(x_TD, layer.router.weight.detach(), e.w1.detach(), e.b1.detach(),
                                              e.w2.detach(), e.b2.detach(), None, config, expert_bias=bias_E)
    unbiased_TD, _ = reference_moe(x_TD, layer.router.weight.detach(), e.w1.detach(), e.b1.detach(),
                                   e.w2.detach(), e.b2.detach(), None, config)
    torch.testing.assert_close(y_TD.detach(), expected_TD)
    torch.testing.assert_close(aux.detach(), expected_aux)
    assert not torch.allclose(expected_TD, unbiased_TD)  # the bias did change some choices


def test_the_z_loss_is_the_mean_squared_logsumexp_of_the_logits():
    logits = [[1.0, 2.0, 0.0], [0.5, -1.0, 3.0]]
    by_hand = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits) / len(logits)
    assert z_loss(torch.tensor(logits, dtype=torch.float64)).item() == pytest.approx(by_hand, rel=1e-12)
    assert z_loss(torch.zeros(0, 3)).item() == 0.0
    config = MoEConfig(d_model=2, d_hidden=4, num_experts=3, top_k=1)
    router = Router(config)
    with torch.no_grad():
        router.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))
    x_TD = torch.tensor([[1.0, 2.0], [0.5, -1.0]])  # logits [1, 2, 3] and [0.5, -1, -0.5]
    rows = [[1.0, 2.0, 3.0], [0.5, -1.0, -0.5]]
    expected = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in rows) / 2
    assert router(x_TD).z_loss.item() == pytest.approx(expected, rel=1e-6)
    # only a router whose z-loss trains it keeps the logits for its gradient (else logged only)
    assert not router(x_TD).z_loss.requires_grad
    router.z_loss_grad = True
    trained = router(x_TD).z_loss
    assert trained.requires_grad and trained.item() == pytest.approx(expected, rel=1e-6)


def _config(data_dir: str, **change) -> WorkerConfig:
    return WorkerConfig(**{"preset": dataclasses.asdict(get_preset("tiny-gpt")), "engine": "mpipemoe",
                           "partitions": 1, "strategy": "none", "seed": 5, "lr": 1e-3, "steps": 20,
                           "batch_size": 2, "seq_len": 32, "data_dir": data_dir, "dtype": "float32",
                           "aux_loss_weight": 0.0, "collective_timeout_s": 60, **change})


@pytest.mark.parametrize("field, value, named", [
    ("expert_bias_rate", -0.001, "--expert-bias-rate"),
    ("expert_bias_rate", 1.5, r"in \[0, 1\)"),
    ("expert_bias_rate", float("nan"), "--expert-bias-rate"),
    ("expert_bias_rate", True, "--expert-bias-rate"),
    ("router_z_loss", -1.0, "--router-z-loss"),
    ("router_z_loss", float("inf"), "--router-z-loss"),
    ("router_z_loss", "1e-3", "--router-z-loss"),
])
def test_bad_balancing_settings_are_refused_naming_the_field_and_the_fix(tmp_path, field, value, named):
    from app.jobs.job import TrainJob
    from app.jobs.train_config import read_train_config

    with pytest.raises(ValueError, match=rf"WorkerConfig\.{field}=.*{named}"):
        _config("data", **{field: value})
    with pytest.raises(ValueError, match=rf"TrainJob\.{field}=.*{named}"):
        TrainJob(data_dir=str(tmp_path), **{field: value})
    toml = tmp_path / "run.toml"
    written = "true" if value is True else f'"{value}"' if isinstance(value, str) else str(value)  # nan, inf: TOML's
    toml.write_text(f"{field.replace('_', '-')} = {written}\n")
    with pytest.raises(ValueError, match=rf"TrainJob\.{field}="):
        TrainJob(data_dir=str(tmp_path), **read_train_config(toml))


def test_the_options_reach_the_workers_from_flags_and_toml(tmp_path):
    import argparse

    from app.commands.train import add_arguments, job_from_args
    from app.jobs.job import TrainJob, worker_config

    prepare_dataset(tmp_path / "data", max_bytes=2**15, row_len=1024)
    (tmp_path / "run.toml").write_text("expert-bias-rate = 0.002\nrouter_z_loss = 0.001\n")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--config", str(tmp_path / "run.toml"), "--router-z-loss", "0.01",
                              "--data-dir", str(tmp_path / "data"), "--storage-path", str(tmp_path / "rr")])
    job = job_from_args(args)
    assert (job.expert_bias_rate, job.router_z_loss) == (0.002, 0.01)  # the flag wins over the file
    config = worker_config(job, use_gpu=False)
    assert (config.expert_bias_rate, config.router_z_loss) == (0.002, 0.01)
    assert (TrainJob.expert_bias_rate, TrainJob.router_z_loss) == (0.0, 0.0)  # off by default


def test_a_state_without_the_bias_loads_as_a_zero_bias_and_a_checkpoint_without_it_is_read(tmp_path):
    import torch.distributed.checkpoint as dcp

    from workers.checkpoint import drop_absent_expert_bias

    config = MoEConfig(d_model=8, d_hidden=8, num_experts=4, top_k=2)
    source, target = Router(config), Router(config)
    with torch.no_grad():
        target.expert_bias.fill_(0.5)
    target.load_state_dict({"weight": source.weight.detach()}, strict=True)  # (a model saved before the bias)
    assert torch.equal(target.expert_bias, torch.zeros(4)) and torch.equal(target.weight, source.weight)
    dcp.save({"model": {"blocks.0.moe.router.weight": source.weight.detach()}},
             storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    model_sd = {"blocks.0.moe.router.weight": torch.zeros(4, 8), "blocks.0.moe.router.expert_bias": torch.ones(4)}
    drop_absent_expert_bias(model_sd, tmp_path)
    assert list(model_sd) == ["blocks.0.moe.router.weight"]


def test_a_mixtral_export_of_a_biased_model_is_refused_and_says_what_would_happen():
    from lm.model import MoETransformer
    from workers.hf_mixtral import to_mixtral

    preset = get_preset("tiny-mixtral")
    model = MoETransformer(preset, partitions=1, strategy="none")
    assert "model.layers.0.block_sparse_moe.gate.weight" in to_mixtral(model.state_dict(), preset)  # zero bias
    with torch.no_grad():
        model.blocks[1].moe.router.expert_bias[2] = 0.01
    with pytest.raises(ValueError, match=r"blocks\.1\.moe\.router\.expert_bias.*Mixtral has no place for.*unbiased "
                                         r"scores.*not exported.*--expert-bias-rate 0"):
        to_mixtral(model.state_dict(), preset)


# ---- tier 2 -------------------------------------------------------------------------------

STEPS, WINDOW = 30, 10  # the load compared over the last WINDOW steps
RATE = 0.01


def _skew_toward_expert_0(model: torch.nn.Module) -> None:
    """Every MoE layer's input gets a shared direction u (the norm's bias) that router row 0
    reads strongly: expert 0's probability is about 0.47 against 0.18 for the others, so it is
    in nearly every token's top 2 (max/mean load near 2.0 of the possible 2.0)."""
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for block in model.blocks:
            u_D = torch.randn(block.ln2.bias.shape[0], generator=generator)
            u_D /= u_D.norm()
            block.ln2.bias.copy_(u_D)
            block.moe.router.weight[0] += u_D


def _train(rank: int, world_size: int, data_dir: str, out: str) -> dict:
    import torch.distributed as dist

    from workers import checkpoint as ckpt
    from workers.loop import Trainer

    torch.set_num_threads(1)
    results: dict = {}
    for label, rate in (("plain", 0.0), ("balanced", RATE)):
        trainer = Trainer(_config(data_dir, expert_bias_rate=rate, steps=STEPS, batch_size=8), rank, world_size,
                          torch.device("cpu"))
        _skew_toward_expert_0(trainer.model)
        biases, local_counts, steps = [], [], []
        for step in range(1, STEPS + 1):
            if step == STEPS - WINDOW + 1:
                trainer.load.read(world_size)  # (collective) the load below: the last WINDOW steps only
            steps.append(trainer.step(step))
            biases.append(np.stack([layer.router.expert_bias.numpy().copy() for layer in trainer.moe_layers]))
            local_counts.append(trainer.balance.counts_LE.numpy().copy())  # this rank's own tokens
        results[label] = {"imbalance": trainer.load.read(world_size)["moe_load/imbalance_max"],
                          "biases": biases, "local_counts": local_counts,
                          "step_imbalance": [s.get("moe_load/step_imbalance_max") for s in steps],
                          "z_loss": [s["z_loss"] for s in steps]}
        if label == "balanced":  # a checkpoint carries the bias to a resumed trainer
            own = Path(out) / f"rank{rank}"
            own.mkdir(parents=True)
            meta = {"step": STEPS, "world_size": world_size, "preset": trainer.config.preset_dict()}
            ckpt.save(own, rank, world_size, trainer.parallel, trainer.optimizer, meta)
            dist.barrier()
            merged = Path(out) / "merged"
            if rank == 0:
                for r in range(world_size):
                    shutil.copytree(Path(out) / f"rank{r}", merged, dirs_exist_ok=True)
            dist.barrier()
            resumed = Trainer(_config(data_dir, expert_bias_rate=RATE, steps=STEPS + 1), rank, world_size,
                              torch.device("cpu"))
            ckpt.load(merged, rank, world_size, resumed.parallel, resumed.optimizer, resumed.config.preset_dict())
            results["resumed_bias"] = np.stack([layer.router.expert_bias.numpy().copy()
                                                for layer in resumed.moe_layers])
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("balance")
    prepare_dataset(root / "data", max_bytes=2**17, row_len=1024)
    return run_on_ranks(2, _train, str(root / "data"), str(root / "out"), timeout=400, collective_timeout_s=60)


@pytest.mark.gloo
def test_the_bias_is_bitwise_the_same_on_every_rank_though_their_routing_differs(runs):
    first, second = (r["balanced"] for r in runs)
    assert any(not np.array_equal(a, b) for a, b in zip(first["local_counts"], second["local_counts"]))
    for a, b in zip(first["biases"], second["biases"]):
        assert a.dtype == np.float32 and a.tobytes() == b.tobytes()
    assert np.abs(first["biases"][-1]).max() > 0  # it moved
    assert (first["biases"][-1][:, 0] < 0).all()  # away from the skewed expert, in every layer
    assert first["step_imbalance"] == second["step_imbalance"] and None not in first["step_imbalance"]
    assert all(b == 0 for r in runs for bias in r["plain"]["biases"] for b in bias.flat)  # off: never moved


@pytest.mark.gloo
def test_the_bias_makes_the_load_of_a_skewed_router_more_even(runs):
    plain, balanced = runs[0]["plain"]["imbalance"], runs[0]["balanced"]["imbalance"]
    assert plain > 1.8  # the skew: expert 0 in nearly every token's top 2 (2.0 at most)
    assert balanced < plain - 0.4, (plain, balanced)  # (one rank, the same settings: 2.0 against 1.32)
    assert runs[0]["plain"]["imbalance"] == runs[1]["plain"]["imbalance"]  # (all ranks' tokens)


@pytest.mark.gloo
def test_a_checkpoint_carries_the_bias_to_the_resumed_trainer(runs):
    for rank_runs in runs:
        assert rank_runs["resumed_bias"].tobytes() == rank_runs["balanced"]["biases"][-1].tobytes()
        assert all(math.isfinite(z) and z > 0 for z in rank_runs["balanced"]["z_loss"])
