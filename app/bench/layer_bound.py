"""The layer bench's yardstick (docs/engine.md, "Reading a timeline"): a record's floor from the
stages of its own pass on the emulated cluster (its transfers' priced time; its compute with the
transfers free, as device-busy time on CUDA), per phase; the pipeline model's bound beside it; the
share of the ideal saving a setting realizes; and the check that no pass beats its floor."""
from __future__ import annotations

import torch

from app.bench.measure import layer_pass
from app.bench.layer_settings import BenchSettings
from app.bench.parts import same_setting, setting_label
from app.bench.timeline import device_busy_ms, record_trace
from moe_engine.timing import Stopwatch, synchronize
from moe_sim.emulation import FREE_TRANSFER_COPY

def overlap_bound_ms(all_to_all_ms: float, expert_ms: float, partitions: int) -> float:
    """The pipeline model of a layer (the paper's): the longer stage, plus one partition of the
    shorter one (the fill before the stages overlap); n = 1 gives the serial sum. Not a floor
    (`add_overlap_account` says why)."""
    return max(all_to_all_ms, expert_ms) + min(all_to_all_ms, expert_ms) / partitions


OWN_PASS = "own pass"      # bound_stages: the record's own pass, its transfers priced and then freed
TIMED_ALONE = "timed alone"  # the point's two stages, each timed alone (real ranks: no transfer can be freed)
BOUND_TOLERANCE = 0.98     # a pass below this share of its own-pass floor: the stages were not floors


def _phased_pass(layer, x, grad_y, device) -> tuple[float, float]:
    """Local. One forward+backward of `layer`: the seconds of its forward and of the whole pass,
    both timed inside the pass (nothing waits between the phases)."""
    forward, whole = Stopwatch(device), Stopwatch(device)
    layer.zero_grad(set_to_none=True)
    x_in = x.detach().requires_grad_(True)
    whole.start()
    forward.start()
    y, aux = layer(x_in)
    forward.stop()
    torch.autograd.backward([y, aux], [grad_y, torch.ones_like(aux)])
    whole.stop()
    return forward.elapsed_s(), whole.elapsed_s()


FORWARD_MARK, BACKWARD_MARK = "mpipemoe.forward", "mpipemoe.backward"  # host ranges of a profiled pass


def _marked_pass(layer, x, grad_y) -> None:
    """Local. One forward+backward of `layer`, each phase inside its host range (a profiler's)."""
    layer.zero_grad(set_to_none=True)
    with torch.profiler.record_function(FORWARD_MARK):
        y, aux = layer(x.detach().requires_grad_(True))
    with torch.profiler.record_function(BACKWARD_MARK):
        torch.autograd.backward([y, aux], [grad_y, torch.ones_like(aux)])


def own_pass_stages(layer, x, grad_y, settings: BenchSettings, device) -> dict:
    """The two stages of `layer`'s own pass on its emulated group, each a floor of that pass:

    comm_fwd_ms, comm_bwd_ms:       the network time the emulator prices for the All-to-Alls the
                                    pass issues in its forward and in its backward (each occupies
                                    its stream at least that long);
    compute_fwd_ms, compute_bwd_ms: the same pass with its transfers free (`free_transfers`): the
                                    same routing, partitions, streams and SM reservation, the
                                    network's time gone. On CUDA the device-busy time of each
                                    phase (`device_busy_ms`: its kernels and copies, whatever the
                                    stream, less the freed transfers' copies, which a priced
                                    transfer's time holds), the least of rounds x repeats profiled
                                    passes: a pass timed by events also counts the device waiting
                                    for the host, which the real pass hides behind its transfers.
                                    Elsewhere the fastest of those passes by the clock.
    compute_device_busy_ms:         on CUDA their sum, the device's busy time in the pass with
                                    its transfers free (None elsewhere): beside the record's
                                    `host_ms` less `emulator_host_ms`, whether the host keeps up.
    """
    group = layer.group
    passes = settings.rounds * settings.repeats
    with group.free_transfers():
        for _ in range(settings.warmup):
            layer_pass(layer, x, grad_y)
        synchronize(device)
        if device.type == "cuda":
            trace = record_trace(lambda: _marked_pass(layer, x, grad_y), device, passes)
            forward_ms = min(device_busy_ms(trace, FORWARD_MARK, excluding=FREE_TRANSFER_COPY))
            backward_ms = min(device_busy_ms(trace, BACKWARD_MARK, excluding=FREE_TRANSFER_COPY))
        else:
            samples = [_phased_pass(layer, x, grad_y, device) for _ in range(passes)]
            # The fastest pass, not the median: a floor must hold for every pass the bench times.
            forward_s, whole_s = min(f for f, _ in samples), min(w for _, w in samples)
            forward_ms, backward_ms = forward_s * 1e3, max(0.0, whole_s - forward_s) * 1e3
        layer.zero_grad(set_to_none=True)
        with group.logging_calls() as forward_calls:
            y, aux = layer(x.detach().requires_grad_(True))
        with group.logging_calls() as backward_calls:
            torch.autograd.backward([y, aux], [grad_y, torch.ones_like(aux)])
        synchronize(device)
    layer.zero_grad(set_to_none=True)
    comm_ms = lambda calls: 1e3 * sum(c.seconds for c in calls if c.kind.startswith("all_to_all"))  # noqa: E731
    return {"comm_fwd_ms": comm_ms(forward_calls), "comm_bwd_ms": comm_ms(backward_calls),
            "compute_fwd_ms": forward_ms, "compute_bwd_ms": backward_ms,
            "compute_device_busy_ms": forward_ms + backward_ms if device.type == "cuda" else None}


