"""Tier 1: ``mpipemoe bench --step`` (app/bench/step.py) on CPU: the bound and its check with
controlled numbers, the modelled data-parallel reduction against DDP's buckets and the
network model, the parameters shared by the engines' models, and every field of a real
tiny run's records with the bound's terms consistent with the modelled collectives."""
import json
from typing import Any

import pytest
import torch

from app.bench.step_bound import BOUND_SLACK, BoundViolation, add_bound_account, check_bounds, step_bound_ms
from app.bench.step_settings import StepSettings
from app.bench.step_training import GradientReduction
from app.bench.step_variants import build_variants
from app.cli import main
from lm.model import param_counts
from workers.distributed import split_params
from moe_sim.emulation import EmulatedCluster
from moe_sim.network import all_reduce_s


def test_the_bound_is_the_longer_of_compute_and_the_link():
    assert step_bound_ms(10.0, 4.0, 3.0) == 10.0
    assert step_bound_ms(5.0, 4.0, 3.0) == 7.0
    record = {"step_ms": 9.0, "compute_ms": 5.0, "no_all_to_all_ms": 6.5, "all_to_all_ms": 4.0, "reduction_ms": 3.0}
    add_bound_account(record)
    assert record["step_bound_ms"] == 7.0 and record["communication_ms"] == 7.0
    assert record["exposed_all_to_all_ms"] == pytest.approx(2.5)
    assert record["step_vs_bound"] == pytest.approx(9.0 / 7.0 - 1) and record["below_bound"] is False


def test_a_record_below_its_bound_fails_the_check_and_is_named():
    base = {"model": "gpt-xl", "tokens": 32768, "micro_batches": 2, "routing": "uniform", "engine": "mpipemoe",
            "chosen_by": "grid", "partitions": 4, "strategy": "S4", "step_bound_ms": 100.0}
    check_bounds([{**base, "step_ms": BOUND_SLACK * 100.0}])  # at the slack: allowed
    check_bounds([{**base, "step_ms": 100.0, "step_bound_ms": None}])  # no bound (no compute timing): nothing
    with pytest.raises(BoundViolation, match=r"1 step record.*gpt-xl 32768 tok K=2 uniform mpipemoe grid n=4/S4: "
                                             r"97\.90 ms < 0\.98 x bound 100\.00"):
        check_bounds([{**base, "step_ms": 97.9}, {**base, "step_ms": 120.0}])


def test_the_reduction_takes_ddps_buckets_priced_as_ring_all_reduces_in_the_last_micro_batch():
    cluster = EmulatedCluster.parse("2x4", "dgx-h200")
    group = cluster.build()
    big = [torch.nn.Parameter(torch.zeros(4 * 2**20)) for _ in range(3)]  # 16 MiB of float32 gradients each
    reduction = GradientReduction(big, group, torch.device("cpu"))
    # reverse order, 25 MiB buckets: [p2, p1] (32 MiB) then [p0]
    assert [[id(p) for p in b.params] for b in reduction.buckets] == [[id(big[2]), id(big[1])], [id(big[0])]]
    expected = [all_reduce_s(cluster.network, cluster.layout, 32 * 2**20), all_reduce_s(cluster.network,
                                                                                         cluster.layout, 16 * 2**20)]
    assert [b.seconds for b in reduction.buckets] == pytest.approx(expected)
    loss = sum((p * 2).sum() for p in big)
    loss.backward()  # not armed (an earlier micro-batch): nothing issued
    assert reduction.issued == []
    reduction.arm()
    (sum((p * 2).sum() for p in big[1:])).backward()  # p0's gradient never comes: finish issues its bucket
    assert reduction.issued == pytest.approx(expected[:1])
    reduction.finish()
    assert reduction.issued == pytest.approx(expected) and reduction.seconds == pytest.approx(sum(expected))
    reduction.remove()


def test_the_engines_models_share_one_set_of_parameters():
    settings = StepSettings(model="tiny-gpt", tokens=[128], layers=1, emulate="1x2", partitions=(2,),
                            strategies=("S4",))
    variants = build_variants(settings, settings.preset(), settings.cluster.build(), torch.device("cpu"))
    assert [(v.engine, v.chosen_by) for v in variants] == [("fastmoe", "baseline"), ("fastermoe", "baseline"),
                                                           ("mpipemoe", "auto"), ("mpipemoe", "grid")]
    first = dict(variants[0].model.named_parameters())
    for variant in variants[1:]:
        assert all(param is first[name] for name, param in variant.model.named_parameters())


