"""Layers the bench times beside our engines (issue 15): torchtitan's MoE layer on our
shapes, inputs and weights, and the dense-GEMM floor of the same routed work.

    mpipemoe bench --model gpt-s --activation swiglu --no-bias --peers torchtitan   # on a GPU

torchtitan is optional (CI has none); it is imported only when a peer is built, and
tools/gpu-records.sh installs the wheels in .whl/ on the GPU machine.

Shapes: see moe_engine's legend (moe_engine/__init__.py); torchtitan's F is our H and
its L our S, which its parameter names (`w1_EFD`) keep.

What torchtitan's layer does differently, by its design (torchtitan 0.3.0,
torchtitan/models/common/moe.py), and how it is configured here:
- the gate: softmax over the E logits computed in fp32 (autocast on CUDA; ours computes
  the logits GEMM in the input dtype and the softmax in fp32), top-K, renormalised
  (``route_norm=True``, denominator + 1e-20; ours has no epsilon), ``route_scale=1``;
- the experts always compute in bf16 (``GroupedExperts`` casts x and the weights to
  bf16 and calls ``torch._grouped_mm``), so on fp32 it matches ours to bf16 precision;
- no load-balance loss: its balancing is the aux-loss-free expert bias, which changes
  routing from step to step and is off here (``load_balance_coeff=None``); the wrapper
  returns a zero aux so the bench's step can run it like ours;
- the combine is ``deterministic_scatter_add`` (scatter_add under deterministic algorithms).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from app.bench.parts import setting_label
from moe_engine import MoEConfig

PEERS = ("torchtitan",)
TORCHTITAN_VERSION = "0.3.0"  # the API below is torchtitan 0.3.0's; .whl/ holds that wheel


def check_peers(peers, *, activation: str, bias: bool, capacity_factor=None, world_size: int = 1) -> None:
    """Raises ValueError naming every option a requested peer cannot run with."""
    for peer in peers:
        if peer not in PEERS:
            raise ValueError(f"--peers {peer!r} is unknown: choose from {', '.join(PEERS)}")
    if "torchtitan" not in peers:
        return
    unsupported = []
    if world_size != 1:
        unsupported.append(f"world size {world_size} (give --world-size 1: the peer runs on one GPU, "
                           "without expert parallelism)")
    if activation != "swiglu":
        unsupported.append(f"activation {activation!r} (give --activation swiglu: torchtitan's experts are SwiGLU)")
    if bias:
        unsupported.append("expert biases (give --no-bias: torchtitan's experts have none)")
    if capacity_factor is not None:
        unsupported.append(f"capacity_factor {capacity_factor} (torchtitan's layer is dropless: use None)")
    if unsupported:
        raise ValueError("torchtitan's MoE layer cannot run with " + "; ".join(unsupported))


def _torchtitan():
    """torchtitan 0.3.0's MoE classes, or an ImportError that says how to get them."""
    try:
        from torchtitan.models.common.linear import Linear
        from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
        from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher
    except ImportError as error:
        raise ImportError(f"--peers torchtitan needs torchtitan=={TORCHTITAN_VERSION} importable ({error}); "
                          "install the wheels in .whl/ as tools/gpu-records.sh does (its MoE also "
                          "imports triton, which CUDA builds of torch bring)") from error
    return Linear, GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter, LocalTokenDispatcher


def require_peers(peers) -> None:
    """Imports every requested peer's library now, so a missing one fails before any timing
    (a RuntimeError: the CLI prints it as one line)."""
    loaders = {"torchtitan": _torchtitan}
    for peer in peers:
        try:
            loaders[peer]()
        except ImportError as error:
            raise RuntimeError(str(error)) from error


def torchtitan_config(config: MoEConfig):
    """torchtitan's MoE.Config for our layer's shapes: SwiGLU experts without biases,
    softmax top-K gate renormalised like ours, dropless, no shared experts, no
    expert-bias balancing, local dispatch (one GPU)."""
    Linear, GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter, LocalTokenDispatcher = _torchtitan()
    E, D, H, K = config.num_experts, config.d_model, config.d_hidden, config.top_k
    return MoE.Config(
        num_experts=E,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=D, hidden_dim=H, num_experts=E),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=K)),
        router=TokenChoiceTopKRouter.Config(
            num_experts=E, gate=Linear.Config(in_features=D, out_features=E, bias=False), top_k=K,
            score_func="softmax", route_norm=True, route_scale=1.0),
        load_balance_coeff=None,
        shared_experts=None)


def torchtitan_state_dict(source_layer: nn.Module) -> dict:
    """Our layer's weights in torchtitan's layout. Ours: router.weight [E, D],
    experts.w1 [E, D, H], experts.w2 [E, H, D], experts.w3 [E, D, H]; torchtitan's:
    router.gate.weight [E, D], w1_EFD [E, H, D], w2_EDF [E, D, H], w3_EFD [E, H, D]."""
    ours = source_layer.state_dict()
    experts = "routed_experts.inner_experts."
    return {"router.gate.weight": ours["router.weight"],
            experts + "w1_EFD": ours["experts.w1"].transpose(1, 2),
            experts + "w2_EDF": ours["experts.w2"].transpose(1, 2),
            experts + "w3_EFD": ours["experts.w3"].transpose(1, 2)}


