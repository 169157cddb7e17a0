"""Tier 1: bad configuration and bad input fail early with a message naming the field and the fix."""
import pytest
import torch

from moe_engine import FastMoE, FasterMoE, MoEConfig, MPipeMoE
from tests.distributed import run_on_ranks


@pytest.mark.parametrize("kwargs, field", [
    (dict(d_model=0, d_hidden=8, num_experts=4), "d_model"),
    (dict(d_model=8, d_hidden=-1, num_experts=4), "d_hidden"),
    (dict(d_model=8, d_hidden=8, num_experts=0), "num_experts"),
    (dict(d_model=8, d_hidden=8, num_experts=4, top_k=0), "top_k"),
    (dict(d_model=8, d_hidden=8, num_experts=4, top_k=5), "top_k"),
    (dict(d_model=8, d_hidden=8, num_experts=4, capacity_factor=0), "capacity_factor"),
    (dict(d_model=8, d_hidden=8, num_experts=4, capacity_factor=-1.5), "capacity_factor"),
    (dict(d_model=8, d_hidden=8, num_experts=4, activation="tanh"), "activation"),
    (dict(d_model=8.5, d_hidden=8, num_experts=4), "d_model"),
])
def test_bad_config_names_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"MoEConfig\.{field}=.*invalid: "):
        MoEConfig(**kwargs)


def test_bad_layer_arguments():
    config = MoEConfig(8, 16, 4)
    with pytest.raises(ValueError, match="partitions=0 is invalid"):
        MPipeMoE(config, partitions=0)
    with pytest.raises(ValueError, match="strategy='S5' is invalid.*S1"):
        MPipeMoE(config, strategy="S5")
    with pytest.raises(ValueError, match="group_size=0 is invalid"):
        FasterMoE(config, group_size=0)
    with pytest.raises(TypeError, match="MoEConfig"):
        FastMoE({"d_model": 8})


@pytest.mark.parametrize("engine", [FastMoE, MPipeMoE, FasterMoE])
def test_bad_input(engine):
    layer = engine(MoEConfig(8, 16, 4))
    with pytest.raises(ValueError, match=r"d_model=8"):
        layer(torch.randn(5, 7))
    with pytest.raises(ValueError, match=r"expected \(tokens, d_model\)"):
        layer(torch.randn(8))
    with pytest.raises(TypeError, match="floating-point"):
        layer(torch.ones(5, 8, dtype=torch.long))
    with pytest.raises(TypeError, match=r"layer.to\(torch.float64\)"):
        layer(torch.randn(5, 8, dtype=torch.float64))
    # One rank: the layer reads nothing back from the device, so NaN/Inf flows to the
    # output as in any PyTorch layer (the training loop's loss check stops it). With
    # several ranks every rank raises together (test_nan_on_one_rank_fails_on_every_rank).
    bad = torch.randn(5, 8)
    bad[2, 3] = float("nan")
    y, _ = layer(bad)
    assert torch.isnan(y[2]).all() and torch.isfinite(y[[0, 1, 3, 4]]).all()


@pytest.mark.parametrize("engine", [FastMoE, MPipeMoE, FasterMoE])
def test_empty_batch_returns_empty_output(engine):
    layer = engine(MoEConfig(8, 16, 4))
    x = torch.randn(0, 8, requires_grad=True)
    y, aux = layer(x)
    assert y.shape == (0, 8)
    (y.sum() + aux).backward()
    assert x.grad.shape == (0, 8)
    assert float(aux.detach()) == 0.0


def _experts_not_divisible(rank, world_size):
    with pytest.raises(ValueError, match=r"MoEConfig\.num_experts=3 .*multiple of the expert-parallel world size 2"):
        FastMoE(MoEConfig(8, 16, 3, top_k=1))
    return True


def _nan_on_one_rank(rank, world_size):
    """Rank 1 gets NaN; both ranks raise (none hangs in an All-to-All)."""
    layer = MPipeMoE(MoEConfig(8, 16, 4), partitions=2, strategy="S1")
    x = torch.randn(6, 8)
    if rank == 1:
        x[0, 0] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf in (this|another) rank's"):
        layer(x)
    return True


@pytest.mark.gloo
def test_experts_not_divisible_by_world_size():
    assert run_on_ranks(2, _experts_not_divisible) == [True, True]


@pytest.mark.gloo
def test_nan_on_one_rank_fails_on_every_rank():
    assert run_on_ranks(2, _nan_on_one_rank) == [True, True]
