"""Measured parts of one GPU, for the schedule simulator (simulator.py).

The simulator builds a layer's forward+backward out of the operations the
engine issues (pipeline.py, layers.py) and needs, for each, how long it keeps
its stream busy and how long the host takes to issue it. Those figures are
measured here, each on its own, never by timing the whole layer at the size
being predicted:

  * ``ffn``        the experts' FFN, device time only (the sum of the kernels'
                   durations in the CUDA profiler, so launch gaps and host syncs
                   are not counted): one expert on M rows (M = 64 … 65536) —
                   GEMM1, the forward, the backward and its input-gradient part
                   (``Experts.input_grad``; the rest is ``weight_grads``) — and
                   the same for L = 2, 4, 8 experts of M rows each
                   (``by_experts``), where one grouped GEMM per projection
                   serves every expert (``ffn_kernels = "grouped"``);
  * ``rows``       row-moving kernels of width D (gather = index_select,
                   copy, index_add), device time;
  * ``shell``      the layer's local work around the experts (router, dispatch
                   plan, un-permute, forward and backward), device time at T
                   tokens, on one rank (``dispatcher.plan_single``);
  * ``host_copy``  pinned device→host and host→device copies;
  * ``host``       the host's cost of issuing a whole layer, per engine,
                   strategy and n, measured at 64 tokens, where the device has
                   almost nothing to do (what remains is the host: Python,
                   launches, stream switches, events; one rank reads nothing
                   back from the device, docs/simulate.md);
  * ``slowdown``   the hardware profile's concurrency factors (perf_model.calibrate).

``GpuParts.load(path)`` reads the JSON ``measure_parts`` writes
(``mpipemoe simulate --measure-parts results/sim-parts-h200.json`` on the GPU).
Curves are interpolated in log-log; beyond the largest measured size a curve
grows in proportion (constant rate), below the smallest it stays flat (the
launch floor).

Older files (before the grouped kernels, commit 190f888) have no ``ffn_kernels``
and no ``input_grad_s``: their FFN curves are the per-expert GEMM loop of that
engine, so an expert group costs the sum of its experts' curves, and their
backward is split by FLOPs (`input_grad_share`). Their ``autograd_*`` curves
measured FastMoE's former autograd FFN, which no engine runs any more; they are
not read.
"""
from __future__ import annotations

import bisect
import json
import math
import time
from dataclasses import asdict, dataclass, field


def interpolate(xs: list, ys: list, x: float) -> float:
    """y at x from measured points, log-log between them; proportional above, flat below."""
    if not xs:
        raise ValueError("interpolate: no measured points; measure the parts again")
    if x <= xs[0]:
        return float(ys[0])
    if x >= xs[-1]:
        return float(ys[-1]) * x / xs[-1]
    i = bisect.bisect_right(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + w * (math.log(y1) - math.log(y0)))


def ffn_key(d_model: int, d_hidden: int, activation: str) -> str:
    return f"{d_model}x{d_hidden}-{activation}"


@dataclass(frozen=True)
class HostCost:
    """Host time to issue one layer's forward and backward, linear in n:
    seconds = fixed + per_partition * n (fitted over the measured n)."""

    forward_fixed_s: float
    forward_per_partition_s: float
    backward_fixed_s: float
    backward_per_partition_s: float
    prelude_s: float            # router + dispatch plan (inside the forward)

    def forward_s(self, n: int) -> float:
        return self.forward_fixed_s + self.forward_per_partition_s * n

    def backward_s(self, n: int) -> float:
        return self.backward_fixed_s + self.backward_per_partition_s * n


def _scaled_curves(curves: dict, scale: float) -> dict:
    """Every time series of a measured curve (nested ones too) times `scale`; the sizes
    ("rows") as they are."""
    return {name: value if name == "rows" else
            _scaled_curves(value, scale) if isinstance(value, dict) else [v * scale for v in value]
            for name, value in curves.items()}


