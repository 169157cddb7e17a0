"""The fused Triton kernels (moe_engine.kernels) against the PyTorch formulas they replace,
on CUDA (marker `gpu`), and the PyTorch path they fall back to on CPU. The engine-level
comparisons with the brute-force reference (tests/moe_engine/test_gpu.py) run them too."""
import pytest
import torch
import torch.nn.functional as F

from moe_engine import kernels
from moe_engine.dispatcher import _WeightedCombine


def test_off_cuda_the_gelu_backward_is_pytorchs_and_makes_the_activation():
    A, dh = torch.randn(64, 96), torch.randn(64, 96)
    expected_dA = torch.ops.aten.gelu_backward(dh, A)
    dA, h = kernels.gelu_backward_and_activation(dh, A)
    assert dA.data_ptr() == dh.data_ptr()  # in place
    assert torch.equal(dA, expected_dA) and torch.equal(h, F.gelu(A))
    assert not kernels.fused_kernels_run_on(A)


def _gelu_backward_equals_pytorchs(device, dtype, shape):
    torch.manual_seed(0)
    A = (3 * torch.randn(shape, device=device)).to(dtype)
    dh = torch.randn(shape, device=device).to(dtype)
    expected_dA, expected_h = torch.ops.aten.gelu_backward(dh, A), F.gelu(A)
    dA, h = kernels.gelu_backward_and_activation(dh.clone(), A)
    # float32 arithmetic in both, rounded once; Triton's exp may differ from CUDA's expf in
    # the last float32 bit, which bf16 rounding hides almost always
    ulp = {torch.bfloat16: 2 ** -7, torch.float32: 2 ** -22, torch.float64: 0.0}[dtype]  # float64: PyTorch's
    atol = 0.0 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(h, expected_h, rtol=ulp, atol=atol)
    torch.testing.assert_close(dA, expected_dA, rtol=ulp, atol=atol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1000, 4096), (3, 5), (0, 8)])
def test_the_fused_gelu_backward_equals_pytorchs(dtype, shape):
    assert kernels.fused_kernels_run_on(torch.empty(0, device="cuda")), "Triton did not import"
    _gelu_backward_equals_pytorchs(torch.device("cuda"), dtype, shape)


def test_the_fused_gelu_backward_equals_pytorchs_cpu_twin():
    _gelu_backward_equals_pytorchs(torch.device("cpu"), torch.bfloat16, (30, 40))


def _combine_case(tokens: int, top_k: int, D: int, rows_dtype, weights_dtype, dropped: int):
    """Rows in expert order for `tokens` x `top_k` pairs, `dropped` of them without a row."""
    generator = torch.Generator().manual_seed(tokens + D)
    P = tokens * top_k
    kept_pairs = torch.randperm(P, generator=generator)[:P - dropped].sort().values
    order = torch.randperm(P - dropped, generator=generator)
    pair_index_R = kept_pairs[order]                          # the pair each row belongs to
    row_of_pair_P = torch.zeros(P, dtype=torch.int64)         # a dropped pair points at row 0
    row_of_pair_P[pair_index_R] = torch.arange(P - dropped)
    keep_P = torch.zeros(P)
    keep_P[pair_index_R] = 1
    rows_RD = torch.randn(P - dropped, D, generator=generator).to(rows_dtype)
    weights_TK = (torch.rand(tokens, top_k, generator=generator) * keep_P.view(tokens, top_k)).to(weights_dtype)
    return rows_RD, weights_TK, row_of_pair_P, pair_index_R, keep_P.view(tokens, top_k)


def _combined(rows_RD, weights_TK, row_of_pair_P, pair_index_R, dy_TD):
    rows_RD = rows_RD.detach().requires_grad_()
    weights_TK = weights_TK.detach().requires_grad_()
    y_TD = _WeightedCombine.apply(rows_RD, weights_TK, row_of_pair_P, pair_index_R, *weights_TK.shape,
                                  weights_TK.dtype)
    y_TD.backward(dy_TD)
    return y_TD.detach(), rows_RD.grad, weights_TK.grad


def _combine_equals_the_pytorch_one(device, rows_dtype, weights_dtype, tokens, top_k, D, dropped):
    """The combine on ``device`` (on CUDA the Triton kernels) against the PyTorch one on CPU."""
    rows_RD, weights_TK, row_of_pair_P, pair_index_R, keep_TK = _combine_case(tokens, top_k, D, rows_dtype,
                                                                              weights_dtype, dropped)
    dy_TD = torch.randn(tokens, D, generator=torch.Generator().manual_seed(1)).to(weights_dtype)
    on_cpu = _combined(rows_RD, weights_TK, row_of_pair_P, pair_index_R, dy_TD)
    on_device = _combined(*(t.to(device) for t in (rows_RD, weights_TK, row_of_pair_P, pair_index_R, dy_TD)))
    # the CPU path rounds each product to the output's dtype, the kernel sums in float32 and
    # rounds once; the weights' gradient is a D-long float32 dot product in both
    low, wide = weights_dtype == torch.bfloat16, weights_dtype == torch.float64
    if wide:  # float64 keeps PyTorch's kernels: the same numbers but for the order of the sums
        assert not kernels.fused_kernels_run_on(rows_RD.to(device))
    torch.testing.assert_close(on_device[0].cpu(), on_cpu[0], rtol=2 ** -7 if low else 1e-12 if wide else 1e-5,
                               atol=2 ** -5 if low else 1e-12 if wide else 1e-5)
    assert torch.equal(on_device[1].cpu(), on_cpu[1])  # one product, one rounding in both
    # a pair without a row has weight 0 (the caller multiplies by the keep mask): its
    # weight's gradient is not used, and the CPU path's is a product with another row
    dot_atol = (3 * 2 ** -9 if low else 1e-5) * D ** 0.5  # the CPU path rounds each bf16 product
    torch.testing.assert_close(on_device[2].cpu() * keep_TK, on_cpu[2] * keep_TK, rtol=2 ** -7 if low else 1e-5,
                               atol=dot_atol)
    if kernels.fused_kernels_run_on(on_device[0], on_device[2]):  # the kernel gives such a pair 0
        assert torch.count_nonzero(on_device[2].cpu() * (1 - keep_TK)) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("rows_dtype,weights_dtype", [(torch.bfloat16, torch.bfloat16),
                                                      (torch.bfloat16, torch.float32),
                                                      (torch.float32, torch.float32),
                                                      (torch.float64, torch.float64)])
