"""Routing files from a real training run on one device, without Ray or MLflow (the GPU
machine has neither): the per-expert loads that `mpipemoe train` logs (workers/load.py),
read at the steps asked and saved as the files `--routing replay:FILE` replays
(moe_sim/routing.py) — as `mpipemoe routing --run` saves them from a logged run.

    python3 tools/routing_from_training.py --data data/stdlib-bpe --preset gpt-s --layers 4 \\
        --experts 64 --steps 200 --at 10,200 --out-dir out/routing
    # writes out/routing/routing-gpt-s-10.json and routing-gpt-s-200.json

Each file holds the loads counted since the step before it (the counts start afresh after
each read), over every MoE layer: `--at 10` is the routing of the first ten steps.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from moe_sim.routing import routing_from_metrics, save_routing  # noqa: E402
from app.jobs.job import TrainJob, worker_config  # noqa: E402
from workers.loop import Trainer  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="a prepared data directory (mpipemoe data prepare)")
    parser.add_argument("--preset", default="gpt-s")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--at", default="10,200", help="comma list of steps whose loads are saved")
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args(argv)
    at = sorted({int(s) for s in args.at.split(",")})
    if not at or at[0] < 1 or at[-1] > args.steps:
        parser.error(f"--at {args.at}: steps between 1 and --steps {args.steps}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as scratch:
        job = TrainJob(preset=args.preset, steps=args.steps, num_workers=1, batch_size=args.batch_size,
                       seq_len=args.seq_len, num_layers=args.layers, num_experts=args.experts, lr=args.lr,
                       checkpoint_every=0, eval_every=0, storage_path=scratch, name="routing",
                       data_dir=str(Path(args.data).resolve()), tracking_uri="none")
        trainer = Trainer(worker_config(job, use_gpu=device.type == "cuda"), 0, 1, device)
        started = time.perf_counter()
        for step in range(1, args.steps + 1):
            metrics = trainer.step(step)
            if step in at:
                routing = routing_from_metrics(trainer.load.read(1), f"{args.preset} on {args.data}", step)
                path = Path(args.out_dir) / f"routing-{args.preset}-{step}.json"
                save_routing(routing, path)
                worst = max(routing.imbalance(layer) for layer in range(len(routing.layers)))
                print(f"step {step}: lm loss {float(metrics['lm_loss']):.3f}, largest imbalance {worst:.2f} "
                      f"(max / mean pairs per expert) -> {path}  [{time.perf_counter() - started:.0f} s]",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
