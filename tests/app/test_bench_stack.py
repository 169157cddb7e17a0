"""Tier 1: ``mpipemoe bench --layers L`` on CPU (no torchtitan, no CUDA memory): every setting
of a stack, with and without checkpointing, gives the brute-force reference stack's outputs
and gradients; the bench records each setting as it finishes (a failing one with its error),
the JSON is whole after each, and the Markdown shows memory against time."""
import json

import pytest
import torch

import app.bench.stack as bench_stack
from app.bench.stack import BUDGET, build_stack, stack_settings
from app.cli import main
from app.reports.memory_time import memory_time_rows, memory_time_table
from moe_engine import FastMoE, MemoryBudget, MoEConfig
from moe_engine.comm import ExpertGroup
from moe_engine.granularity import GranularitySearch
from moe_engine.reference import reference_moe

WEIGHTS = ("router.weight", "experts.w1", "experts.b1", "experts.w2", "experts.b2", "experts.w3")


def reference_stack(source, config, layers, x, grad_y):
    """h = h + reference_moe(h)[0] per layer, each layer with its own leaf copy of the weights;
    returns the output, dx and every layer's weight gradients."""
    weights = dict(source.named_parameters())
    leaves: list[dict] = [{name: weights[name].detach().clone().requires_grad_(True) if name in weights else None
                           for name in WEIGHTS} for _ in range(layers)]
    h = x.detach().requires_grad_(True)
    out = h
    for w in leaves:
        out = out + reference_moe(out, w["router.weight"], w["experts.w1"], w["experts.b1"], w["experts.w2"],
                                  w["experts.b2"], w["experts.w3"], config)[0]
    out.backward(grad_y)
    return out.detach(), h.grad, leaves


@pytest.mark.parametrize("activation,bias", [("gelu", True), ("swiglu", False)])
def test_every_setting_gives_the_reference_stacks_outputs_and_gradients(activation, bias):
    config = MoEConfig(8, 16, 4, top_k=2, activation=activation, bias=bias)
    layers, device, dtype = 2, torch.device("cpu"), torch.float64
    torch.manual_seed(0)
    source = FastMoE(config, ExpertGroup(None), dtype=dtype)
    x = torch.randn(12, 8, dtype=dtype)
    grad_y = torch.randn_like(x)
    expected, expected_dx, leaves = reference_stack(source, config, layers, x, grad_y)
    settings = stack_settings((1, 2), ("none", "S1", "S3", "S4"), True, (), "both", budget=True)
    assert {s.name for s in settings} >= {"fastmoe", "fastmoe+ckpt", "fastermoe+ckpt", "mpipemoe:auto:auto+ckpt",
                                          "mpipemoe:2:S4", "mpipemoe:2:S4+ckpt", BUDGET, BUDGET + "+ckpt"}
    for setting in settings:
        options: dict = {}
        if setting.chosen_by in ("auto", "budget"):
            options["search"] = GranularitySearch(candidates=(1, 2))
        if setting.chosen_by == "budget":
            options["memory_budget"] = MemoryBudget(2**30, layers)
        stack = build_stack(setting, config, layers, source, ExpertGroup(None), device, dtype, **options)
        h = x.detach().requires_grad_(True)
        y = stack(h)
        y.backward(grad_y)
        torch.testing.assert_close(y, expected, msg=lambda m: f"{setting.name}: output: {m}")
        torch.testing.assert_close(h.grad, expected_dx, msg=lambda m: f"{setting.name}: dx: {m}")
        for i, (layer, reference) in enumerate(zip(stack.layers, leaves)):
            for name, leaf in reference.items():
                if leaf is not None:
                    torch.testing.assert_close(layer.get_parameter(name).grad, leaf.grad,
                                               msg=lambda m: f"{setting.name}: layer {i} {name}: {m}")


def bench(out, *extra):
    return main(["bench", "--layers", "2", "--tokens", "24", "--warmup", "0", "--repeats", "1", "--rounds", "1",
                 "--partitions", "2", "--strategies", "S3", "--tracking-uri", "none", "--out", str(out), *extra])


