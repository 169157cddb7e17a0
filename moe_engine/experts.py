"""All local experts' FFNs as one grouped computation.

Legend: N rows grouped by local expert (counts[l] rows for expert l, in order),
D d_model, H d_hidden, A width of the pre-activation (H, or 2H for SwiGLU),
L local experts.

    A = x @ w1 + b1              (SwiGLU: A = [x @ w1 + b1 | x @ w3])   "GEMM1"
    h = act(A)                   (SwiGLU: silu(A[:, :H]) * A[:, H:])
    y = h @ w2 + b2                                                       "GEMM2"

The grouped GEMM is one dense GEMM per local expert on its contiguous rows (L is
small; each GEMM is large), never a loop over tokens. Two forms are offered:
autograd-tracked (used by FastMoE and FasterMoE, which keep what autograd saves)
and explicit forward/backward into preallocated buffers (used by MPipeMoE's
pipeline, which decides itself what to keep).
"""
from __future__ import annotations

import itertools

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import MoEConfig


def activate(A_NA: torch.Tensor, activation: str) -> torch.Tensor:
    """Local. The expert's activation on the pre-activation A."""
    if activation == "relu":
        return F.relu(A_NA)
    if activation == "gelu":
        return F.gelu(A_NA)
    gate_NH, up_NH = A_NA.chunk(2, dim=-1)
    return F.silu(gate_NH) * up_NH


def _slices(counts: list[int]):
    start = 0
    for count in counts:
        yield slice(start, start + count)
        start += count


def grouped_linear(x_NI: torch.Tensor, w_LIO: torch.Tensor, b_LO: torch.Tensor | None,
                   counts: list[int], out_NO: torch.Tensor | None = None) -> torch.Tensor:
    """y[rows of l] = x[rows of l] @ w[l] (+ b[l]). Autograd-tracked unless `out_NO` is given."""
    if out_NO is not None:
        for l, rows in enumerate(_slices(counts)):
            if b_LO is None:
                torch.mm(x_NI[rows], w_LIO[l], out=out_NO[rows])
            else:
                torch.addmm(b_LO[l], x_NI[rows], w_LIO[l], out=out_NO[rows])
        return out_NO
    parts = []
    for l, rows in enumerate(_slices(counts)):
        parts.append(x_NI[rows] @ w_LIO[l] if b_LO is None else torch.addmm(b_LO[l], x_NI[rows], w_LIO[l]))
    if not parts:
        return x_NI.new_zeros(0, w_LIO.shape[-1])
    return torch.cat(parts)


def grouped_linear_backward(dy_NO: torch.Tensor, x_NI: torch.Tensor, w_LIO: torch.Tensor,
                            counts: list[int], grad_w_LIO: torch.Tensor, grad_b_LO: torch.Tensor | None,
                            dx_NI: torch.Tensor | None) -> torch.Tensor | None:
    """Accumulates dw[l] += x_lᵀ dy_l and db[l] += Σ dy_l; writes dx_l = dy_l w[l]ᵀ into dx_NI."""
    for l, rows in enumerate(_slices(counts)):
        if rows.stop == rows.start:
            continue
        grad_w_LIO[l].addmm_(x_NI[rows].t(), dy_NO[rows])
        if grad_b_LO is not None:
            grad_b_LO[l].add_(dy_NO[rows].sum(0))
        if dx_NI is not None:
            torch.mm(dy_NO[rows], w_LIO[l].t(), out=dx_NI[rows])
    return dx_NI


@dataclass
class ExpertGrads:
    """Gradient accumulators of the expert parameters (same layout as the parameters)."""

    w1: torch.Tensor
    b1: torch.Tensor | None
    w2: torch.Tensor
    b2: torch.Tensor | None
    w3: torch.Tensor | None


