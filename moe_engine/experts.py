"""All local experts' FFNs as grouped GEMMs: one kernel per projection for all experts.

Shapes: see moe_engine's legend (moe_engine/__init__.py). Expert l owns rows
[end[l-1], end[l]) of the N rows.

    A = x @ w1 + b1              (SwiGLU: A = (x @ w1 + b1, x @ w3), two parts)   "GEMM1"
    h = act(A)                   (SwiGLU: silu(gate) * up)
    y = h @ w2 + b2                                                               "GEMM2"

Every projection, its input gradient and its weight gradient is one grouped GEMM
(`torch._grouped_mm`, on CUDA for bf16 on Hopper and on CPU for float32/bf16/fp16), so
the number of kernel launches does not grow with the number of experts. Bias gradients
are one grouped GEMM too (a row of ones against the output gradient). Where the kernel
has no such dtype (float64, fp32 on CUDA) a per-expert loop computes the same numbers.

The pre-activation A is a list of one tensor (ReLU, GELU) or two (SwiGLU's gate and up
projections, each N × H): the grouped kernel writes fresh outputs, so two GEMMs into two
tensors cost nothing extra, where one GEMM into one tensor would need the weights
concatenated (a weight-sized copy per pass) or the output split (a copy per partition).

Forward and backward are explicit (no autograd inside): the pipeline decides what to
keep, and backward is split in two, `input_grad` then `weight_grads`, so the input
gradient can be sent back while the weight-gradient GEMMs run.
"""
from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from typing import Any, Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import kernels
from .config import MoEConfig
from .streams import honouring_sm_carveout

PreActivation = list[torch.Tensor]  # [A] or [gate, up]; each N × H


@dataclass(frozen=True)
class HostCountsCopy:
    """Rows per expert on their way to pinned host memory: copied without waiting when the
    forward plans the rows, read in backward (by then long arrived), so the per-expert
    fallback of the weight gradients waits for this copy, not for every kernel queued
    before it (a device-wide wait per layer starved the GPU while the host re-filled the queue)."""

    host_L: torch.Tensor
    event: torch.cuda.Event

    @classmethod
    def start(cls, counts_nL: torch.Tensor) -> list["HostCountsCopy"] | None:
        """Local. Start copying a [n, L] table of counts; one copy per row. None off CUDA
        and while a CUDA graph is captured (its replays would not refill the host copy)."""
        if counts_nL.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return None
        host_nL = torch.empty(counts_nL.shape, dtype=counts_nL.dtype, pin_memory=True)
        host_nL.copy_(counts_nL, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(counts_nL.device))  # the counts' device, not the current one
        return [cls(host_L, event) for host_L in host_nL]

    def read(self) -> list[int]:
        """Local. The counts, once this copy has arrived (waits for it alone)."""
        self.event.synchronize()
        return self.host_L.tolist()


BIAS_COLUMNS = 8  # a column of ones and seven of zeros: a widened bf16 row stays a multiple of 16 bytes


