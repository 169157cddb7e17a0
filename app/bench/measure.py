"""Measuring one MoE layer at a bench point (app/bench/layer.py): its forward+backward time in
interleaved rounds with the host probe beside it, its settled peak memory, and the two stages
MPipeMoE overlaps (the All-to-Alls and the expert FFN) each timed alone, with the expert GEMMs'
rate against one dense GEMM of the same rows."""
from __future__ import annotations

from typing import Callable

import torch

from app.bench.layer_settings import BenchSettings
from app.bench.parts import peak_memory_bytes
from moe_engine import MoEConfig, MPipeMoE
from moe_engine.comm import ExpertGroup
from moe_engine.experts import Experts, ExpertSegments
from moe_engine.router import count_ids
from moe_engine.timing import synchronize, time_fn, time_interleaved

def layer_pass(layer, x, grad_y) -> None:
    """One forward+backward of `layer` on `x`, `grad_y` the output's gradient (its own
    gradients cleared first)."""
    layer.zero_grad(set_to_none=True)
    x_in = x.detach().requires_grad_(True)
    y, aux = layer(x_in)
    torch.autograd.backward([y, aux], [grad_y, torch.ones_like(aux)])


def settle_and_measure_memory(layer, x, grad_y, device) -> dict:
    """Lets an automatic layer's search settle, then its peak memory above parameters and
    inputs for one forward+backward (None off CUDA)."""
    if isinstance(layer, MPipeMoE) and layer.partitions == "auto":
        for _ in range(60):  # let the online search settle on an n
            layer_pass(layer, x, grad_y)
            if layer.search.active is None and layer.search.cache:
                break
    layer_pass(layer, x, grad_y)
    synchronize(device)
    layer.zero_grad(set_to_none=True)
    return {"peak_memory_bytes": peak_memory_bytes(lambda: layer_pass(layer, x, grad_y), device)}


# The host probe: the same layer at so few tokens that the device has almost nothing to do,
# so its time is the host's cost of issuing the layer (what the simulator's host term is).
HOST_PROBE_TOKENS = 64


