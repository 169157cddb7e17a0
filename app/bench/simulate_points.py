"""What `mpipemoe simulate` predicts (app/bench/simulate.py): every (nodes, tokens) point of its
settings (`run_simulation`): each engine's MoE layer, and training step with --step
(`simulate_point`), or MPipeMoE's training step per expert-parallel degree
(`expert_parallel_point`); the text printed for each, and for a sweep how each engine's cost
grows and whether the fastest n keeps growing with the tokens (`monotonicity`)."""
from __future__ import annotations

from app.bench.simulate_settings import SimulateSettings

def _cluster(settings: SimulateSettings, nodes: int, experts: int):
    """The cluster at ``nodes``, its experts loaded as the routing loads them (moe_sim/routing.py
    `routing_load`: the shares whose counts the benches impose)."""
    from lm.model import PRESETS
    from moe_sim.network import ClusterLayout, load_network
    from moe_sim.routing import routing_load
    from moe_sim.simulator import Cluster

    layout = ClusterLayout(nodes, settings.gpus_per_node)
    network = load_network(settings.network)
    load = None if settings.routing == "uniform" else tuple(
        routing_load(settings.routing, experts, PRESETS[settings.model].top_k, settings.seed))
    return Cluster(layout, network, load, settings.hierarchical), network


def _model_shape(name: str, experts: int):
    """The simulator's shape of preset ``name`` with ``experts`` experts per MoE layer."""
    from lm.model import PRESETS
    from moe_sim.simulator import ModelShape

    preset = PRESETS[name]
    return ModelShape(preset.d_model, preset.d_hidden, preset.num_layers, preset.num_heads, preset.seq_len, experts,
                      preset.top_k, preset.activation, preset.vocab_size, preset.kind == "gpt")


def _layer_row(result, fastermoe) -> dict:
    return {"engine": result.engine, "partitions": result.partitions, "strategy": result.strategy,
            "fwd_bwd_ms": result.total_s * 1e3, "forward_ms": result.forward_s * 1e3,
            "backward_ms": result.backward_s * 1e3, "peak_memory_bytes": result.peak_bytes,
            "host_memory_bytes": result.host_bytes,
            "speedup_vs_fastermoe": fastermoe.total_s / result.total_s,
            "memory_ratio_vs_fastermoe": result.peak_bytes / fastermoe.peak_bytes}


