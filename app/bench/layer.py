"""The MoE-layer benchmark of `mpipemoe bench` (app/commands/bench.py): every engine side by side
in one process on the same inputs and parameters (docs/design.md §7).

For each (model, tokens) it times forward+backward of FastMoE, FasterMoE, MPipeMoE
with partitions="auto" and strategy="auto" (after its online search settles), an
exhaustive grid of MPipeMoE over partitions × strategies, the dense-GEMM floor of the
same routed work and, with --peers, other libraries' layers on the same inputs and
weights (app/bench/peers.py). All of a point's layers are
timed together in interleaved rounds (`--rounds`, each a warm-up and `--repeats` timed
steps of every layer in turn) and each one's time is the median over rounds, so a
slow spell of the machine falls on every engine alike. It measures peak memory
(CUDA), the expert FFN's GEMM rate against one dense GEMM of the same total shape,
and the performance model's predictions. Records are JSON (and a Markdown table
beside them), and MLflow runs (tag kind=bench) when MLflow is installed.
"""
from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from dataclasses import asdict
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from app.bench.layer_settings import BenchSettings
from app.bench.layer_bound import add_overlap_account, add_own_pass_stages, check_bounds
from app.bench.layer_summary import markdown_table, summarize, targets
from app.bench.measure import (HOST_PROBE_TOKENS, busiest_rank_first, expert_gemm_efficiency, layer_pass,
                               pipeline_stages, probe_inputs, settle_and_measure_memory, time_layers)
from app.bench.parts import (FASTERMOE_GROUP_SIZE, MEMORY_ERRORS, chosen_setting, chosen_split, layer_inputs,
                             memory_failure, peak_memory_bytes, point_config, release_memory, same_setting, setting_n)
from app.bench.stack import bench_stack_point, progress_line, stack_markdown
from app.bench.shapes import LAYER_SHAPES
from app.bench.peers import build_peer, dense_floor_step, require_peers
from app.tracking.records import DEFAULT_OUT_DIR, BenchPoint, BenchResult, RecordMeta, record_meta
from app.tracking.run_kinds import BENCH, BENCH_SUMMARY, kind_tags
from app.bench.timeline import device_busy_floor_ms, trace_name, trace_step
from app.tracking.store import log_result_run, results_store, scalar_fields
from moe_engine import FastMoE, build_layer
from moe_engine.comm import ExpertGroup
from moe_sim.emulation import EmulatedExpertGroup
from moe_engine.granularity import SEARCH_SPLITS, GranularitySearch
from moe_engine.memory import HostBufferPool, predict_memory
from moe_engine.perf_model import PerformanceModel, calibrate, device_name
from workers.distributed import cpu_threads_per_process

# The routings (moe_sim/routing.py): uniform, random inputs through a random router (about 1/E
# of the rows per expert); hot-expert, every other token of each rank picks expert 0 first;
# zipf:S, hot:F and replay:FILE (replay:early, replay:late), their counts imposed on the router.


def grid_partitions(settings: BenchSettings, world_size: int) -> list[tuple[str, int]]:
    """(split, n) of the grid: every n split by tokens; split by peers, the n > 1 that divide
    the expert-parallel world size (n = 1 is one partition however it is split)."""
    return [(split, n) for split in settings.splits for n in settings.partitions
            if split == "tokens" or (n > 1 and world_size % n == 0)]


# -- one point ------------------------------------------------------------------------------------

