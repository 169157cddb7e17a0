"""What `mpipemoe simulate` (app/commands/simulate.py) does: predict a cluster's MoE layer (and
training step) from calibrated parts, and validate the simulator against bench records.

The schedule simulator (moe_sim/simulator.py) replays the engine's operations on
host, compute, communication and copy timelines. Compute, copy and host figures come
from the parts measured on one GPU (--parts); the network from a profile (--network:
dgx-a100, dgx-h200, or a JSON file of measured figures; moe_sim/network.py lists the
datasheet defaults). Results print as a table, go to a JSON file (--out) and to MLflow
(tag kind=simulate; --tracking-uri none to skip); `mpipemoe report` plots them
(app/reports/simulate.py).
See docs/simulate.md. Its parts: the settings (app/bench/simulate_settings.py), the points
predicted (app/bench/simulate_points.py), the validation against bench records
(app/bench/simulate_validation.py).
"""
from __future__ import annotations

import json
import os
import sys
import time

from app.bench.simulate_points import run_simulation
from app.bench.simulate_settings import SimulateSettings
from app.bench.simulate_validation import _spot_check, validate, validation_markdown
from app.tracking.records import DEFAULT_OUT_DIR, command_line, utc_timestamp
from app.tracking.run_kinds import SIMULATE, kind_tags

DEFAULT_PARTS = "results/sim-parts-h200.json"
EXPERIMENT = "mpipemoe-simulate"


# -- MLflow -------------------------------------------------------------------------------------------

def _rows(point: dict) -> list[dict]:
    """A point's rows as MLflow runs: one per engine (a layer point, ``engines``), or one per
    expert-parallel degree E (``--expert-parallel``, ``degrees``: MPipeMoE's step, label
    ``mpipemoe-epE``; a degree that is not possible has its reason and no metrics)."""
    if "engines" in point:
        return point["engines"]
    return [{**degree, "label": f"mpipemoe-ep{degree['expert_parallel']}", "engine": "mpipemoe",
             "partitions": degree.get("partitions", ""), "strategy": degree.get("strategy", "")}
            for degree in point["degrees"]]


def log_to_mlflow(result: dict, tracking_uri: str | None, experiment: str, printer=print) -> int:
    """One MLflow run per (point, engine), or per (point, expert-parallel degree), tag kind=simulate."""
    from app.tracking.store import log_result_run, results_store

    uri = results_store(tracking_uri, printer, "MLflow is not installed here: results stay in the JSON.")
    if uri is None:
        return 0
    count = 0
    for point in result["points"]:
        for row in _rows(point):
            params = {k: v for k, v in point.items() if isinstance(v, (str, int, bool)) and not isinstance(v, float)}
            params.update(label=row["label"], engine=row["engine"], partitions=row["partitions"],
                          strategy=row["strategy"], parts=result["meta"]["parts"])
            if "why" in row:
                params["not_possible"] = row["why"]
            metrics = {k: v for k, v in {**point, **row}.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool)}
            log_result_run(uri, experiment, f"sim-{point['model']}-{point['tokens']}-{point['nodes']}x"
                                            f"{point['gpus_per_node']}-{row['label']}",
                           {**kind_tags(SIMULATE), "command": result["meta"]["command"][:250]}, params, metrics)
            count += 1
    printer(f"Logged {count} MLflow runs to {uri} (experiment {experiment!r}).")
    return count


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
    out = out or os.path.join(DEFAULT_OUT_DIR, "simulate-validation.json")
    parts, meta = _load_parts(parts_path, host_scale)
    result = validate(bench_paths, parts)
    if not result["rows"]:  # nothing priced: an earlier report at `out` stays
        raise ValueError(f"--validate: no record could be simulated ({'; '.join(result['skipped'])}); {out} "
                         f"left as it was")
    meta["spot_check"] = _spot_check(parts, bench_paths)
    result = {"meta": meta, **result}
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
    # older records lack expert_parallel; the seed only draws zipf's ranking, so others omit it
    recorded = {k: v for k, v in settings.__dict__.items()
                if (k != "expert_parallel" or v) and (k != "seed" or settings.routing.startswith("zipf:"))}
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