def simulate_point(settings: SimulateSettings, parts, nodes: int, tokens: int) -> dict:
    """Every engine at one (nodes, tokens): the rows to print, log and plot."""
    from moe_sim.simulator import all_to_all_options, compare_engines, simulate_step

    ranks = nodes * settings.gpus_per_node
    experts = settings.experts_for(ranks)
    cluster, network = _cluster(settings, nodes, experts)
    model = _model_shape(settings.model, experts)
    shape = model.layer(tokens)
    choice = compare_engines(shape, cluster, parts, settings.partitions)
    engines = [("fastmoe", choice.fastmoe), ("fastermoe", choice.fastermoe), ("mpipemoe", choice.chosen),
               ("mpipemoe-fastest", choice.fastest)]
    rows = []
    for label, result in engines:
        row = {"label": label, **_layer_row(result, choice.fastermoe)}
        if settings.step:
            step = simulate_step(result.engine, model, tokens, cluster, parts, result.partitions, result.strategy)
            row.update(step_ms=step.step_s * 1e3, step_peak_memory_bytes=step.peak_bytes,
                       step_moe_ms=step.moe_s * 1e3, step_dense_ms=step.dense_s * 1e3,
                       step_all_reduce_ms=step.all_reduce_s * 1e3)
        rows.append(row)
    if settings.step:
        base = next(r for r in rows if r["label"] == "fastermoe")
        for row in rows:
            row["step_speedup_vs_fastermoe"] = base["step_ms"] / row["step_ms"]
            row["step_memory_ratio_vs_fastermoe"] = row["step_peak_memory_bytes"] / base["step_peak_memory_bytes"]
    full = choice.fastmoe
    options = all_to_all_options(shape, cluster, parts)
    flat, hier = options["flat_s"], options["hierarchical_s"]
    # One partition's All-to-All at MPipeMoE's n: smaller messages, where aggregation pays first.
    n = choice.chosen.partitions
    per_partition = all_to_all_options(model.layer(max(1, tokens // n)), cluster, parts)
    return {"model": settings.model, "tokens": tokens, "nodes": nodes, "gpus_per_node": settings.gpus_per_node,
            "ranks": ranks, "experts": experts, "network": network.name, "routing": settings.routing,
            "hierarchical": settings.hierarchical, "leaving_node": full.leaving_node,
            "all_to_all_ms": full.all_to_all_s * 1e3, "flat_all_to_all_ms": flat * 1e3,
            "hierarchical_all_to_all_ms": hier * 1e3,
            "partition_flat_all_to_all_ms": per_partition["flat_s"] * 1e3,
            "partition_hierarchical_all_to_all_ms": per_partition["hierarchical_s"] * 1e3,
            "best_partitions": choice.chosen.partitions, "best_strategy": choice.chosen.strategy,
            "fastest_partitions": choice.fastest.partitions, "fastest_strategy": choice.fastest.strategy,
            "engines": rows,
            "grid": [{"partitions": r.partitions, "strategy": r.strategy, "fwd_bwd_ms": r.total_s * 1e3,
                      "peak_memory_bytes": r.peak_bytes} for r in choice.grid]}


def expert_parallel_point(settings: SimulateSettings, parts, nodes: int, tokens: int) -> dict:
    """MPipeMoE's training step at one (nodes, tokens) for every expert-parallel degree E of
    ``settings``: its n and strategy chosen for the MoE layer on one expert group of E GPUs,
    the step priced by ``simulate_step(expert_parallel=E)``."""
    from dataclasses import replace

    from moe_sim.network import expert_group_layouts
    from moe_sim.simulator import compare_engines, simulate_step

    ranks = nodes * settings.gpus_per_node
    experts = settings.experts_for(ranks)
    cluster, network = _cluster(settings, nodes, experts)
    model = _model_shape(settings.model, experts)
    degrees = []
    for degree in settings.expert_parallel:
        if experts % degree:
            degrees.append({"expert_parallel": degree, "possible": False,
                            "why": f"{experts} experts on {degree} GPUs"})
            continue
        group = replace(cluster, layout=expert_group_layouts(cluster.layout, degree)[0])
        chosen = compare_engines(model.layer(tokens), group, parts, settings.partitions).chosen
        step = simulate_step("mpipemoe", model, tokens, cluster, parts, chosen.partitions, chosen.strategy,
                             expert_parallel=degree)
        degrees.append({"expert_parallel": degree, "possible": True, "partitions": step.partitions,
                        "strategy": step.strategy, "step_ms": step.step_s * 1e3, "moe_ms": step.moe_s * 1e3,
                        "dense_ms": step.dense_s * 1e3, "all_reduce_ms": step.all_reduce_s * 1e3,
                        "expert_reduction_ms": step.expert_reduction_s * 1e3,
                        "peak_memory_bytes": step.peak_bytes})
    return {"model": settings.model, "tokens": tokens, "nodes": nodes, "gpus_per_node": settings.gpus_per_node,
            "ranks": ranks, "experts": experts, "network": network.name, "routing": settings.routing,
            "hierarchical": settings.hierarchical, "degrees": degrees}


def _expert_parallel_text(point: dict) -> str:
    lines = [f"\n{point['model']} training step (MPipeMoE), {point['tokens']} tokens per GPU, {point['nodes']} node(s) "
             f"x {point['gpus_per_node']} GPUs, {point['experts']} experts, network {point['network']}, routing "
             f"{point['routing']}; ms per step (the MoE layers' share; the expert gradients' reduction across "
             f"the groups):"]
    for d in point["degrees"]:
        if not d["possible"]:
            lines.append(f"  E = {d['expert_parallel']:<4} not possible: {d['why']}")
            continue
        lines.append(f"  E = {d['expert_parallel']:<4} {d['step_ms']:>7.0f} (MoE {d['moe_ms']:.0f}, reduction "
                     f"{d['expert_reduction_ms']:.0f})  n={d['partitions']} {d['strategy']}, peak "
                     f"{d['peak_memory_bytes'] / 2**30:.1f} GiB")
    return "\n".join(lines)


def run_simulation(settings: SimulateSettings, parts, printer=print) -> tuple[list, str]:
    """Every (nodes, tokens) point; returns the points and the text printed."""
    points, texts = [], []
    for nodes in settings.nodes:
        for tokens in settings.tokens:
            if settings.expert_parallel:
                points.append(expert_parallel_point(settings, parts, nodes, tokens))
                texts.append(_expert_parallel_text(points[-1]))
            else:
                points.append(simulate_point(settings, parts, nodes, tokens))
                texts.append(_point_text(points[-1], settings))
            printer(texts[-1])
    if settings.expert_parallel:
        return points, "\n".join(texts)
    if len(points) > 1:
        texts.append(_sweep_text(points, settings))
        printer(texts[-1])
    return points, "\n".join(texts)


def _mib(value) -> str:
    return f"{value / 2**20:,.0f}"


def _point_text(point: dict, settings: SimulateSettings) -> str:
    lines = [f"\n{point['model']} MoE layer, {point['tokens']} tokens per GPU, {point['nodes']} node(s) x "
             f"{point['gpus_per_node']} GPUs = {point['ranks']} ranks, {point['experts']} experts, network "
             f"{point['network']}, routing {point['routing']}"
             + (", hierarchical All-to-All" if point["hierarchical"] else ""),
             f"  All-to-All of the whole batch: {point['all_to_all_ms']:.2f} ms; "
             f"{point['leaving_node']:.1%} of the rows leave their node",
             f"  {'engine':<18}{'n':>3}  {'strategy':<8}{'fwd+bwd ms':>11}{'peak MiB':>10}{'vs fastermoe':>14}"
             f"{'memory vs fastermoe':>21}" + (f"{'step ms':>10}{'step GiB':>10}" if settings.step else "")]
    for row in point["engines"]:
        lines.append(f"  {row['label']:<18}{row['partitions']:>3}  {row['strategy']:<8}{row['fwd_bwd_ms']:>11.2f}"
                     f"{_mib(row['peak_memory_bytes']):>10}{row['speedup_vs_fastermoe']:>13.2f}x"
                     f"{row['memory_ratio_vs_fastermoe']:>21.2f}"
                     + (f"{row['step_ms']:>10.0f}{row['step_peak_memory_bytes'] / 2**30:>10.1f}"
                        if settings.step else ""))
    chosen = next(r for r in point["engines"] if r["label"] == "mpipemoe")
    lines.append(f"  best n and strategy: n={point['best_partitions']} {point['best_strategy']} "
                 f"({chosen['speedup_vs_fastermoe']:.2f}x FasterMoE's speed at "
                 f"{chosen['memory_ratio_vs_fastermoe']:.2f}x its memory); fastest of all: "
                 f"n={point['fastest_partitions']} {point['fastest_strategy']}")
    return "\n".join(lines)


def monotonicity(points: list) -> list[dict]:
    """Per (nodes, network, routing): MPipeMoE's fastest n at each token count, and every
    token count where it is smaller than at the previous (smaller) one."""
    series = {}
    for p in points:
        series.setdefault((p["nodes"], p["network"], p["routing"]), []).append(p)
    out = []
    for (nodes, network, routing), ps in sorted(series.items(), key=lambda item: item[0]):
        ps = sorted(ps, key=lambda p: p["tokens"])
        best = [(p["tokens"], p["fastest_partitions"]) for p in ps]
        drops = [(t0, n0, t1, n1) for (t0, n0), (t1, n1) in zip(best, best[1:]) if n1 < n0]
        out.append({"nodes": nodes, "network": network, "routing": routing, "best_n": best, "drops": drops})
    return out


def _sweep_text(points: list, settings: SimulateSettings) -> str:
    lines = ["\nHow each engine's cost grows (fwd+bwd ms of one MoE layer; a2a: one All-to-All of the whole batch; "
             "flat/hier: one partition's flat over hierarchical All-to-All time):",
             f"  {'nodes':>5}{'ranks':>6}{'tokens':>7}{'fastmoe':>9}{'fastermoe':>10}{'mpipemoe':>9}{'n/strat':>9}"
             f"{'speedup':>8}{'a2a ms':>8}{'leave':>7}{'flat/hier':>10}"]
    for p in points:
        by = {r["label"]: r for r in p["engines"]}
        lines.append(f"  {p['nodes']:>5}{p['ranks']:>6}{p['tokens']:>7}{by['fastmoe']['fwd_bwd_ms']:>9.2f}"
                     f"{by['fastermoe']['fwd_bwd_ms']:>10.2f}{by['mpipemoe']['fwd_bwd_ms']:>9.2f}"
                     f"{str(p['best_partitions']) + '/' + p['best_strategy']:>9}"
                     f"{by['mpipemoe']['speedup_vs_fastermoe']:>7.2f}x{p['all_to_all_ms']:>8.2f}"
                     f"{p['leaving_node']:>7.1%}"
                     f"{p['partition_flat_all_to_all_ms'] / p['partition_hierarchical_all_to_all_ms']:>10.2f}")
    if len(settings.tokens) > 1:
        lines.append("\nFastest n against tokens (the online search assumes it never decreases):")
        for m in monotonicity(points):
            where = "; ".join(f"{t0} tok n={n0} -> {t1} tok n={n1}" for t0, n0, t1, n1 in m["drops"])
            lines.append(f"  {m['nodes']} node(s): " + " ".join(f"{t}:{n}" for t, n in m["best_n"])
                         + (f"  DECREASES at {where}" if m["drops"] else "  monotone"))
    return "\n".join(lines)
