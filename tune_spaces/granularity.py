"""Granularity study: pipeline partitions n x memory strategy, jointly, for one model and
batch (docs/design.md §2, §5, §7): which setting is fastest, and which fits a memory cap.

    mpipemoe sweep granularity --address auto --storage-path /mnt/shared/ray_results
    mpipemoe sweep granularity --preset tiny-gpt --num-workers 2 --steps 6 --batch-size 4 \
        --set partitions=1,2,auto --set strategy=none,S1,auto      # on 2 CPU cores

Every n in {1, 2, 4, 8, auto} with every strategy in {none, S1..S4, auto}, each point run
twice (``NUM_SAMPLES``: the spread shows in the ranking). The command ranks the settings by
throughput, prints the time/memory Pareto front and, with ``--memory-cap-gib``, the fastest
setting under the cap (memory: the settled peak, after the online choice of an ``auto``
setting). The model, batch, workers and steps are the defaults below; ``mpipemoe sweep
granularity --preset P --batch-size B --num-workers W --steps S`` asks it of your own.
``--set split=tokens,peers`` adds the split of MPipeMoE's partitions (docs/engine.md, "Two
ways to split a pass"; a fixed n split by peers must divide the expert group's workers); an
``auto`` setting's ranking line names the split it settled on (``n=8:peers none``).
"""
from __future__ import annotations

from ray import tune

from moe_engine.config import STRATEGIES as STRATEGIES_OF_THE_ENGINE

DESCRIPTION = "partitions {1,2,4,8,auto} x strategy {none,S1..S4,auto} on one model and batch, ranked by time and memory"
NUM_SAMPLES = 2          # each setting twice: the ranking shows the spread
PARTITIONS = [1, 2, 4, 8, "auto"]
STRATEGIES = [*STRATEGIES_OF_THE_ENGINE, "auto"]


def param_space(search: str = "grid") -> dict:
    return {
        "engine": "mpipemoe",
        "preset": "gpt-xl",
        "batch_size": 16,        # x seq_len 512 = 8k tokens per GPU
        "seq_len": 512,
        "partitions": tune.grid_search(PARTITIONS),
        "strategy": tune.grid_search(STRATEGIES),
        "steps": 30,             # the first steps warm up and run the online search
        "num_workers": 8,
        "checkpoint_every": 0,   # a timing trial needs no checkpoint
    }