class TorchtitanMoE(nn.Module):
    """torchtitan's MoE layer behind our layers' call, ``y, aux = layer(x)`` with x of
    shape (T, D) or (B, S, D)."""

    def __init__(self, moe: nn.Module):
        super().__init__()
        self.moe = moe

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x_BSD = x.reshape(1, -1, x.shape[-1]) if x.dim() == 2 else x
        y = self.moe(x_BSD).reshape(x.shape)
        # torchtitan has no aux loss (see the module docstring); a zero that requires grad
        # lets the bench's backward([y, aux], ...) run as it does for our layers.
        return y, torch.zeros((), device=x.device, dtype=x.dtype, requires_grad=True)


def build_torchtitan_moe(config: MoEConfig, source_layer: nn.Module, device, dtype) -> TorchtitanMoE:
    """torchtitan's MoE layer with `config`'s shapes and `source_layer`'s weights (one of
    our layers at world size 1), on `device` in `dtype`."""
    world_size = getattr(getattr(source_layer, "group", None), "size", 1)
    check_peers(("torchtitan",), activation=config.activation, bias=config.bias,
                capacity_factor=config.capacity_factor, world_size=world_size)
    torch_config = torchtitan_config(config)
    with torch.device(device):
        moe = torch_config.build()
    # Only the parameters take `dtype`: the layer's token counter stays fp32, as torchtitan keeps it.
    moe.router.to(dtype=dtype)
    moe.routed_experts.to(dtype=dtype)
    weights = torchtitan_state_dict(source_layer)
    for name, tensor in weights.items():
        expected = moe.get_parameter(name).shape
        if tensor.shape != expected:
            raise ValueError(f"{name}: our layer gives shape {tuple(tensor.shape)}, torchtitan's needs "
                             f"{tuple(expected)}; build the source layer with world size 1 and the same config")
    moe.load_state_dict(weights, strict=True)
    return TorchtitanMoE(moe)


def build_peer(name: str, config: MoEConfig, source_layer: nn.Module, device, dtype) -> nn.Module:
    """The peer called `name` (one of PEERS) with `source_layer`'s shapes and weights."""
    builders = {"torchtitan": build_torchtitan_moe}
    if name not in builders:
        raise ValueError(f"--peers {name!r} is unknown: choose from {', '.join(PEERS)}")
    return builders[name](config, source_layer, device, dtype)


# -- the dense-GEMM floor -----------------------------------------------------------------------

def dense_ffn(x_RD: torch.Tensor, w1_HD: torch.Tensor, w3_HD: torch.Tensor | None, w2_DH: torch.Tensor,
              activation: str, b1_H=None, b2_D=None) -> torch.Tensor:
    """Local. One dense FFN over all rows: SwiGLU silu(x w1ᵀ) · (x w3ᵀ), else act(x w1ᵀ + b1);
    then · w2ᵀ + b2."""
    gate_RH = F.linear(x_RD, w1_HD, b1_H)
    if activation == "swiglu":
        h_RH = F.silu(gate_RH) * F.linear(x_RD, w3_HD)
    else:
        h_RH = F.relu(gate_RH) if activation == "relu" else F.gelu(gate_RH)
    return F.linear(h_RH, w2_DH, b2_D)


def dense_floor_step(config: MoEConfig, tokens: int, device, dtype):
    """A callable running forward + backward of ONE dense FFN (config's activation and
    biases; SwiGLU has separate gate and up GEMMs, as our experts and torchtitan's do)
    over top_k·tokens rows: the routed layer's GEMMs with no routing, no permutation and
    one expert, the floor its expert work could reach. Each call computes dx and every
    weight gradient and keeps none of them (nothing stays allocated between calls)."""
    R, D, H = config.top_k * tokens, config.d_model, config.d_hidden

    def leaf(*shape, std):
        return (torch.randn(*shape, device=device, dtype=dtype) * std).requires_grad_(True)

    x_RD, dy_RD = leaf(R, D, std=1.0), torch.randn(R, D, device=device, dtype=dtype)
    w1_HD, w2_DH = leaf(H, D, std=D ** -0.5), leaf(D, H, std=H ** -0.5)
    w3_HD = leaf(H, D, std=D ** -0.5) if config.gated else None
    b1_H, b2_D = (leaf(H, std=0.0), leaf(D, std=0.0)) if config.bias else (None, None)
    leaves = [t for t in (x_RD, w1_HD, w3_HD, w2_DH, b1_H, b2_D) if t is not None]

    def step():
        y_RD = dense_ffn(x_RD, w1_HD, w3_HD, w2_DH, config.activation, b1_H, b2_D)
        torch.autograd.grad(y_RD, leaves, dy_RD)
    return step