class PassRows:
    """Local, no device reads. The constant operands a pass's partitions multiply their rows
    by, built once per pass for the rows of every partition and sliced per partition: the
    one-hot rows that apply per-expert vectors (biases) as one GEMM, the columns of ones that
    sum rows per expert (bias gradients) and the bias columns that widen GEMM1's rows. Built
    per partition they were five to seven launches each (`ExpertSegments.one_hot`,
    `grouped_bias_grad`, `bias_columns`): host time that grew with n.

    counts_nL: rows per (partition, local expert) on the rows' device; rows_n: each
    partition's row count on the host (the sum of its counts)."""

    def __init__(self, counts_nL: torch.Tensor, rows_n: list[int]):
        self.counts_nL = counts_nL
        self.rows_n = rows_n
        self.starts_n = [sum(rows_n[:i]) for i in range(len(rows_n))]
        self._one_hots: dict[torch.dtype, torch.Tensor] = {}
        self._ones: dict[torch.dtype, torch.Tensor] = {}
        self._bias_columns: dict[torch.dtype, torch.Tensor] = {}

    def one_hot(self, partition: int, dtype: torch.dtype) -> torch.Tensor:
        """[N, L] in ``dtype`` for partition ``partition``'s N rows: row r's expert as a
        one-hot row. The pass's table is built on first use (three launches for all partitions)."""
        if dtype not in self._one_hots:
            n, L = self.counts_nL.shape
            eye_nLL = torch.eye(L, dtype=dtype, device=self.counts_nL.device).repeat(n, 1)
            self._one_hots[dtype] = eye_nLL.repeat_interleave(self.counts_nL.reshape(-1), dim=0,
                                                              output_size=sum(self.rows_n))
        start = self.starts_n[partition]
        return self._one_hots[dtype][start:start + self.rows_n[partition]]

    def ones(self, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """[BIAS_COLUMNS, rows] of ones in ``dtype``, column-major (the grouped kernel's
        16-byte alignment along the rows): the left operand that sums rows per expert."""
        if dtype not in self._ones:
            self._ones[dtype] = torch.ones(max(self.rows_n, default=0), BIAS_COLUMNS, dtype=dtype,
                                           device=self.counts_nL.device)
        return self._ones[dtype][:rows].t()

    def bias_columns(self, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """[rows, BIAS_COLUMNS] in ``dtype``: ones in the first column, zeros in the rest
        (the columns that make x @ [w1; b1; 0…] add b1, `Experts.project_in`)."""
        if dtype not in self._bias_columns:
            columns_NB = torch.zeros(max(self.rows_n, default=0), BIAS_COLUMNS, dtype=dtype,
                                     device=self.counts_nL.device)
            columns_NB[:, 0] = 1
            self._bias_columns[dtype] = columns_NB
        return self._bias_columns[dtype][:rows]


@dataclass(frozen=True)
class ExpertSegments:
    """Local. How N rows split into the local experts' contiguous segments.

    rows:        N, known on the host.
    ends_L:      int32 on the rows' device: end row of each expert's segment (cumulative).
    counts_L:    int64 on the rows' device: rows per expert.
    counts:      the same on the host when known without reading the device (several ranks
                 read their count tables anyway); None otherwise.
    counts_copy: the counts on their way to the host (one rank on CUDA), for `host_counts`.
    pass_rows:   the pass's constant operands (`PassRows`), shared by its partitions' segments,
                 and this segments' partition in it; None: one of its own, built on first use.
    """

    rows: int
    ends_L: torch.Tensor
    counts_L: torch.Tensor
    counts: list[int] | None = None
    counts_copy: HostCountsCopy | None = None
    pass_rows: PassRows | None = field(default=None, compare=False, repr=False)
    partition: int = 0

    @classmethod
    def from_counts(cls, counts: list[int], device: torch.device | str | None) -> "ExpertSegments":
        """Local. Segments of known sizes (benchmarks, calibration, tests)."""
        counts_L = torch.tensor(counts, dtype=torch.int64).to(device, non_blocking=True)
        return cls(sum(counts), counts_L.cumsum(0).to(torch.int32), counts_L, list(counts))

    def host_counts(self) -> list[int]:
        """Rows per expert on the host; reads the device when not known (only the per-expert
        fallback for dtypes without a grouped kernel needs it), once: the answer is kept, so
        the weight gradients of w1 and w2 (a CUDA torch whose grouped kernel does not write
        float32) wait for the device once per partition, not once per projection."""
        if self.counts is None:
            counts = self.counts_copy.read() if self.counts_copy is not None else self.counts_L.tolist()
            object.__setattr__(self, "counts", counts)  # frozen: the one late field
        return self.counts  # type: ignore[return-value]  # (set just above)

    @property
    def experts(self) -> int:
        """L, the local experts the rows split into."""
        return self.counts_L.shape[0]

    @property
    def constants(self) -> PassRows:
        """The pass's constant operands (`PassRows`); a segments made alone gets its own."""
        if self.pass_rows is None:
            object.__setattr__(self, "pass_rows", PassRows(self.counts_L.view(1, -1), [self.rows]))  # frozen: late
        return self.pass_rows  # type: ignore[return-value]  # (set just above)

    def one_hot(self, dtype: torch.dtype) -> torch.Tensor:
        """Local, no device reads. [N, L] in ``dtype``: row r's expert as a one-hot row (a row
        of the identity repeated over each segment), the left operand that applies per-expert
        vectors (biases) to the rows, or sums the rows per expert, as one GEMM. A slice of
        the pass's table (`PassRows.one_hot`), kept with it."""
        return self.constants.one_hot(self.partition, dtype)

    def ones(self, dtype: torch.dtype) -> torch.Tensor:
        """[BIAS_COLUMNS, N] of ones (`PassRows.ones`)."""
        return self.constants.ones(self.rows, dtype)

    def bias_columns(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, BIAS_COLUMNS]: ones, then zeros (`PassRows.bias_columns`)."""
        return self.constants.bias_columns(self.rows, dtype)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Local. The dtype the experts run in for the input ``x`` (and the All-to-Alls move
    rows in): the autocast dtype when autocast is on for x's device type (the layer casts
    the rows and the weights to it, layers.MoELayerBase._run_experts), else x's own. Under
    autocast the layer's input may be float32 (a plain LayerNorm's output) while the
    GEMMs are bf16: every decision that prices the experts (the planner, the performance
    model's calibration, the host check) asks this, not ``x.dtype``."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def grouped_kernel_supports(x: torch.Tensor, *widths: int) -> bool:
    """Whether `torch._grouped_mm` runs on rows like `x` with these inner widths (else:
    the per-expert loop)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    # The kernel asks for 16-byte strides: the inner widths (not the row count) must align.
    element = x.element_size()
    for size in widths:
        if size * element % 16:
            return False
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if x.device.type != "cuda" or x.dtype != torch.bfloat16:
        return False
    return _device_runs_grouped_kernel(x.device)


@functools.cache
def _device_runs_grouped_kernel(device: torch.device) -> bool:
    """`grouped_kernel_runs_on` for this GPU, asked once (every grouped GEMM of a pass asks)."""
    return grouped_kernel_runs_on(torch.cuda.get_device_capability(device))


# Compute capability majors where torch's grouped kernel is CUTLASS's (sm90 Hopper, sm100
# Blackwell). Elsewhere (sm80, sm11x, sm12x) torch runs a fallback that reads the group
# offsets on the host: a device sync per grouped GEMM.
GROUPED_KERNEL_MAJORS = (9, 10)


def grouped_kernel_runs_on(capability: tuple[int, int]) -> bool:
    """Whether `torch._grouped_mm` has its device-side (CUTLASS) kernel on a GPU of this
    compute capability."""
    return capability[0] in GROUPED_KERNEL_MAJORS


def _segments(counts: list[int]) -> Iterator[slice]:
    start = 0
    for count in counts:
        yield slice(start, start + count)
        start += count


def grouped_mm(x_NI: torch.Tensor, w_LIO: torch.Tensor, seg: ExpertSegments) -> torch.Tensor:
    """Local. y[rows of l] = x[rows of l] @ w[l], one kernel for all experts."""
    if seg.rows == 0:
        return x_NI.new_empty(0, w_LIO.shape[-1])
    if x_NI.dtype == w_LIO.dtype and grouped_kernel_supports(x_NI, *w_LIO.shape[-2:]):
        return torch._grouped_mm(x_NI, w_LIO, offs=seg.ends_L)
    y_NO = x_NI.new_empty(seg.rows, w_LIO.shape[-1])
    with honouring_sm_carveout():
        for l, rows in enumerate(_segments(seg.host_counts())):
            torch.mm(x_NI[rows], w_LIO[l], out=y_NO[rows])
    return y_NO


def runs_without_host_sync(call: Callable[[], object]) -> bool:
    """Whether ``call`` runs on the current CUDA device without raising and without a
    host-device synchronisation (CUDA's sync debug mode set to "error" makes any sync
    raise); the caller's mode is restored after. The mode is process-wide: call it only
    where no other thread launches work (`resolve_kernel_probes`)."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    except (RuntimeError, TypeError):
        return False
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return True


@functools.cache
def _grouped_kernel_widens(device_type: str) -> bool:
    """Whether this torch's grouped kernel writes a float32 result from bf16 operands on
    `device_type` (``out_dtype``) on the device, with no host sync (a kernel that reads the
    offsets on the host would sync once per GEMM, and abort a CUDA graph capture); a
    property of the installed build and the GPU, probed once."""
    if device_type != "cuda":
        return False  # CPU: "Grouped gemm output dtype must match `mat_a` dtype" (torch 2.13)
    a_KM = torch.ones(16, 8, dtype=torch.bfloat16, device=device_type)
    if not grouped_kernel_supports(a_KM, 8, 8):
        return False
    offs = torch.tensor([8, 16], dtype=torch.int32).to(device_type)  # copied before the check: a
    torch.cuda.synchronize()                                          # blocking copy is a sync too
    return runs_without_host_sync(lambda: torch._grouped_mm(a_KM.t(), a_KM, offs=offs, out_dtype=torch.float32))


def resolve_kernel_probes(device: torch.device) -> None:
    """Local (CUDA, the first time: a device sync). Run the probes the expert kernels make
    once per process (`_grouped_kernel_widens`) now, on the calling thread: a probe switches
    the process-wide sync debug mode and synchronises the device, which must not happen on
    one thread while another launches work (the overlapped micro-batch schedule calls this
    before its two threads start: workers/schedules.py)."""
    if device.type == "cuda":
        _grouped_kernel_widens("cuda")


def _wide_weight_grad(x_NI: torch.Tensor, dy_NO: torch.Tensor, seg: ExpertSegments,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """dw summed in ``out_dtype`` from rows of a lower precision: on CUDA the grouped kernel
    writing float32 where this torch has it, else one tensor-core GEMM per expert with a
    float32 result (an upcast float32 GEMM would run without tensor cores); elsewhere the
    kernel on upcast copies (a product of two bf16 or fp16 numbers is exact in float32, so
    only the order of the sums differs)."""
    if x_NI.device.type == "cuda" and out_dtype == torch.float32:
        if _grouped_kernel_widens("cuda") and grouped_kernel_supports(x_NI, x_NI.shape[-1], dy_NO.shape[-1]):
            return torch._grouped_mm(x_NI.t(), dy_NO, offs=seg.ends_L, out_dtype=out_dtype)
        dw_LIO = dy_NO.new_empty(seg.ends_L.shape[0], x_NI.shape[-1], dy_NO.shape[-1], dtype=out_dtype)
        with honouring_sm_carveout():
            for l, rows in enumerate(_segments(seg.host_counts())):
                # written in place: a product assigned into dw_LIO[l] was copied there, a pass
                # over every expert weight's gradient (2.1 ms of a gpt-xl step on an H200)
                torch.mm(x_NI[rows].t(), dy_NO[rows], out_dtype=out_dtype, out=dw_LIO[l])
        return dw_LIO
    return grouped_weight_grad(x_NI.to(out_dtype), dy_NO.to(out_dtype), seg)


def grouped_weight_grad(x_NI: torch.Tensor, dy_NO: torch.Tensor, seg: ExpertSegments,
                        out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Local. dw[l] = x[rows of l]ᵀ @ dy[rows of l] for all experts: [L, I, O], summed
    in ``out_dtype`` (default: the rows' dtype; under mixed precision the parameters', so
    the partial sums of several partitions add without rounding to the compute dtype)."""
    L, out_dtype = seg.ends_L.shape[0], out_dtype or dy_NO.dtype
    if seg.rows == 0:
        return dy_NO.new_zeros(L, x_NI.shape[-1], dy_NO.shape[-1], dtype=out_dtype)
    if out_dtype != dy_NO.dtype:
        return _wide_weight_grad(x_NI, dy_NO, seg, out_dtype)
    if x_NI.dtype == dy_NO.dtype and grouped_kernel_supports(x_NI, x_NI.shape[-1], dy_NO.shape[-1]):
        return torch._grouped_mm(x_NI.t(), dy_NO, offs=seg.ends_L)
    dw_LIO = dy_NO.new_empty(L, x_NI.shape[-1], dy_NO.shape[-1])
    with honouring_sm_carveout():
        for l, rows in enumerate(_segments(seg.host_counts())):
            torch.mm(x_NI[rows].t(), dy_NO[rows], out=dw_LIO[l])
    return dw_LIO


def grouped_bias_grad(dy_NO: torch.Tensor, seg: ExpertSegments, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Local. db[l] = Σ dy[rows of l], summed in ``out_dtype`` (default dy's): a row of
    ones against dy, one grouped GEMM.
    (An index_add over rows would serialise on atomics: every row of an expert adds
    into the same O numbers.) The kernel asks that a group's rows span a multiple of 16
    bytes along the operand's contiguous dimension, so the ones are 8 columns of N
    (column-major: the rows are the outer dimension); the first row is the answer."""
    L, out_dtype = seg.ends_L.shape[0], out_dtype or dy_NO.dtype
    if seg.rows == 0:
        return dy_NO.new_zeros(L, dy_NO.shape[-1], dtype=out_dtype)
    if L == 1:  # one expert (as many experts as GPUs): the column sums, one reduction
        return dy_NO.sum(0, keepdim=True, dtype=out_dtype)
    if out_dtype != dy_NO.dtype:
        if dy_NO.device.type == "cuda" and _grouped_kernel_widens("cuda") and grouped_kernel_supports(
                dy_NO, dy_NO.shape[-1]):
            return torch._grouped_mm(seg.ones(dy_NO.dtype), dy_NO, offs=seg.ends_L, out_dtype=out_dtype)[:, 0]
        if dy_NO.device.type == "cuda" and out_dtype == torch.float32 and dy_NO.dtype in (torch.bfloat16,
                                                                                           torch.float16):
            # one-hotᵀ @ dy with a float32 result: reads dy once, where an upcast copy of dy
            # (written and read again in float32) and a float32 sum per expert (each a wait
            # for the host counts) moved 5x the bytes: 2 x 9 ms per gpt-xl layer at 128k
            # tokens on an H200. Products with 1 are exact, so only the order of the float32
            # sums differs.
            return torch.mm(seg.one_hot(dy_NO.dtype).t(), dy_NO, out_dtype=out_dtype)
        return grouped_bias_grad(dy_NO.to(out_dtype), seg)
    if grouped_kernel_supports(dy_NO, dy_NO.shape[-1]):
        return torch._grouped_mm(seg.ones(dy_NO.dtype), dy_NO, offs=seg.ends_L)[:, 0]
    db_LO = dy_NO.new_empty(L, dy_NO.shape[-1])
    for l, rows in enumerate(_segments(seg.host_counts())):
        torch.sum(dy_NO[rows], 0, out=db_LO[l])
    return db_LO


def _add_bias(y_NO: torch.Tensor, b_LO: torch.Tensor | None, seg: ExpertSegments) -> torch.Tensor:
    """y[rows of l] += b[l], in place. In bf16, as one GEMM whose epilogue adds it: y += one-hot @ b
    (y read and written once, as by the GEMM that made it), where repeating b over the rows
    writes and reads an N x O tensor besides (3 passes of y's size more; 6 ms per gpt-xl layer
    at 128k tokens on an H200). The same numbers: the product sums one b and zeros in float32,
    and y + b rounds once, as the elementwise add does."""
    if b_LO is None or seg.rows == 0:
        return y_NO
    if b_LO.shape[0] == 1:  # one expert: one bias for every row, broadcast (y read and written once)
        return y_NO.add_(b_LO[0])
    if y_NO.dtype == torch.bfloat16 and b_LO.dtype == torch.bfloat16:
        return y_NO.addmm_(seg.one_hot(y_NO.dtype), b_LO)
    return y_NO.add_(b_LO.repeat_interleave(seg.counts_L, dim=0, output_size=seg.rows))


def _accumulate(total: torch.Tensor | None, part: torch.Tensor) -> torch.Tensor:
    return part if total is None else total.add_(part)


@dataclass
class ExpertGrads:
    """Gradient accumulators of the expert parameters (parameter layout; None until a
    partition adds to it), in ``dtype``: the parameters' own, also when the experts compute
    in a lower precision (mixed precision), so the sum over partitions does not depend on
    how many there are beyond float32 rounding (docs/design.md §7, numerics)."""

    dtype: torch.dtype | None = None  # None: each partition's product's dtype
    w1: torch.Tensor | None = None
    b1: torch.Tensor | None = None
    w2: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    w3: torch.Tensor | None = None

    def for_parameters(self, experts: "Experts") -> list[torch.Tensor | None]:
        """[w1, b1, w2, b2, w3] gradients, zeros for a present parameter no row reached."""
        out = []
        for name in ("w1", "b1", "w2", "b2", "w3"):
            param, grad = getattr(experts, name), getattr(self, name)
            out.append(None if param is None else grad if grad is not None
                       else torch.zeros_like(param, dtype=self.dtype or param.dtype))
        return out


@dataclass
class InputGrad:
    """What `Experts.input_grad` leaves for `Experts.weight_grads`."""

    dx_ND: torch.Tensor
    dA: PreActivation       # gradients of the pre-activation parts
    h_NH: torch.Tensor | None  # act(A) where the backward computed it (SwiGLU; GELU unless kept)


class Experts(nn.Module):
    """This rank's L experts. Parameters (docs/engine.md, "Parameters"):
    w1 [L, D, H], b1 [L, H], w2 [L, H, D], b2 [L, D]; SwiGLU adds w3 [L, D, H] (no bias)."""

    master_dtype: torch.dtype | None = None  # a `cast` view: its parameters' dtype
    # A `cast` view with b1: w1 and b1 in one [L, D + BIAS_COLUMNS, H] tensor, whose first D
    # rows are the view's w1, for GEMM1 to add the bias in its product (`project_in`).
    w1_with_bias: torch.Tensor | None = None

    def __init__(self, config: MoEConfig, local_experts: int, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.config = config
        self.local_experts = local_experts
        L, D, H = local_experts, config.d_model, config.d_hidden
        factory: dict[str, Any] = dict(device=device, dtype=dtype)
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

    def cast(self, dtype: torch.dtype) -> "Experts":
        """Local. A view of these experts whose weights are ``dtype`` copies (differentiable
        casts of the parameters), for compute in a lower precision than the parameters
        (mixed precision); ``self`` when they already are ``dtype``."""
        if self.w1.dtype == dtype:
            return self
        view = copy.copy(self)
        view._parameters = {}  # plain tensors below, not parameters of the view
        view.master_dtype = self.w1.dtype
        for name in ("w2", "w3", "b1", "b2"):
            weight = getattr(self, name)
            object.__setattr__(view, name, None if weight is None else weight.to(dtype))
        if self.b1 is None:
            object.__setattr__(view, "w1", self.w1.to(dtype))
            return view
        # The cast of w1 written into the first D rows of w1_with_bias, b1 into the next
        # (the same bytes as a cast of w1 alone, plus one row per BIAS_COLUMNS - 1 zeros).
        L, D, H = self.w1.shape
        w1_with_bias = self.w1.new_empty(L, D + BIAS_COLUMNS, H, dtype=dtype)
        w1_with_bias[:, :D].copy_(self.w1)
        w1_with_bias[:, D].copy_(self.b1)
        w1_with_bias[:, D + 1:].zero_()
        object.__setattr__(view, "w1_with_bias", w1_with_bias)
        object.__setattr__(view, "w1", w1_with_bias[:, :D])
        return view

    @property
    def pre_activation_width(self) -> int:
        return self.config.pre_activation_width

    # -- forward ------------------------------------------------------------------------------
    def project_in(self, x_ND: torch.Tensor, seg: ExpertSegments) -> PreActivation:
        """Local. GEMM1: A = [x @ w1 + b1] (SwiGLU: [x @ w1 + b1, x @ w3]). A `cast` view
        with b1 adds it inside the product: [x | 1 | 0…] @ [w1; b1; 0…] (the rows widened
        by BIAS_COLUMNS, a pass over N·D), where adding it after the GEMM reads and writes
        A again (N·H: most of the 17 ms the bias adds took in a gpt-xl step at batch 128 on
        an H200). One rounding of x·w1 + b1 to the compute dtype where the add rounded twice."""
        with torch.no_grad():
            w1_with_bias = self.w1_with_bias
            if w1_with_bias is not None and x_ND.dtype == w1_with_bias.dtype and grouped_kernel_supports(
                    x_ND, *w1_with_bias.shape[-2:]):
                A = [grouped_mm(torch.cat([x_ND, seg.bias_columns(x_ND.dtype)], dim=1), w1_with_bias, seg)]
            else:
                A = [_add_bias(grouped_mm(x_ND, self.w1, seg), self.b1, seg)]
            if self.w3 is not None:
                A.append(grouped_mm(x_ND, self.w3, seg))
            return A

    def activate(self, A: PreActivation) -> torch.Tensor:
        """Local. h = act(A)."""
        with torch.no_grad():
            if self.config.activation == "relu":
                return F.relu(A[0])
            if self.config.activation == "gelu":
                return F.gelu(A[0])
            return F.silu(A[0]).mul_(A[1])

    def project_out(self, h_NH: torch.Tensor, seg: ExpertSegments) -> torch.Tensor:
        """Local. GEMM2: y = h @ w2 + b2."""
        with torch.no_grad():
            return _add_bias(grouped_mm(h_NH, self.w2, seg), self.b2, seg)

    def forward(self, x_ND: torch.Tensor, seg: ExpertSegments) -> torch.Tensor:
        """Local, no autograd. The whole FFN of every local expert on its rows."""
        return self.project_out(self.activate(self.project_in(x_ND, seg)), seg)

    def host_count_reads(self, dtype: torch.dtype, device: torch.device, backward: bool) -> str | None:
        """Local. Why a pass of these experts on ``dtype`` rows on ``device`` would read the
        rows per expert on the host (the per-expert loop, for shapes and dtypes the grouped
        kernel does not run; a sync that no CUDA graph can capture), or None when every GEMM
        of the pass (its ``backward`` too) is one grouped kernel. Mirrors `grouped_mm` and
        `grouped_weight_grad`."""
        D, H = self.config.d_model, self.config.d_hidden
        if not grouped_kernel_supports(torch.empty(0, dtype=dtype, device=device), D, H):
            return (f"the grouped GEMM kernel does not run {dtype} rows of widths {D} and {H} on this "
                    f"{'GPU' if device.type == 'cuda' else 'device'} (it needs bf16 on sm90/sm100 and "
                    f"widths of whole 16-byte units)")
        wide = self.master_dtype or self.w1.dtype
        if not backward or wide == dtype:
            return None
        if device.type == "cuda":
            if wide == torch.float32 and _grouped_kernel_widens("cuda"):
                return None
            return (f"the weight gradients are summed in the {wide} parameters' dtype from {dtype} rows, "
                    f"which this torch's grouped kernel cannot write without host reads")
        if grouped_kernel_supports(torch.empty(0, dtype=wide, device=device), D, H):
            return None
        return f"the weight gradients are summed in {wide}, which the grouped GEMM kernel does not run"

    # -- backward -----------------------------------------------------------------------------
    def grads(self) -> ExpertGrads:
        """Empty gradient accumulators for `weight_grads`, in the parameters' dtype (a `cast`
        view's: its parameters')."""
        return ExpertGrads(self.master_dtype or self.w1.dtype)

    def backward(self, x_ND: torch.Tensor, A: PreActivation, dy_ND: torch.Tensor, seg: ExpertSegments,
                 grads: ExpertGrads) -> torch.Tensor:
        """Local. The whole backward of one group of rows (benchmarks and calibration):
        returns dx and adds the parameter gradients into `grads`."""
        done = self.input_grad(A, dy_ND, seg)
        self.weight_grads(x_ND, A, dy_ND, seg, done, grads)
        return done.dx_ND

    def input_grad(self, A: PreActivation, dy_ND: torch.Tensor, seg: ExpertSegments,
                   activation_kept: bool = False) -> InputGrad:
        """Local. dx = d(FFN)/dx · dy, from the pre-activation A (the activation is
        differentiated from A, elementwise). Run `weight_grads` with the result after
        sending dx on its way. GELU recomputes act(A) here, for w2's gradient, unless the
        caller kept it (``activation_kept``): one pass over A with its backward
        (`kernels.gelu_backward_and_activation`) where `weight_grads` would read A again."""
        with torch.no_grad():
            dh_NH = grouped_mm(dy_ND, self.w2.transpose(-2, -1), seg)
            if self.w3 is None:
                h_NH = None
                if self.config.activation == "gelu" and not activation_kept:
                    dA0, h_NH = kernels.gelu_backward_and_activation(dh_NH, A[0])
                else:
                    dA0 = activation_backward(dh_NH, A[0], self.config.activation)
                return InputGrad(grouped_mm(dA0, self.w1.transpose(-2, -1), seg), [dA0], h_NH)
            dgate_NH, dup_NH, h_NH = swiglu_backward(dh_NH, A[0], A[1])
            dx_ND = grouped_mm(dgate_NH, self.w1.transpose(-2, -1), seg)
            dx_ND.add_(grouped_mm(dup_NH, self.w3.transpose(-2, -1), seg))
            return InputGrad(dx_ND, [dgate_NH, dup_NH], h_NH)

    def weight_grads(self, x_ND: torch.Tensor, A: PreActivation, dy_ND: torch.Tensor, seg: ExpertSegments,
                     done: InputGrad, grads: ExpertGrads, h_NH: torch.Tensor | None = None) -> None:
        """Local. Adds this group of rows' parameter gradients into `grads`. `h_NH` is the
        activation when the caller kept it; otherwise it is recomputed from A."""
        with torch.no_grad():
            if h_NH is None:
                h_NH = done.h_NH if done.h_NH is not None else self.activate(A)
            done.h_NH = None  # freed once w2's gradient has used it
            wide = grads.dtype
            grads.w2 = _accumulate(grads.w2, grouped_weight_grad(h_NH, dy_ND, seg, wide))
            del h_NH
            if self.b2 is not None:
                grads.b2 = _accumulate(grads.b2, grouped_bias_grad(dy_ND, seg, wide))
            grads.w1 = _accumulate(grads.w1, grouped_weight_grad(x_ND, done.dA[0], seg, wide))
            if self.b1 is not None:
                grads.b1 = _accumulate(grads.b1, grouped_bias_grad(done.dA[0], seg, wide))
            if self.w3 is not None:
                grads.w3 = _accumulate(grads.w3, grouped_weight_grad(x_ND, done.dA[1], seg, wide))


def activation_backward(dh_NH: torch.Tensor, A_NH: torch.Tensor, activation: str) -> torch.Tensor:
    """dA from dh for ReLU / GELU, computed in place into dh_NH (returned)."""
    if activation == "relu":
        return dh_NH.masked_fill_(A_NH <= 0, 0)
    return torch.ops.aten.gelu_backward.grad_input(dh_NH, A_NH, grad_input=dh_NH)  # type: ignore[no-any-return]  # (torch.ops is untyped)


def swiglu_backward(dh_NH: torch.Tensor, gate_NH: torch.Tensor, up_NH: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d gate, d up, h) of h = silu(gate) * up, with three N·H tensors live at most:
    d gate in a new one (PyTorch's fused silu_backward, in place), d up in dh's memory and
    h in silu(gate)'s. The values are those of the plain formulas, bit for bit."""
    dgate_NH = dh_NH * up_NH
    torch.ops.aten.silu_backward.grad_input(dgate_NH, gate_NH, grad_input=dgate_NH)
    silu_NH = F.silu(gate_NH)
    dup_NH = dh_NH.mul_(silu_NH)
    h_NH = silu_NH.mul_(up_NH)
    return dgate_NH, dup_NH, h_NH