def bench_point(model: str, tokens: int, routing: str, settings: BenchSettings, group: ExpertGroup, device,
                log) -> list:
    config, dtype = point_config(model, settings, device)
    d_model, d_hidden = config.d_model, config.d_hidden
    torch.manual_seed(0)
    source = FastMoE(config, group, device=device, dtype=dtype)
    x = layer_inputs(tokens, source.router.weight.detach(), routing, settings.top_k, settings.seed)
    if isinstance(group, EmulatedExpertGroup):
        busiest_rank_first(source.router.weight.detach(), x, group.size, settings.top_k)
    grad_y = torch.randn_like(x)
    profile = calibrate(config, tokens, group, device, dtype, repeats=3)
    model_of_time = PerformanceModel(profile)
    # One pinned-host pool for all MPipeMoE variants: they stay alive together for the
    # interleaved timing, and each would otherwise keep its own offload buffers.
    host_pool = HostBufferPool()
    # An emulated group answers FasterMoE's count exchange by its peer steps (emulation.py).
    faster_group = group.for_peer_steps(FASTERMOE_GROUP_SIZE) if isinstance(group, EmulatedExpertGroup) else group
    variants = [("fastmoe", "baseline", lambda: build_layer("fastmoe", config, group, device=device, dtype=dtype)),
                # FasterMoE at its best: its shadowing on (the default), priced by the profile
                ("fastermoe", "baseline", lambda: build_layer("fastermoe", config, faster_group,
                                                              group_size=FASTERMOE_GROUP_SIZE, profile=profile,
                                                              device=device, dtype=dtype)),
                # auto as a user gets it: the search times both splits (where they can run)
                # with its hot-expert replication, where the model says it pays
                ("mpipemoe", "auto", lambda: build_layer("mpipemoe:auto:auto", config, group, profile=profile,
                                                         search=GranularitySearch(candidates=settings.partitions,
                                                                                  splits=SEARCH_SPLITS),
                                                         host_pool=host_pool, hot_replicas=True, device=device,
                                                         dtype=dtype))]
    if settings.grid:
        variants += [("mpipemoe", "grid", lambda n=n, s=s, split=split: build_layer(
                          f"mpipemoe:{n}:{s}:{split}", config, group, host_pool=host_pool, device=device, dtype=dtype))
                     for split, n in grid_partitions(settings, group.size) for s in settings.strategies]
    # measured_rows: each layer's `last_rows` after its measured pass (the host probe's passes
    # below, at 64 tokens, overwrite them); None for peers and the floor.
    layers, memories, measured_rows = [], [], []
    replicas: list[tuple[tuple[int, ...], int]] = []  # (experts replicated or shadowed, rows computed with them)
    for _, _, build in variants:
        layer = build()
        layer.load_state_dict(source.state_dict())
        memories.append(settle_and_measure_memory(layer, x, grad_y, device))
        measured_rows.append(getattr(layer, "last_rows", None))
        replicas.append((tuple(getattr(layer, "last_shadowed", ())), getattr(layer, "last_replica_rows", 0)))
        layers.append(layer)
    # Peers (app/bench/peers.py) copy the source's weights into their own layout themselves.
    for peer in settings.peers:
        variants.append((peer, "peer", None))
        layers.append(build_peer(peer, config, source, device, dtype))
        memories.append(settle_and_measure_memory(layers[-1], x, grad_y, device))
    floor = dense_floor_step(config, tokens, device, dtype)
    floor()
    floor_memory = {"peak_memory_bytes": peak_memory_bytes(floor, device)}
    # The automatic layer is not probed: a pass at another token count would start its search
    # there. Its record takes the probe of the grid layer it settled on; where the grid lacks
    # that setting (auto may settle on a split or n the grid does not hold), a fixed layer of
    # the setting it settled on is probed in the same rounds. Peers are not probed (the probe
    # is for the simulator, which models our engines only).
    auto_probe = auto_probe_twin(variants, layers, x, grad_y, settings, group, config, source, host_pool, device,
                                 dtype)
    extra = (floor,) if auto_probe is None else (floor, auto_probe[1])
    emulator_host = (lambda: group.timing.host_s) if isinstance(group, EmulatedExpertGroup) else None
    times = time_layers(layers, [chosen_by not in ("auto", "peer") for _, chosen_by, _ in variants], x, grad_y,
                        settings, device, extra=extra, emulator_host=emulator_host)
    auto_probe_ms = times.pop()["fwd_bwd_ms"] if auto_probe is not None else None
    variants.append(("dense-floor", "floor", None))
    memories.append(floor_memory)
    records = []
    measured_rows += [None] * (len(variants) - len(measured_rows))
    replicas += [((), 0)] * (len(variants) - len(replicas))
    for (engine, chosen_by, _), layer, memory, timing, rows, (replicated, replica_rows) in zip(
            variants, layers + [None], memories, times, measured_rows, replicas):
        n, strategy = chosen_setting(layer)
        # The model on the rows this rank actually sent and received in the measured pass
        # (under skew the busiest rank's, which an emulated rank 0 is), not the balanced k·T.
        rows_sent, rows_received, largest_partition = rows or (None, None, None)
        predicted_memory = None if chosen_by in ("peer", "floor") else predict_memory(
            config, tokens, group.size, n if engine != "fastmoe" else 1, strategy, engine=engine,
            dtype=dtype, rows_sent=rows_sent, rows_received=rows_received,
            largest_partition_received=largest_partition, replicas=len(replicated),
            replica_rows=replica_rows).peak_bytes
        record = {"engine": engine, "model": model, "tokens": tokens, "routing": routing, "world_size": group.size,
                  "device": device_name(device), "dtype": str(dtype).replace("torch.", ""),
                  "partitions": n, "strategy": strategy, "split": chosen_split(layer), "chosen_by": chosen_by,
                  **timing, **memory,
                  "predicted_memory_bytes": predicted_memory,
                  **({"rows_sent": rows_sent, "rows_received": rows_received,
                      "largest_partition_received": largest_partition} if rows_sent is not None else {}),
                  "d_model": d_model, "d_hidden": d_hidden, "num_experts": settings.num_experts,
                  "top_k": settings.top_k, "activation": settings.activation, "bias": settings.bias,
                  **group_fields(group)}
        if engine == "fastermoe" or chosen_by == "auto":  # FasterMoE's shadowed, MPipeMoE's replicated experts
            record["shadowed_experts"] = list(replicated)
        if engine == "mpipemoe":
            record["predicted_fwd_bwd_ms"] = 1e3 * model_of_time.predict(config, tokens, group.size, n, strategy,
                                                                         dtype).total_s
            if chosen_by == "auto":
                record["search_decisions"] = layer.search.decisions
        records.append(record)
    for record in records:
        if record["chosen_by"] == "auto":
            twin = next((r for r in records if r["chosen_by"] == "grid" and same_setting(r, record)), None)
            if twin:
                record.update(host_probe_ms=twin["host_probe_ms"], host_probe_tokens=twin["host_probe_tokens"])
            elif auto_probe is not None and same_setting(auto_probe[0], record):
                record.update(host_probe_ms=auto_probe_ms, host_probe_tokens=HOST_PROBE_TOKENS)
    emulated = isinstance(group, EmulatedExpertGroup)
    if emulated:
        add_own_pass_stages(records, layers, x, grad_y, settings, device)
    elif group.size == 1 and device.type == "cuda":  # one rank: the pass is all compute
        for record, layer in zip(records, layers):
            record["compute_device_busy_ms"] = device_busy_floor_ms(lambda layer=layer: layer_pass(layer, x, grad_y),
                                                                    device, settings.rounds * settings.repeats)
    # Every record of an emulated point carries its timeline's account (trace files kept with --trace).
    traced = layers + [None] if settings.trace or emulated else []  # the dense floor is not traced
    del layers, floor
    if device.type == "cuda":
        torch.cuda.empty_cache()
    efficiency = expert_gemm_efficiency(config, tokens, config.experts_per_rank(group.size), device, dtype, settings)
    stages = pipeline_stages(config, x, source.router.weight.detach(), group, device, dtype, settings)
    for record in records:
        record.update(efficiency, **stages, **group_fields(group))
    add_overlap_account(records)
    if traced:
        if settings.trace:
            trace_records(records, traced, x, grad_y, settings.trace, device)
        else:
            with tempfile.TemporaryDirectory() as scratch:
                trace_records(records, traced, x, grad_y, scratch, device, keep_files=False)
    del traced
    for record in records:  # logged whole: a run stopped later keeps every finished point
        log(record)
    return records


