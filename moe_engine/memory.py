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


# -- memory model (DESIGN.md §5; derivation in docs/engine.md) ---------------------------

ENGINES = ("mpipemoe", "fastmoe", "fastermoe")
# Hidden-width tensors autograd keeps per row in the keep-everything baseline:
# ReLU keeps its output (shared with GEMM2's input), GELU its input and output,
# SwiGLU the two projections (2H), silu's output and the product.
_AUTOGRAD_ACTIVATION_FACTOR = {"relu": 1, "gelu": 2, "swiglu": 4}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank for one micro-batch of one MoE layer.

    saved_bytes:   kept on the device from forward until backward (what autograd
                   and the pipeline save), parameters excluded.
    host_bytes:    offloaded to pinned host memory (S1–S3).
    forward_working_bytes / backward_working_bytes: transient buffers of a pass.
    peak_bytes:    saved + the larger working set: the layer's activation peak
                   above its parameters and input.
    """

    saved_bytes: int
    host_bytes: int
    forward_working_bytes: int
    backward_working_bytes: int

    @property
    def peak_bytes(self) -> int:
        return self.saved_bytes + max(self.forward_working_bytes, self.backward_working_bytes)


def predict_memory(config, tokens: int, world_size: int = 1, partitions: int = 1, strategy: str = "none",
                   engine: str = "mpipemoe", dtype: torch.dtype = torch.bfloat16,
                   rows_sent: int | None = None, rows_received: int | None = None) -> MemoryEstimate:
    """Predict the layer's activation memory per rank (DESIGN.md §5).

    tokens: T on this rank. rows_sent / rows_received: R and N when known (e.g.
    measured); by default R = N = k·T, exact for dropless routing on one rank and
    the balanced-routing expectation on several.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r} is invalid: choose one of {', '.join(ENGINES)}")
    if engine != "mpipemoe":
        strategy, partitions = "none", (partitions if engine == "fastermoe" else 1)
    policy = RestorePolicy.of(strategy)
    T, K, E, D, H = tokens, config.top_k, config.num_experts, config.d_model, config.d_hidden
    L = config.experts_per_rank(world_size)
    A_width = 2 * H if config.gated else H
    s = torch.empty((), dtype=dtype).element_size()
    r = torch.empty((), dtype=torch.promote_types(dtype, torch.float32)).element_size()
    index = 8
    R = K * T if rows_sent is None else rows_sent
    N = K * T if rows_received is None else rows_received

    # Saved by every engine: X (router GEMM), router probabilities, top-k indices and
    # weights, f (balance loss), the (token, choice) rows and weights of un-permute.
    saved = s * (T * D + T * K * D + T * K) + r * (T * E + E) + index * 2 * T * K
    if K > 1:
        saved += r * (T * K + T)  # top-k values and their sum (renormalisation)

    if engine == "fastmoe":
        saved += index * (R + 2 * N) + s * N * (D + _AUTOGRAD_ACTIVATION_FACTOR[config.activation] * H)
        forward_working = s * (R * D + 3 * N * D)
        backward_working = s * (R * D + 3 * N * D + N * (H + A_width) + T * D)
        host = 0
    else:
        n = max(1, partitions)
        Rn, Nn = -(-R // n), -(-N // n)
        if not policy.share_buffers:
            saved += s * N * (D + A_width)
        host = s * N * ((D if policy.offload_input else 0) + (A_width if policy.offload_preactivation else 0))
        input_slots = 0 if not policy.share_buffers else (2 if policy.offload_input else 1)
        preact_slots = 0 if not policy.share_buffers else (2 if policy.offload_preactivation else 1)
        forward_working = s * (R * D + 2 * Rn * D + 5 * Nn * D + input_slots * Nn * D
                               + preact_slots * Nn * A_width + Nn * H)
        restore = 0
        if policy.share_buffers:
            restore = 2 * Nn * D + (2 if policy.offload_preactivation else 1) * Nn * A_width
            if policy.recommunicate_input:
                restore += 2 * Nn * D + 2 * Rn * D
        backward_working = s * (R * D + T * D + 6 * Nn * D + 2 * Rn * D + restore + Nn * (2 * H + A_width))
    grads = s * L * (2 * D * H + (D * H if config.gated else 0) + (H + D if config.bias else 0))
    return MemoryEstimate(saved, host, forward_working, backward_working + grads)
