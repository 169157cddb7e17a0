"""What `mpipemoe simulate` (app/commands/simulate.py) does: predict a cluster's MoE layer (and
training step) from calibrated parts, and validate the simulator against bench records.

The schedule simulator (moe_sim/simulator.py) replays the engine's operations on
host, compute, communication and copy timelines. Compute, copy and host figures come
from the parts measured on one GPU (--parts); the network from a profile (--network:
dgx-a100, dgx-h200, or a JSON file of measured figures; moe_sim/network.py lists the
datasheet defaults). Results print as a table, go to a JSON file (--out) and to MLflow
(tag kind=simulate; --tracking-uri none to skip); `mpipemoe report` plots them
(app/reports/simulate.py).
See docs/simulate.md. Its parts: the settings (app/bench/simulate_settings.py).
"""
from __future__ import annotations

import json
import os
import sys
import time

from app.bench.simulate_settings import SimulateSettings
from app.tracking.records import DEFAULT_OUT_DIR, command_line, utc_timestamp
from app.tracking.run_kinds import SIMULATE, kind_tags

DEFAULT_PARTS = "results/sim-parts-h200.json"
EXPERIMENT = "mpipemoe-simulate"
TOLERANCE = 0.15          # the validation target: |simulated / measured - 1| <= 15%


# -- simulating -------------------------------------------------------------------------------------

def _cluster(settings: SimulateSettings, nodes: int, experts: int):
    from moe_sim.network import ClusterLayout, load_network, routing_load
    from moe_sim.simulator import Cluster

    layout = ClusterLayout(nodes, settings.gpus_per_node)
    network = load_network(settings.network)
    load = None if settings.routing == "uniform" else tuple(routing_load(settings.routing, experts))
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


# -- MLflow -------------------------------------------------------------------------------------------

def log_to_mlflow(result: dict, tracking_uri: str | None, experiment: str, printer=print) -> int:
    """One MLflow run per (point, engine), tag kind=simulate."""
    try:
        from app.tracking.store import NO_TRACKING, RunLogger, resolve_tracking_uri
        import mlflow  # noqa: F401
    except ImportError:
        printer("MLflow is not installed here: results stay in the JSON.")
        return 0
    uri = resolve_tracking_uri(tracking_uri)
    if uri == NO_TRACKING:
        return 0
    count = 0
    for point in result["points"]:
        for row in point["engines"]:
            run = RunLogger.start(uri, experiment, run_name=f"sim-{point['model']}-{point['tokens']}-"
                                  f"{point['nodes']}x{point['gpus_per_node']}-{row['label']}",
                                  tags={**kind_tags(SIMULATE), "command": result["meta"]["command"][:250]})
            params = {k: v for k, v in point.items() if isinstance(v, (str, int, bool)) and not isinstance(v, float)}
            params.update(label=row["label"], engine=row["engine"], partitions=row["partitions"],
                          strategy=row["strategy"], parts=result["meta"]["parts"])
            metrics = {k: v for k, v in {**point, **row}.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool)}
            run.log_params(params)
            run.log_metrics(metrics, step=0, flush=True)
            run.finish()
            count += 1
    printer(f"Logged {count} MLflow runs to {uri} (experiment {experiment!r}).")
    return count


# -- validation against measurements --------------------------------------------------------------------

def _bound(busy: dict, total: float) -> str:
    """The timeline that fills most of the simulated time."""
    names = {"host": "host issue cost", "compute": "device compute", "copy": "host copies", "comm": "All-to-All"}
    stream = max(busy, key=busy.get)
    return f"{names[stream]} ({busy[stream] / total:.0%} busy)"


def _host_matched(parts, record: dict, shape_at, cluster):
    """`parts` with the host term scaled so that the simulator reproduces the record's host
    probe (the same layer at a few tokens, timed in the same rounds as the record), or None
    for a record without one."""
    from moe_sim.simulator import HostScaled, simulate_layer

    probe_ms = record.get("host_probe_ms")
    if not probe_ms:
        return None
    at_probe = simulate_layer(record["engine"], shape_at(record["host_probe_tokens"]), cluster, parts,
                              record["partitions"], record["strategy"])
    host_ms = at_probe.busy_s["host"] * 1e3
    device_ms = at_probe.total_s * 1e3 - host_ms
    return HostScaled(parts, max(probe_ms - device_ms, 0.0) / host_ms)


