"""Expert parallelism of degree P < W through the Trainer (workers/distributed.py ExpertLayout).

Tier 2 (gloo, no Ray). tiny-gpt (4 experts) on 4 ranks, float32, dropless:

- P = 2 (two expert groups of 2 ranks, each expert on 2 ranks) trains the same losses as
  P = 4 (every expert on one rank) from the same seed: the expert gradients summed over the
  replicas equal those summed over one group of all tokens;
- checkpoints reshard across P and W: a P = 4 checkpoint resumed with P = 2 on 4 workers and
  on 2 workers, and a P = 2 checkpoint (the experts held twice, written once) resumed on 2
  workers, continue the losses of the run that never stopped within float32 rounding
  (``aux_loss_weight`` 0: the load-balance loss is per rank, workers/reshard.py).

One spawn of 4 ranks (the straight runs and the resume on 4) and one of 2 ranks (the resumes on 2).
"""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from lm.data import prepare_dataset
from lm.model import get_preset
from tests.distributed import run_on_ranks
from workers.config import WorkerConfig
from workers.distributed import check_expert_degree, default_expert_degree
from workers.reshard import check_checkpoint_layout, check_worker_count

N, K, GLOBAL_BATCH = 4, 2, 8


def _config(data_dir: str, world_size: int, expert_parallel: int | None, **change) -> WorkerConfig:
    preset = get_preset("tiny-gpt")
    return WorkerConfig(**{"preset": dataclasses.asdict(preset), "engine": "mpipemoe", "partitions": 2,
                           "strategy": "S1", "seed": 5, "lr": 3e-3, "warmup_steps": 1, "aux_loss_weight": 0.0,
                           "steps": N, "batch_size": GLOBAL_BATCH // world_size, "data_dir": data_dir,
                           "dtype": "float32", "expert_parallel": expert_parallel, **change})


def _train(rank: int, world_size: int, config: WorkerConfig, save_to: Path | None) -> list[float]:
    """Collective: N steps; with ``save_to``, a checkpoint after step K in ``save_to/merged``
    (every rank writes its own folder, merged as Ray Train does)."""
    import torch.distributed as dist

    from workers import checkpoint as ckpt
    from workers.loop import Trainer

    trainer = Trainer(config, rank, world_size, torch.device("cpu"))
    losses = []
    for step in range(1, N + 1):
        losses.append(trainer.step(step)["lm_loss"])
        if step == K and save_to is not None:
            own = save_to / f"rank{rank}"
            own.mkdir(parents=True)
            ckpt.save(own, rank, world_size, trainer.parallel, trainer.optimizer,
                      {"step": K, "world_size": world_size, "data_shards": world_size,
                       "expert_parallel": trainer.layout.degree, "preset": config.preset_dict()})
            dist.barrier()
            if rank == 0:
                for r in range(world_size):
                    shutil.copytree(save_to / f"rank{r}", save_to / "merged", dirs_exist_ok=True)
            dist.barrier()
    return losses


def _resume(rank: int, world_size: int, config: WorkerConfig, directory: Path) -> dict:
    """Collective: a fresh Trainer loads ``directory`` and trains steps K+1..N."""
    from workers import checkpoint as ckpt
    from workers.loop import Trainer

    trainer = Trainer(config, rank, world_size, torch.device("cpu"))
    meta = ckpt.load(directory, rank, world_size, trainer.parallel, trainer.optimizer, config.preset_dict(),
                     config.data_shards)
    return {"losses": [trainer.step(step)["lm_loss"] for step in range(meta["step"] + 1, N + 1)],
            "w1_local_rows": trainer.model.blocks[0].moe.experts.w1.shape[0]}


def _on_four(rank: int, world_size: int, data: str, out: str) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        four = _train(rank, world_size, _config(data, 4, 4), Path(out) / "p4")
        two = _train(rank, world_size, _config(data, 4, 2), Path(out) / "p2")
        resumed = _resume(rank, world_size, _config(data, 4, 2), Path(out) / "p4" / "merged")
        return {"p4": four, "p2": two, "p4_to_p2": resumed}
    finally:
        torch.set_num_threads(threads)


