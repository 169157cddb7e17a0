"""A CPU stand-in for `torch.cuda.max_memory_allocated`: the peak of the bytes of live
tensor storages while a step runs, counted op by op under a TorchDispatchMode.

After every operation the tracker sums the storages created under it that are still
alive (weak references; CPython frees a tensor as soon as its last reference goes) and
keeps the largest sum with a snapshot of what made it up. Buffers a `HostBufferPool`
holds are host memory on a GPU, so they are left out (`exclude`). What the CPU cannot
show: a CUDA caching allocator keeps a block counted until every stream that used it is
done, and cuBLAS workspaces; neither exists here.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Peak live bytes of the storages created under it (see the module docstring).

    exclude: called after each op; returns data pointers not to count (host buffers).
    existing: tensors alive before (parameters, inputs): views of them are not counted."""

    def __init__(self, exclude: Callable[[], set[int]] = set, existing: tuple[torch.Tensor, ...] = ()):
        super().__init__()
        self.exclude = exclude
        # storages that exist before (parameters, inputs): views of them allocate nothing
        self.existing = {t.untyped_storage().data_ptr() for t in existing}
        self.storages: dict[int, tuple[StorageWeakRef, int, str, tuple, torch.dtype]] = {}
        self.peak = 0
        self.peak_op = ""
        self.at_peak: list[tuple[str, tuple, torch.dtype, int]] = []
        self.ops = 0
        self.forward_peak = 0  # step_peak: the peak before backward
        self.forward_at_peak: list[tuple[str, tuple, torch.dtype, int]] = []

    def live(self) -> list[tuple[int, tuple[StorageWeakRef, int, str, tuple, torch.dtype]]]:
        self.storages = {p: e for p, e in self.storages.items() if not e[0].expired()}
        skip = self.exclude()
        return [(p, e) for p, e in self.storages.items() if p not in skip]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                known = self.storages.get(ptr)
                # a freed storage's address can come back for a new one before the sweep
                if ptr and (known is None or known[0].expired()) and ptr not in self.existing:
                    self.storages[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes(),
                                                         str(func), tuple(t.shape), t.dtype)
        live = self.live()
        total = sum(e[1] for _, e in live)
        if total > self.peak:
            self.peak, self.peak_op = total, str(func)
            self.at_peak = sorted(((e[2], e[3], e[4], e[1]) for _, e in live), key=lambda x: -x[3])
        return out


def pool_buffers(layer: torch.nn.Module) -> Callable[[], set[int]]:
    """The data pointers of the buffers `layer`'s host pool holds (handed out or free)."""
    def held() -> set[int]:
        pool = getattr(layer, "host_pool", None)
        if pool is None:
            return set()
        return set(pool._taken) | {b.data_ptr() for b, _ in pool._free}
    return held


def step_peak(layer: torch.nn.Module, x: torch.Tensor, grad_y: torch.Tensor) -> LiveBytes:
    """One forward+backward of `layer` as `mpipemoe bench` times it (gradients set to None
    first), tracked: the peak counts what the step allocates above its inputs and parameters."""
    layer.zero_grad(set_to_none=True)
    x_in = x.detach().requires_grad_(True)
    tracker = LiveBytes(pool_buffers(layer), (*layer.parameters(), x, grad_y))
    with tracker:
        y, aux = layer(x_in)
        tracker.forward_peak, tracker.forward_at_peak = tracker.peak, tracker.at_peak
        torch.autograd.backward([y, aux], [grad_y, torch.ones_like(aux)])
    return tracker