def _line(ns: list, ys: list) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys over ns; slope 0 for one point."""
    if len(ns) == 1:
        return float(ys[0]), 0.0
    mean_n, mean_y = sum(ns) / len(ns), sum(ys) / len(ys)
    slope = sum((n - mean_n) * (y - mean_y) for n, y in zip(ns, ys)) / sum((n - mean_n) ** 2 for n in ns)
    return mean_y - slope * mean_n, slope


FFN_PHASES = ("gemm1", "forward", "backward", "input_grad", "weight_grads")


def input_grad_share(activation: str) -> float:
    """Share of the expert backward's GEMM FLOPs in its input-gradient part.

    `Experts.input_grad` runs the data-gradient GEMMs (GELU/ReLU: dh = dy·w2ᵀ and
    dx = dA·w1ᵀ, 2 of the 4 backward GEMMs; SwiGLU: dy·w2ᵀ, dgate·w1ᵀ and dup·w3ᵀ, 3 of
    6) and `weight_grads` the weight-gradient GEMMs; every one of them is 2·N·D·H FLOPs.
    Used to split a measured total backward where the parts have no input-gradient
    curve (files measured before the grouped kernels): the elementwise work (activation
    backward, its recomputation, bias gradients) is split the same way, an approximation.
    """
    data_gemms, all_gemms = (3, 6) if activation == "swiglu" else (2, 4)
    return data_gemms / all_gemms


def _phase_s(curve: dict, phase: str, rows: float, activation: str) -> float | None:
    """Seconds of an FFN `phase` from one measured curve; the backward's two parts from
    their own curve when measured, else split by FLOPs (`input_grad_share`). None for
    GEMM1 on a curve without it (the expert-group curves)."""
    if phase in ("input_grad", "weight_grads"):
        backward = interpolate(curve["rows"], curve["backward_s"], rows)
        if "input_grad_s" in curve:
            data = min(interpolate(curve["rows"], curve["input_grad_s"], rows), backward)
        else:
            data = backward * input_grad_share(activation)
        return data if phase == "input_grad" else backward - data
    if phase == "gemm1" and "gemm1_s" not in curve:  # an expert-group curve: GEMM1 as in one expert
        return None
    return interpolate(curve["rows"], curve[f"{phase}_s"], rows)


@dataclass(frozen=True)
class GpuParts:
    """Everything measured on one GPU that the simulator needs (see the module docstring)."""

    device: str
    dtype: str
    ffn: dict          # ffn_key -> {"rows": [...], "gemm1_s", "forward_s", "backward_s", "input_grad_s",
                       #   "by_experts": {str(L): {"rows", "forward_s", "backward_s", "input_grad_s"}}}
    rows: dict         # str(d_model) -> {"rows": [...], "gather_s", "copy_s", "index_add_s"}
    shell: dict        # str(d_model) -> {"tokens": [...], "forward_s", "backward_s"}
    host_copy: dict    # {"bytes": [...], "d2h_s", "h2d_s"}
    host: dict         # str(local experts) -> engine key (fastmoe, fastermoe, mpipemoe|none … mpipemoe|S4)
                       #   -> {"partitions": [...], "forward_s", "backward_s", "prelude_s"}
    slowdown: dict     # "victim|other" -> factor, as HardwareProfile.slowdown
    measured_at: str = ""
    torch_version: str = ""
    command: str = ""
    notes: dict = field(default_factory=dict)
    ffn_kernels: str = "per-expert"  # "grouped": one GEMM per projection for all experts (190f888 on)

    # -- reading -----------------------------------------------------------------------
    @classmethod
    def from_json(cls, data: dict) -> "GpuParts":
        missing = [k for k in ("device", "dtype", "ffn", "rows", "shell", "host_copy", "host", "slowdown")
                   if k not in data]
        if missing:
            raise ValueError(f"GpuParts: the parts file lacks {', '.join(missing)}; "
                             f"measure it again with mpipemoe simulate --measure-parts")
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

    @classmethod
    def load(cls, path: str) -> "GpuParts":
        with open(path) as f:
            return cls.from_json(json.load(f))

    def to_json(self) -> dict:
        return asdict(self)

    # -- device time of one operation ------------------------------------------------------
    def _ffn(self, d_model: int, d_hidden: int, activation: str) -> dict:
        key = ffn_key(d_model, d_hidden, activation)
        if key in self.ffn:
            return self.ffn[key]
        # Another shape: scale the nearest measured shape by FLOPs per row (same rows),
        # preferring a curve of the same activation (SwiGLU has a third projection).
        if not self.ffn:
            raise ValueError("GpuParts.ffn is empty; measure the parts again")

        def flops(k):
            size, act = k.split("-")
            d, h = size.split("x")
            return int(d) * int(h) * (3 if act == "swiglu" else 2)

        wanted = flops(key)
        nearest = min(self.ffn, key=lambda k: (k.split("-")[1] != activation, abs(math.log(flops(k) / wanted))))
        return _scaled_curves(self.ffn[nearest], wanted / flops(nearest))

    def ffn_s(self, phase: str, rows: int, d_model: int, d_hidden: int, activation: str = "gelu") -> float:
        """Device seconds of one expert's FFN `phase` (gemm1, forward, backward,
        input_grad, weight_grads) on `rows` rows; 0 for no rows."""
        if phase not in FFN_PHASES:
            raise ValueError(f"phase={phase!r} is invalid: choose one of {', '.join(FFN_PHASES)}")
        if rows <= 0:
            return 0.0
        return _phase_s(self._ffn(d_model, d_hidden, activation), phase, rows, activation)

    def grouped_ffn_s(self, phase: str, expert_rows: list, d_model: int, d_hidden: int,
                      activation: str = "gelu") -> float:
        """Device seconds of FFN `phase` over a rank's local experts, `expert_rows[l]` rows
        for expert l (experts.py: one grouped GEMM per projection for all of them).

        The sum of the experts' one-expert times, times the grouping factor measured at
        their mean rows: the grouped kernels on the nearest measured number of experts
        (``by_experts``) over that many one-expert kernels. So uniform routing gets the
        grouped measurement itself and skewed routing keeps the one-expert curve's shape.
        Files without grouped measurements: the plain sum (their engine ran one GEMM
        per expert)."""
        rows = [round(m) for m in expert_rows if m >= 0.5]
        if not rows:
            return 0.0
        alone = sum(self.ffn_s(phase, m, d_model, d_hidden, activation) for m in rows)
        return alone * self._grouping(phase, len(rows), sum(rows) / len(rows), d_model, d_hidden, activation)

    def _grouping(self, phase: str, experts: int, rows: float, d_model: int, d_hidden: int,
                  activation: str) -> float:
        """Grouped kernels over `experts` experts of `rows` rows each, against as many
        one-expert kernels (1 where not measured)."""
        if self.ffn_kernels != "grouped" or experts == 1:
            return 1.0
        curve = self._ffn(d_model, d_hidden, activation)
        groups = {int(L): c for L, c in curve.get("by_experts", {}).items()}
        nearest = min([1, *groups], key=lambda L: (abs(math.log(L / experts)), L))
        if nearest == 1:
            return 1.0
        grouped = _phase_s(groups[nearest], phase, rows, activation)
        if grouped is None:  # no GEMM1 curve per group: GEMM1 groups as the forward does
            return self._grouping("forward", experts, rows, d_model, d_hidden, activation)
        alone = nearest * _phase_s(curve, phase, rows, activation)
        return grouped / alone if alone > 0 else 1.0

    def rows_s(self, op: str, rows: int, d_model: int) -> float:
        """Device seconds of a row kernel (gather, copy, index_add) over rows × d_model."""
        if rows <= 0:
            return 0.0
        key = str(d_model)
        if key not in self.rows:  # bytes scale with the width: use the nearest width's curve
            nearest = min(self.rows, key=lambda k: abs(int(k) - d_model))
            rows, key = rows * d_model / int(nearest), nearest
        curve = self.rows[key]
        return interpolate(curve["rows"], curve[f"{op}_s"], rows)

    def shell_s(self, phase: str, tokens: int, d_model: int) -> float:
        """Seconds of the layer's local work around the experts (forward or backward)."""
        key = str(d_model)
        if key not in self.shell:
            nearest = min(self.shell, key=lambda k: abs(int(k) - d_model))
            tokens, key = tokens * d_model / int(nearest), nearest
        curve = self.shell[key]
        return interpolate(curve["tokens"], curve[f"{phase}_s"], max(tokens, 1))

    def host_copy_s(self, direction: str, nbytes: float) -> float:
        """Seconds of a pinned host copy ("d2h" or "h2d") of `nbytes`."""
        if nbytes <= 0:
            return 0.0
        return interpolate(self.host_copy["bytes"], self.host_copy[f"{direction}_s"], nbytes)

    def _host_line(self, engine_key: str, experts: str) -> HostCost:
        if engine_key not in self.host[experts]:
            raise ValueError(f"GpuParts.host has no entry {engine_key!r}; known: {', '.join(self.host[experts])}")
        entry = self.host[experts][engine_key]
        ns = entry["partitions"]
        f0, f1 = _line(ns, entry["forward_s"])
        b0, b1 = _line(ns, entry["backward_s"])
        return HostCost(f0, max(f1, 0.0), b0, max(b1, 0.0), float(sorted(entry["prelude_s"])[0]))

    def host_cost(self, engine_key: str, local_experts: int = 8) -> HostCost:
        """The host cost line of one engine (``fastmoe``, ``fastermoe``, ``mpipemoe|S1`` ...)
        with `local_experts` experts per rank, never below zero. Grouped kernels issue
        the same calls whatever the number of experts, so between the two measured L the
        line is interpolated and outside them it stays at the nearer one; older files
        (a GEMM launch per expert) extrapolate linearly in L."""
        measured = sorted(int(k) for k in self.host)
        lines = {L: self._host_line(engine_key, str(L)) for L in measured}
        if len(measured) == 1:
            return lines[measured[0]]
        lo, hi = measured[0], measured[-1]
        w = (local_experts - lo) / (hi - lo)
        if self.ffn_kernels == "grouped":
            w = min(max(w, 0.0), 1.0)
        mix = {name: max(0.0, (1 - w) * getattr(lines[lo], name) + w * getattr(lines[hi], name))
               for name in HostCost.__dataclass_fields__}
        return HostCost(**mix)


