"""Tier 1: tools/stacked_layers.py on CPU (no torchtitan, no CUDA memory): every setting
runs, checkpointed stacks give the gradients of plain ones, and the table lists them."""
import importlib.util
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location(
    "stacked_layers", Path(__file__).resolve().parents[2] / "tools" / "stacked_layers.py")
assert _spec is not None and _spec.loader is not None
stacked = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stacked)


def test_stacked_settings_run_and_checkpointing_keeps_the_gradients(tmp_path):
    out = tmp_path / "stacked.json"
    settings = "mpipemoe:1:none,mpipemoe:1:none+ckpt,mpipemoe:2:S1+ckpt,auto@budget"
    assert stacked.main(["--model", "tiny", "--tokens", "64", "--layers", "2", "--dtype", "fp32",
                         "--settings", settings, "--warmup", "1", "--repeats", "1", "--out", str(out)]) == 0
    table = out.with_suffix(".md").read_text()
    for setting in settings.split(","):
        assert f"| {setting} |" in table
    config = stacked.MoEConfig(64, 128, 8, top_k=2, activation="swiglu", bias=False)
    torch.manual_seed(0)
    source = stacked.FastMoE(config)
    grads = []
    for setting in ("mpipemoe:2:S4", "mpipemoe:2:S4+ckpt"):
        stack = stacked.build_stack(setting, config, 2, source, torch.device("cpu"), torch.float32, None)
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        stack(x).square().sum().backward()
        grads.append([x.grad] + [p.grad for p in stack.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
