"""Tier 1: every engine in fp32, bf16 and fp16 against the float64 reference (loose tolerance)."""
import pytest
import torch

from moe_engine import MoEConfig, MPipeMoE

from tests.engine_cases import SCENARIOS, build_engine, load_params, make_problem, solve_reference

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 6e-2, torch.float16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("engine", ["fastmoe", "mpipemoe:3:S1", "mpipemoe:2:S4", "fastermoe:4"])
def test_low_precision_close_to_reference(dtype, engine):
    scenario = SCENARIOS[0]
    problem = make_problem(scenario, 1)
    solve_reference(problem, scenario.config)
    layer = build_engine(engine, scenario.config, dtype=dtype)
    load_params(layer, problem, 0)
    x = problem.x[0].to(dtype).requires_grad_(True)
    y, aux = layer(x)
    assert y.dtype == dtype and aux.dtype == dtype
    loss = (y.double() * problem.grad_y[0]).sum() + problem.aux_coef * aux.double()
    loss.backward()
    for got, want in [(y, problem.ref_y[0]), (x.grad, problem.ref_dx[0]),
                      (layer.experts.w1.grad, problem.ref_expert_grads["experts.w1"])]:
        relative = float((got.double() - want).abs().max() / want.abs().max())
        assert relative < TOLERANCE[dtype], f"relative error {relative:.3g}"


@pytest.mark.parametrize("engine", ["fastmoe", "mpipemoe:3:S1", "fastermoe:4"])
def test_autocast_runs_the_experts_in_bf16_over_float32_parameters(engine, monkeypatch):
    """Mixed precision (the trainer's): float32 parameters under autocast. The expert GEMMs
    run in bf16 (forward and backward), the parameters' gradients arrive in float32, and
    the result stays near the reference."""
    import moe_engine.experts as experts_module

    seen = []
    original = experts_module.grouped_mm
    monkeypatch.setattr(experts_module, "grouped_mm",
                        lambda x, w, seg: seen.append((x.dtype, w.dtype)) or original(x, w, seg))
    scenario = SCENARIOS[0]
    problem = make_problem(scenario, 1)
    solve_reference(problem, scenario.config)
    layer = build_engine(engine, scenario.config, dtype=torch.float32)
    load_params(layer, problem, 0)
    x = problem.x[0].float().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, aux = layer(x)
    loss = (y.double() * problem.grad_y[0]).sum() + problem.aux_coef * aux.double()
    loss.backward()
    assert set(seen) == {(torch.bfloat16, torch.bfloat16)}
    assert layer.experts.w1.grad.dtype == torch.float32 and y.dtype == torch.float32
    for got, want in [(y, problem.ref_y[0]), (layer.experts.w1.grad, problem.ref_expert_grads["experts.w1"])]:
        relative = float((got.double() - want).abs().max() / want.abs().max())
        assert relative < TOLERANCE[torch.bfloat16], f"relative error {relative:.3g}"


@pytest.mark.parametrize("strategy", ["S1", "S4"])
def test_autocast_gradients_do_not_depend_on_the_partition_count(strategy):
    """bf16 autocast over float32 parameters: the expert gradients of n = 1, 2, 4, 8, 16
    partitions agree within float32 rounding (each partition's weight gradient is summed in
    float32, the parameters' dtype; summed in bf16 they differed by ~0.5% rms at n = 16)."""
    config = MoEConfig(d_model=64, d_hidden=128, num_experts=4, top_k=2, activation="swiglu")
    x_TD = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    dy_TD = torch.randn(256, 64, generator=torch.Generator().manual_seed(2))
    grads = {}
    for n in (1, 2, 4, 8, 16):
        torch.manual_seed(0)
        layer = MPipeMoE(config, partitions=n, strategy=strategy)
        x = x_TD.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, _ = layer(x)
        (y.float() * dy_TD).sum().backward()
        grads[n] = {name: p.grad for name, p in layer.named_parameters()} | {"x": x.grad}
    for n in (2, 4, 8, 16):
        for name, grad in grads[n].items():
            want = grads[1][name]
            assert grad.dtype == torch.float32
            relative_rms = float((grad - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())
            assert relative_rms < 1e-6, f"n={n} {name}: {relative_rms:.3g} rms from n=1"
