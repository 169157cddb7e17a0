"""Buffer sharing and the S1–S4 restore strategies (DESIGN.md §2, §5).

A `RestorePolicy` says, for one strategy, how backward gets back the two
per-partition tensors the shared forward buffers overwrote:

| strategy | T_DI (expert input)   | A (pre-activation; T_M = act(A)) |
|----------|-----------------------|----------------------------------|
| none     | kept on the device    | kept on the device               |
| S1       | copy back from host   | copy back from host              |
| S2       | re-communication      | copy back from host              |
| S3       | copy back from host   | recomputation (GEMM1)            |
| S4       | re-communication      | recomputation (GEMM1)            |

We keep the pre-activation A rather than the activation output: act(A) is an
elementwise recomputation in backward, so every strategy needs one H-wide
tensor per row (a = 1 in §5), whatever the activation.

`HostBufferPool` owns pinned host memory for offloads. Each forward takes its
own buffers (so several micro-batches can be in flight), backward gives them
back, and later steps reuse them. Pass one pool to several layers to share it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import STRATEGIES


@dataclass(frozen=True)
class RestorePolicy:
    strategy: str
    share_buffers: bool          # forward overwrites T_DI / A of earlier partitions
    offload_input: bool          # T_DI copied to host in forward
    offload_preactivation: bool  # A copied to host in forward
    recommunicate_input: bool    # T_DI rebuilt by All-to-All in backward
    recompute_preactivation: bool  # A rebuilt by GEMM1 in backward

    @classmethod
    def of(cls, strategy: str) -> "RestorePolicy":
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy={strategy!r} is invalid: choose 'auto' or one of {', '.join(STRATEGIES)}")
        if strategy == "none":
            return cls("none", False, False, False, False, False)
        recommunicate = strategy in ("S2", "S4")
        recompute = strategy in ("S3", "S4")
        return cls(strategy, True, not recommunicate, not recompute, recommunicate, recompute)

    @property
    def needs_layer_input(self) -> bool:
        """Re-communication rebuilds T_DI from the layer input x, so backward keeps x."""
        return self.recommunicate_input


class HostBufferPool:
    """Reusable host buffers for offloaded activations (pinned when CUDA is present).

    `take` hands out a buffer no one else holds; `give_back` returns it for reuse.
    Sizes are rounded up to a power of two so buffers are reused across steps
    whose token counts differ a little.
    """

    def __init__(self):
        self._free: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}
        self.bytes_allocated = 0

    def take(self, numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        capacity = 1 << max(0, (numel - 1).bit_length())
        free = self._free.get((dtype, capacity))
        if free:
            return free.pop()
        buffer = torch.empty(capacity, dtype=dtype, pin_memory=pin)
        self.bytes_allocated += buffer.numel() * buffer.element_size()
        return buffer

    def give_back(self, buffer: torch.Tensor) -> None:
        self._free.setdefault((buffer.dtype, buffer.numel()), []).append(buffer)

    @property
    def free_buffers(self) -> int:
        return sum(len(v) for v in self._free.values())