def test_stacked_bench_records_every_setting_with_and_without_checkpointing(tmp_path, capsys):
    out = tmp_path / "stacked.json"
    assert bench(out, "--memory-budget-gib", "1") == 0
    result = json.loads(out.read_text())
    meta = result["meta"]
    assert meta["command"] and meta["hardware"].startswith("cpu")
    assert meta["date"] and meta["git_commit"] and meta["complete"] is True and meta["settings"]["layers"] == 2
    records = {r["setting"]: r for r in result["records"]}
    bases = ("fastmoe", "fastermoe", "mpipemoe:auto:auto", "mpipemoe:2:S3", BUDGET)
    assert list(records) == [name + ckpt for name in bases for ckpt in ("", "+ckpt")]
    for name, r in records.items():
        assert r["measured_as"] == "measured" and r["layers"] == 2 and r["checkpointed"] == name.endswith("+ckpt")
        assert "error" not in r and r["fwd_bwd_ms"] > 0 and r["fwd_bwd_ms_std"] >= 0
        assert r["activation_bytes"] is None  # not measured off CUDA
        assert r["reference"] == "fastmoe" and r["time_vs_fastmoe"] == r["fwd_bwd_ms"] / records["fastmoe"]["fwd_bwd_ms"]
        assert "memory_vs_fastmoe" not in r
    assert records["mpipemoe:2:S3+ckpt"]["chosen"] == ["2/S3"]
    assert records[BUDGET]["budget_bytes"] == 2**30 and records[BUDGET]["partitions"] in (1, 2)
    table = out.with_suffix(".md").read_text()
    assert "## Memory against time" in table and "against fastmoe" in table
    for name in records:
        assert f"| {name} |" in table
    printed = capsys.readouterr().out
    assert "L=2  mpipemoe:2:S3+ckpt" in printed and f"Wrote {out}" in printed


def test_a_failing_setting_is_recorded_the_others_run_and_the_json_is_whole_after_each(tmp_path, monkeypatch):
    out = tmp_path / "stacked.json"
    seen = []
    build = bench_stack.build_stack

    def failing_build(setting, *args, **kwargs):
        seen.append(len(json.loads(out.read_text())["records"]) if out.exists() else 0)
        if setting.engine == "fastermoe":
            raise RuntimeError("out of memory (a test's)")
        return build(setting, *args, **kwargs)

    monkeypatch.setattr(bench_stack, "build_stack", failing_build)
    assert bench(out, "--no-grid", "--checkpointing", "on") == 0
    assert seen == [0, 1, 2]  # each setting finds every earlier one in the JSON
    records = {r["setting"]: r for r in json.loads(out.read_text())["records"]}
    assert list(records) == ["fastmoe+ckpt", "fastermoe+ckpt", "mpipemoe:auto:auto+ckpt"]
    assert records["fastermoe+ckpt"]["error"] == "RuntimeError: out of memory (a test's)"
    assert records["fastermoe+ckpt"]["fwd_bwd_ms"] is None
    assert records["mpipemoe:auto:auto+ckpt"]["fwd_bwd_ms"] > 0
    assert "| fastermoe+ckpt | – | failed: RuntimeError: out of memory (a test's) |" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["--checkpointing", "on"], "give --layers L"),
    (["--layers", "2", "--memory-budget-share", "0.1", "--memory-budget-gib", "1"], "give one of"),
    (["--layers", "2", "--memory-budget-gib", "0"], "--memory-budget-gib 0.0 is invalid"),
    (["--layers", "0"], "--layers 0 is invalid"),
    (["--layers", "2", "--emulate", "1x2"], "--emulate times single layers"),
])
def test_stack_options_are_checked_naming_the_option(argv, message, capsys):
    assert main(["bench", "--tracking-uri", "none", *argv]) == 1
    assert message in capsys.readouterr().err


def test_memory_against_time_is_relative_to_the_peer_without_checkpointing():
    def record(setting, ms, gib, chosen_by="grid", engine="mpipemoe"):
        return {"setting": setting, "engine": engine, "chosen_by": chosen_by, "model": "gpt-xl", "tokens": 32768,
                "layers": 8, "routing": "uniform", "world_size": 1, "device": "NVIDIA H200", "dtype": "bfloat16",
                "fwd_bwd_ms": ms, "fwd_bwd_ms_std": 0.1, "activation_bytes": gib * 2**30, "chosen": ["4/S4"]}
    records = [record("torchtitan", 100.0, 40, "peer", "torchtitan"),
               record("torchtitan+ckpt", 130.0, 8, "peer", "torchtitan"),
               record("fastmoe", 95.0, 44, "baseline", "fastmoe"),
               record("mpipemoe:4:S4", 120.0, 10), record(BUDGET, 125.0, 5, "budget"),
               {**record("mpipemoe:8:S4", 0, 0), "fwd_bwd_ms": None, "activation_bytes": None, "error": "boom"}]
    rows = memory_time_rows(records)
    assert [r.setting for r in rows] == [BUDGET, "torchtitan+ckpt", "mpipemoe:4:S4", "torchtitan", "fastmoe",
                                         "mpipemoe:8:S4"]
    assert {r.reference for r in rows} == {"torchtitan"}
    budget = rows[0]
    assert budget.time_ratio == pytest.approx(1.25) and budget.memory_ratio == pytest.approx(0.125)
    table = "\n".join(memory_time_table(records))
    assert "### gpt-xl, 32768 tokens, 8 layers, uniform routing, 1 × NVIDIA H200, bfloat16 — against torchtitan" \
        in table
    assert f"| {BUDGET} | 4/S4 | 125.00 | 0.10 | 5120 | 1.25 | 0.12 |" in table
    assert "| mpipemoe:8:S4 | – | failed: boom |" in table