def _record_cluster(meta: dict):
    """The cluster a bench file's records ran in, as a function of the record (its routing),
    or None for records of several real ranks (not simulated here): one GPU, or rank 0 of
    an emulated cluster (docs/emulation.md) with the network, layout and routing it had."""
    from moe_sim.network import ClusterLayout, hot_expert_load, load_network
    from moe_sim.simulator import Cluster, single_gpu

    if meta.get("measured_as") == "emulated":
        layout = ClusterLayout(meta["nodes"], meta["gpus_per_node"])
        network = load_network(meta["network"])

        def emulated(record: dict):
            # The routing rank 0 measured (every rank routes alike; rank 0 is the busiest,
            # as the bench arranges); records before `expert_load`: uniform, or one hot expert.
            load = record.get("expert_load")
            if load is None and record.get("routing", "uniform") != "uniform":
                load = hot_expert_load(record["num_experts"], record["hot_expert_share"])
            return Cluster(layout, network, None if load is None else tuple(load), meta.get("hierarchical", False))
        return emulated
    if meta["world_size"] == 1:
        return lambda record: single_gpu()
    return None


def emulated_all_to_all_ms(meta: dict, record: dict) -> float | None:
    """The network model's time for the stage the bench timed alone (`all_to_all_ms`: four
    All-to-Alls of rank 0's rows, split by the record's expert load), or None where that
    cannot be priced. Its ratio to the measured stage is the emulator's dilation: how much
    longer the emulated transfers ran than the model says (docs/emulation.md)."""
    from moe_sim.emulation import EmulatedCluster
    from moe_sim.network import ClusterLayout, load_network

    load = record.get("expert_load")
    if meta.get("measured_as") != "emulated" or not load:
        return None
    ranks = meta["world_size"]
    local = len(load) // ranks
    rows = record["top_k"] * record["tokens"]
    send = [round(rows * sum(load[r * local:(r + 1) * local])) for r in range(ranks)]
    cluster = EmulatedCluster(layout=ClusterLayout(meta["nodes"], meta["gpus_per_node"]),
                              network=load_network(meta["network"]), hierarchical=meta.get("hierarchical", False))
    row_bytes = record["d_model"] * (2 if record["dtype"] in ("bfloat16", "float16") else 4)
    return 4 * cluster.all_to_all_s([send[0]] * ranks, send, row_bytes) * 1e3


def _predicted_memory_now(record: dict) -> int:
    """What the memory model predicts today for the record's layer, as the bench asked it
    (`predicted_memory_bytes`): equal when the record was measured with today's model."""
    import torch

    from moe_engine import MoEConfig
    from moe_engine.memory import predict_memory

    config = MoEConfig(record["d_model"], record["d_hidden"], record["num_experts"], top_k=record["top_k"],
                       activation=record["activation"], bias=record.get("bias", True))
    engine = record["engine"]
    return predict_memory(config, record["tokens"], record["world_size"],
                          record["partitions"] if engine != "fastmoe" else 1, record["strategy"], engine=engine,
                          dtype=getattr(torch, record["dtype"])).peak_bytes


def _dilated(cluster, factor: float):
    """`cluster` with its network `factor` times slower (bandwidths divided, costs multiplied)."""
    from dataclasses import replace

    network = cluster.network
    slower = replace(network, intra_bytes_per_s=network.intra_bytes_per_s / factor,
                     inter_bytes_per_s=network.inter_bytes_per_s / factor,
                     intra_message_s=network.intra_message_s * factor, inter_message_s=network.inter_message_s * factor,
                     collective_s=network.collective_s * factor)
    return replace(cluster, network=slower)


