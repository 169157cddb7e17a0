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


def test_gemm1_adds_the_bias_inside_its_product_under_mixed_precision(monkeypatch):
    """A bf16 `cast` of float32 experts holds w1 and b1 in one tensor (its w1 is a view of
    it: no second copy), and GEMM1 takes the bias as a row of it against a column of ones
    in x: one product, no pass over A afterwards; A is x @ w1 + b1 within bf16 rounding."""
    import moe_engine.experts as experts_module
    from moe_engine.experts import BIAS_COLUMNS, Experts, ExpertSegments

    config = MoEConfig(d_model=64, d_hidden=128, num_experts=4, top_k=2)
    experts = Experts(config, 4)
    with torch.no_grad():
        experts.b1.normal_()
    view = experts.cast(torch.bfloat16)
    assert view.w1_with_bias.shape == (4, 64 + BIAS_COLUMNS, 128)
    assert view.w1.data_ptr() == view.w1_with_bias.data_ptr() and view.w1.shape == experts.w1.shape
    seg = ExpertSegments.from_counts([5, 0, 7, 4], "cpu")
    x = torch.randn(16, 64).bfloat16()
    widths, bias_adds = [], []
    original_mm, original_add = experts_module.grouped_mm, experts_module._add_bias
    monkeypatch.setattr(experts_module, "grouped_mm", lambda a, w, s: widths.append(a.shape[1]) or original_mm(a, w, s))
    monkeypatch.setattr(experts_module, "_add_bias", lambda y, b, s: bias_adds.append(b) or original_add(y, b, s))
    (A,) = view.project_in(x, seg)
    assert widths == [64 + BIAS_COLUMNS] and bias_adds == []
    want = torch.cat([x.double()[rows] @ experts.w1[l].double() + experts.b1[l].double()
                      for l, rows in enumerate([slice(0, 5), slice(5, 5), slice(5, 12), slice(12, 16)])])
    assert float((A.double() - want).abs().max() / want.abs().max()) < 1e-2
    # float32 experts (no cast) add the bias after the product, as before
    widths.clear()
    experts.project_in(x.float(), seg)
    assert widths == [64] and len(bias_adds) == 1


def _wide_weight_grads_equal_float64(device):
    """Expert weight gradients summed in float32 from bf16 rows (mixed precision's
    `_wide_weight_grad`; on CUDA without a widening grouped kernel, one product per expert
    written into its slice), an empty expert included, against float64 products."""
    from moe_engine.experts import ExpertSegments, _wide_weight_grad

    counts = [40, 0, 17, 64]
    generator = torch.Generator().manual_seed(0)
    x_NI = torch.randn(sum(counts), 32, generator=generator).to(device, torch.bfloat16)
    dy_NO = torch.randn(sum(counts), 48, generator=generator).to(device, torch.bfloat16)
    dw_LIO = _wide_weight_grad(x_NI, dy_NO, ExpertSegments.from_counts(counts, device), torch.float32)
    assert dw_LIO.dtype == torch.float32 and dw_LIO.shape == (4, 32, 48)
    start = 0
    for l, count in enumerate(counts):
        rows = slice(start, start + count)
        want = x_NI[rows].double().t() @ dy_NO[rows].double()  # bf16 products are exact in float32
        torch.testing.assert_close(dw_LIO[l].double(), want, rtol=1e-5, atol=1e-5)
        start += count


@pytest.mark.gpu
def test_wide_weight_grads_equal_float64_products():
    _wide_weight_grads_equal_float64(torch.device("cuda"))


def test_wide_weight_grads_equal_float64_products_cpu_twin():
    _wide_weight_grads_equal_float64(torch.device("cpu"))