def auto_probe_twin(variants: list, layers: list, x, grad_y, settings: BenchSettings, group: ExpertGroup, config,
                    source, host_pool, device, dtype):
    """(setting, probe pass) for the automatic layer when the grid lacks the setting it settled
    on: a fixed MPipeMoE layer of that n, strategy and split with the source's weights, its
    pass at HOST_PROBE_TOKENS timed beside the others; None when the grid holds that setting
    (its record carries the probe) or there is no automatic layer."""
    auto = next((layer for (_, chosen_by, _), layer in zip(variants, layers) if chosen_by == "auto"), None)
    if auto is None:
        return None
    n, strategy = chosen_setting(auto)
    setting = {"partitions": n, "strategy": strategy, "split": chosen_split(auto)}
    grid = [{"partitions": g_n, "strategy": s, "split": split}
            for split, g_n in grid_partitions(settings, group.size) for s in settings.strategies] if settings.grid else []
    if any(same_setting(g, setting) for g in grid):
        return None
    twin = build_layer(f"mpipemoe:{n}:{strategy}:{setting['split']}", config, group, host_pool=host_pool,
                       device=device, dtype=dtype)
    twin.load_state_dict(source.state_dict())
    x_probe, grad_probe = probe_inputs(x, grad_y)
    return setting, lambda: layer_pass(twin, x_probe, grad_probe)


