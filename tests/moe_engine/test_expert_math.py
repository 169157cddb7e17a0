"""Tier 1: the experts' hand-written backward pieces give autograd's values, bit for bit
against the plain formulas, in the memory the model (moe_engine/memory.py) prices."""
import pytest
import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from moe_engine.experts import swiglu_backward


class _PeakNewBytes(TorchDispatchMode):
    """The most bytes, at any operation's end, of storages created under it and still alive."""

    def __init__(self):
        super().__init__()
        self.storages, self.peak = {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.storages.setdefault(storage.data_ptr(), (StorageWeakRef(storage), storage.nbytes()))
        self.peak = max(self.peak, sum(size for ref, size in self.storages.values() if not ref.expired()))
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_backward_is_the_plain_formulas_in_three_hidden_tensors(dtype):
    torch.manual_seed(0)
    N, H = 64, 48
    gate, up, dh = (torch.randn(N, H, dtype=dtype) for _ in range(3))
    silu = F.silu(gate)
    expected = (torch.ops.aten.silu_backward(dh * up, gate), silu * dh, silu * up)
    tracker = _PeakNewBytes()
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
