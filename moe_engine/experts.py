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
        Accumulates parameter gradients into `grads`, writes the input gradient into dx_ND."""
        H = self.config.d_hidden
        with torch.enable_grad():
            A_leaf = A_NA.detach().requires_grad_(True)
            h_NH = activate(A_leaf, self.config.activation)
        with torch.no_grad():
            dh_NH = torch.empty_like(h_NH)
            grouped_linear_backward(dy_ND, h_NH.detach(), self.w2, counts, grads.w2, grads.b2, dh_NH)
        (dA_NA,) = torch.autograd.grad(h_NH, A_leaf, dh_NH)
        with torch.no_grad():
            if self.w3 is None:
                grouped_linear_backward(dA_NA, x_ND, self.w1, counts, grads.w1, grads.b1, dx_ND)
            else:
                dgate, dup = dA_NA[:, :H].contiguous(), dA_NA[:, H:].contiguous()
                grouped_linear_backward(dgate, x_ND, self.w1, counts, grads.w1, grads.b1, dx_ND)
                dx_up = torch.empty_like(dx_ND)
                grouped_linear_backward(dup, x_ND, self.w3, counts, grads.w3, None, dx_up)
                dx_ND += dx_up
        return dx_ND
