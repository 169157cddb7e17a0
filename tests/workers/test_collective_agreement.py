"""Tier 2 (4 gloo ranks, no Ray): every rank issues the same collectives and ends a step the
same way, with expert groups smaller than the world.

- NaN/Inf reaching the MoE input of one expert group only (ranks 0-1 of tiny-gpt at expert
  parallel 2): under both micro-batch schedules every rank skips the step together
  (``on_nonfinite_loss="skip"``, and the next step trains) or halts together naming ranks 0
  and 1 (``"halt"``). The decision comes from the step's loss all-reduce over every rank; a
  rank that decided alone would leave the others in a collective until the short collective
  timeout ends the test.
- Over several overlapped steps with uneven routing (the granularity search on), every rank
  issues the same collectives on each communicator (each expert group's and its second
  lane's) in the same order: the same operations, All-to-Alls whose splits pair up (what
  rank p sends q is what q receives from p), agreements of the same sizes. The MoE layers'
  collectives are recorded as each rank issues them (a CollectiveLog given to the lanes);
  each communicator's first is the one that connected it when the lanes were made.
- A checkpointed MoE layer's recomputation in the overlapped schedule's backward thread is
  refused on every rank alike (its collectives would go to the other thread's lane).

One spawn of 4 ranks, with a 20 s collective timeout: a regression fails, it does not hang.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from lm.data import prepare_dataset
from lm.model import get_preset
from tests.distributed import run_on_ranks
from workers.config import WorkerConfig

TIMEOUT_S = 20
POISONED = (0, 1)  # the ranks of expert group 0 at expert-parallel 2


def _config(data_dir: str, **change) -> WorkerConfig:
    preset = get_preset("tiny-gpt")
    return WorkerConfig(**{"preset": dataclasses.asdict(preset), "engine": "mpipemoe", "partitions": 2,
                           "strategy": "S1", "seed": 5, "lr": 1e-3, "aux_loss_weight": 0.01, "steps": 4,
                           "batch_size": 2, "seq_len": 32, "grad_accum": 2, "data_dir": data_dir,
                           "dtype": "float32", "expert_parallel": 2, "collective_timeout_s": TIMEOUT_S,
                           **change})


def _on_four(rank: int, world_size: int, data_dir: str) -> dict:
    torch.set_num_threads(1)
    return {"nan": _nan_on_one_expert_group(rank, world_size, data_dir),
            "collectives": _overlapped_collectives(rank, world_size, data_dir),
            "recomputed": _checkpointed_under_lanes(rank)}


def _checkpointed_under_lanes(rank: int) -> str:
    """A checkpointed MoE layer under the overlapped schedule: its recomputation (in the
    backward thread) is refused on every rank, whatever the other thread is doing."""
    from torch.utils.checkpoint import checkpoint

    from moe_engine import MoEConfig, MPipeMoE
    from workers.schedules import Lanes, ScheduleError, forward_backward

    torch.manual_seed(0)
    layer = MPipeMoE(MoEConfig(8, 16, 4), partitions=2, strategy="S1")
    xs = [torch.randn(12, 8, generator=torch.Generator().manual_seed(10 * rank + k)) for k in range(3)]
    lanes = Lanes.create(layer)
    try:
        forward_backward(layer, range(3), lambda module, k: (checkpoint(module, xs[k], use_reentrant=False)[0].sum(), k),
                         schedule="overlapped", lanes=lanes)
    except ScheduleError as error:
        return f"{error.phase} {error.micro_batch}: {error.__cause__}"
    finally:
        lanes.close()
    return "ran"


def _overlapped_collectives(rank: int, world_size: int, data_dir: str) -> dict:
    from moe_engine.comm import CollectiveLog
    from workers.loop import Trainer

    log = CollectiveLog()
    config = _config(data_dir, micro_batch_schedule="overlapped", grad_accum=3, partitions="auto")
    trainer = Trainer(config, rank, world_size, torch.device("cpu"), collective_log=log)
    for step in range(1, 4):
        trainer.step(step)
    return {name: [(e.ranks, e.op, e.sizes) for e in events] for name, events in log.by_group.items()}


def _nan_on_one_expert_group(rank: int, world_size: int, data_dir: str) -> dict:
    from workers.loop import StepError, Trainer

    outcomes = {}
    for schedule in ("sequential", "overlapped"):
        for policy in ("skip", "halt"):
            trainer = Trainer(_config(data_dir, micro_batch_schedule=schedule, on_nonfinite_loss=policy),
                              rank, world_size, torch.device("cpu"))
            assert trainer.schedule == schedule
            poison = [rank in POISONED]
            trainer.model.tok_embed.register_forward_hook(
                lambda module, inputs, out: out * math.nan if poison[0] else None)
            try:
                first = trainer.step(1)
                outcome: tuple = ("skipped", first["skipped"], first.get("skip_reason"))
            except StepError as error:
                outcome = ("halted", str(error))
            poison[0] = False
            if policy == "skip":  # the next step trains on every rank
                second = trainer.step(2)
                outcome += (second["skipped"], math.isfinite(second["lm_loss"]))
            outcomes[f"{schedule}-{policy}"] = outcome
    return outcomes


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("agreement")
    prepare_dataset(root / "data", max_bytes=2**17, row_len=1024)
    return run_on_ranks(4, _on_four, str(root / "data"), timeout=300, collective_timeout_s=TIMEOUT_S)


@pytest.mark.gloo
def test_nonfinite_input_on_one_expert_group_ends_the_step_alike_on_every_rank(runs):
    results = [r["nan"] for r in runs]
    for schedule in ("sequential", "overlapped"):
        skipped = [r[f"{schedule}-skip"] for r in results]
        assert all(s == skipped[0] for s in skipped), skipped  # every rank alike
        kind, flag, reason, next_skipped, next_finite = skipped[0]
        assert (kind, flag, next_skipped, next_finite) == ("skipped", 1, 0, True)
        assert "NaN or Inf in the MoE layer input of rank(s) 0, 1" in reason
        halted = [r[f"{schedule}-halt"] for r in results]
        assert all(h == halted[0] for h in halted), halted
        kind, message = halted[0]
        assert kind == "halted"
        assert "NaN or Inf in the MoE layer input of rank(s) 0, 1 at step 1" in message
        assert "--on-nonfinite-loss skip" in message


@pytest.mark.gloo
def test_every_rank_issues_the_same_collectives_per_communicator_under_the_overlapped_schedule(runs):
    logs = [r["collectives"] for r in runs]
    names = {name for log in logs for name in log}
    members_of = {name: next(log[name][0][0] for log in logs if name in log) for name in names}
    # each expert group: its own communicator and lane 1's; the world's: the ranks met after connecting them
    assert sorted(members_of.values()) == [(0, 1)] * 2 + [(0, 1, 2, 3)] + [(2, 3)] * 2
    uneven = 0
    for name, members in members_of.items():
        sequences = [logs[rank].get(name, []) for rank in members]
        assert len({len(s) for s in sequences}) == 1, (name, [len(s) for s in sequences])
        # every communicator was connected (a first collective) in Lanes.create, before any step
        assert sequences[0][0][1].startswith("all-reduce") and sequences[0][0][2] == ((1,),)
        if len(members) < 4:
            assert len(sequences[0]) > 20  # several steps' count exchanges, All-to-Alls and agreements
        for i, issued in enumerate(zip(*sequences)):
            assert len({(ranks, op) for ranks, op, _ in issued}) == 1, (name, i, issued)
            op = issued[0][1]
            if op == "All-to-All":  # what p sends q is what q receives from p
                for p, (_, _, (_, sent)) in enumerate(issued):
                    for q, (_, _, (received, _)) in enumerate(issued):
                        assert sent[q] == received[p], (name, i, issued)
                uneven += any(len(set(sent)) > 1 for _, _, (_, sent) in issued)
            else:
                assert len({sizes for _, _, sizes in issued}) == 1, (name, i, issued)
    assert uneven > 0  # the routing sent different row counts to different ranks


@pytest.mark.gloo
def test_a_checkpointed_moe_layer_under_the_overlapped_schedule_is_refused_alike_on_every_rank(runs):
    outcomes = [r["recomputed"] for r in runs]
    assert all(outcome == outcomes[0] for outcome in outcomes), outcomes
    assert outcomes[0].startswith("backward 0: an activation checkpoint recomputes this MoE layer in the backward "
                                  "of lane 0")
    assert "checkpoint the MoE layers only under the sequential micro-batch schedule" in outcomes[0]
