"""Fused kernels (Triton) for the memory-bound steps around the expert GEMMs.

Each replaces a few PyTorch kernels that read and write the same N·H or P·D tensors
one after another; the values are those of the PyTorch formulas, with the arithmetic in
float32 and one rounding to the output's dtype.

    gelu_backward_and_activation   dA = dh · gelu'(A) and h = gelu(A) in one pass over A
                                   (the weight gradient of w2 needs h again; PyTorch
                                   reads A once for the recomputation and once for the
                                   backward). Strategy-independent: any expert backward.
    weighted_combine               y_t = Σ_k w_tk · rows[row_of_pair[t, k]], the K rows
                                   read where they lie (no gathered P × D copy, no
                                   broadcast products).
    weighted_combine_backward      the rows' gradient (w · dy, in row order) and the
                                   weights' (dy · row), one pass over the rows.

`fused_kernels_run_on(*tensors)` says whether they apply: CUDA tensors of 16- or 32-bit
floats (the kernels compute in float32) where Triton imports (it ships with PyTorch's CUDA
builds). Elsewhere (CPU, the CPU test suite) the
callers run the PyTorch formulas; the GPU tests compare the two.

Each launch runs on its tensors' device (`on_device_of`), not on the current one: Triton
launches on the current device, so a layer on cuda:1 called with cuda:0 current would
otherwise hand GPU 1's pointers to a kernel on GPU 0. Masked loads read 0 in the masked
lanes (`other=0.0`), so a partial block's sums never see undefined values.
"""
from __future__ import annotations

import torch

try:  # Triton ships with PyTorch's CUDA wheels, not with the CPU ones
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

ELEMENTWISE_BLOCK = 2048  # elements per program of the GELU kernel (8 warps, 8 per thread)
ROW_BLOCK = 1024          # columns per program step of the combine kernels (4 warps, 8 bf16 each)


FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fused_kernels_run_on(*tensors: torch.Tensor) -> bool:
    """Whether the Triton kernels run on ``tensors``: on CUDA, Triton present, each of
    FUSED_DTYPES (float64 keeps PyTorch's kernels and its precision)."""
    return triton is not None and all(t.device.type == "cuda" and t.dtype in FUSED_DTYPES for t in tensors)


def on_device_of(tensor: torch.Tensor) -> torch.cuda.device:
    """The context a kernel on ``tensor`` is launched in: its CUDA device made current."""
    return torch.cuda.device(tensor.device)