class Experts(nn.Module):
    """This rank's E_local experts. Parameters (DESIGN.md §4.1):
    w1 [L, D, H], b1 [L, H], w2 [L, H, D], b2 [L, D]; SwiGLU adds w3 [L, D, H] (no bias)."""

    def __init__(self, config: MoEConfig, local_experts: int, device=None, dtype=None):
        super().__init__()
        self.config = config
        self.local_experts = local_experts
        L, D, H = local_experts, config.d_model, config.d_hidden
        factory = dict(device=device, dtype=dtype)
        self.w1 = nn.Parameter(torch.empty(L, D, H, **factory))
        self.w2 = nn.Parameter(torch.empty(L, H, D, **factory))
        self.w3 = nn.Parameter(torch.empty(L, D, H, **factory)) if config.gated else None
        self.b1 = nn.Parameter(torch.zeros(L, H, **factory)) if config.bias else None
        self.b2 = nn.Parameter(torch.zeros(L, D, **factory)) if config.bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        D, H = self.config.d_model, self.config.d_hidden
        with torch.no_grad():
            self.w1.normal_(std=D ** -0.5)
            self.w2.normal_(std=H ** -0.5)
            if self.w3 is not None:
                self.w3.normal_(std=D ** -0.5)

    @property
    def pre_activation_width(self) -> int:
        return 2 * self.config.d_hidden if self.config.gated else self.config.d_hidden

    # -- autograd-tracked form (baselines) ----------------------------------------------
    def forward(self, x_ND: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Local. The FFN of every local expert on its rows, tracked by autograd."""
        A_NA = grouped_linear(x_ND, self.w1, self.b1, counts)
        if self.w3 is not None:
            A_NA = torch.cat([A_NA, grouped_linear(x_ND, self.w3, None, counts)], dim=-1)
        h_NH = activate(A_NA, self.config.activation)
        return grouped_linear(h_NH, self.w2, self.b2, counts)

    # -- explicit form (pipeline) ---------------------------------------------------------
    def project_in(self, x_ND: torch.Tensor, counts: list[int], out_NA: torch.Tensor) -> torch.Tensor:
        """Local, no autograd. GEMM1 into out_NA: A = x @ w1 + b1 (| x @ w3)."""
        H = self.config.d_hidden
        with torch.no_grad():
            if self.w3 is None:
                return grouped_linear(x_ND, self.w1, self.b1, counts, out_NO=out_NA)
            # out_NA[:, :H] is not contiguous; GEMM into contiguous temporaries per expert.
            for l, rows in enumerate(_slices(counts)):
                gate = x_ND[rows] @ self.w1[l]
                if self.b1 is not None:
                    gate += self.b1[l]
                out_NA[rows, :H] = gate
                out_NA[rows, H:] = x_ND[rows] @ self.w3[l]
            return out_NA

    def project_out(self, h_NH: torch.Tensor, counts: list[int], out_ND: torch.Tensor) -> torch.Tensor:
        """Local, no autograd. GEMM2 into out_ND: y = h @ w2 + b2."""
        with torch.no_grad():
            return grouped_linear(h_NH, self.w2, self.b2, counts, out_NO=out_ND)

    def new_grads(self) -> ExpertGrads:
        zeros = lambda p: None if p is None else torch.zeros_like(p)  # noqa: E731
        return ExpertGrads(zeros(self.w1), zeros(self.b1), zeros(self.w2), zeros(self.b2), zeros(self.w3))

    def backward_rows(self, x_ND: torch.Tensor, A_NA: torch.Tensor, dy_ND: torch.Tensor,
                      counts: list[int], grads: ExpertGrads, dx_ND: torch.Tensor) -> torch.Tensor:
        """Local. Backward of the FFN for one group of rows, from its input x and
        pre-activation A (the activation itself is recomputed from A, elementwise).
        Accumulates parameter gradients into `grads`; returns the input gradient
        (written into dx_ND). Frees each hidden-width temporary as soon as it is used,
        so at most one or two N × H tensors live beside A."""
        with torch.no_grad():
            h_NH = activate(A_NA, self.config.activation)
            grouped_linear_backward(dy_ND, h_NH, self.w2, counts, grads.w2, grads.b2, None)
            del h_NH
            dh_NH = grouped_matmul_transposed(dy_ND, self.w2, counts)
            if self.w3 is None:
                dA_NH = activation_backward(dh_NH, A_NA, self.config.activation)
                grouped_linear_backward(dA_NH, x_ND, self.w1, counts, grads.w1, grads.b1, None)
                dx_ND.copy_(grouped_matmul_transposed(dA_NH, self.w1, counts))
                return dx_ND
            dgate_NH, dup_NH = swiglu_backward(dh_NH, A_NA)
            grouped_linear_backward(dgate_NH, x_ND, self.w1, counts, grads.w1, grads.b1, None)
            grouped_linear_backward(dup_NH, x_ND, self.w3, counts, grads.w3, None, None)
            dx_ND.copy_(grouped_matmul_transposed(dgate_NH, self.w1, counts))
            dx_ND.add_(grouped_matmul_transposed(dup_NH, self.w3, counts))
            return dx_ND


def activation_backward(dh_NH: torch.Tensor, A_NH: torch.Tensor, activation: str) -> torch.Tensor:
    """dA from dh for ReLU / GELU, computed in place into dh_NH (returned)."""
    if activation == "relu":
        return dh_NH.masked_fill_(A_NH <= 0, 0)
    return torch.ops.aten.gelu_backward.grad_input(dh_NH, A_NH, grad_input=dh_NH)


def swiglu_backward(dh_NH: torch.Tensor, A_N2H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up) of h = silu(gate) * up; d gate is computed in place into dh_NH."""
    gate_NH, up_NH = A_N2H.chunk(2, dim=-1)
    sigmoid_NH = torch.sigmoid(gate_NH)
    silu_NH = gate_NH * sigmoid_NH
    dup_NH = dh_NH * silu_NH
    # silu'(g) = s·(1 + g·(1 − s)) = s·(1 + g − silu(g))
    dsilu_NH = torch.sub(gate_NH, silu_NH, out=silu_NH).add_(1).mul_(sigmoid_NH)
    del sigmoid_NH
    return dh_NH.mul_(up_NH).mul_(dsilu_NH), dup_NH


def _grouped_mm_ok(a: torch.Tensor, w: torch.Tensor) -> bool:
    """torch._grouped_mm (one kernel for all experts) where this PyTorch and device offer it."""
    return (hasattr(torch, "_grouped_mm") and a.is_cuda and a.dtype == torch.bfloat16
            and w.dtype == torch.bfloat16 and a.shape[-1] % 16 == 0 and w.shape[-2] % 16 == 0
            and w.shape[-1] % 16 == 0 and torch.cuda.get_device_capability(a.device)[0] >= 9)


def grouped_matmul_transposed(dy_NO: torch.Tensor, w_LIO: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """dx[rows of l] = dy[rows of l] @ w[l]ᵀ for all experts (the input gradient of a grouped linear)."""
    if dy_NO.shape[0] and _grouped_mm_ok(dy_NO, w_LIO):
        # Offsets summed on the host; a non-blocking copy from pageable memory is staged at
        # once and does not wait for the device (a blocking one synchronises the stream).
        offsets = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32)
        return torch._grouped_mm(dy_NO, w_LIO.transpose(-2, -1), offs=offsets.to(dy_NO.device, non_blocking=True))
    dx_NI = dy_NO.new_empty(dy_NO.shape[0], w_LIO.shape[1])
    for l, rows in enumerate(_slices(counts)):
        torch.mm(dy_NO[rows], w_LIO[l].t(), out=dx_NI[rows])
    return dx_NI
