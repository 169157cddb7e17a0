"""Tier 1: the experts' hand-written backward pieces give autograd's values, bit for bit
against the plain formulas, in the memory the model (moe_engine/memory.py) prices."""
import pytest
import torch
import torch.nn.functional as F

from moe_engine.experts import swiglu_backward
from tests.moe_engine.live_memory import LiveBytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_backward_is_the_plain_formulas_in_three_hidden_tensors(dtype):
    torch.manual_seed(0)
    N, H = 64, 48
    gate, up, dh = (torch.randn(N, H, dtype=dtype) for _ in range(3))
    silu = F.silu(gate)
    expected = (torch.ops.aten.silu_backward(dh * up, gate), silu * dh, silu * up)
    tracker = LiveBytes(existing=(gate, up, dh))
    with tracker:
        dgate, dup, h = swiglu_backward(dh.clone(), gate, up)
    for got, want in zip((dgate, dup, h), expected):
        assert torch.equal(got, want)
    # dh's clone is one of the three: d up is written into it
    assert tracker.peak <= 3 * N * H * gate.element_size()
    # ... and they are autograd's gradients of h = silu(gate) * up
    g, u = gate.float().requires_grad_(), up.float().requires_grad_()
    (F.silu(g) * u).backward(dh.float())
    tolerance = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(dgate.float(), g.grad, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(dup.float(), u.grad, rtol=tolerance, atol=tolerance)