@pytest.mark.parametrize("tokens,top_k,D,dropped", [(4096, 2, 2048, 0), (333, 1, 200, 0), (500, 4, 1030, 77)])
def test_the_fused_combine_equals_the_pytorch_one(rows_dtype, weights_dtype, tokens, top_k, D, dropped):
    _combine_equals_the_pytorch_one(torch.device("cuda"), rows_dtype, weights_dtype, tokens, top_k, D, dropped)


def test_the_fused_combine_equals_the_pytorch_one_cpu_twin():
    _combine_equals_the_pytorch_one(torch.device("cpu"), torch.bfloat16, torch.float32, 50, 2, 24, 7)


def _kernels_syntax():
    import ast
    import inspect
    return ast.parse(inspect.getsource(kernels))


def test_every_masked_triton_load_reads_zero_in_the_masked_lanes():
    """A masked `tl.load` without `other=` leaves the masked lanes undefined, and the
    combine's backward sums a whole block (`tl.sum`): every masked load says `other=0.0`."""
    import ast
    loads = [node for node in ast.walk(_kernels_syntax()) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr == "load"]
    masked = [node for node in loads if any(k.arg == "mask" for k in node.keywords)]
    assert len(masked) == 5
    for node in masked:
        other = [k.value for k in node.keywords if k.arg == "other"]
        assert other and isinstance(other[0], ast.Constant) and other[0].value == 0.0, ast.unparse(node)


def test_every_triton_launch_enters_its_tensors_device_on_cuda_cpu_twin():
    """CPU twin of the GPU test below: each kernel launch (`kernel[grid](...)`) sits inside
    `with on_device_of(tensor)`, so it runs on the tensors' device, not the current one."""
    import ast
    tree = _kernels_syntax()
    launches, guarded = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
            launches.append(node)
        if isinstance(node, ast.With) and any(isinstance(item.context_expr, ast.Call)
                                              and getattr(item.context_expr.func, "id", None) == "on_device_of"
                                              for item in node.items):
            guarded += [n for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript)]
    assert len(launches) == 3 and all(launch in guarded for launch in launches)


@pytest.mark.gpu
def test_every_triton_launch_enters_its_tensors_device_on_cuda(monkeypatch):
    """The three kernels, each launched on cuda tensors, enter those tensors' device. (One
    GPU cannot hold tensors on a device that is not current; with two, the next test runs
    the kernels on cuda:1 while cuda:0 is current.)"""
    entered = []
    original = torch.cuda.device

    class Recording(original):  # type: ignore[valid-type]
        def __init__(self, device):
            entered.append(torch.device(device))
            super().__init__(device)

    monkeypatch.setattr(torch.cuda, "device", Recording)
    device = torch.device("cuda", torch.cuda.current_device())
    rows_RD, weights_TK, row_of_pair_P, pair_index_R, _ = _combine_case(64, 2, 40, torch.bfloat16, torch.float32, 3)
    _combined(*(t.to(device) for t in (rows_RD, weights_TK, row_of_pair_P, pair_index_R,
                                       torch.randn(64, 40, dtype=torch.float32))))
    kernels.gelu_backward_and_activation(torch.randn(8, 8, device=device), torch.randn(8, 8, device=device))
    assert len(entered) >= 3 and set(entered) == {device}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_the_fused_kernels_run_on_a_device_that_is_not_current():
    with torch.cuda.device(0):
        _combine_equals_the_pytorch_one(torch.device("cuda", 1), torch.bfloat16, torch.float32, 333, 2, 200, 7)
        _gelu_backward_equals_pytorchs(torch.device("cuda", 1), torch.bfloat16, (300, 70))


def test_the_fused_kernels_run_on_a_device_that_is_not_current_cpu_twin():
    """The two-GPU test's comparisons, on CPU (where the PyTorch formulas run)."""
    _combine_equals_the_pytorch_one(torch.device("cpu"), torch.bfloat16, torch.float32, 333, 2, 200, 7)
    _gelu_backward_equals_pytorchs(torch.device("cpu"), torch.bfloat16, (300, 70))