def probe_inputs(x: torch.Tensor, grad_y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HOST_PROBE_TOKENS of the point's tokens, spread over the batch (its routing mix)."""
    stride = max(1, x.shape[0] // HOST_PROBE_TOKENS)
    return x[::stride][:HOST_PROBE_TOKENS].contiguous(), grad_y[::stride][:HOST_PROBE_TOKENS].contiguous()


def time_layers(layers: list, probed: list, x, grad_y, settings: BenchSettings, device,
                extra: tuple = (), emulator_host: Callable[[], float] | None = None) -> list[dict]:
    """Forward+backward time of every layer, timed in interleaved rounds (timing.time_interleaved):
    the median over rounds and the spread between rounds, and the host's time to issue a pass
    beside it (`host_ms`: until the pass returned, unsynchronized; it includes any wait at the
    pass's host read); with `emulator_host` (an emulated group's running total of its own host
    seconds, moe_sim/emulation.py EmulatedTiming.host_s) the part of it spent inside the
    emulated collectives (`emulator_host_ms`), which a real rank does not pay. For the layers
    marked in `probed` also the host probe, timed in the same rounds right after its layer
    (`host_probe_ms`), so both see the machine in the same state. `extra` callables (the dense
    floor) are timed in the same rounds; their results follow the layers'."""
    x_probe, grad_probe = probe_inputs(x, grad_y)
    fns: list = []
    slots: list[tuple[int, int | None]] = []
    for layer, probe in zip(layers, probed):
        fns.append(lambda layer=layer: layer_pass(layer, x, grad_y))
        slots.append((len(fns) - 1, len(fns) if probe else None))
        if probe:
            fns.append(lambda layer=layer: layer_pass(layer, x_probe, grad_probe))
    for fn in extra:
        fns.append(fn)
        slots.append((len(fns) - 1, None))
    timings = time_interleaved(fns, device, rounds=settings.rounds, warmup=settings.warmup, repeats=settings.repeats,
                               host_counter=emulator_host)
    results = []
    for main, probe in slots:
        result = {"fwd_bwd_ms": timings[main].median_ms, "fwd_bwd_ms_std": timings[main].spread_s * 1e3,
                  "host_ms": timings[main].host_ms}
        if emulator_host is not None:
            result["emulator_host_ms"] = timings[main].counted_ms
        if probe is not None:
            result.update(host_probe_ms=timings[probe].median_ms, host_probe_tokens=HOST_PROBE_TOKENS)
        results.append(result)
    return results


def expert_ffn(config: MoEConfig, experts: Experts, counts: list, device, dtype):
    """A callable running the expert FFN forward + backward on sum(counts) rows, counts[e]
    of them for local expert e, with the engines' own kernels."""
    rows = sum(counts)
    x = torch.randn(rows, config.d_model, device=device, dtype=dtype)
    dy = torch.randn_like(x)

    segments = ExpertSegments.from_counts(counts, device)

    def run():
        A = experts.project_in(x, segments)
        experts.project_out(experts.activate(A), segments)
        experts.backward(x, A, dy, segments, experts.grads())
    return run


def expert_gemm_efficiency(config: MoEConfig, tokens: int, local_experts: int, device, dtype, settings) -> dict:
    """Grouped expert FFN (forward + backward) against one dense GEMM chain of the same total rows."""
    rows = config.top_k * tokens
    grouped = Experts(config, local_experts, device=device, dtype=dtype)
    dense = Experts(config, 1, device=device, dtype=dtype)
    counts = [rows // local_experts + (1 if i < rows % local_experts else 0) for i in range(local_experts)]
    grouped_s = time_fn(expert_ffn(config, grouped, counts, device, dtype), device,
                        settings.warmup, settings.repeats).mean_s
    dense_s = time_fn(expert_ffn(config, dense, [rows], device, dtype), device,
                      settings.warmup, settings.repeats).mean_s
    flops = 3 * 2 * rows * config.d_model * (grouped.pre_activation_width + config.d_hidden)
    return {"expert_ffn_ms": grouped_s * 1e3, "dense_ffn_ms": dense_s * 1e3,
            "expert_tflops": flops / grouped_s / 1e12, "dense_tflops": flops / dense_s / 1e12,
            "expert_gemm_efficiency": dense_s / grouped_s}


def busiest_rank_first(router_weight: torch.Tensor, x: torch.Tensor, ranks: int, top_k: int) -> None:
    """In place: swaps router rows so that the rank receiving the most rows of `x` is rank 0.

    An emulated cluster times rank 0 (docs/emulation.md); a real step waits for its busiest
    rank, and the simulator prices that one, so rank 0 must be it. Every rank's experts start
    alike (random), so which rank holds which router rows changes nothing else."""
    with torch.no_grad():
        local = router_weight.shape[0] // ranks
        ids = torch.topk(x @ router_weight.t(), top_k, dim=-1).indices.flatten()
        per_rank = count_ids(ids, router_weight.shape[0]).view(ranks, local).sum(1)
        hot = int(per_rank.argmax())
        if hot:
            rows = router_weight[hot * local:(hot + 1) * local].clone()
            router_weight[hot * local:(hot + 1) * local] = router_weight[:local]
            router_weight[:local] = rows


def pipeline_stages(config: MoEConfig, x: torch.Tensor, router_weight: torch.Tensor, group: ExpertGroup,
                    device, dtype, settings: BenchSettings) -> dict:
    """The two stages MPipeMoE overlaps, each timed alone on this (model, tokens, routing),
    slowest rank's figure (it sets the layer's time):

    all_to_all_ms: the layer's four All-to-Alls of the routed rows (dispatch and combine,
                   forward and backward) with the real per-rank split sizes;
    expert_ms:     the expert FFN forward + backward on the rows this rank receives;
    hot_expert_share: the busiest expert's share of all routed rows;
    expert_load:      every expert's share of all routed rows (what the simulator's
                      validation routes by).
    """
    with torch.no_grad():
        expert_ids = torch.topk(x @ router_weight.t(), config.top_k, dim=-1).indices.flatten()
    local = config.experts_per_rank(group.size)
    rows_per_expert = count_ids(expert_ids, config.num_experts)  # this rank's rows for each expert
    send_counts = rows_per_expert.view(group.size, local)
    recv_counts = group.exchange_counts(send_counts)  # [source rank, local expert]
    send_splits, recv_splits = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
    send = torch.randn(sum(send_splits), config.d_model, device=device, dtype=dtype)
    recv = torch.empty(sum(recv_splits), config.d_model, device=device, dtype=dtype)

    def four_all_to_alls():
        for _ in range(2):  # forward, backward
            group.all_to_all(recv, send, recv_splits, send_splits)  # dispatch (or its gradient's return)
            group.all_to_all(send, recv, send_splits, recv_splits)  # combine

    a2a_s = time_fn(four_all_to_alls, device, settings.warmup, settings.repeats).mean_s
    experts = Experts(config, local, device=device, dtype=dtype)
    expert_s = time_fn(expert_ffn(config, experts, recv_counts.sum(0).tolist(), device, dtype), device,
                       settings.warmup, settings.repeats).mean_s
    all_rows_per_expert = group.all_reduce_sum(rows_per_expert)
    slowest = group.all_reduce_max(torch.tensor([a2a_s, expert_s], device=device, dtype=torch.float64))
    return {"all_to_all_ms": float(slowest[0]) * 1e3, "expert_ms": float(slowest[1]) * 1e3,
            "hot_expert_share": float(all_rows_per_expert.max() / all_rows_per_expert.sum()),
            "expert_load": [round(v, 5) for v in (all_rows_per_expert / all_rows_per_expert.sum()).tolist()]}