def group_fields(group: ExpertGroup) -> dict:
    """What a record says about how its collectives were made: measured on real ranks, or rank
    0 of an emulated cluster (with the emulated wait's measured dilation)."""
    if not isinstance(group, EmulatedExpertGroup):
        return {"measured_as": "measured"}
    fields = group.cluster.record_fields()
    if group.dilation is not None:
        fields.update(emulated_wait_dilation_alone=group.dilation["alone"],
                      emulated_wait_dilation_beside_gemms=group.dilation["beside_gemms"])
    return fields

def trace_records(records: list, layers: list, x, grad_y, folder: str, device, keep_files: bool = True) -> None:
    """In place: one timeline per record that has a layer (app/bench/timeline.py), its stream account
    under ``timeline`` and, with `keep_files`, its file under ``trace_file``."""
    for record, layer in zip(records, layers):
        if layer is None:
            continue
        path = os.path.join(folder, trace_name(record))
        record["timeline"] = trace_step(lambda layer=layer: layer_pass(layer, x, grad_y), device, path)
        if keep_files:
            record["trace_file"] = path


# -- running ----------------------------------------------------------------------------------

def _rank_main(rank: int, settings: BenchSettings, init_file: str, queue) -> None:
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= settings.world_size
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    elif settings.world_size > 1:  # rank processes of their own: they share the cores
        torch.set_num_threads(cpu_threads_per_process(settings.world_size))
    if settings.world_size > 1:
        dist.init_process_group("nccl" if use_cuda else "gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=settings.world_size, timeout=timedelta(minutes=5))
    cluster = settings.emulated_cluster()
    group = cluster.build() if cluster is not None else ExpertGroup(None)
    if isinstance(group, EmulatedExpertGroup) and use_cuda:
        group.dilation = group.clock.measure_dilation(device)
    records: list = []

    def log(record: dict) -> None:  # every record of a point, as it is measured
        records.append(record)
        if rank == 0:
            queue.put(("record", record))

    point = bench_stack_point if settings.layers > 1 else bench_point
    try:
        for model in settings.models:
            for routing in settings.routings:
                for tokens in settings.tokens:
                    try:
                        point(model, tokens, routing, settings, group, device, log)
                        continue
                    except MEMORY_ERRORS as error:
                        # One process (one GPU, or rank 0 of an emulated cluster) goes on with the
                        # next point; real ranks would leave the others waiting in a collective.
                        if settings.world_size > 1:
                            raise
                        reason = memory_failure(error)
                    release_memory(device)  # out of the handler: the error's frames are gone
                    if rank == 0:
                        queue.put(("not_measured", {"model": model, "routing": routing, "tokens": tokens,
                                                    "reason": reason}))
        if rank == 0:
            queue.put(("done", records))
    finally:
        if settings.world_size > 1:
            dist.destroy_process_group()


class _Reporter:
    """Rank 0's channel in the one-process case: each record (and each point not measured)
    is printed and handed on as it arrives (what `queue.put` carries between processes
    otherwise)."""

    def __init__(self, on_record, on_not_measured):
        self.on_record, self.on_not_measured = on_record, on_not_measured
        self.records: list | None = None

    def put(self, item) -> None:
        kind, payload = item
        if kind == "record":
            self.on_record(payload)
        elif kind == "not_measured":
            self.on_not_measured(payload)
        else:
            self.records = payload


def run_bench(settings: BenchSettings, printer=print, on_record=None, on_not_measured=None) -> list:
    """Every rank benchmarks; rank 0's records come back, each printed (and passed to
    `on_record`) as soon as its point is measured. A point that does not fit one process's
    memory (parts.MEMORY_ERRORS) is printed and passed to `on_not_measured` (model, routing,
    tokens, reason), and the run goes on."""
    started = time.time()

    def arrived(record: dict) -> None:
        printer(_progress_line(record, time.time() - started))
        if on_record is not None:
            on_record(record)

    def failed(point: dict) -> None:
        printer(f"  [{time.time() - started:6.0f} s] {point['model']:>6} {point['routing']:<7} {point['tokens']:>6} "
                f"tok  not measured: {point['reason']}")
        if on_not_measured is not None:
            on_not_measured(point)

    if settings.world_size == 1:
        reporter = _Reporter(arrived, failed)
        _rank_main(0, settings, "", reporter)
        return reporter.records
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank_main, args=(r, settings, os.path.join(tmp, "init"), q))
                 for r in range(settings.world_size)]
        for p in procs:
            p.start()
        try:
            while True:
                kind, payload = q.get(timeout=3600)
                if kind == "record":
                    arrived(payload)
                if kind == "not_measured":
                    failed(payload)
                if kind == "done":
                    break
            for p in procs:
                p.join()
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
    return payload