# -- summaries ----------------------------------------------------------------------------------

LEAN_MEMORY_SHARE = 0.5  # a "lean" grid setting peaks at most at this share of torchtitan's memory


def peer_summary(point: list) -> dict:
    """The peers' ratios at one (model, routing, tokens) point, from its records; each
    X_vs_Y is X's fwd+bwd time over Y's (below 1: X is faster). n1 is MPipeMoE's grid
    setting n=1, strategy none. lean_* is the fastest memory-saving grid setting
    (S1–S4) whose peak memory is at most LEAN_MEMORY_SHARE of torchtitan's."""
    def one(engine, chosen_by, **match):
        return next((r for r in point if r["engine"] == engine and r["chosen_by"] == chosen_by
                     and all(r.get(k) == v for k, v in match.items())), None)

    n1 = one("mpipemoe", "grid", partitions=1, strategy="none")
    fast, titan, floor = one("fastmoe", "baseline"), one("torchtitan", "peer"), one("dense-floor", "floor")
    out = {}
    ratio = lambda a, b: a["fwd_bwd_ms"] / b["fwd_bwd_ms"]  # noqa: E731
    if titan:
        out["torchtitan_fwd_bwd_ms"] = titan["fwd_bwd_ms"]
        if titan.get("peak_memory_bytes"):
            out["torchtitan_peak_memory_bytes"] = titan["peak_memory_bytes"]
    if floor:
        out["dense_floor_fwd_bwd_ms"] = floor["fwd_bwd_ms"]
    if n1:
        out["mpipemoe_n1_fwd_bwd_ms"] = n1["fwd_bwd_ms"]
        if titan:
            out["mpipemoe_n1_vs_torchtitan"] = ratio(n1, titan)
            if n1.get("peak_memory_bytes") and titan.get("peak_memory_bytes"):
                out["mpipemoe_n1_memory_vs_torchtitan"] = n1["peak_memory_bytes"] / titan["peak_memory_bytes"]
        if fast:
            out["fastmoe_vs_mpipemoe_n1"] = ratio(fast, n1)
        if floor:
            out["n1_vs_dense_floor"] = ratio(n1, floor)
    if titan and titan.get("peak_memory_bytes"):
        lean = [r for r in point if r["engine"] == "mpipemoe" and r["chosen_by"] == "grid"
                and r["strategy"] != "none" and r.get("peak_memory_bytes")
                and r["peak_memory_bytes"] <= LEAN_MEMORY_SHARE * titan["peak_memory_bytes"]]
        if lean:
            best = min(lean, key=lambda r: r["fwd_bwd_ms"])
            out.update(lean_setting=setting_label(best), lean_vs_torchtitan=ratio(best, titan),
                       lean_memory_vs_torchtitan=best["peak_memory_bytes"] / titan["peak_memory_bytes"])
    return out


def peer_table(summaries: list) -> list[str]:
    """Markdown lines: our layer against torchtitan and the dense floor, per point (none
    when no summary has a peer or floor measurement)."""
    if not any("dense_floor_fwd_bwd_ms" in s or "torchtitan_fwd_bwd_ms" in s for s in summaries):
        return []
    fmt = lambda v, f: "–" if v is None else format(v, f)  # noqa: E731
    lines = ["## Against torchtitan and the dense-GEMM floor", "",
             "n1 = MPipeMoE at n = 1, strategy none. Ratios are fwd+bwd times (below 1: the first is faster). "
             f"lean = the fastest S1–S4 grid setting peaking at ≤ {LEAN_MEMORY_SHARE:.0%} of torchtitan's memory. "
             "Dense floor = one dense FFN over the same k·T rows, no routing.", "",
             "| model | routing | tokens | n1 ms | torchtitan ms | dense floor ms | n1 / torchtitan | "
             "FastMoE / n1 | n1 / floor | n1 memory / torchtitan | lean n/strategy | lean / torchtitan | "
             "lean memory / torchtitan |", "|" + "---|" * 13]
    for s in summaries:
        lines.append(
            f"| {s['model']} | {s.get('routing', 'uniform')} | {s['tokens']} | "
            f"{fmt(s.get('mpipemoe_n1_fwd_bwd_ms'), '.2f')} | {fmt(s.get('torchtitan_fwd_bwd_ms'), '.2f')} | "
            f"{fmt(s.get('dense_floor_fwd_bwd_ms'), '.2f')} | {fmt(s.get('mpipemoe_n1_vs_torchtitan'), '.2f')} | "
            f"{fmt(s.get('fastmoe_vs_mpipemoe_n1'), '.2f')} | {fmt(s.get('n1_vs_dense_floor'), '.2f')} | "
            f"{fmt(s.get('mpipemoe_n1_memory_vs_torchtitan'), '.2f')} | {s.get('lean_setting', '–')} | "
            f"{fmt(s.get('lean_vs_torchtitan'), '.2f')} | {fmt(s.get('lean_memory_vs_torchtitan'), '.2f')} |")
    return lines + [""]
