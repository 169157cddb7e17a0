"""moe_engine/experts.py's memory-bound pieces in their cheaper form give the same numbers:
the bias add as a one-hot GEMM (bf16: bitwise the repeat-and-add it replaced), the one-hot
rows (the bias gradient's left operand on CUDA) built once, one local expert's bias as a
broadcast, the host counts read once per partition."""
from __future__ import annotations

import pytest
import torch

from moe_engine.experts import ExpertSegments, PassRows, _add_bias, grouped_bias_grad


def _segments(counts: list[int]) -> ExpertSegments:
    counts_L = torch.tensor(counts, dtype=torch.int64)
    return ExpertSegments(sum(counts), counts_L.cumsum(0).to(torch.int32), counts_L)  # counts unknown on host


def test_bias_add_as_a_gemm_is_bitwise_the_repeated_add():
    torch.manual_seed(0)
    seg = _segments([5, 0, 17, 3, 1, 0, 9, 13])  # empty experts too
    y_NO = torch.randn(seg.rows, 64).to(torch.bfloat16) * 10
    b_LO = torch.randn(8, 64).to(torch.bfloat16)
    expected = y_NO.clone().add_(b_LO.repeat_interleave(seg.counts_L, dim=0, output_size=seg.rows))
    got = _add_bias(y_NO.clone(), b_LO, seg)
    assert torch.equal(got, expected)
    # float32/float64 keep the elementwise add
    y64 = torch.randn(seg.rows, 8, dtype=torch.float64)
    b64 = torch.randn(8, 8, dtype=torch.float64)
    assert torch.equal(_add_bias(y64.clone(), b64, seg), y64 + b64.repeat_interleave(seg.counts_L, dim=0))


def test_one_hot_rows_sum_each_experts_rows():
    torch.manual_seed(1)
    seg = _segments([4, 0, 7, 1])
    one_hot_NL = seg.one_hot(torch.float64)
    assert one_hot_NL.shape == (12, 4) and torch.equal(one_hot_NL.sum(1), torch.ones(12, dtype=torch.float64))
    dy_NO = torch.randn(12, 16, dtype=torch.float64)
    torch.testing.assert_close(one_hot_NL.t() @ dy_NO, grouped_bias_grad(dy_NO, seg), rtol=0, atol=1e-12)


def test_a_pass_builds_its_constant_operands_once_for_every_partition():
    """The one-hot rows, the columns of ones and the bias columns of a pass's partitions are
    slices of one table per dtype (a few launches per pass, none per partition), with each
    partition's own values."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Launches(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls += not func.is_view
            return func(*args, **(kwargs or {}))

    counts_nL = torch.tensor([[3, 2], [0, 4], [1, 1]])
    rows_n = counts_nL.sum(1).tolist()
    pass_rows = PassRows(counts_nL, rows_n)
    segments = [ExpertSegments(rows, counts_nL[i].cumsum(0).to(torch.int32), counts_nL[i], pass_rows=pass_rows,
                               partition=i) for i, rows in enumerate(rows_n)]
    for seg in segments:
        expected = torch.eye(2, dtype=torch.bfloat16).repeat_interleave(seg.counts_L, dim=0)
        assert torch.equal(seg.one_hot(torch.bfloat16), expected)
        assert torch.equal(seg.ones(torch.bfloat16), torch.ones(8, seg.rows, dtype=torch.bfloat16))
        columns = torch.zeros(seg.rows, 8, dtype=torch.bfloat16)
        columns[:, 0] = 1
        assert torch.equal(seg.bias_columns(torch.bfloat16), columns)
    with Launches() as launches:
        for seg in segments:
            seg.one_hot(torch.bfloat16), seg.ones(torch.bfloat16), seg.bias_columns(torch.bfloat16)
    assert launches.calls == 0
    assert segments[0].one_hot(torch.float32).dtype == torch.float32


@pytest.mark.parametrize("dtype,wide", [(torch.bfloat16, torch.float32), (torch.float32, None),
                                        (torch.float64, None)])
def test_one_local_expert_adds_and_sums_its_bias_over_every_row(dtype, wide):
    """L = 1 (as many experts as GPUs): the bias is broadcast over the rows and its gradient
    is the column sums, with the same numbers as the per-expert forms (no one-hot built)."""
    torch.manual_seed(2)
    seg = _segments([11])
    y_NO, b_LO = torch.randn(11, 16).to(dtype), torch.randn(1, 16).to(dtype)
    assert torch.equal(_add_bias(y_NO.clone(), b_LO, seg), y_NO + b_LO.repeat_interleave(seg.counts_L, dim=0))
    dy_NO = torch.randn(11, 16).to(dtype)
    got = grouped_bias_grad(dy_NO, seg, wide)
    assert got.shape == (1, 16) and got.dtype == (wide or dtype)
    torch.testing.assert_close(got, dy_NO.to(wide or dtype).sum(0, keepdim=True))
    assert seg.pass_rows is None  # no one-hot (nor any other constant operand) was built


def test_host_counts_are_read_once_and_kept():
    seg = _segments([2, 3])
    assert seg.counts is None
    assert seg.host_counts() == [2, 3]
    assert seg.counts == [2, 3]  # kept: a second call reads nothing


def test_the_grouped_kernel_is_taken_on_hopper_and_blackwell_only():
    """torch's CUTLASS grouped kernel exists for compute capability majors 9 and 10; on
    sm80, sm11x and sm12x its fallback reads the offsets on the host (a sync per GEMM), so
    the per-expert loop (which reads the counts once per partition) is taken there."""
    from moe_engine.experts import grouped_kernel_runs_on

    assert [grouped_kernel_runs_on((major, minor)) for major, minor in
            [(8, 0), (8, 9), (9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1)]] == \
        [False, False, True, True, True, False, False, False]


@pytest.mark.gpu
def test_the_sync_probe_tells_a_sync_free_call_from_one_that_syncs():
    """`runs_without_host_sync` (the widen probe's check): a kernel launch passes, a read of
    a device value on the host (`.item()`) and an error fail; the caller's mode comes back."""
    from moe_engine.experts import _grouped_kernel_widens, runs_without_host_sync

    x = torch.ones(64, device="cuda")
    torch.cuda.set_sync_debug_mode("warn")
    assert runs_without_host_sync(lambda: x.mul(2))
    assert not runs_without_host_sync(lambda: x.sum().item())
    assert not runs_without_host_sync(lambda: x.view(3, 7))
    assert torch.cuda.get_sync_debug_mode() == 1  # "warn", as the caller left it
    torch.cuda.set_sync_debug_mode("default")
    if _grouped_kernel_widens("cuda"):  # then the widening call is sync-free on this GPU
        a_KM = torch.ones(64, 32, dtype=torch.bfloat16, device="cuda")
        offs = torch.tensor([16, 64], dtype=torch.int32, device="cuda")
        torch.cuda.synchronize()
        assert runs_without_host_sync(lambda: torch._grouped_mm(a_KM.t(), a_KM, offs=offs, out_dtype=torch.float32))


def test_the_sync_probe_tells_a_sync_free_call_from_one_that_syncs_cpu_twin():
    """On CPU the widening grouped kernel is never probed: the per-expert path runs."""
    from moe_engine.experts import _grouped_kernel_widens

    assert _grouped_kernel_widens("cpu") is False
