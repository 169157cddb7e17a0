"""Which operations of a training step move memory, and from which source line (CPU, no GPU).

Runs ``Trainer.step`` on the CPU under bf16 autocast (float32 master weights, one rank,
mpipemoe n=1, as ``tools/profile_step.py`` does on a GPU) and records every ATen operation
(``TorchDispatchMode``): its kind as the CUDA profile names it (copy/cast, elementwise,
reduce/norm, gemm, attention, optimizer), the bytes it reads and writes, and where it comes
from: the repository line that called it, or for autograd's own backward nodes the node and
the forward line that made it (anomaly mode keeps that trace). Two sequence lengths give each
operation's bytes as a + b x tokens, so the census extrapolates to a batch that does not fit
a CPU (``--tokens``), in GB per step and, at ``--bandwidth``, in ms.

    python3 tools/op_census.py --preset gpt-xl --num-layers 4 --tokens 8192 131072 --out census.json

Costs are bytes over one bandwidth, not measurements: they rank the operations and say which
line each kernel of the GPU profile comes from; the GPU profile (profile_step.py) is the truth.
The CPU runs a few operations the GPU does not (float32 upcasts in the expert weight
gradients, ``experts._wide_weight_grad``); they are marked ``cpu_only``.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

REPO = str(Path(__file__).resolve().parents[1])
sys.path.insert(0, REPO)  # this checkout's lm/, workers/, moe_engine/, not an installed copy
VIEWS = {"view", "_unsafe_view", "t", "transpose", "expand", "slice", "select", "unsqueeze", "squeeze",
         "permute", "as_strided", "alias", "detach", "split", "split_with_sizes", "chunk", "unbind",
         "reshape", "view_as", "lift_fresh", "unfold", "diagonal", "_reshape_alias", "empty", "empty_like",
         "empty_strided", "new_empty", "new_empty_strided", "_local_scalar_dense", "set_", "resize_",
         "is_same_size", "_to_copy_noop", "_has_compatible_shallow_copy_type", "item"}
GEMM = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "linear", "matmul"}
ATTENTION = ("scaled_dot_product", "flash", "efficient_attention", "cudnn_attention")
COPY = {"_to_copy", "copy_", "clone", "contiguous", "cat", "stack", "to", "_copy_from"}
REDUCE = ("sum", "mean", "norm", "softmax", "layer_norm", "nll_loss", "topk", "aminmax", "max", "min", "cumsum",
          "sort", "argsort", "var", "prod", "any", "all", "_foreach_norm")
GATHER = {"index_select", "embedding", "gather", "index", "embedding_dense_backward", "index_copy",
          "index_copy_", "index_add_", "scatter_add_", "scatter_add", "repeat_interleave"}
CPU_ONLY = ("_wide_weight_grad",)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def kind_of(name: str) -> str:
    base = name.split(".")[0]
    if base in GEMM:
        return "gemm"
    if any(a in base for a in ATTENTION):
        return "attention"
    if "adam" in base:
        return "optimizer"
    if base in COPY:
        return "copy/cast"
    if base in GATHER:
        return "gather"
    if any(base.startswith(r) or base.endswith(r) or f"{r}_" in base for r in REDUCE):
        return "reduce/norm"
    return "elementwise"


def _repo_frames(frames: list[tuple[str, int, str]]) -> list[str]:
    return [f"{Path(f).relative_to(REPO)}:{line} {fn}" for f, line, fn in frames
            if f.startswith(REPO) and "/.venv/" not in f and not f.endswith("op_census.py")]


class Census(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[dict[str, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in VIEWS or name.endswith("_view"):
            return out
        ins, outs = _tensors((args, kwargs)), _tensors(out)
        if name in GATHER and outs:  # reads only the rows it gathers
            read = sum(_nbytes(o) for o in outs) + sum(_nbytes(t) for t in ins if t.dtype in (torch.int64, torch.int32))
        else:
            read = sum(_nbytes(t) for t in ins)
        written = sum(_nbytes(o) for o in outs)
        if name == "copy_":  # writes into args[0], reads args[1]
            read, written = _nbytes(args[1]) if isinstance(args[1], torch.Tensor) else 0, _nbytes(args[0])
        if name in ("zero_", "fill_", "zeros", "zeros_like", "full", "ones", "ones_like", "new_zeros", "new_ones",
                    "full_like", "new_full", "arange", "scalar_tensor"):
            read = 0
        stack = _repo_frames([(f.filename, f.lineno or 0, f.name) for f in traceback.extract_stack()])
        node = torch._C._current_autograd_node()
        where, phase = (stack[-1] if stack else "?"), "forward"
        if node is not None:
            phase = "backward"
            python_backward = [s for s in stack if " backward" in s and "loop.py" not in s]
            if python_backward:
                where = python_backward[-1]
            else:
                made = node.metadata.get("traceback_", "")
                lines = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', "".join(made) if isinstance(made, list)
                                   else str(made))
                frames = _repo_frames([(f, int(line), fn) for f, line, fn in lines])
                where = f"{node.name()} <- {frames[-1] if frames else '?'}"
        elif any("loop.py" in s and ("clip_grad_norm" in s or "optimizer.step" in s or "zero_grad" in s)
                 for s in stack) or any("distributed.py" in s for s in stack):
            phase = "update"
        self.ops.append({"op": name, "kind": kind_of(name), "where": where, "phase": phase,
                         "dtypes": "->".join(sorted({str(t.dtype).replace("torch.", "") for t in ins}))
                         + ">" + ",".join(sorted({str(o.dtype).replace("torch.", "") for o in outs})),
                         "bytes": read + written, "cpu_only": any(c in " ".join(stack) for c in CPU_ONLY)})
        return out


def census_of_step(preset_name: str, num_layers: int, batch_size: int, seq_len: int, data_dir: str,
                   engine: str = "mpipemoe") -> list[dict[str, Any]]:
    """The operations of one training step (the second: the first builds caches)."""
    from lm.model import get_preset
    from workers.config import WorkerConfig
    from workers.loop import Trainer

    preset = get_preset(preset_name).replace(num_layers=num_layers, vocab_size=259, seq_len=seq_len)
    config = WorkerConfig(preset=preset, engine=engine, partitions=1, strategy="none", seed=0, lr=3e-4,
                          weight_decay=0.1, warmup_steps=5, grad_clip=1.0, aux_loss_weight=0.01, steps=100,
                          batch_size=batch_size, seq_len=seq_len, data_dir=data_dir, dtype="bfloat16",
                          shard_dense=False, grad_accum=1, optimizer_impl="fused")
    trainer = Trainer(config, 0, 1, torch.device("cpu"))
    trainer.step(1)
    census = Census()
    with torch.autograd.set_detect_anomaly(True, check_nan=False), census:
        trainer.step(2)
    return census.ops


def _aggregate(ops: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    rows: dict[tuple, dict[str, Any]] = {}
    for o in ops:
        key = (o["kind"], o["op"], o["dtypes"], o["where"], o["phase"], o["cpu_only"])
        row = rows.setdefault(key, {"calls": 0, "bytes": 0})
        row["calls"] += 1
        row["bytes"] += o["bytes"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="gpt-xl")
    parser.add_argument("--num-layers", type=int, default=4, help="the model to report (runs use 1 and 2 layers)")
    parser.add_argument("--seq-lens", type=int, nargs=2, default=[32, 64], help="two short runs (batch 1)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 131072], help="tokens per step to report")
    parser.add_argument("--bandwidth", type=float, default=3.0e12, help="bytes/s for the ms column")
    parser.add_argument("--engine", default="mpipemoe")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from lm.data import prepare_dataset

    torch.manual_seed(0)
    work = tempfile.mkdtemp(prefix="op-census")
    prepare_dataset(f"{work}/data", max_bytes=2**18, row_len=1024)
    (t0, t1), L = args.seq_lens, args.num_layers
    runs = {(layers, s): _aggregate(census_of_step(args.preset, layers, 1, s, f"{work}/data", args.engine))
            for layers in (1, 2) for s in (t0, t1)}
    keys = list(dict.fromkeys(k for run in runs.values() for k in run))
    table = []
    kernels_per_token = {}
    for key in keys:
        def at(layers: int, s: int, field: str) -> float:
            return float(runs[(layers, s)].get(key, {}).get(field, 0))
        row: dict[str, Any] = dict(zip(("kind", "op", "dtypes", "where", "phase", "cpu_only"), key))
        # bytes(L, T) = a + b T + L (c + d T); calls(L) = e + L f
        d1 = [at(2, s, "bytes") - at(1, s, "bytes") for s in (t0, t1)]  # c + d T
        b0 = [at(1, s, "bytes") - d1[i] for i, s in enumerate((t0, t1))]  # a + b T
        per_layer_calls = at(2, t0, "calls") - at(1, t0, "calls")
        row["calls"] = int(at(1, t0, "calls") + (L - 1) * per_layer_calls)
        for tokens in args.tokens:
            def line(values: list[float]) -> float:
                return values[0] + (values[1] - values[0]) / (t1 - t0) * (tokens - t0)
            gb = (line(b0) + L * line(d1)) / 1e9
            row[f"gb_at_{tokens}"], row[f"ms_at_{tokens}"] = round(gb, 4), round(gb * 1e12 / args.bandwidth, 3)
        table.append(row)
    kernels = sum(r["calls"] for r in table if r["kind"] != "view")
    result = {"preset": args.preset, "num_layers": L, "bandwidth": args.bandwidth, "engine": args.engine,
              "operations_per_step": kernels, "operations": table}
    for tokens in args.tokens:
        print(f"##### {tokens} tokens per step")
        for kind in ("copy/cast", "gather", "elementwise", "reduce/norm"):
            rows_of = sorted((r for r in table if r["kind"] == kind and not r["cpu_only"]),
                             key=lambda r: -r[f"ms_at_{tokens}"])
            total = sum(r[f"ms_at_{tokens}"] for r in rows_of)
            print(f"== {kind}: {total:.1f} ms ({args.bandwidth / 1e12:g} TB/s)")
            for r in rows_of[:30]:
                if r[f"ms_at_{tokens}"] >= 0.05:
                    print(f"  {r[f'ms_at_{tokens}']:7.2f} ms x{r['calls']:<3} {r['op']:<20} {r['dtypes']:<26} "
                          f"{r['phase']:<8} {r['where']}")
    print(f"operations that launch a kernel per step ({L} layers): {kernels}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
