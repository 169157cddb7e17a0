"""Gradient reductions in buckets (workers/distributed.py all_reduce_in_buckets): the sums of
the flat whole-buffer reduction, with at most two buckets of extra memory, and the same
sequence of collectives on every rank (tier 1, then 2 gloo ranks)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from tests.distributed import run_on_ranks
from workers.distributed import all_reduce_in_buckets, gradient_buckets


def _grads(rank: int) -> list[torch.Tensor]:
    torch.manual_seed(rank)
    shapes = [(10, 4), (3,), (50,), (2, 2), (7, 9), (1,)]
    dtypes = [torch.float32, torch.float64, torch.float32, torch.float64, torch.float32, torch.float32]
    return [torch.randn(shape, dtype=dtype) for shape, dtype in zip(shapes, dtypes)]


def test_buckets_hold_one_dtype_keep_the_order_and_stay_within_the_size():
    grads = _grads(0)
    buckets = gradient_buckets(grads, bucket_bytes=200)  # 50 float32 elements
    assert all(len({g.dtype for g in bucket}) == 1 for bucket in buckets)
    assert sorted(id(g) for bucket in buckets for g in bucket) == sorted(id(g) for g in grads)
    for bucket in buckets:  # within the size, or one gradient larger than it alone
        nbytes = sum(g.numel() * g.element_size() for g in bucket)
        assert nbytes <= 200 or len(bucket) == 1
    float32 = [g for bucket in buckets for g in bucket if g.dtype == torch.float32]
    assert [g.shape for g in float32] == [(10, 4), (50,), (7, 9), (1,)]  # in the given order
    assert [len(b) for b in buckets if b[0].dtype == torch.float32] == [1, 1, 1, 1]  # 160 + 200 > 200, ...
    assert len(gradient_buckets(grads)) == 2  # the default size: one bucket per dtype
    assert gradient_buckets([]) == []


def _reduce(rank: int, world_size: int, bucket_bytes: int):
    calls: list[tuple] = []
    real = dist.all_reduce

    def logged(tensor, *args, **kwargs):
        calls.append((tuple(tensor.shape), str(tensor.dtype)))
        return real(tensor, *args, **kwargs)

    setattr(dist, "all_reduce", logged)  # this rank's process only (workers.distributed calls dist.all_reduce)
    try:
        grads = _grads(rank)
        all_reduce_in_buckets(grads, None, divide_by=world_size, bucket_bytes=bucket_bytes)
    finally:
        setattr(dist, "all_reduce", real)
    return [g.numpy() for g in grads], calls  # by value: a tensor sent by a process that exits is lost


def test_two_ranks_get_the_mean_of_their_gradients_in_the_same_collectives():
    results = run_on_ranks(2, _reduce, 200)
    expected = [(a + b) / 2 for a, b in zip(_grads(0), _grads(1))]
    for grads, _ in results:
        for got, want in zip(grads, expected):
            torch.testing.assert_close(torch.from_numpy(got), want)
    sequences = [calls for _, calls in results]
    assert sequences[0] == sequences[1] and len(sequences[0]) == len(gradient_buckets(_grads(0), 200)) > 2