def validate(bench_paths: list[str], parts, printer=print) -> dict:
    """The simulator against every record of the bench JSON files (our engines' records;
    peers and the dense floor are not simulated): with the parts' host cost, and (records
    with a host probe) with the host term matched to the probe. One-GPU records are
    simulated on one GPU; emulated ones (`mpipemoe bench --emulate`) in the emulated
    cluster, with the record's network and routing: the first test of the simulator's
    several-rank schedule against the engine's.

    Memory is compared only for records of the engine the memory model describes: those
    whose prediction at measurement time (``predicted_memory_bytes``, written by the
    bench) is today's. A record of an earlier engine keeps its memory error in its row
    but is left out of the memory summary (``memory_model_current`` False)."""
    from moe_engine.config import ENGINES
    from moe_sim.simulator import LayerShape, simulate_layer

    rows = []
    for path in bench_paths:
        with open(path) as f:
            bench = json.load(f)
        cluster_of = _record_cluster(bench["meta"])
        if cluster_of is None:
            printer(f"  {path}: {bench['meta']['world_size']} real ranks: only one-GPU and emulated records are "
                    f"simulated here")
            continue
        for r in bench["records"]:
            if r["engine"] not in ENGINES:
                continue
            cluster = cluster_of(r)
            if r.get("kind") == "step":  # `mpipemoe bench --step`: the whole training step
                rows.append(_step_row(os.path.basename(path), r, cluster, parts))
                continue

            def shape_at(tokens, r=r):
                return LayerShape(r["d_model"], r["d_hidden"], r["num_experts"], tokens, r["top_k"], r["activation"],
                                  2 if r["dtype"] == "bfloat16" else 4, r.get("bias", True))
            sim = simulate_layer(r["engine"], shape_at(r["tokens"]), cluster, parts, r["partitions"], r["strategy"])
            error = sim.total_s * 1e3 / r["fwd_bwd_ms"] - 1
            matched_parts = _host_matched(parts, r, shape_at, cluster)
            matched = None if matched_parts is None else simulate_layer(
                r["engine"], shape_at(r["tokens"]), cluster, matched_parts, r["partitions"], r["strategy"])
            modelled_a2a_ms = emulated_all_to_all_ms(bench["meta"], r)
            dilation = r["all_to_all_ms"] / modelled_a2a_ms if modelled_a2a_ms else None
            dilated = None if dilation is None else simulate_layer(
                r["engine"], shape_at(r["tokens"]), _dilated(cluster, dilation), parts, r["partitions"],
                r["strategy"])
            measured_peak = r.get("peak_memory_bytes")
            memory_error = sim.peak_bytes / measured_peak - 1 if measured_peak else None
            memory_model_current = r.get("predicted_memory_bytes") == _predicted_memory_now(r)
            rows.append({"source": os.path.basename(path), "measured_as": r.get("measured_as", "measured"),
                         "routing": r.get("routing", "uniform"), "model": r["model"], "tokens": r["tokens"],
                         "engine": r["engine"], "chosen_by": r["chosen_by"], "partitions": r["partitions"],
                         "strategy": r["strategy"], "measured_ms": r["fwd_bwd_ms"],
                         "measured_ms_std": r.get("fwd_bwd_ms_std"), "simulated_ms": sim.total_s * 1e3,
                         "error": error, "measured_peak_bytes": measured_peak, "simulated_peak_bytes": sim.peak_bytes,
                         "memory_error": memory_error, "memory_model_current": memory_model_current,
                         "busy_ms": {k: v * 1e3 for k, v in sim.busy_s.items()},
                         "term_off": _bound(sim.busy_s, sim.total_s) if abs(error) > TOLERANCE else "",
                         "host_probe_ms": r.get("host_probe_ms"),
                         "host_matched_ms": None if matched is None else matched.total_s * 1e3,
                         "host_matched_error": None if matched is None else matched.total_s * 1e3 / r["fwd_bwd_ms"] - 1,
                         "network_dilation": dilation,
                         "dilated_ms": None if dilated is None else dilated.total_s * 1e3,
                         "dilated_error": None if dilated is None else dilated.total_s * 1e3 / r["fwd_bwd_ms"] - 1})
    return {"rows": rows, "summary": _summary(rows)}


