"""`mpipemoe simulate --validate` (app/bench/simulate.py): the simulator against bench records,
one-GPU and emulated, layers and training steps (`validate`), with the host term matched to a
record's probe and the network dilated as the emulator ran it; the summary per file, the
Markdown (`validation_markdown`) and the re-timed layers beside their records (`_spot_check`).
See docs/simulate.md, *Validation*."""
from __future__ import annotations

import json
import os
from dataclasses import replace

from app.bench.parts import setting_n

TOLERANCE = 0.15          # flagged in the tables: |simulated / measured - 1| > 15%
TARGET = 0.10             # issue 36's target: 90% of the emulated records within 10%


def _bound(busy: dict, total: float) -> str:
    """The timeline that fills most of the simulated time."""
    names = {"host": "host issue cost", "compute": "device compute", "copy": "host copies", "comm": "All-to-All"}
    stream = max(busy, key=busy.get)
    return f"{names[stream]} ({busy[stream] / total:.0%} busy)"


def record_split(record: dict) -> str:
    """How the record's MPipeMoE partitions split its pass ("tokens" for records made
    before the field existed, and for the other engines, which the simulator prices by
    their own schedule)."""
    return (record.get("split") or "tokens") if record["engine"] == "mpipemoe" else "tokens"


def _host_matched(parts, record: dict, shape_at, cluster):
    """`parts` with the host term scaled so that the simulator reproduces the record's host
    probe (the same layer at a few tokens, timed in the same rounds as the record), or None
    for a record without one."""
    from moe_sim.simulator import simulate_layer

    probe_ms = record.get("host_probe_ms")
    if not probe_ms:
        return None
    at_probe = simulate_layer(record["engine"], shape_at(record["host_probe_tokens"]), cluster, parts,
                              record["partitions"], record["strategy"], split=record_split(record))
    return _scaled_to_probe(parts, probe_ms, at_probe.total_s, at_probe.busy_s["host"])


