"""Tier 1: the console's step line (app/jobs/progress.py) names what the engine ran."""
from app.jobs.progress import _format_step

STEP = {"step": 3, "loss": 1.0, "lm_loss": 1.0, "aux_loss": 0.1, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0,
        "step_time_s": 0.1, "peak_memory_bytes": 2**20, "partitions": 16, "strategy": "S4"}


def test_the_step_line_names_partitions_split_by_peers():
    assert _format_step({**STEP, "split": "peers"}, 10, 1.0).endswith("[partitions=16:peers strategy=S4]")
    assert _format_step({**STEP, "split": "tokens"}, 10, 1.0).endswith("[partitions=16 strategy=S4]")
    assert _format_step(STEP, 10, 1.0).endswith("[partitions=16 strategy=S4]")  # other engines: no split