@pytest.mark.parametrize("flags,message", [
    (["--tokens", "100"], "whole sequences of 64 tokens; give a multiple of 128"),
    (["--schedule", "interleaved"], "--schedule 'interleaved' is unknown"),
    (["--schedule", "sequential,overlaped"], "--schedule 'overlaped' is unknown: choose from sequential, overlapped, auto"),
    (["--schedule", "sequential,"], "--schedule '' is unknown"),
    (["--routing", "replay:/nonexistent.json"], "no such file"),
    (["--experts", "6"], "multiple of the 4 emulated ranks"),
    (["--peers", "torchtitan"], "drop --peers"),
    (["--layers", "0"], "--layers 0 is invalid"),
    (["--expert-parallel", "3"], "expert_parallel=3 is invalid on 2x2: "),
    (["--expert-parallel", "2", "--experts", "3"], "--experts 3 must be a multiple of the 2 ranks of an expert group "
                                                   "(--expert-parallel 2)"),
])
def test_bad_step_flags_name_the_flag_and_the_fix(flags, message, capsys):
    argv = ["bench", "--step", "--model", "tiny-gpt", "--emulate", "2x2", "--tokens", "128", "--micro-batches", "2",
            "--tracking-uri", "none", *flags]
    assert main(argv) != 0
    assert message in capsys.readouterr().err


def test_step_flags_without_step_are_refused(capsys):
    assert main(["bench", "--micro-batches", "2", "--tracking-uri", "none"]) != 0
    assert "--micro-batches time a whole training step: add --step" in capsys.readouterr().err


def test_the_layer_bench_refuses_an_expert_parallel_degree_naming_the_step_and_the_emulated_group(capsys):
    assert main(["bench", "--expert-parallel", "2", "--tracking-uri", "none"]) != 0
    assert "--expert-parallel 2 prices a training step's expert groups" in capsys.readouterr().err


def test_expert_groups_smaller_than_the_cluster_add_the_replicas_reduction_and_price_the_step_over_all_ranks(tmp_path):
    """E = 2 on an emulated 2x2: rank 0's MoE layers run over 2 ranks (2 experts, one each), the
    expert gradients are all-reduced over the 2 replicas after the backward (the reduction
    grows by exactly that term), and the records say E; E = W (4) reduces no expert."""
    records = {}
    for degree in (2, 4):
        out = tmp_path / f"e{degree}.json"
        assert main(["bench", "--step", "--model", "tiny-gpt", "--layers", "1", "--emulate", "2x2", "--tokens", "128",
                     "--partitions", "2", "--strategies", "S4", "--no-grid", "--rounds", "1", "--repeats", "1",
                     "--warmup", "0", "--expert-parallel", str(degree), "--tracking-uri", "none",
                     "--out", str(out)]) == 0
        records[degree] = json.loads(out.read_text())["records"]
    cluster = EmulatedCluster.parse("2x2", "dgx-a100", expert_parallel=2)
    settings = StepSettings(model="tiny-gpt", tokens=[128], layers=1, emulate="2x2", expert_parallel=2)
    model = build_variants(settings, settings.preset(), cluster.build(), torch.device("cpu"))[0].model
    expert_params = split_params(model)[1]  # rank 0's one expert of the group's 2
    assert settings.num_experts == 2 and expert_params
    expert_ms = 1e3 * cluster.expert_reduction_s(4 * sum(p.numel() for p in expert_params))
    assert expert_ms > 0
    for two, four in zip(records[2], records[4]):
        assert (two["expert_parallel"], four["expert_parallel"]) == (2, 4) and two["world_size"] == 4
        assert four["expert_reduction_ms"] == 0 and two["expert_reduction_ms"] == pytest.approx(expert_ms, rel=1e-3)
        assert two["reduction_ms"] == pytest.approx(four["reduction_ms"] + expert_ms, rel=1e-3)  # records round