def _step_row(source: str, r: dict, cluster, parts) -> dict:
    """A step record (app/bench/step.py) against `simulator.simulate_step` for its model,
    tokens, micro-batches and setting, the reduction overlapped with the last backward as
    the bench models it. Step rows carry what layer rows do (no host probe, no dilation)."""
    from moe_sim.simulator import ModelShape, simulate_step

    model = ModelShape(r["d_model"], r["d_hidden"], r["layers"], r["num_heads"], r["seq_len"], r["num_experts"],
                       r["top_k"], r["activation"], r["vocab_size"], r["causal"])
    sim = simulate_step(r["engine"], model, r["tokens"], cluster, parts, r["partitions"], r["strategy"],
                        dtype_bytes=2 if r["dtype"] in ("bfloat16", "float16") else 4,
                        micro_batches=r["micro_batches"], overlap_reduction=True)
    error = sim.step_s * 1e3 / r["step_ms"] - 1
    measured_peak = r.get("peak_memory_bytes")
    busy = {"moe": sim.moe_s * 1e3, "dense": sim.dense_s * 1e3, "reduction": sim.exposed_reduction_s * 1e3,
            "optimizer": sim.optimizer_s * 1e3}
    return {"source": source, "kind": "step", "measured_as": r.get("measured_as", "emulated"),
            "routing": r.get("routing", "uniform"), "model": f"{r['model']} x{r['layers']} K={r['micro_batches']}",
            "tokens": r["tokens"], "engine": r["engine"], "chosen_by": r["chosen_by"], "partitions": r["partitions"],
            "strategy": r["strategy"], "measured_ms": r["step_ms"], "measured_ms_std": r.get("step_ms_std"),
            "simulated_ms": sim.step_s * 1e3, "error": error, "measured_peak_bytes": measured_peak,
            "simulated_peak_bytes": sim.peak_bytes,
            "memory_error": sim.peak_bytes / measured_peak - 1 if measured_peak else None,
            "memory_model_current": True, "busy_ms": busy,
            "term_off": (max(busy, key=lambda k: busy[k]) + " (largest part)") if abs(error) > TOLERANCE else "",
            "host_probe_ms": None, "host_matched_ms": None, "host_matched_error": None, "network_dilation": None,
            "dilated_ms": None, "dilated_error": None}


