"""Where one training step's time goes on a GPU (torch.profiler): the worker's Trainer
(float32 master weights, bf16 autocast) on one rank, kernel time by kind, where the GPU
idled, and the step's wall time unprofiled (``step_s``, MFU's) and profiled, with the GPU's
clocks, so that MFU's gap to the GEMM rate is measured, not guessed.

    python3 tools/profile_step.py --preset gpt-xl --num-layers 4 --batch-size 32 --out step.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from app.tracking.records import record_meta
from lm.data import prepare_dataset
from lm.model import get_preset, model_flops_per_token
from workers.config import OPTIMIZER_IMPLS, WorkerConfig
from workers.loop import Trainer, peak_flops

# Kernel kinds by name fragment, first match wins (names of cuBLAS/cuDNN/Triton/ATen kernels).
KINDS = (("gemm", ("gemm", "cutlass", "sm90_xmma", "nvjet", "wgmma")), ("attention", ("flash", "fmha", "attention")),
         ("optimizer", ("adam", "multi_tensor")), ("copy/cast", ("copy", "cast", "convert")),
         ("reduce/norm", ("reduce", "norm", "softmax")), ("elementwise", ("elementwise", "vectorized", "unrolled")))


def kind_of(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, parts in KINDS if any(p in lowered for p in parts)), "other")


def idle_gaps(prof, steps: int, top: int = 12) -> list[dict]:
    """The GPU's idle time between consecutive kernels (any stream), per step, summed by the
    pair of kernels around each gap of more than 10 us: which step of the model the GPU
    waited before (a host wait, or the host queueing slower than the GPU ran)."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start)
    by_pair: dict[tuple[str, str], list[float]] = {}
    busy_until, before = None, ""
    for start, end, name in spans:
        if busy_until is not None and start - busy_until > 10:  # microseconds
            entry = by_pair.setdefault((before[:60], name[:60]), [0.0, 0])
            entry[0] += (start - busy_until) / 1e6 / steps
            entry[1] += 1
        if busy_until is None or end > busy_until:
            busy_until, before = end, name
    ranked = sorted(by_pair.items(), key=lambda item: -item[1][0])[:top]
    return [{"s": s, "gaps_per_step": count / steps, "after": a, "before": b} for (a, b), (s, count) in ranked]


def gpu_clocks() -> dict | None:
    """The GPU's SM clock now and its maximum, power and temperature (nvidia-smi), right after
    the profiled steps: a step of the same kernels takes longer on a GPU held to a lower clock,
    so records from two machines compare only with these beside them."""
    fields = "clocks.sm,clocks.max.sm,power.draw,temperature.gpu"
    try:
        line = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-i", "0"],
                              capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        sm, sm_max, power, temperature = (float(v) for v in line.split(","))
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    return {"sm_mhz": sm, "sm_max_mhz": sm_max, "power_w": power, "temperature_c": temperature}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="gpt-xl")
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--engine", default="mpipemoe")
    parser.add_argument("--optimizer-impl", default="auto", choices=OPTIMIZER_IMPLS,
                        help="AdamW kernels (auto: fused on CUDA)")
    parser.add_argument("--steps", type=int, default=3,
                        help="profiled steps (after 3 warm-up steps and twice as many timed unprofiled)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    work = tempfile.mkdtemp(prefix="profile-step")
    prepare_dataset(f"{work}/data", max_bytes=2**24, row_len=1024)
    preset = get_preset(args.preset).replace(num_layers=args.num_layers, vocab_size=259)
    config = WorkerConfig(preset=preset, engine=args.engine, partitions=1, strategy="none",
                          seed=0, lr=3e-4, weight_decay=0.1, warmup_steps=5, grad_clip=1.0,
                          aux_loss_weight=0.01, steps=100, batch_size=args.batch_size, seq_len=preset.seq_len,
                          data_dir=f"{work}/data", dtype="bfloat16", shard_dense=False, grad_accum=1,
                          optimizer_impl=args.optimizer_impl)
    dist.init_process_group("nccl", init_method=f"file://{work}/init", rank=0, world_size=1, device_id=device)
    trainer = Trainer(config, 0, 1, device)
    for step in range(1, 4):
        trainer.step(step)
    torch.cuda.synchronize()
    # The step's time unprofiled first: the profiler's tracing slows every launch, which a
    # step the host only just keeps ahead of (batch 8) shows as idle GPU time.
    started = time.perf_counter()
    for step in range(4, 4 + 2 * args.steps):
        trainer.step(step)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - started) / (2 * args.steps)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        for step in range(4 + 2 * args.steps, 4 + 3 * args.steps):
            trainer.step(step)
        torch.cuda.synchronize()
        profiled = (time.perf_counter() - started) / args.steps
    clocks = gpu_clocks()
    kinds: dict[str, float] = {}
    launches = 0
    for event in prof.key_averages():
        if event.device_type.name == "CUDA" and event.self_device_time_total > 0:
            kind = kind_of(event.key)
            kinds[kind] = kinds.get(kind, 0.0) + event.self_device_time_total / 1e6 / args.steps
            launches += event.count
    gaps = idle_gaps(prof, args.steps)
    top = sorted(((e.self_device_time_total / 1e6 / args.steps, e.key[:90]) for e in prof.key_averages()
                  if e.device_type.name == "CUDA"), reverse=True)[:40]
    tokens = args.batch_size * preset.seq_len
    flops = tokens * model_flops_per_token(preset)
    result = {"meta": record_meta("profile_step", use_gpu=True), "preset": args.preset, "num_layers": args.num_layers, "batch_size": args.batch_size,
              "engine": args.engine, "optimizer_impl": args.optimizer_impl,
              "device": torch.cuda.get_device_name(device), "gpu_clocks": clocks,
              "step_s": wall, "profiled_step_s": profiled,
              "kernel_s": sum(kinds.values()), "kernel_s_by_kind": kinds, "mfu": flops / wall / peak_flops(device, "bfloat16"),
              # the bound the GEMMs alone set: model FLOPs over the GEMM kernels' time
              "mfu_if_only_gemms": flops / kinds["gemm"] / peak_flops(device, "bfloat16") if kinds.get("gemm") else None,
              # host-side bound: kernels per step, and the step's time the GPU ran no kernel
              "kernels_per_step": launches / args.steps, "gpu_idle_s": profiled - sum(kinds.values()),
              "top_kernels": [{"s": s, "name": n} for s, n in top],
              # where the GPU waited: idle time between kernels, by the kernels on either side
              "idle_gaps": gaps}
    dist.destroy_process_group()
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