def _progress_line(r: dict, elapsed_s: float) -> str:
    if "setting" in r:  # a stack's (app/bench/stack.py)
        return progress_line(r, elapsed_s)
    peak = r.get("peak_memory_bytes")
    return (f"  [{elapsed_s:6.0f} s] {r['model']:>6} {r.get('routing', 'uniform'):<7} {r['tokens']:>6} tok  {r['engine']:<11} {r['chosen_by']:<8} n={setting_n(r):<2} "
            f"{r['strategy']:<4}  {r['fwd_bwd_ms']:9.2f} ms  "
            f"{'' if peak is None else f'peak {peak / 2**20:8.0f} MiB'}")


def log_to_mlflow(result: dict, tracking_uri: str | None, experiment: str, printer=print) -> int:
    """One MLflow run per record (tag kind=bench), plus one per summary (kind=bench-summary)."""
    uri = results_store(tracking_uri, printer, "MLflow is not installed here: records stay in the JSON (log them "
                                               "later with --import).")
    if uri is None:
        return 0
    meta = result["meta"]
    count = 0
    for kind, rows in ((BENCH, result["records"]), (BENCH_SUMMARY, result["summaries"])):
        for row in rows:
            name = row.get("setting") or row.get("engine", "summary")
            params, metrics = scalar_fields(row)
            params.update(world_size=meta["world_size"], date=meta["date"], torch=meta["torch"],
                          **{k: meta[k] for k in ("network", "emulated_cluster") if k in meta})
            log_result_run(uri, experiment, f"{row['model']}-{row['tokens']}-{name}",
                           {**kind_tags(kind), "device": meta["device"], "command": meta["command"][:250],
                            "measured_as": meta.get("measured_as", "measured")}, params, metrics)
            count += 1
    printer(f"Logged {count} MLflow runs to {uri} (experiment {experiment!r}).")
    return count


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def bench_and_write(settings: BenchSettings, out: str | None, tracking_uri: str | None, experiment: str) -> int:
    """`mpipemoe bench` once its flags are settings: run the points, write the JSON and the Markdown
    beside it (``out``, default under out/), log to MLflow and check the bounds; 1 when stopped early."""
    on_gpu = torch.cuda.is_available()
    require_peers(settings.peers)
    device = device_name(torch.device("cuda")) if on_gpu else "cpu"
    cluster = settings.emulated_cluster()
    where = (f"1 × {device} as rank 0 of an emulated {cluster.name} {cluster.network.name} cluster" if cluster
             else f"{settings.world_size} × {device}")
    stacked = settings.layers > 1
    if stacked:
        print(f"Benchmarking stacks of {settings.layers} layers of {', '.join(settings.models)} at {settings.tokens} "
              f"tokens per rank on {where}, setting by setting (checkpointing {settings.checkpointing}): "
              f"{''.join(peer + ', ' for peer in settings.peers)}FastMoE, FasterMoE, MPipeMoE auto"
              f"{' and the n × strategy grid' if settings.grid else ''}"
              f"{', auto@budget' if settings.budgeted() else ''}...", flush=True)
    else:
        print(f"Benchmarking {', '.join(settings.models)} at {settings.tokens} tokens per rank on "
              f"{where}: FastMoE, FasterMoE, MPipeMoE auto"
              f"{' and the n × strategy grid' if settings.grid else ''}"
              f"{''.join(', ' + peer for peer in settings.peers)}, the dense floor...", flush=True)
    started = time.time()
    out = out or os.path.join(DEFAULT_OUT_DIR, f"{'stacked' if stacked else 'bench'}-"
                                   f"{device.replace(' ', '-').lower()}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json")
    # An emulated run's world size is the emulated cluster's (so nothing reads its records as
    # one GPU's); it ran in one process.
    emulated = {**cluster.record_fields(), "processes": 1} if cluster else {"measured_as": "measured"}

    def meta(complete: bool) -> RecordMeta:
        return RecordMeta.from_json({**record_meta("bench", on_gpu), "device": device,
                                     "world_size": settings.world_size, **emulated, "settings": asdict(settings),
                                     "wall_s": round(time.time() - started, 1), "complete": complete,
                                     "not_measured": skipped})

    def write(records: list, complete: bool) -> tuple[dict, str]:
        """The JSON and the Markdown beside it, both whole (a stacked run writes them after each setting)."""
        if stacked:
            result = {"meta": meta(complete).to_json(), "records": records, "summaries": []}
            markdown = stack_markdown(result)
        else:
            summaries = summarize(records)
            typed = BenchResult(meta=meta(complete), records=[BenchPoint.from_json(r) for r in records],
                                summaries=summaries, targets=targets(summaries))
            result, markdown = typed.to_json(), markdown_table(typed)
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1, default=str)
        with open(os.path.splitext(out)[0] + ".md", "w") as f:
            f.write(markdown)
        return result, markdown

    finished: list = []
    skipped: list = []  # the points that did not fit (model, routing, tokens, reason)

    def arrived(record: dict) -> None:
        finished.append(record)
        if stacked:  # a later setting's failure or a stop loses none of the earlier ones
            write(finished, complete=False)

    def not_measured(point: dict) -> None:
        skipped.append(point)
        write(finished, complete=False)

    previous = signal.signal(signal.SIGTERM, _interrupt)  # `timeout` and schedulers stop with SIGTERM
    try:
        records, complete = run_bench(settings, lambda line: print(line, flush=True), arrived, not_measured), True
    except KeyboardInterrupt:
        records, complete = finished, False
        print(f"Stopped: writing the {len(records)} records of the {'settings' if stacked else 'points'} "
              "finished so far", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    result, markdown = write(records, complete)
    print(markdown.split("## Every measurement")[0])
    print(f"Wrote {out} and {os.path.splitext(out)[0]}.md")
    log_to_mlflow(result, tracking_uri, experiment)
    check_bounds(result["records"], out)  # after writing: the records that show it are kept
    return 0 if complete else 1