def _summary(rows: list[dict]) -> dict:
    summary = {}
    for source in sorted({r["source"] for r in rows}):
        mine = [r for r in rows if r["source"] == source]
        errors = sorted(abs(r["error"]) for r in mine)
        memory = [abs(r["memory_error"]) for r in mine
                  if r["memory_error"] is not None and r.get("memory_model_current", True)]
        host_bound = [r for r in mine if r["busy_ms"].get("host", 0.0) >= 0.8 * r["simulated_ms"]]
        matched = sorted(abs(r["host_matched_error"]) for r in mine if r.get("host_matched_error") is not None)
        summary[source] = {
            "records": len(mine), "within_15pct": sum(e <= TOLERANCE for e in errors),
            "mean_abs_error": sum(errors) / len(errors), "median_abs_error": errors[len(errors) // 2],
            "max_abs_error": errors[-1], "mean_signed_error": sum(r["error"] for r in mine) / len(mine),
            "memory_records": len(memory),
            "memory_within_15pct": sum(e <= TOLERANCE for e in memory),
            "memory_model_changed": sum(not r.get("memory_model_current", True) for r in mine),
            "memory_max_abs_error": max(memory) if memory else None,
            "host_bound_records": len(host_bound),
            "host_bound_within_15pct": sum(abs(r["error"]) <= TOLERANCE for r in host_bound),
            "device_bound_within_15pct": sum(abs(r["error"]) <= TOLERANCE for r in mine if r not in host_bound),
            "host_matched_records": len(matched),
            "host_matched_within_15pct": sum(e <= TOLERANCE for e in matched),
            "host_matched_max_abs_error": matched[-1] if matched else None,
        }
        dilated = [r for r in mine if r.get("dilated_error") is not None]
        if dilated:  # emulated records: the network priced as slow as the emulator ran it
            summary[source].update(
                dilated_records=len(dilated),
                dilated_within_15pct=sum(abs(r["dilated_error"]) <= TOLERANCE for r in dilated),
                median_network_dilation=sorted(r["network_dilation"] for r in dilated)[len(dilated) // 2])
    return summary


def validation_markdown(result: dict) -> str:
    meta = result["meta"]
    lines = ["# Simulator against measurements", "",
             f"Generated by `{meta['command']}` on {meta['date']} from `{meta['parts']}` "
             f"(parts measured on {meta['parts_device']} at {meta['parts_measured_at']}); do not edit.", "",
             "Each row: the schedule simulator's forward+backward time and peak memory for the record's engine, "
             "n and strategy, against the measurement. Error = simulated / measured − 1. Where the time error "
             "exceeds 15%, `term off` names the timeline that fills most of the simulated time — the term to "
             "look at (docs/simulate.md, *Validation*). Memory is summarised over the records whose memory-model "
             "prediction at measurement time is today's (the others were measured with an earlier engine).", "",
             "## Summary", "",
             "| measurements | records | time within 15% | mean abs. error | median | max | mean signed | "
             "host-bound (sim.) within 15% | device-bound within 15% | memory within 15% | memory max error | "
             "host matched to the probe: within 15% | its max error |",
             "|" + "---|" * 13]
    for source, s in result["summary"].items():
        lines.append(f"| {source} | {s['records']} | {s['within_15pct']} | {s['mean_abs_error']:.1%} | "
                     f"{s['median_abs_error']:.1%} | {s['max_abs_error']:.1%} | {s['mean_signed_error']:+.1%} | "
                     f"{s['host_bound_within_15pct']} of {s['host_bound_records']} | "
                     f"{s['device_bound_within_15pct']} of {s['records'] - s['host_bound_records']} | "
                     f"{s['memory_within_15pct']} of {s.get('memory_records', s['records'])} | "
                     + ("-" if s["memory_max_abs_error"] is None else f"{s['memory_max_abs_error']:.1%}") + " | "
                     + (f"{s['host_matched_within_15pct']} of {s['host_matched_records']} | "
                        f"{s['host_matched_max_abs_error']:.1%} |" if s.get("host_matched_records") else "- | - |"))
    emulated = {source: s for source, s in result["summary"].items() if s.get("dilated_records")}
    if emulated:
        lines += ["", "## Emulated records: the network as slow as the emulator ran it", "",
                  "An emulated record's All-to-All stage, timed alone, ran longer than the network model says "
                  "(docs/emulation.md, \"The emulator's dilation\"). Dilation = that stage "
                  "measured / modelled; the simulation below prices the network that much slower.", "",
                  "| measurements | records | median dilation | time within 15%, plain | within 15%, dilated |",
                  "|---|---|---|---|---|"]
        for source, s in emulated.items():
            lines.append(f"| {source} | {s['dilated_records']} | {s['median_network_dilation']:.3f} | "
                         f"{s['within_15pct']} | {s['dilated_within_15pct']} |")
    spot = meta.get("spot_check")
    if spot:
        lines += ["", "## The same layers measured again", "",
                  "Run-to-run spread of the measurements themselves: layers re-timed, as `mpipemoe bench` times "
                  "them, on the machine and in the session that measured the parts (`parts.notes.spot_check`), "
                  "against the committed records.", "",
                  "| model | tokens | engine | n | strategy | committed ms | re-measured ms | difference |",
                  "|---|---|---|---|---|---|---|---|"]
        for s in spot:
            lines.append(f"| {s['model']} | {s['tokens']} | {s['engine']} | {s['partitions']} | {s['strategy']} | "
                         f"{s['committed_ms']:.2f} | {s['fwd_bwd_ms']:.2f} | {s['difference']:+.1%} |"
                         if s.get("committed_ms") else
                         f"| {s['model']} | {s['tokens']} | {s['engine']} | {s['partitions']} | {s['strategy']} | - | "
                         f"{s['fwd_bwd_ms']:.2f} | - |")
    lines += ["", "## Every record", "",
              "| source | model | tokens | engine | chosen by | n | strategy | measured ms | simulated ms | error | "
              "measured MiB | simulated MiB | memory error | term off | host probe ms | simulated, host matched | "
              "error |", "|" + "---|" * 17]
    for r in result["rows"]:
        flag = "**" if abs(r["error"]) > TOLERANCE else ""
        lines.append(
            f"| {r['source']} | {r['model']} | {r['tokens']} | {r['engine']} | {r['chosen_by']} | {r['partitions']} | "
            f"{r['strategy']} | {r['measured_ms']:.2f} | {r['simulated_ms']:.2f} | {flag}{r['error']:+.1%}{flag} | "
            + ("-" if r["measured_peak_bytes"] is None else f"{r['measured_peak_bytes'] / 2**20:.0f}")
            + f" | {r['simulated_peak_bytes'] / 2**20:.0f} | "
            + ("-" if r["memory_error"] is None else f"{r['memory_error']:+.1%}"
               + ("" if r.get("memory_model_current", True) else " (earlier engine)")) + f" | {r['term_off']} | "
            + (f"{r['host_probe_ms']:.2f} | {r['host_matched_ms']:.2f} | {_flagged(r['host_matched_error'])} |"
               if r.get("host_matched_ms") is not None else "- | - | - |"))
    return "\n".join(lines) + "\n"


def _flagged(error: float) -> str:
    flag = "**" if abs(error) > TOLERANCE else ""
    return f"{flag}{error:+.1%}{flag}"


def _spot_check(parts, bench_paths: list[str]) -> list:
    """The parts file's re-timed layers, each beside the committed record of the same layer."""
    checks = parts.notes.get("spot_check", [])
    records = []
    for path in bench_paths:
        with open(path) as f:
            records += [r for r in json.load(f)["records"] if r.get("kind") != "step"]  # layers only
    out = []
    for s in checks:
        match = next((r for r in records if r["model"] == s["model"] and r["tokens"] == s["tokens"]
                      and r["engine"] == s["engine"] and r["partitions"] == s["partitions"]
                      and r["strategy"] == s["strategy"] and r["chosen_by"] in ("grid", "baseline")), None)
        row = dict(s)
        if match:
            row.update(committed_ms=match["fwd_bwd_ms"], difference=s["fwd_bwd_ms"] / match["fwd_bwd_ms"] - 1)
        out.append(row)
    return out


# -- running ----------------------------------------------------------------------------------------------

def _write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)


def measure(path: str) -> int:
    import torch

    from moe_sim.parts import measure_parts

    if not torch.cuda.is_available():
        print("--measure-parts needs a CUDA GPU: the parts are device and host times of that GPU", file=sys.stderr)
        return 2
    started = time.time()
    parts = measure_parts([(1024, 4096), (2048, 8192)], printer=lambda m: print(m, flush=True))
    data = parts.to_json()
    data["command"] = command_line("simulate")
    data["notes"]["wall_s"] = round(time.time() - started, 1)
    _write_json(path, data)
    print(f"Wrote {path} ({data['notes']['wall_s']} s)")
    return 0


def _load_parts(parts_path: str, host_scale: float) -> tuple:
    """The measured GPU parts (scaled host costs unless ``host_scale`` is 1) and the meta every result carries."""
    from moe_sim.parts import GpuParts

    from moe_sim.simulator import HostScaled

    parts = GpuParts.load(parts_path)
    meta = {"command": command_line("simulate"), "date": utc_timestamp(), "parts": parts_path,
            "parts_device": parts.device, "parts_measured_at": parts.measured_at, "host_scale": host_scale}
    return (HostScaled(parts, host_scale) if host_scale != 1.0 else parts), meta


def validate_and_write(bench_paths: list[str], parts_path: str, host_scale: float, out: str | None) -> int:
    """`mpipemoe simulate --validate`: the simulator against every record of the bench JSONs, written
    as JSON and Markdown (``out``, default out/simulate-validation.json)."""
    parts, meta = _load_parts(parts_path, host_scale)
    result = validate(bench_paths, parts)
    meta["spot_check"] = _spot_check(parts, bench_paths)
    result = {"meta": meta, **result}
    out = out or os.path.join(DEFAULT_OUT_DIR, "simulate-validation.json")
    _write_json(out, result)
    markdown = validation_markdown(result)
    with open(os.path.splitext(out)[0] + ".md", "w") as f:
        f.write(markdown)
    print(markdown.split("## Every record")[0])
    print(f"Wrote {out} and {os.path.splitext(out)[0]}.md")
    return 0


def simulate_and_write(settings: SimulateSettings, parts_path: str, host_scale: float, out: str | None,
                       tracking_uri: str | None, experiment: str) -> int:
    """`mpipemoe simulate`: every point of ``settings`` predicted, written to ``out`` (JSON and Markdown)
    when given, and logged to MLflow."""
    parts, meta = _load_parts(parts_path, host_scale)
    print(f"Simulating {settings.model} on {', '.join(map(str, settings.nodes))} node(s) x {settings.gpus_per_node} "
          f"GPUs from the parts of {parts.device} ({parts_path}) and the {settings.network} network...")
    points, text = run_simulation(settings, parts)
    recorded = {k: v for k, v in settings.__dict__.items() if k != "expert_parallel" or v}  # older records lack it
    result = {"meta": {**meta, "settings": recorded}, "points": points}
    if out:
        _write_json(out, result)
        markdown = os.path.splitext(out)[0] + ".md"
        with open(markdown, "w") as f:
            f.write(f"# Simulated: {settings.model}\n\nGenerated by `{meta['command']}` on {meta['date']} from "
                    f"`{parts_path}` ({parts.device}); predictions, not measurements; do not edit.\n\n"
                    f"```\n{text.strip()}\n```\n")
        print(f"Wrote {out} and {markdown}")
    log_to_mlflow(result, tracking_uri, experiment)
    return 0