def test_a_tiny_step_run_writes_every_field_and_a_consistent_bound(tmp_path):
    out = tmp_path / "step.json"
    assert main(["bench", "--step", "--model", "tiny-gpt", "--layers", "1", "--emulate", "1x2", "--tokens", "128",
                 "--micro-batches", "2", "--partitions", "2", "--strategies", "S4", "--rounds", "1", "--repeats", "1",
                 "--warmup", "0", "--tracking-uri", "none", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["kind"] == "step" and result["meta"]["emulated_cluster"] == "1x2"
    assert {"command", "date", "hardware", "git_commit", "torch"} <= result["meta"].keys()
    records = result["records"]
    assert [(r["engine"], r["chosen_by"]) for r in records] == [("fastmoe", "baseline"), ("fastermoe", "baseline"),
                                                                ("mpipemoe", "auto"), ("mpipemoe", "grid")]
    cluster = EmulatedCluster.parse("1x2", "dgx-a100")
    settings = StepSettings(model="tiny-gpt", tokens=[128], layers=1, emulate="1x2")
    model = build_variants(settings, settings.preset(), cluster.build(), torch.device("cpu"))[0].model
    reduction_ms = 1e3 * all_reduce_s(cluster.network, cluster.layout, 4 * param_counts(model)["params_replicated"])
    for r in records:
        for key in ("kind", "engine", "chosen_by", "schedule", "model", "layers", "tokens", "micro_batches", "network",
                    "routing", "step_ms", "step_bound_ms", "all_to_all_ms", "exposed_all_to_all_ms", "mfu",
                    "peak_memory_bytes", "timeline", "transfer_ctas", "measured_as", "device", "expert_load"):
            assert key in r, key
        assert (r["kind"], r["schedule"], r["layers"], r["tokens"], r["micro_batches"], r["network"], r["routing"]) \
            == ("step", "sequential", 1, 128, 2, "dgx-a100", "uniform")
        assert r["reduction_ms"] == pytest.approx(reduction_ms)  # one bucket: the tiny model's dense gradients
        assert r["all_to_all_ms"] > 0 and r["step_bound_ms"] == pytest.approx(
            max(r["compute_ms"], r["all_to_all_ms"] + r["reduction_ms"]))
        assert r["compute_device_busy_ms"] is None  # profiled on CUDA only
        # the host's time to issue the step (and its compute alone), the emulator's own share apart
        assert 0 < r["emulator_host_ms"] < r["host_ms"] and 0 < r["compute_emulator_host_ms"] < r["compute_host_ms"]
        assert sum(r["expert_load"]) == pytest.approx(1.0, abs=1e-3)
    for r in records[:2] + records[3:]:  # the host probe: 2 micro-batches of one short sequence each
        assert r["host_probe_ms"] > 0 and r["host_probe_seq_len"] == min(64, settings.preset().seq_len)
        assert r["host_probe_tokens"] == 2 * r["host_probe_seq_len"]
    auto = records[2]  # its bound terms and host probe are its grid twin's when the grid has its setting
    twin = (auto["partitions"], auto["strategy"]) == (2, "S4")
    assert (auto.get("bound_terms_from") == "grid twin") == twin
    assert auto.get("host_probe_ms") == (records[3]["host_probe_ms"] if twin else None)
    assert "| tiny-gpt | 1 | uniform | 128 | 2 | fastmoe |" in (tmp_path / "step.md").read_text()


@pytest.mark.gpu
def test_on_cuda_the_link_holds_every_modelled_transfer_and_no_record_beats_its_bound(tmp_path):
    """A slow network (0.1 GB/s links) makes the transfers tens of milliseconds, well above the
    host's time to launch tiny-gpt's step (about 19 ms on an H100: at 1 GB/s the link's 9 ms
    hid behind the launches, and FastMoE's sequential step exposed only 2.7 ms of it; at
    0.2 GB/s it exposed 20.4 of 42.3 ms once, the host's launches again beside the waits).
    FastMoE's step, which overlaps nothing but the reduction, takes at least its link time;
    its sequential step's All-to-Alls are mostly exposed; the compute alone is shorter than
    the step; the run's own check (no record below 0.98x its bound) passes under both
    schedules; the timeline of each step holds every modelled wait on the link (the
    overlapped step's helper thread too)."""
    network = tmp_path / "slow.json"
    network.write_text(json.dumps({"name": "slow", "intra_bytes_per_s": 1e8, "inter_bytes_per_s": 1e8}))
    out = tmp_path / "step.json"
    assert main(["bench", "--step", "--model", "tiny-gpt", "--layers", "2", "--emulate", "2x2", "--network",
                 str(network), "--tokens", "4096", "--micro-batches", "1,2", "--partitions", "2",
                 "--strategies", "S4", "--rounds", "2", "--repeats", "2", "--tracking-uri", "none",
                 "--schedule", "sequential,overlapped", "--out", str(out), "--trace", str(tmp_path / "traces")]) == 0
    records = json.loads(out.read_text())["records"]
    assert any(r["schedule"] == "overlapped" for r in records)
    for r in records:
        assert r["step_ms"] >= BOUND_SLACK * r["step_bound_ms"] and r["mfu"] is not None and r["peak_memory_bytes"]
        assert r["timeline"]["comm_busy_ms"] >= 0.9 * r["all_to_all_ms"]  # the link's waits, both lanes'
    for r in (r for r in records if r["engine"] == "fastmoe"):
        assert r["step_ms"] >= 0.98 * (r["all_to_all_ms"] + r["reduction_ms"]) and r["all_to_all_ms"] > 1.0
        assert r["compute_ms"] < r["step_ms"]
        assert 0 < r["compute_device_busy_ms"] < r["compute_ms"]  # tiny-gpt's device waits for the host
        if r["schedule"] == "sequential":
            assert r["exposed_all_to_all_ms"] > 0.5 * r["all_to_all_ms"]


def test_the_report_summarizes_each_point_and_flags_auto_slower_than_fastermoe():
    from app.reports.step import section_steps, step_summaries

    point = {"network": "dgx-h200", "emulated_cluster": "8x8", "model": "gpt-xl", "layers": 4.0, "routing": "uniform",
             "tokens": 32768.0, "micro_batches": 2.0}
    rows = [{**point, "engine": "fastmoe", "chosen_by": "baseline", "partitions": 1, "strategy": "none",
             "step_ms": 300.0},
            {**point, "engine": "fastermoe", "chosen_by": "baseline", "partitions": 16, "strategy": "none",
             "step_ms": 240.0},
            {**point, "engine": "mpipemoe", "chosen_by": "auto", "partitions": 2, "strategy": "S4", "step_ms": 250.0},
            {**point, "engine": "mpipemoe", "chosen_by": "grid", "partitions": 4, "strategy": "S4", "step_ms": 220.0,
             "step_bound_ms": 200.0, "all_to_all_ms": 40.0, "exposed_all_to_all_ms": 4.0, "mfu": 0.31},
            {**point, "engine": "mpipemoe", "chosen_by": "grid", "partitions": 4, "strategy": "S4", "step_ms": 210.0,
             "step_bound_ms": 200.0, "all_to_all_ms": 40.0, "exposed_all_to_all_ms": 2.0, "mfu": 0.32}]  # a rerun
    [summary] = step_summaries(rows)
    assert summary["best_setting"] == "4/S4" and summary["best_step_ms"] == 210.0  # the last logged counts
    assert summary["best_vs_fastmoe"] == pytest.approx(300 / 210) and summary["best_vs_fastermoe"] == pytest.approx(
        240 / 210)
    assert summary["auto_vs_fastermoe"] == pytest.approx(240 / 250) and summary["best_exposed_share"] == 0.05
    assert summary["best_vs_bound"] == pytest.approx(1.05)
    line = section_steps(rows)[-2]
    assert line.startswith("| dgx-h200 | 8x8 | gpt-xl | 4 | uniform | 32768 | 2 | 300.0 | 240.0 | 250.0 | 210.0 (4/S4)")
    assert "**0.96x**" in line and "| 5% | 32.0% |" in line


def test_the_report_takes_the_best_of_every_schedule_against_the_baselines_plain_step():
    from app.reports.step import section_steps, step_summaries

    point = {"network": "dgx-h200", "emulated_cluster": "8x8", "model": "gpt-xl", "layers": 4.0, "routing": "uniform",
             "tokens": 32768.0, "micro_batches": 2.0}
    row = lambda engine, chosen_by, n, schedule, ms, **more: {  # noqa: E731
        **point, "engine": engine, "chosen_by": chosen_by, "partitions": n, "strategy": "none", "schedule": schedule,
        "step_ms": ms, **more}
    rows = [row("fastmoe", "baseline", 1, "overlapped", 200.0), row("fastmoe", "baseline", 1, "sequential", 300.0),
            row("fastermoe", "baseline", 16, "sequential", 240.0),
            row("mpipemoe", "auto", 2, "sequential", 250.0, schedule_asked="sequential"),
            row("mpipemoe", "auto", 2, "overlapped", 230.0, schedule_asked="overlapped,auto"),
            row("mpipemoe", "grid", 4, "sequential", 220.0), row("mpipemoe", "grid", 4, "overlapped", 180.0)]
    [summary] = step_summaries(rows)
    assert (summary["best_setting"], summary["best_schedule"], summary["best_step_ms"]) == ("4/none", "overlapped",
                                                                                          180.0)
    assert summary["fastmoe_step_ms"] == 300.0 and summary["best_vs_fastmoe"] == pytest.approx(300 / 180)
    assert (summary["auto_step_ms"], summary["auto_schedule"]) == (230.0, "overlapped")
    line = section_steps(rows)[-2]
    assert "| 300.0 | 240.0 | 230.0 | 180.0 (4/none) | overlapped | 1.67x | 1.33x | 1.04x |" in line


def test_a_stopped_run_keeps_the_records_it_finished(tmp_path, monkeypatch):
    import app.bench.step as bench_step

    def one_then_stop(settings, device, log, not_measured=None):
        log({"model": "tiny-gpt", "routing": "uniform", "tokens": 128, "micro_batches": 1, "engine": "fastmoe",
             "chosen_by": "baseline", "partitions": 1, "strategy": "none", "step_ms": 5.0, "step_ms_std": 0.1,
             "layers": 1, "all_to_all_ms": 0.1, "reduction_ms": 0.1})
        raise KeyboardInterrupt("SIGTERM")

    monkeypatch.setattr(bench_step, "run_step_bench", one_then_stop)
    out = tmp_path / "step.json"
    assert main(["bench", "--step", "--model", "tiny-gpt", "--emulate", "1x2", "--tokens", "128",
                 "--tracking-uri", "none", "--out", str(out)]) == 130
    result = json.loads(out.read_text())
    assert result["meta"]["complete"] is False and [r["engine"] for r in result["records"]] == ["fastmoe"]
    assert "| tiny-gpt | 1 | uniform | 128 | 1 | fastmoe |" in (tmp_path / "step.md").read_text()


def test_a_point_out_of_memory_is_named_and_the_run_goes_on(tmp_path, monkeypatch):
    # On the H200 the skewed (now hot-expert) 32k point ran out of memory and ended the run,
    # losing the points after it. Now it is named in the JSON and the Markdown, and the next
    # point runs (here under Zipf routing, imposed at the counts the simulator prices).
    from moe_sim.routing import routing_load

    import app.bench.step as bench_step

    real_point = bench_step.bench_step_point
    released = []

    def point(settings, preset, variants, pushes, parts_of, routing, tokens, k, device, log):
        if tokens == 256:
            for p in variants[0].model.parameters():  # a failed backward's leftovers
                p.grad = torch.zeros_like(p)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 24.00 GiB\nmore detail")
        return real_point(settings, preset, variants, pushes, parts_of, routing, tokens, k, device, log)

    real_release = bench_step.release_point_memory

    def release(variants, device):
        real_release(variants, device)
        released.append(all(p.grad is None for v in variants for p in v.model.parameters()))

    monkeypatch.setattr(bench_step, "bench_step_point", point)
    monkeypatch.setattr(bench_step, "release_point_memory", release)
    out = tmp_path / "step.json"
    assert main(["bench", "--step", "--model", "tiny-gpt", "--layers", "1", "--emulate", "1x2", "--experts", "8",
                 "--routing", "zipf:1.2", "--tokens", "256,128", "--no-grid", "--rounds", "1", "--repeats", "1",
                 "--tracking-uri", "none", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["complete"] is True and released == [True]
    assert result["meta"]["not_measured"] == [{"model": "tiny-gpt", "routing": "zipf:1.2", "tokens": 256,
                                               "micro_batches": 1, "reason": "out of memory: CUDA out of memory. "
                                                                             "Tried to allocate 24.00 GiB"}]
    assert {r["tokens"] for r in result["records"]} == {128}
    assert {r["engine"] for r in result["records"]} == {"fastmoe", "fastermoe", "mpipemoe"}
    # rank 0 holds the busier half of the experts (the bench lays the busiest rank first)
    simulated = routing_load("zipf:1.2", 8, 2)
    for record in result["records"]:  # within one of the 256 pairs per expert
        assert sorted(record["expert_load"]) == pytest.approx(sorted(simulated), abs=1 / 256)
        assert sum(record["expert_load"][:4]) == pytest.approx(max(sum(simulated[:4]), sum(simulated[4:])),
                                                                abs=4 / 256)
    markdown = (tmp_path / "step.md").read_text()
    assert "- tiny-gpt, zipf:1.2 routing, 256 tokens, K=1: out of memory: CUDA out of memory." in markdown


def test_the_step_body_updates_the_weights_as_a_plain_training_loop_does():
    """training_step (two micro-batches) against a plain loop: each micro-batch's
    (lm + 0.01 aux) / K backward, expert gradients / W, the clip to 1.0, AdamW; the same
    model (FastMoE on the emulated group) from the same weights."""
    import copy

    from app.bench.step import LR
    from app.bench.step_training import GRAD_CLIP, StepParts, step_batches, training_step
    from lm.model import lm_loss
    from workers.distributed import DenseParallel
    from workers.loop import build_optimizer

    settings = StepSettings(model="tiny-gpt", tokens=[128], layers=1, emulate="1x2")
    group = settings.cluster.build()
    model = build_variants(settings, settings.preset(), group, torch.device("cpu"))[0].model
    reference = copy.deepcopy(model)
    parallel = DenseParallel(model)
    reduction = GradientReduction(parallel.dense, group, torch.device("cpu"))
    parts = StepParts(model, parallel, build_optimizer(parallel, LR, 0.1), reduction, group, torch.device("cpu"),
                      torch.float32)
    batches = step_batches(settings.preset(), 128, 2, torch.device("cpu"), seed=3)
    losses = training_step("sequential", parts, batches)

    optimizer = build_optimizer(DenseParallel(reference), LR, 0.1)
    expected = torch.zeros(2)
    for inputs_BS, targets_BS in batches:
        logits_BSV, aux = reference(inputs_BS)
        loss_lm = lm_loss(logits_BSV, targets_BS)
        ((loss_lm + 0.01 * aux) / 2).backward()
        expected += torch.stack([loss_lm.detach(), aux.detach()]) / 2
    for name, param in reference.named_parameters():
        if "experts." in name:
            param.grad /= group.size
    torch.nn.utils.clip_grad_norm_(list(reference.parameters()), GRAD_CLIP)
    optimizer.step()
    assert losses == pytest.approx(expected.tolist(), rel=1e-5)
    for (name, mine), theirs in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-7, msg=name)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(),
                                                       build_variants(settings, settings.preset(), group,
                                                                      torch.device("cpu"))[0].model.parameters()))
    reduction.remove()


def test_on_cuda_the_link_holds_every_modelled_transfer_and_no_record_beats_its_bound_cpu_twin(tmp_path):
    """The GPU test's command at CPU sizes: a network file of its own, every engine's
    record written with its bound terms."""
    network = tmp_path / "slow.json"
    network.write_text(json.dumps({"name": "slow", "intra_bytes_per_s": 1e9, "inter_bytes_per_s": 1e9}))
    out = tmp_path / "step.json"
    assert main(["bench", "--step", "--model", "tiny-gpt", "--layers", "1", "--emulate", "2x2", "--network",
                 str(network), "--tokens", "256", "--micro-batches", "2", "--partitions", "1",
                 "--strategies", "none", "--rounds", "1", "--repeats", "1", "--tracking-uri", "none",
                 "--schedule", "sequential,overlapped", "--out", str(out)]) == 0
    records = json.loads(out.read_text())["records"]
    assert {r["engine"] for r in records} >= {"fastmoe", "fastermoe", "mpipemoe"}
    assert {r["schedule"] for r in records} == {"sequential", "overlapped"}
    for r in records:
        assert r["all_to_all_ms"] > 0 and r["step_bound_ms"] >= r["compute_ms"]


def _overlapped_against_sequential(device: torch.device, micro_batches: int) -> None:
    """Each engine's step body (no optimizer step) by both schedules from the same weights on
    the emulated 2x2 cluster, with the bench's models and its lanes: the same losses, the same
    gradients, the same modelled collectives and reduction (the lane clones log into the
    group; the reduction is issued whole after the last backward)."""
    from app.bench.step_training import StepParts, run_micro_batches, step_batches
    from workers.distributed import DenseParallel
    from workers.schedules import Lanes

    settings = StepSettings(model="tiny-gpt", tokens=[64 * micro_batches], layers=2, emulate="2x2",
                            partitions=(2,), strategies=("S4",), dtype="fp32")
    group = settings.cluster.build()
    if device.type == "cuda":
        group.timing.link = torch.cuda.Stream(device)
    variants = [v for v in build_variants(settings, settings.preset(), group, device) if v.chosen_by != "auto"]
    parallel = DenseParallel(variants[0].model, device=device)
    reduction = GradientReduction(parallel.dense, group, device)
    batches = step_batches(settings.preset(), 64 * micro_batches, micro_batches, device, seed=5)
    try:
        for variant in variants:
            lanes = Lanes.create(variant.model)
            own_group: Any = variant.model.moe_layers()[0].group  # FasterMoE's: a sibling with its own log
            parts = StepParts(variant.model, DenseParallel(variant.model, device=device), None, reduction,  # type: ignore[arg-type]
                              own_group, device, torch.float32, lanes)
            outcome = {}
            for schedule in ("sequential", "overlapped"):
                variant.model.zero_grad(set_to_none=True)
                with own_group.logging_calls() as calls:
                    losses = run_micro_batches(schedule, parts, batches)
                if device.type == "cuda":  # the overlapped section's carve-out, held whole and given back
                    assert torch._C._get_sm_carveout_experimental() is None
                    with lanes.holding_sms():
                        sms = torch.cuda.get_device_properties(device).multi_processor_count
                        assert torch._C._get_sm_carveout_experimental() == min(group.comm_sms, sms - 1)
                grads = {name: p.grad.clone() for name, p in variant.model.named_parameters() if p.grad is not None}
                outcome[schedule] = (losses, grads, sorted((c.kind, c.seconds) for c in calls),
                                     list(reduction.issued))
            lanes.close()
            (seq_losses, seq_grads, seq_calls, seq_issued), (ovl_losses, ovl_grads, ovl_calls, ovl_issued) = \
                outcome["sequential"], outcome["overlapped"]
            torch.testing.assert_close(ovl_losses, seq_losses, rtol=1e-6, atol=0, msg=variant.engine)
            assert seq_grads.keys() == ovl_grads.keys() and len(seq_grads) == len(list(variant.model.parameters()))
            for name, grad in seq_grads.items():
                torch.testing.assert_close(ovl_grads[name], grad, rtol=1e-5, atol=1e-7, msg=f"{variant.engine} {name}")
            assert any(kind.startswith("all_to_all") for kind, _ in ovl_calls) and ovl_calls == seq_calls
            assert sorted(ovl_issued) == pytest.approx(sorted(seq_issued)) and len(ovl_issued) == len(
                reduction.buckets)
    finally:
        reduction.remove()
        variants[0].model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("micro_batches", [2, 3])
def test_the_overlapped_step_has_the_sequential_steps_losses_and_gradients_on_the_emulated_cluster(micro_batches):
    _overlapped_against_sequential(torch.device("cpu"), micro_batches)


@pytest.mark.gpu
def test_on_cuda_the_emulated_lanes_run_the_overlapped_step_on_the_link():
    """On the GPU: the lanes' compute streams and the shared link stream (both lanes' waits
    on it) give the sequential step's losses and gradients in fp32; the SMs the layers leave
    to communication are held for the whole overlapped section and given back after."""
    _overlapped_against_sequential(torch.device("cuda"), 2)


def test_on_cuda_the_emulated_lanes_run_the_overlapped_step_on_the_link_cpu_twin():
    _overlapped_against_sequential(torch.device("cpu"), 2)


def test_each_schedule_is_a_setting_of_the_run_and_auto_says_what_it_chose(tmp_path):
    out = tmp_path / "step.json"
    assert main(["bench", "--step", "--model", "tiny-gpt", "--layers", "1", "--emulate", "1x2", "--tokens", "128",
                 "--micro-batches", "1,2", "--partitions", "2", "--strategies", "S4", "--no-grid", "--rounds", "1",
                 "--repeats", "1", "--warmup", "0", "--tracking-uri", "none", "--schedule", "sequential,auto",
                 "--out", str(out)]) == 0
    records = json.loads(out.read_text())["records"]
    one = [r for r in records if r["micro_batches"] == 1]
    two = [r for r in records if r["micro_batches"] == 2]
    assert {(r["schedule"], r["schedule_asked"], r["schedule_reason"]) for r in one} == {
        ("sequential", "sequential,auto", "one micro-batch a step: nothing to overlap")}
    assert [(r["engine"], r["schedule"]) for r in two] == [(e, s) for e in ("fastmoe", "fastermoe", "mpipemoe")
                                                           for s in ("sequential", "overlapped")]
    for r in two:
        assert r["schedule_asked"] == ("auto" if r["schedule"] == "overlapped" else "sequential")
        assert "step_bound_ms" in r and "exposed_all_to_all_ms" in r and "peak_memory_bytes" in r
    by = {(r["engine"], r["schedule"]): r for r in two}
    for engine in ("fastmoe", "fastermoe", "mpipemoe"):  # the same transfers, the same reduction
        assert by[engine, "overlapped"]["all_to_all_ms"] == pytest.approx(by[engine, "sequential"]["all_to_all_ms"])
        assert by[engine, "overlapped"]["reduction_ms"] == pytest.approx(by[engine, "sequential"]["reduction_ms"])
    assert "| tiny-gpt | 1 | uniform | 128 | 2 | fastmoe | baseline | 1 | none | overlapped |" in (
        tmp_path / "step.md").read_text()


def test_auto_keeps_the_sequential_schedule_when_two_micro_batches_overflow_the_moe_budget():
    from app.bench.step_point import point_schedules

    settings = StepSettings(model="tiny-gpt", tokens=[128], layers=1, emulate="1x2", micro_batches=(2,),
                            schedule="auto", moe_memory_gib=1e-6)
    [(ran, entry)] = point_schedules(settings, settings.preset(), 128, 2, torch.float32).items()
    assert ran == "sequential" and entry["schedule_asked"] == "auto"
    assert "two micro-batches in flight need" in entry["schedule_reason"] and "over the" in entry["schedule_reason"]
    roomy = StepSettings(model="tiny-gpt", tokens=[128], layers=1, emulate="1x2", micro_batches=(2,),
                         schedule="auto", moe_memory_gib=64.0)
    assert list(point_schedules(roomy, roomy.preset(), 128, 2, torch.float32)) == ["overlapped"]
    with pytest.raises(ValueError, match="moe_memory_gib=0"):
        StepSettings(model="tiny-gpt", tokens=[128], emulate="1x2", moe_memory_gib=0)


def test_the_overlapped_steps_timeline_holds_both_micro_batches_of_the_last_step(tmp_path):
    """--trace records the helper thread too: the last traced step shows both micro-batches'
    forwards (main thread) and backwards (helper thread), and the account says how much
    communication ran with no compute beside it."""
    import gzip

    from app.bench.timeline import PASS_MARK
    from workers.schedules import trace_mark

    out, traces = tmp_path / "step.json", tmp_path / "traces"
    assert main(["bench", "--step", "--model", "tiny-gpt", "--layers", "1", "--emulate", "1x2", "--tokens", "128",
                 "--micro-batches", "2", "--partitions", "1", "--strategies", "none", "--no-grid", "--rounds", "1",
                 "--repeats", "1", "--warmup", "0", "--tracking-uri", "none", "--schedule", "overlapped",
                 "--out", str(out), "--trace", str(traces)]) == 0
    records = json.loads(out.read_text())["records"]
    assert {r["schedule"] for r in records} == {"overlapped"}
    for record in records:
        assert record["trace_file"].endswith("-overlapped.json.gz")
        with gzip.open(record["trace_file"], "rt") as handle:
            events = json.load(handle)["traceEvents"]
        last = max((e for e in events if e.get("name") == PASS_MARK), key=lambda e: float(e["ts"]))
        inside = [e for e in events if e.get("ph") == "X" and float(last["ts"]) <= float(e.get("ts", -1))
                  <= float(last["ts"]) + float(last["dur"])]
        threads = {phase: {e["tid"] for e in inside if e["name"] in (trace_mark(0, phase), trace_mark(1, phase))}
                   for phase in ("forward", "backward")}
        for k in (0, 1):
            for phase in ("forward", "backward"):
                assert any(e["name"] == trace_mark(k, phase) for e in inside), (record["engine"], k, phase)
        assert threads["forward"].isdisjoint(threads["backward"])  # the backwards ran on the helper thread


def test_step_records_are_logged_one_mlflow_run_each(tmp_path):
    pytest.importorskip("mlflow")
    from app.bench.step_summary import log_step_records
    from app.tracking.run_kinds import BENCH_STEP
    from app.tracking.store import client

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    row = {"model": "tiny-gpt", "tokens": 4096, "micro_batches": 2, "engine": "mpipemoe", "chosen_by": "grid",
           "schedule": "overlapped", "partitions": 2, "strategy": "S4", "step_ms": 12.5, "below_bound": False}
    said = []
    assert log_step_records({"meta": {"device": "cpu", "command": "mpipemoe bench --step"}, "records": [row]},
                            uri, "steps", printer=said.append) == 1
    assert log_step_records({"meta": {}, "records": [row]}, "none", "steps") == 0  # tracking off
    (run,) = client(uri).search_runs([client(uri).get_experiment_by_name("steps").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "step-tiny-gpt-4096-k2-mpipemoe-grid-overlapped"
    assert run.data.tags["mpipemoe.kind"] == BENCH_STEP and run.data.tags["measured_as"] == "emulated"
    assert run.data.params["strategy"] == "S4" and "below_bound" not in run.data.params  # bools are neither
    assert run.data.metrics == {"tokens": 4096.0, "micro_batches": 2.0, "partitions": 2.0, "step_ms": 12.5}
    assert said == [f"Logged 1 MLflow runs to {uri} (experiment 'steps')."]


def test_uniform_routing_is_imposed_on_the_step_benchs_model(tmp_path):
    """The step bench's model routes its own activations, which can send a layer's tokens
    unevenly (here 19% of layer 1's pairs to one of 8 experts unpushed; gpt-s at 64 experts
    sent 28% to expert 0 on an H100), and every emulated rank routes as rank 0 does, so
    rank 0 would take that share of 64 ranks' rows: "uniform" is imposed, each expert of
    each layer takes 1/E of the (token, choice) pairs."""
    out = tmp_path / "step.json"
    assert main(["bench", "--step", "--model", "tiny-gpt", "--layers", "2", "--emulate", "2x4", "--experts", "8",
                 "--tokens", "512", "--rounds", "1", "--repeats", "1", "--warmup", "0", "--no-grid",
                 "--tracking-uri", "none", "--out", str(out)]) == 0
    records = json.loads(out.read_text())["records"]
    assert {r["engine"] for r in records} == {"fastmoe", "fastermoe", "mpipemoe"}
    for r in records:
        assert len(r["expert_load_by_layer"]) == 2
        for shares in r["expert_load_by_layer"]:
            assert shares == pytest.approx([1 / 8] * 8, abs=1e-3), r["engine"]


def test_the_step_grid_times_the_peer_split_and_each_record_names_its_split(tmp_path):
    out = tmp_path / "step.json"
    assert main(["bench", "--step", "--model", "tiny-gpt", "--layers", "1", "--emulate", "1x2", "--tokens", "128",
                 "--partitions", "1,2", "--strategies", "none", "--splits", "tokens,peers", "--rounds", "1",
                 "--repeats", "1", "--tracking-uri", "none", "--out", str(out)]) == 0
    records = json.loads(out.read_text())["records"]
    assert {(r["partitions"], r["split"]) for r in records if r["chosen_by"] == "grid"} == \
        {(1, "tokens"), (2, "tokens"), (2, "peers")}
    assert {r["engine"]: r["split"] for r in records if r["chosen_by"] == "baseline"} == \
        {"fastmoe": "tokens", "fastermoe": "peers"}
    assert "| grid | 2:peers | none |" in out.with_suffix(".md").read_text()
