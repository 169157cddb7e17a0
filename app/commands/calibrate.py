"""`mpipemoe calibrate`: measure the hardware profile the performance model uses and store it.

    mpipemoe calibrate --model gpt-xl --tokens 16384 --profiles out/profiles.json

Later runs load it with ProfileStore(path).get(key) and pass it to MPipeMoE(profile=...)
(or give the layers ProfileCache(ProfileStore(path))); run this again to refresh it (e.g.
after a driver or topology change). Calibrate in the dtype the experts run in: the
training's compute (autocast) dtype, which --dtype auto matches. Where ranks load
different profiles (one file per node), the layers adopt rank 0's, with a warning.
"""
from __future__ import annotations

import argparse
import json

import torch

from app.bench.shapes import DTYPES, LAYER_SHAPES
from app.tracking.records import DEFAULT_OUT_DIR
from moe_engine import MoEConfig
from moe_engine.comm import ExpertGroup
from moe_engine.perf_model import ProfileStore, calibrate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", choices=sorted(LAYER_SHAPES))
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), bf16, fp16, fp32")
    parser.add_argument("--profiles", default=f"{DEFAULT_OUT_DIR}/profiles.json",
                        help=f"JSON file holding profiles by key (default {DEFAULT_OUT_DIR}/profiles.json)")


def run(args) -> int:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = (torch.bfloat16 if device.type == "cuda" else torch.float32) if args.dtype == "auto" else DTYPES[args.dtype]
    d_model, d_hidden = LAYER_SHAPES[args.model]
    config = MoEConfig(d_model, d_hidden, args.experts)
    print(f"Calibrating {args.model} ({d_model}/{d_hidden}, {args.experts} experts) at {args.tokens} tokens "
          f"on {device} in {dtype}...", flush=True)
    profile = calibrate(config, args.tokens, ExpertGroup(None), device, dtype)
    ProfileStore(args.profiles).put(profile)
    print(json.dumps(profile.to_json(), indent=2))
    print(f"Stored under key {profile.key!r} in {args.profiles}")
    return 0