# -- measuring (needs a CUDA device; imports torch lazily) ------------------------------------

def _device_seconds(fn, device, repeats: int = 5) -> float:
    """Device time per call of `fn`: the sum of its kernels' and copies' durations as the
    CUDA profiler records them, so host gaps (launches, syncs) are not counted."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize(device)
    total_us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
    return total_us / 1e6 / repeats


ROW_GRID = tuple(2 ** i for i in range(6, 17))        # 64 … 65536 rows per expert
TOKEN_GRID = tuple(2 ** i for i in range(8, 17))      # 256 … 65536 tokens


def _grouped_ffn(experts, x, dy, counts, device) -> dict:
    """Device seconds of the FFN kernels every engine runs (experts.py), on rows split
    as `counts` over the local experts: GEMM1, the forward, the backward and its
    input-gradient part (`Experts.input_grad`; the weight-gradient GEMMs are the rest).
    Each backward starts from empty gradients, as the pipeline's first partition does
    (the simulator adds a later partition's gradient adds itself)."""
    from moe_engine.experts import ExpertSegments

    segments = ExpertSegments.from_counts(list(counts), device)
    A = experts.project_in(x, segments)
    return {"gemm1_s": _device_seconds(lambda: experts.project_in(x, segments), device),
            "forward_s": _device_seconds(lambda: experts(x, segments), device),
            "backward_s": max(_device_seconds(lambda: experts.backward(x, A, dy, segments, experts.grads()),
                                              device), 1e-6),
            "input_grad_s": _device_seconds(lambda: experts.input_grad(A, dy, segments), device)}


GROUPS = (2, 4, 8)  # local experts of the expert-group curves


def measure_ffn(config, device, dtype, rows_grid=ROW_GRID) -> dict:
    """One expert's FFN at every size of `rows_grid`, and the grouped kernels over L =
    2, 4, 8 experts of M rows each (M up to 16384): the grouping factor the simulator
    applies to a rank's experts (`GpuParts.grouped_ffn_s`)."""
    import torch

    from moe_engine.experts import Experts

    def curve(L, grid, phases):
        experts = Experts(config, L, device=device, dtype=dtype)
        out = {"rows": list(grid), **{f"{phase}_s": [] for phase in phases}}
        for M in grid:
            x = torch.randn(L * M, config.d_model, device=device, dtype=dtype)
            measured = _grouped_ffn(experts, x, torch.randn_like(x), [M] * L, device)
            for phase in phases:
                out[f"{phase}_s"].append(measured[f"{phase}_s"])
            del x
        return out

    out = curve(1, rows_grid, ("gemm1", "forward", "backward", "input_grad"))
    out["by_experts"] = {str(L): curve(L, [m for m in rows_grid if m <= 16384], ("forward", "backward", "input_grad"))
                         for L in GROUPS}
    return out


def measure_rows(d_model: int, device, dtype, rows_grid=ROW_GRID) -> dict:
    import torch

    out = {"rows": [], "gather_s": [], "copy_s": [], "index_add_s": []}
    for R in rows_grid:
        R = 2 * R  # rows of all experts together: up to 131072
        T = R // 2
        x_TD = torch.randn(T, d_model, device=device, dtype=dtype)
        rows_RD = torch.randn(R, d_model, device=device, dtype=dtype)
        out_RD = torch.empty_like(rows_RD)
        index_R = torch.randint(0, T, (R,), device=device)
        dx_TD = torch.zeros_like(x_TD)
        out["rows"].append(R)
        out["gather_s"].append(_device_seconds(lambda: torch.index_select(x_TD, 0, index_R, out=out_RD), device))
        out["copy_s"].append(_device_seconds(lambda: out_RD.copy_(rows_RD), device))
        out["index_add_s"].append(_device_seconds(lambda: dx_TD.index_add_(0, index_R, rows_RD), device))
    return out


def measure_shell(config, device, dtype, token_grid=TOKEN_GRID) -> dict:
    """Router + dispatch plan + un-permute, forward and backward, on one rank (the
    experts' output rows are a leaf tensor here: what produces them is simulated op by op)."""
    import torch

    from moe_engine import dispatcher
    from moe_engine.layers import FastMoE

    layer = FastMoE(config, None, device=device, dtype=dtype)
    out = {"tokens": list(token_grid), "forward_s": [], "backward_s": []}
    for T in token_grid:
        x = torch.randn(T, config.d_model, device=device, dtype=dtype)
        dy = torch.randn_like(x)
        rows_RD = torch.randn(config.top_k * T, config.d_model, device=device, dtype=dtype, requires_grad=True)
        holder = {}

        def forward():
            x_TD = x.detach().requires_grad_(True)
            routing = layer.router(x_TD)
            plan, _ = layer.plan(x_TD, routing)
            y_TD = dispatcher.unpermute(rows_RD, plan, routing.weights_TK, routing.keep_TK)
            holder["out"] = (y_TD, routing.aux_loss)

        def backward():
            y_TD, aux = holder["out"]
            rows_RD.grad = None
            torch.autograd.backward([y_TD, aux], [dy, torch.ones_like(aux)])

        out["forward_s"].append(_device_seconds(forward, device))
        both = _device_seconds(lambda: (forward(), backward()), device)
        out["backward_s"].append(max(both - out["forward_s"][-1], 1e-6))
    return out


def measure_host_copy(device, dtype, sizes=tuple(2 ** i for i in range(20, 31, 2))) -> dict:
    import torch

    out = {"bytes": [], "d2h_s": [], "h2d_s": []}
    for nbytes in sizes:
        dev = torch.empty(nbytes // 2, device=device, dtype=dtype)
        host = torch.empty(nbytes // 2, dtype=dtype, pin_memory=True)
        out["bytes"].append(nbytes)
        out["d2h_s"].append(_device_seconds(lambda: host.copy_(dev, non_blocking=True), device, repeats=5))
        out["h2d_s"].append(_device_seconds(lambda: dev.copy_(host, non_blocking=True), device, repeats=5))
    return out


def measure_host(config, device, dtype, tokens: int = 64, partitions=(1, 2, 4, 8), rounds: int = 40) -> dict:
    """Host seconds of one layer's forward and backward at `tokens` tokens (the device has
    almost nothing to do at this size, so the wall time is the host's): per engine,
    strategy and n.

    Every configuration runs once per round, round after round, so a slow spell of the
    machine touches all of them alike; the median over rounds counts. Run it before
    anything uses the CUDA profiler: profiling slows later launches."""
    import statistics

    import torch

    from moe_engine.config import STRATEGIES
    from moe_engine.layers import FastMoE, FasterMoE, MPipeMoE
    from moe_engine.timing import synchronize

    x = torch.randn(tokens, config.d_model, device=device, dtype=dtype)
    dy = torch.randn_like(x)
    layers = {("fastmoe", 1): FastMoE(config, None, device=device, dtype=dtype),
              ("fastermoe", 1): FasterMoE(config, None, device=device, dtype=dtype)}
    for s in STRATEGIES:
        for n in partitions:
            layers[(f"mpipemoe|{s}", n)] = MPipeMoE(config, None, n, s, device=device, dtype=dtype)
    samples = {key: ([], [], []) for key in layers}
    clock = time.perf_counter
    for round_ in range(rounds + 3):
        for key, layer in layers.items():
            synchronize(device)
            t0 = clock()
            layer.zero_grad(set_to_none=True)
            y, aux = layer(x.detach().requires_grad_(True))
            t1 = clock()
            torch.autograd.backward([y, aux], [dy, torch.ones_like(aux)])
            t2 = clock()
            synchronize(device)
            x_TD = x.detach().requires_grad_(True)
            t3 = clock()
            routing = layer.router(x_TD)
            layer.plan(x_TD, routing)
            t4 = clock()
            if round_ >= 3:
                for series, value in zip(samples[key], (t1 - t0, t2 - t1, t4 - t3)):
                    series.append(value)
    result = {}
    for (engine_key, n), (fwd, bwd, pre) in samples.items():
        entry = result.setdefault(engine_key, {"partitions": [], "forward_s": [], "backward_s": [], "prelude_s": []})
        entry["partitions"].append(n)
        entry["forward_s"].append(statistics.median(fwd))
        entry["backward_s"].append(statistics.median(bwd))
        entry["prelude_s"].append(statistics.median(pre))
    return result


SPOT_CHECKS = (("gpt-s", 4096, "mpipemoe", 1, "none"), ("gpt-s", 4096, "mpipemoe", 4, "none"),
               ("gpt-s", 16384, "mpipemoe", 2, "S4"), ("gpt-xl", 32768, "mpipemoe", 1, "none"),
               ("gpt-xl", 32768, "mpipemoe", 1, "S1"), ("gpt-xl", 16384, "mpipemoe", 8, "S3"),
               ("gpt-xl", 32768, "fastmoe", 1, "none"), ("gpt-s", 8192, "fastermoe", 1, "none"))
SPOT_SHAPES = {"gpt-s": (1024, 4096), "gpt-xl": (2048, 8192)}


def spot_check(device, dtype, checks=SPOT_CHECKS) -> list:
    """A few whole layers timed the way `mpipemoe bench` times them (interleaved rounds,
    median), to compare this machine today with the one that made the benchmark records
    (not used by the simulator)."""
    import torch

    from moe_engine.config import MoEConfig
    from moe_engine.layers import FastMoE, FasterMoE, MPipeMoE
    from moe_engine.timing import time_interleaved

    steps = []
    for model, tokens, engine, n, strategy in checks:
        d_model, d_hidden = SPOT_SHAPES[model]
        config = MoEConfig(d_model, d_hidden, 8, top_k=2, activation="gelu")
        layer = {"fastmoe": lambda: FastMoE(config, None, device=device, dtype=dtype),
                 "fastermoe": lambda: FasterMoE(config, None, device=device, dtype=dtype),
                 "mpipemoe": lambda: MPipeMoE(config, None, n, strategy, device=device, dtype=dtype)}[engine]()
        x = torch.randn(tokens, d_model, device=device, dtype=dtype)

        def step(layer=layer, x=x, dy=torch.randn_like(x)):
            layer.zero_grad(set_to_none=True)
            y, aux = layer(x.detach().requires_grad_(True))
            torch.autograd.backward([y, aux], [dy, torch.ones_like(aux)])
        steps.append(step)
    timings = time_interleaved(steps, device, rounds=5, warmup=1, repeats=3)
    results = [{"model": model, "tokens": tokens, "engine": engine, "partitions": n, "strategy": strategy,
                "fwd_bwd_ms": timing.median_ms}
               for (model, tokens, engine, n, strategy), timing in zip(checks, timings)]
    del steps
    torch.cuda.empty_cache()
    return results


HOST_EXPERTS = (8, 2)   # local experts of the host-cost measurements (E = 8 and E = 2, one rank)
HOST_LAYER = {"top_k": 2, "activation": "gelu", "bias": True}  # the layer the host costs are measured on
FFN_ACTIVATIONS = ("gelu", "swiglu")  # the FFN curves of each shape (SwiGLU: the lean engine's benchmarks)


def measure_parts(shapes, device=None, dtype=None, printer=print) -> GpuParts:
    """Measure every part on this CUDA device for the (d_model, d_hidden) `shapes`
    (GELU, top-2: the benchmark's layer; the FFN also with SwiGLU). Host costs first: the
    CUDA profiler, which the device-time measurements use, slows every later launch of
    the process."""
    import torch

    from moe_engine.comm import ExpertGroup
    from moe_engine.config import MoEConfig
    from moe_engine.perf_model import calibrate, device_name

    device = device or torch.device("cuda")
    dtype = dtype or torch.bfloat16
    if device.type != "cuda":
        raise ValueError("measure_parts needs a CUDA device: the parts are device times")
    torch.manual_seed(0)
    d_model, d_hidden = shapes[0]
    printer("  host cost per engine ...")
    host = {str(L): measure_host(MoEConfig(d_model, d_hidden, L, **HOST_LAYER), device, dtype)
            for L in HOST_EXPERTS}
    printer("  spot check of whole layers ...")
    notes = {"spot_check": spot_check(device, dtype)}
    ffn, rows, shell, slowdown = {}, {}, {}, {}
    for d_model, d_hidden in shapes:
        config = MoEConfig(d_model, d_hidden, 8, top_k=2, activation="gelu")
        profile = calibrate(config, 16384, ExpertGroup(None), device, dtype)
        notes[f"profile {d_model}x{d_hidden}"] = profile.to_json()
        for k, v in profile.slowdown.items():
            slowdown[k] = max(slowdown.get(k, 1.0), v)
        for activation in FFN_ACTIVATIONS:
            printer(f"  ffn {d_model}x{d_hidden} {activation} ...")
            ffn[ffn_key(d_model, d_hidden, activation)] = measure_ffn(
                MoEConfig(d_model, d_hidden, 8, top_k=2, activation=activation), device, dtype)
        printer(f"  rows / shell d_model={d_model} ...")
        rows[str(d_model)] = measure_rows(d_model, device, dtype)
        shell[str(d_model)] = measure_shell(config, device, dtype)
    printer("  host copies ...")
    host_copy = measure_host_copy(device, dtype)
    return GpuParts(device=device_name(device), dtype=str(dtype).replace("torch.", ""), ffn=ffn, rows=rows,
                    shell=shell, host_copy=host_copy, host=host, slowdown=slowdown,
                    measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    torch_version=torch.__version__, notes=notes, ffn_kernels="grouped")