def _on_two(rank: int, world_size: int, data: str, out: str) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config = _config(data, 2, None, data_shards=4)  # the data keeps the 4-worker layout
        return {source: _resume(rank, world_size, config, Path(out) / source / "merged") for source in ("p4", "p2")}
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("expert_parallel")
    data, out = str(root / "data"), str(root / "out")
    prepare_dataset(data, max_bytes=2**18, row_len=1024)
    return {"four": run_on_ranks(4, _on_four, data, out), "two": run_on_ranks(2, _on_two, data, out), "out": out}


@pytest.mark.gloo
def test_two_expert_groups_train_the_losses_of_one(runs):
    four = runs["four"]
    assert all(r["p4"] == four[0]["p4"] and r["p2"] == four[0]["p2"] for r in four)  # every rank sees the mean
    assert four[0]["p2"] == pytest.approx(four[0]["p4"], abs=1e-3)
    assert four[0]["p2"] == pytest.approx(four[0]["p4"], rel=1e-5)  # in fact within float32 rounding
    assert four[0]["p4"][-1] < four[0]["p4"][0]


@pytest.mark.gloo
def test_a_checkpoint_resumes_on_another_expert_degree_and_worker_count(runs):
    straight = {"p4": runs["four"][0]["p4"], "p2": runs["four"][0]["p2"]}
    for rank, result in enumerate(runs["four"]):  # P = 4 -> P = 2 on 4 workers
        assert result["p4_to_p2"]["w1_local_rows"] == 2
        assert result["p4_to_p2"]["losses"] == pytest.approx(straight["p4"][K:], rel=2e-5, abs=1e-6), rank
    for rank, result in enumerate(runs["two"]):  # P = 4 and P = 2 (written once per expert) -> 2 workers
        for source in ("p4", "p2"):
            assert result[source]["w1_local_rows"] == 2
            assert result[source]["losses"] == pytest.approx(straight[source][K:], rel=2e-5, abs=1e-6), \
                (rank, source)


@pytest.mark.gloo
def test_a_replicated_checkpoint_writes_each_expert_once(runs):
    """The P = 2 checkpoint on 4 ranks holds each expert once (DCP writes a replicated chunk
    from one of its ranks): its files are as large as the P = 4 checkpoint's, where each
    expert lives on one rank, not larger by a second copy of the experts (about 6 of 7 MB)."""
    def total(source: str) -> int:
        return sum(path.stat().st_size for path in (Path(runs["out"]) / source / "merged").glob("*.distcp"))

    assert total("p2") < 1.1 * total("p4")


# ---- tier 1: the rules ------------------------------------------------------------------------

def test_the_default_degree_is_a_node_where_it_divides_the_experts():
    assert default_expert_degree(8, 64, gpus_per_node=8) == 8     # gpt-s on 8 DGX nodes: All-to-All on NVLink
    assert default_expert_degree(64, 64, gpus_per_node=8) == 8
    assert default_expert_degree(4, 64, gpus_per_node=8) == 64    # 8 does not divide 4 experts: the world
    assert default_expert_degree(8, 4, gpus_per_node=8) == 4      # one node not filled: the world
    assert default_expert_degree(8, 4, gpus_per_node=None) == 4   # CPU workers: the world


def test_a_degree_that_does_not_divide_is_refused_naming_the_flag():
    check_expert_degree(2, 4, 4)
    with pytest.raises(ValueError, match=r"^expert_parallel=8 is invalid: .* use --expert-parallel 1, 2, 4 "):
        check_expert_degree(8, 8, 4)
    with pytest.raises(ValueError, match=r"cannot continue on 2 workers with --expert-parallel 4: .* use "
                                         r"--expert-parallel 1, 2$"):
        check_worker_count(4, 8, 2, "run r", expert_parallel=4)
    check_worker_count(4, 8, 8, "run r", expert_parallel=4)  # more workers than experts, in 2 groups
    meta = {"world_size": 4, "data_shards": 4, "preset": {"num_experts": 4}}
    check_checkpoint_layout(meta, 8, 4, "ck", expert_parallel=4)
    with pytest.raises(ValueError, match=r"expert groups of 8 workers: resume with --expert-parallel 1, 2, 4 on 8 "):
        check_checkpoint_layout(meta, 8, 4, "ck")
