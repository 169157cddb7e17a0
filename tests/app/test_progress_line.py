"""Tier 1: the console's step line (app/jobs/progress.py) names what the engine ran."""
from app.jobs.progress import _format_step

STEP = {"step": 3, "loss": 1.0, "lm_loss": 1.0, "aux_loss": 0.1, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0,
        "step_time_s": 0.1, "peak_memory_bytes": 2**20, "partitions": 16, "strategy": "S4"}


def test_the_step_line_names_partitions_split_by_peers():
    assert _format_step({**STEP, "split": "peers"}, 10, 1.0).endswith("[partitions=16:peers strategy=S4]")
    assert _format_step({**STEP, "split": "tokens"}, 10, 1.0).endswith("[partitions=16 strategy=S4]")
    assert _format_step(STEP, 10, 1.0).endswith("[partitions=16 strategy=S4]")  # other engines: no split


def test_a_step_the_console_shows_is_already_sent_to_mlflow():
    """The driver flushes a step's metrics before printing its line: a SIGKILL right after the
    line cannot lose a step the user saw (steps between shown lines are buffered and may be lost)."""
    from app.jobs.job import TrainJob
    from app.jobs.progress import _MetricsPump

    class Run:
        def __init__(self):
            self.pending, self.sent = [], []

        def log_metrics(self, metrics, step=None, flush=False):
            self.pending.append(step)

        def flush(self):
            self.sent += self.pending
            self.pending = []

    run, lines = Run(), []
    sent_when_shown = []
    pump = _MetricsPump(None, run, TrainJob(steps=6, log_every=3), lambda line: (
        lines.append(line), sent_when_shown.append(list(run.sent))), None)
    for step in range(1, 7):
        pump._handle({**STEP, "step": step})
    assert [line.split("/")[0].split()[-1] for line in lines] == ["1", "3", "6"]
    assert sent_when_shown == [[1], [1, 2, 3], [1, 2, 3, 4, 5, 6]]