if triton is not None:
    @triton.jit
    def _gelu_backward_and_activation_kernel(dh_ptr, a_ptr, h_ptr, numel, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < numel
        a = tl.load(a_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dh = tl.load(dh_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        cdf = 0.5 * (1.0 + tl.erf(a * 0.7071067811865476))          # Φ(a)
        pdf = tl.exp(-0.5 * a * a) * 0.3989422804014327              # φ(a)
        tl.store(h_ptr + offsets, (a * cdf).to(h_ptr.dtype.element_ty), mask=mask)
        tl.store(dh_ptr + offsets, (dh * (cdf + a * pdf)).to(dh_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _weighted_combine_kernel(rows_ptr, weights_ptr, row_of_pair_ptr, out_ptr, D,
                                 K: tl.constexpr, BLOCK: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = columns < D
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for k in tl.static_range(K):
            row = tl.load(row_of_pair_ptr + token * K + k).to(tl.int64)
            weight = tl.load(weights_ptr + token * K + k).to(tl.float32)
            total += weight * tl.load(rows_ptr + row * D + columns, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + token * D + columns, total.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _weighted_combine_backward_kernel(dy_ptr, rows_ptr, weights_ptr, pair_of_row_ptr, d_rows_ptr,
                                          d_weights_ptr, D, pairs, K: tl.constexpr, BLOCK: tl.constexpr,
                                          ROWS_GRAD: tl.constexpr, WEIGHTS_GRAD: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        pair = tl.load(pair_of_row_ptr + row).to(tl.int64)
        real = pair < pairs  # a padding row (pair index P) belongs to no pair: zero gradient
        pair = tl.where(real, pair, 0)
        token = pair // K
        weight = tl.where(real, tl.load(weights_ptr + pair).to(tl.float32), 0.0)
        dot = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, D, BLOCK):
            columns = start + tl.arange(0, BLOCK)
            mask = columns < D
            dy = tl.load(dy_ptr + token * D + columns, mask=mask & real, other=0.0).to(tl.float32)
            if ROWS_GRAD:
                tl.store(d_rows_ptr + row * D + columns, (weight * dy).to(d_rows_ptr.dtype.element_ty), mask=mask)
            if WEIGHTS_GRAD:
                dot += dy * tl.load(rows_ptr + row * D + columns, mask=mask, other=0.0).to(tl.float32)
        if WEIGHTS_GRAD:
            tl.store(d_weights_ptr + pair, tl.sum(dot, axis=0).to(d_weights_ptr.dtype.element_ty), mask=real)


def gelu_backward_and_activation(dh_NH: torch.Tensor, A_NH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dA, h) of h = gelu(A) (the erf form) given dh: dA written into dh's memory, h new.
    On CUDA one pass over A (Triton); elsewhere PyTorch's gelu and gelu_backward."""
    if not fused_kernels_run_on(dh_NH, A_NH) or not (dh_NH.is_contiguous() and A_NH.is_contiguous()):
        h_NH = torch.nn.functional.gelu(A_NH)
        torch.ops.aten.gelu_backward.grad_input(dh_NH, A_NH, grad_input=dh_NH)
        return dh_NH, h_NH
    h_NH = torch.empty_like(A_NH)
    numel = A_NH.numel()
    if numel:
        grid = (triton.cdiv(numel, ELEMENTWISE_BLOCK),)
        with on_device_of(A_NH):
            _gelu_backward_and_activation_kernel[grid](dh_NH, A_NH, h_NH, numel, BLOCK=ELEMENTWISE_BLOCK,
                                                       num_warps=8)
    return dh_NH, h_NH


def weighted_combine(rows_RD: torch.Tensor, weights_TK: torch.Tensor, row_of_pair_P: torch.Tensor,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Where `fused_kernels_run_on` the rows and weights:
    y_TD[t] = Σ_k weights_TK[t, k] · rows_RD[row_of_pair_P[t·K + k]], summed in float32
    from the weights as they are, rounded once to ``out_dtype`` (default: the weights')."""
    T, K = weights_TK.shape
    D = rows_RD.shape[-1]
    rows_RD, weights_TK, row_of_pair_P = (t.contiguous() for t in (rows_RD, weights_TK, row_of_pair_P))
    y_TD = rows_RD.new_empty(T, D, dtype=out_dtype or weights_TK.dtype)
    if T and D:
        block = min(ROW_BLOCK, triton.next_power_of_2(D))
        with on_device_of(rows_RD):
            _weighted_combine_kernel[(T, triton.cdiv(D, block))](rows_RD, weights_TK, row_of_pair_P, y_TD, D,
                                                                   K=K, BLOCK=block, num_warps=4)
    return y_TD


def weighted_combine_backward(dy_TD: torch.Tensor, rows_RD: torch.Tensor, weights_TK: torch.Tensor,
                              pair_index_R: torch.Tensor, rows_grad: bool, weights_grad: bool
                              ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Where `fused_kernels_run_on` the rows and weights: the gradients of
    `weighted_combine`. d_rows_RD[r] = w_p · dy[t] for r's pair p = pair_index_R[r] of
    token t = p // K (in the rows' dtype; one rounding), and d_weights_TK[p] = dy[t] ·
    rows_RD[r] (float32 sums; 0 for a pair without a row, whose weight the caller has
    zeroed). A row whose pair index is T·K (a capacity plan's padding row) gets a zero
    gradient and adds to no weight's."""
    T, K = weights_TK.shape
    R, D = rows_RD.shape
    dy_TD, rows_RD, weights_TK, pair_index_R = (t.contiguous() for t in (dy_TD, rows_RD, weights_TK, pair_index_R))
    d_rows = torch.empty_like(rows_RD) if rows_grad else None
    d_weights = torch.zeros_like(weights_TK) if weights_grad else None
    if R and D and (rows_grad or weights_grad):
        with on_device_of(rows_RD):
            _weighted_combine_backward_kernel[(R,)](
                dy_TD, rows_RD, weights_TK, pair_index_R, rows_RD if d_rows is None else d_rows,
                weights_TK if d_weights is None else d_weights, D, T * K, K=K,
                BLOCK=min(ROW_BLOCK, triton.next_power_of_2(D)), ROWS_GRAD=rows_grad, WEIGHTS_GRAD=weights_grad,
                num_warps=4)
    return d_rows, d_weights