def _scaled_to_probe(parts, probe_ms: float, simulated_s: float, host_s: float):
    """`parts` with the host term scaled so that a simulated probe of `simulated_s`, `host_s`
    of it the host's issue, takes `probe_ms`: the rest of the simulated time (the device's)
    is kept, the host's stretched or shrunk to fill the probe."""
    from moe_sim.simulator import HostScaled

    host_ms = host_s * 1e3
    device_ms = simulated_s * 1e3 - host_ms
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
        # The SMs its pipelined GEMMs left free: the record's, or (records before the field)
        # the emulated transfers' thread blocks, which the emulated group left then.
        comm_sms = meta.get("comm_sms", meta.get("transfer_ctas", 1))

        def emulated(record: dict):
            # The routing rank 0 measured (every rank routes alike; rank 0 is the busiest,
            # as the bench arranges); records before `expert_load`: uniform, or one hot expert.
            load = record.get("expert_load")
            if load is None and record.get("routing", "uniform") != "uniform":
                load = hot_expert_load(record["num_experts"], record["hot_expert_share"])
            return Cluster(layout, network, None if load is None else tuple(load), meta.get("hierarchical", False),
                           comm_sms=comm_sms)
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

    rows, skipped = [], []

    def skip(line: str) -> None:
        skipped.append(line)
        printer(f"  {line}")

    for path in bench_paths:
        bench = load_bench(path)
        cluster_of = _record_cluster(bench["meta"])
        device, parts_device = bench["meta"].get("device"), getattr(parts, "device", None)
        if device and parts_device and device != parts_device:
            fix = ("the simulator prices GPU records" if device == "cpu" else
                   f"measure the parts on {device}: mpipemoe simulate --measure-parts")
            skip(f"{path}: measured on {device}, the parts on {parts_device}: not simulated here ({fix})")
            continue
        if cluster_of is None:
            skip(f"{path}: {bench['meta']['world_size']} real ranks: only one-GPU and emulated records are "
                 f"simulated here")
            continue
        ours = [r for r in bench["records"] if r.get("engine") in ENGINES]
        if not ours:
            skip(f"{path}: no record of {', '.join(ENGINES)} (peers and the dense floor are not simulated)")
        for r in ours:
            cluster = cluster_of(r)
            if r.get("kind") == "step":  # `mpipemoe bench --step`: the whole training step
                rows.append(_step_row(os.path.basename(path), r, cluster, parts))
                continue

            def shape_at(tokens, r=r):
                return LayerShape(r["d_model"], r["d_hidden"], r["num_experts"], tokens, r["top_k"], r["activation"],
                                  2 if r["dtype"] == "bfloat16" else 4, r.get("bias", True))
            split = record_split(r)
            sim = simulate_layer(r["engine"], shape_at(r["tokens"]), cluster, parts, r["partitions"], r["strategy"],
                                 split=split)
            error = sim.total_s * 1e3 / r["fwd_bwd_ms"] - 1
            matched_parts = _host_matched(parts, r, shape_at, cluster)
            matched = None if matched_parts is None else simulate_layer(
                r["engine"], shape_at(r["tokens"]), cluster, matched_parts, r["partitions"], r["strategy"], split=split)
            modelled_a2a_ms = emulated_all_to_all_ms(bench["meta"], r)
            dilation = r["all_to_all_ms"] / modelled_a2a_ms if modelled_a2a_ms else None
            dilated = None if dilation is None else simulate_layer(
                r["engine"], shape_at(r["tokens"]), _dilated(cluster, dilation), parts, r["partitions"],
                r["strategy"], split=split)
            measured_peak = r.get("peak_memory_bytes")
            memory_error = sim.peak_bytes / measured_peak - 1 if measured_peak else None
            memory_model_current = r.get("predicted_memory_bytes") == _predicted_memory_now(r)
            rows.append({"source": os.path.basename(path), "measured_as": r.get("measured_as", "measured"),
                         "routing": r.get("routing", "uniform"), "model": r["model"], "tokens": r["tokens"],
                         "engine": r["engine"], "chosen_by": r["chosen_by"], "partitions": r["partitions"],
                         "split": split, "strategy": r["strategy"], "measured_ms": r["fwd_bwd_ms"],
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
    return {"rows": rows, "summary": _summary(rows), "skipped": skipped}


def load_bench(path: str) -> dict:
    """A `mpipemoe bench` JSON (``meta`` and ``records``); raises ValueError naming the file and
    what it is instead: missing, empty, not JSON, or JSON that is not a bench record."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as error:
        raise ValueError(f"--validate {path}: cannot read it ({error.strerror or error}): give the JSON that "
                         f"`mpipemoe bench --out` wrote") from None
    if not text.strip():
        raise ValueError(f"--validate {path}: the file is empty: give the JSON that `mpipemoe bench --out` wrote")
    try:
        bench = json.loads(text)
    except ValueError as error:
        raise ValueError(f"--validate {path}: not JSON ({error}): give the JSON that `mpipemoe bench --out` "
                         f"wrote") from None
    if not isinstance(bench, dict) or not isinstance(bench.get("meta"), dict) \
            or not isinstance(bench.get("records"), list):
        raise ValueError(f"--validate {path}: not a bench record (it has no \"meta\" and \"records\"): give the "
                         f"JSON that `mpipemoe bench --out` wrote")
    return bench


def _step_row(source: str, r: dict, cluster, parts) -> dict:
    """A step record (app/bench/step.py) against `simulator.simulate_step` for its model,
    tokens, micro-batches and setting, the reduction overlapped with the last backward as
    the bench models it; with the host term matched to the record's host probe where it has
    one (`_step_host_matched`). Step rows carry what layer rows do (no dilation)."""
    from moe_sim.simulator import ModelShape, simulate_step

    model = ModelShape(r["d_model"], r["d_hidden"], r["layers"], r["num_heads"], r["seq_len"], r["num_experts"],
                       r["top_k"], r["activation"], r["vocab_size"], r["causal"])

    def step_at(tokens: int, cluster=cluster, parts=parts, seq_len: int = r["seq_len"]):
        return simulate_step(r["engine"], replace(model, seq_len=seq_len), tokens, cluster, parts, r["partitions"],
                             r["strategy"],
                             dtype_bytes=2 if r["dtype"] in ("bfloat16", "float16") else 4,
                             micro_batches=r["micro_batches"], overlap_reduction=True, split=record_split(r))
    sim = step_at(r["tokens"])
    matched_parts = _step_host_matched(parts, r, cluster, step_at)
    matched = None if matched_parts is None else step_at(r["tokens"], parts=matched_parts)
    error = sim.step_s * 1e3 / r["step_ms"] - 1
    measured_peak = r.get("peak_memory_bytes")
    busy = {"moe": sim.moe_s * 1e3, "dense": sim.dense_s * 1e3, "reduction": sim.exposed_reduction_s * 1e3,
            "optimizer": sim.optimizer_s * 1e3}
    return {"source": source, "kind": "step", "measured_as": r.get("measured_as", "emulated"),
            "routing": r.get("routing", "uniform"),
            "model": f"{r['model']} x{r['layers']} K={r['micro_batches']}"
                     + (" overlapped" if r.get("schedule") == "overlapped" else ""),
            "schedule": r.get("schedule", "sequential"),
            "tokens": r["tokens"], "engine": r["engine"], "chosen_by": r["chosen_by"], "partitions": r["partitions"], "split": record_split(r),
            "strategy": r["strategy"], "measured_ms": r["step_ms"], "measured_ms_std": r.get("step_ms_std"),
            "simulated_ms": sim.step_s * 1e3, "error": error, "measured_peak_bytes": measured_peak,
            "simulated_peak_bytes": sim.peak_bytes,
            "memory_error": sim.peak_bytes / measured_peak - 1 if measured_peak else None,
            "memory_model_current": True, "busy_ms": busy,
            "term_off": (max(busy, key=lambda k: busy[k]) + " (largest part)") if abs(error) > TOLERANCE else "",
            "host_probe_ms": r.get("host_probe_ms"),
            "host_matched_ms": None if matched is None else matched.step_s * 1e3,
            "host_matched_error": None if matched is None else matched.step_s * 1e3 / r["step_ms"] - 1,
            "network_dilation": None, "dilated_ms": None, "dilated_error": None}


def _step_host_matched(parts, r: dict, cluster, step_at):
    """`parts` with the MoE layers' host term scaled so that the simulated step reproduces the
    record's host probe (the step's compute alone at a few tokens, app/bench/step_point.py
    HOST_PROBE_SEQ_LEN), or None for a record without one. The probe runs with every modelled
    transfer at zero time, so it is simulated on a free network; what the simulated probe's
    device does besides the host's issue is subtracted, as for a layer (`_host_matched`)."""
    probe_ms = r.get("host_probe_ms")
    if not probe_ms:
        return None
    at_probe = step_at(r["host_probe_tokens"], cluster=_dilated(cluster, 1e-9), seq_len=r["host_probe_seq_len"])
    return _scaled_to_probe(parts, probe_ms, at_probe.step_s, at_probe.host_s)


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
            "within_10pct": sum(e <= TARGET for e in errors),
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
             "| measurements | records | time within 10% | within 15% | mean abs. error | median | max | "
             "mean signed | host-bound (sim.) within 15% | device-bound within 15% | memory within 15% | "
             "memory max error | host matched to the probe: within 15% | its max error |",
             "|" + "---|" * 14]
    for source, s in result["summary"].items():
        lines.append(f"| {source} | {s['records']} | {s['within_10pct']} | {s['within_15pct']} | "
                     f"{s['mean_abs_error']:.1%} | "
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
            f"| {r['source']} | {r['model']} | {r['tokens']} | {r['engine']} | {r['chosen_by']} | {setting_n(r)} | "
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
        records += [r for r in load_bench(path)["records"] if r.get("kind") != "step"]  # layers only
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
