"""``mpipemoe capacity``: the batch-size search, one trial on CPU, the command on Ray, a real
out-of-memory search on a GPU."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from app.commands.capacity import add_arguments, run
from app.jobs.capacity import CapacitySearch
from lm.data import prepare_dataset
from lm.model import MoETransformer, get_preset
from workers.capacity import BatchTrials, largest_fitting
from workers.config import WorkerConfig

TRIAL_SETTINGS: dict[str, Any] = {"lr": 1e-3, "weight_decay": 0.1, "seed": 0, "aux_loss_weight": 0.01, "steps_per_trial": 2}


@pytest.mark.parametrize("start, limit", [(1, 1), (1, 2), (1, 7), (3, 7), (1, 64), (8, 64), (3, 100), (8, 100)])
def test_largest_fitting_finds_the_threshold_with_few_trials(start, limit):
    for threshold in range(0, limit + 3):
        calls = []

        def fits(size):
            calls.append(size)
            return size <= threshold

        assert largest_fitting(fits, start, limit) == min(threshold, limit)
        assert all(1 <= size <= limit for size in calls)
        assert len(calls) <= 2 * (limit.bit_length() + 1) + 1, (threshold, calls)


def test_largest_fitting_rejects_a_start_outside_the_range():
    with pytest.raises(ValueError, match="start_batch=9"):
        largest_fitting(lambda size: True, 9, 8)


@pytest.mark.parametrize("field, value, words", [
    ("memory_cap_gib", 0, "memory_cap_gib=0 is invalid"),
    ("start_batch", 0, "start_batch=0 is invalid"),
    ("steps_per_trial", 1.5, "steps_per_trial=1.5 is invalid"),
    ("max_batch", 4, "start_batch=8 is invalid: it must not exceed max_batch=4"),
])
def test_capacity_search_settings_are_validated(field, value, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        CapacitySearch(**{field: value})


def _tiny_trials(engine: str, device: torch.device, dtype=torch.float32, windows: int = 64 * 40) -> BatchTrials:
    torch.manual_seed(0)
    preset = get_preset("tiny-gpt").replace(seq_len=32)
    model = MoETransformer(preset, engine=engine, partitions=2, strategy="S1").to(device=device, dtype=dtype)
    tokens = np.random.default_rng(0).integers(0, preset.vocab_size, size=windows * 33)
    return BatchTrials(model, tokens, device, world_size=1, rank=0, config=WorkerConfig(preset, engine, data_dir="(tokens given)", **TRIAL_SETTINGS))


@pytest.mark.parametrize("engine", ["mpipemoe", "fastmoe"])
def test_a_trial_trains_and_records_the_engine_settings(engine):
    trials = _tiny_trials(engine, torch.device("cpu"))
    before = [p.detach().clone() for p in trials.model.parameters()]
    assert trials.fits(4)
    trial = trials.trials[-1]
    assert trial["batch_size"] == 4 and trial["fits"]
    assert trial["tokens_per_s"] == pytest.approx(4 * 32 / trial["step_time_s"])
    changed = sum(not torch.equal(a, b) for a, b in zip(before, trials.model.parameters()))
    assert changed == len(before)  # the optimizer stepped every parameter
    if engine == "mpipemoe":
        assert (trial["partitions"], trial["strategy"]) == (2, "S1")


@pytest.mark.ray
def test_capacity_command_on_ray_writes_a_record(ray_local, tmp_path):
    prepare_dataset(tmp_path / "data", max_bytes=2**19)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "capacity.json"
    args = parser.parse_args(["--preset", "tiny-gpt", "--engines", "mpipemoe", "--no-gpu", "--num-workers", "2",
                              "--start-batch", "2", "--max-batch", "5", "--steps-per-trial", "2",
                              "--seq-len", "32", "--data-dir", str(tmp_path / "data"),
                              "--tracking-uri", "none", "--out", str(out)])
    assert run(args) == 0
    record = json.loads(out.read_text())
    (result,) = record["results"]
    assert result["largest_batch_size"] == 5  # no cap on CPU: the search stops at --max-batch
    assert [t["batch_size"] for t in result["trials"]] == [2, 4, 5]
    assert result["at_largest"]["tokens_per_s"] == pytest.approx(2 * 5 * 32 / result["at_largest"]["step_time_s"])
    assert record["meta"]["search"]["max_batch"] == 5 and record["meta"]["num_workers"] == 2


@pytest.mark.gpu
def test_the_search_stops_where_the_memory_cap_is_reached():
    device = torch.device("cuda", torch.cuda.current_device())  # the memory-fraction call needs an index
    torch.cuda.empty_cache()
    limit = 1 << 15  # sequences; the data holds that many windows
    trials = _tiny_trials("mpipemoe", device, torch.bfloat16, windows=limit)
    # The fraction caps what the allocator reserves, which can stay above what is allocated
    # after empty_cache (with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True the H200 run
    # found no batch that fits when the cap was counted from the allocated bytes).
    base = max(torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))
    headroom = 256 * 2**20  # above the weights: a few hundred sequences of 32 tokens fit, 32k do not
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction((base + headroom) / total, device)
    try:
        largest = largest_fitting(trials.fits, 8, limit)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    assert 8 <= largest < limit
    for trial in trials.trials:  # the outcome is monotone in the batch size and the failures are real OOMs
        assert trial["fits"] == (trial["batch_size"] <= largest)
        if trial["fits"]:
            assert trial["peak_memory_bytes"] <= base + headroom
    assert any(t["batch_size"] == largest + 1 and not t["fits"] for t in trials.trials)


def test_the_search_stops_where_the_memory_cap_is_reached_cpu_twin():
    """The same trials on CPU, where nothing caps the memory: the search reaches its limit."""
    limit = 4
    trials = _tiny_trials("mpipemoe", torch.device("cpu"), torch.float32, windows=limit)
    assert largest_fitting(trials.fits, 2, limit) == limit
    assert all(trial["fits"] for trial in trials.trials) and trials.trials[-1]["batch_size"] == limit


def test_report_section_tabulates_the_logged_h200_search(tmp_path):
    """The committed H200 record, logged to a fresh MLflow store, read back for `mpipemoe report`."""
    pytest.importorskip("mlflow")
    from app.reports.capacity import load_capacity_runs, section_capacity

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    path = str(Path(__file__).parents[2] / "results" / "capacity-gpt-s-h200.json")
    assert run(parser.parse_args(["--import", path, "--tracking-uri", uri])) == 0
    rows = load_capacity_runs(uri)
    assert sorted(r["engine"] for r in rows) == ["fastmoe", "mpipemoe"]
    table = [line for line in section_capacity(rows) if line.startswith("| gpt-s")]
    assert table[0].startswith("| gpt-s | NVIDIA H200 (140 GiB) | 32.0 | 1 | mpipemoe | 43 | 58,176 | 31.20 | 1.00 | 1.00 |")
    assert table[1].startswith("| gpt-s | NVIDIA H200 (140 GiB) | 32.0 | 1 | fastmoe | 16 | 44,784 | 31.44 | 0.37 | 0.77 |")
    assert section_capacity([])[-2].startswith("_No data")


def _trials_as_training_builds(rank: int, world_size: int, data_dir: str) -> dict:
    from workers.capacity import capacity_trials

    torch.set_num_threads(1)
    preset = get_preset("tiny-gpt")
    config = WorkerConfig(preset, "mpipemoe", data_dir=data_dir, partitions=2, strategy="S1", seq_len=32,
                          expert_parallel=1, grad_accum=2, micro_batch_schedule="overlapped",
                          start_batch=2, max_batch=2, **TRIAL_SETTINGS)
    trials = capacity_trials(config, rank, world_size, torch.device("cpu"))
    fits = trials.fits(2)
    trial = trials.trials[-1]
    return {"fits": fits, "local_experts": trials.model.moe_layers()[0].local_experts, "schedule": trials.schedule,
            "tokens_per_step": trial["tokens_per_s"] * trial["step_time_s"]}


@pytest.mark.gloo
def test_the_search_builds_the_model_as_training_does(tmp_path):
    """2 workers at expert-parallel 1 (each holds all 4 experts, as training would), 2
    micro-batches a step under the overlapped schedule: each trial step trains both, two in
    flight. Built with the world as the expert group, each rank held 2 experts and the batch it
    found was one training at that degree could run out of memory with."""
    from tests.distributed import run_on_ranks

    prepare_dataset(tmp_path / "data", max_bytes=2**17, row_len=1024)
    results = run_on_ranks(2, _trials_as_training_builds, str(tmp_path / "data"))
    for result in results:
        assert result["fits"] and result["local_experts"] == 4 and result["schedule"] == "overlapped"
        assert result["tokens_per_step"] == pytest.approx(2 * 2 * 2 * 32)  # workers x micro-batches x batch x tokens