def add_own_pass_stages(records: list, layers: list, x, grad_y, settings: BenchSettings, device) -> None:
    """In place, on an emulated point: `own_pass_stages` for every FastMoE, FasterMoE and MPipeMoE
    record. The automatic layer takes its grid twin's (the same setting; extra passes would feed
    its online search), and its own where the grid lacks that setting."""
    for record, layer in zip(records, layers):
        if record["engine"] in ("fastmoe", "fastermoe", "mpipemoe") and record["chosen_by"] != "auto":
            record.update(own_pass_stages(layer, x, grad_y, settings, device))
    for record, layer in zip(records, layers):
        if record["chosen_by"] == "auto":
            twin = next((r for r in records if r["chosen_by"] == "grid" and same_setting(r, record)), None)
            copied = (*STAGE_KEYS, "compute_device_busy_ms")
            record.update({k: twin[k] for k in copied} if twin else own_pass_stages(layer, x, grad_y, settings, device))


STAGE_KEYS = ("comm_fwd_ms", "comm_bwd_ms", "compute_fwd_ms", "compute_bwd_ms")


def add_overlap_account(records: list) -> None:
    """In place: for every record of a point, its floor, t / floor (`bound_ratio`), the share
    of the ideal saving over FastMoE it realizes, (FastMoE − t) / (FastMoE − floor)
    (docs/design.md §7), and the pipeline model's bound at its n.

    From the record's own pass (`own_pass_stages`, emulated points), C its transfers' time and
    K its compute: the floor is max(C_fwd, K_fwd) + max(C_bwd, K_bwd) (`phase_floor_ms`: the
    backward starts when the forward ends, and within a phase neither lane can do less than its
    own work), and the pipeline model max(C, K) + min(C, K) / n over the whole pass
    (`overlap_bound_ms`). The model is no floor: it takes every compute kernel to wait for the
    All-to-All, while work independent of it (S1–S3's host copies, the gate, a skewed rank's
    share) runs beside it even at n = 1 (measured on an H100: bert-l 32k at 1/S3 took 23.75 ms
    against a model of 27.07 and a floor of 14.99). Else from the point's stages timed alone
    (`all_to_all_ms`, `expert_ms`): the floor max(A, E) and the model at n."""
    fast = next((r for r in records if r["engine"] == "fastmoe"), None)
    for record in records:
        if record["engine"] not in ("mpipemoe", "fastermoe", "fastmoe"):
            continue
        n = record["partitions"]  # FasterMoE overlaps per peer step: its partitions are its steps
        if all(record.get(key) is not None for key in STAGE_KEYS):
            comm, compute = record["comm_fwd_ms"] + record["comm_bwd_ms"], \
                record["compute_fwd_ms"] + record["compute_bwd_ms"]
            floor = max(record["comm_fwd_ms"], record["compute_fwd_ms"]) + \
                max(record["comm_bwd_ms"], record["compute_bwd_ms"])
            record.update(bound_stages=OWN_PASS, overlap_bound_ms=overlap_bound_ms(comm, compute, n),
                          phase_floor_ms=floor, floor_ms=floor)
        elif record.get("all_to_all_ms") is not None:
            record.update(bound_stages=TIMED_ALONE,
                          overlap_bound_ms=overlap_bound_ms(record["all_to_all_ms"], record["expert_ms"], n),
                          floor_ms=max(record["all_to_all_ms"], record["expert_ms"]))
        else:
            continue
        floor = record["floor_ms"]
        if floor > 0:
            record["bound_ratio"] = record["fwd_bwd_ms"] / floor
        if fast is not None and fast["fwd_bwd_ms"] - floor > 1e-9:
            record["realized_saving"] = (fast["fwd_bwd_ms"] - record["fwd_bwd_ms"]) / (fast["fwd_bwd_ms"] - floor)


class BoundError(ValueError):
    """A record ran faster than BOUND_TOLERANCE x its own-pass floor: the stages are no floors."""


def check_bounds(records: list, out: str) -> None:
    """Raises BoundError naming the records timed on a GPU below BOUND_TOLERANCE x their own-pass
    floor. CPU records are not checked: there the emulated transfers take no time (docs/emulation.md)."""
    below = [r for r in records if r.get("bound_stages") == OWN_PASS and r.get("device", "cpu") != "cpu"
             and r["fwd_bwd_ms"] < BOUND_TOLERANCE * r["floor_ms"]]
    if not below:
        return
    first = below[0]
    raise BoundError(
        f"{len(below)} record(s) ran below {BOUND_TOLERANCE}x their floor, first {first['model']} "
        f"{first.get('routing', 'uniform')} {first['tokens']} tokens {first['engine']} {first['chosen_by']} "
        f"{setting_label(first)}: {first['fwd_bwd_ms']:.2f} ms against a floor of "
        f"{first['floor_ms']:.2f} ms; the stage times are not floors of the pass, so its bound_ratio "
        f"and realized_saving in {out} are wrong: report it with that file")
