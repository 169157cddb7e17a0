"""tools/trace_link.py: what the emulated link waited for, on a trace written by hand."""
from __future__ import annotations

import gzip
import json

import pytest

from tools.trace_link import link_account, main

MAIN, HELPER = 1, 2  # host threads: the forward of micro-batch k+1, the backward of k


def _launch(correlation: int, ts: float, tid: int) -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "tid": tid,
            "args": {"correlation": correlation}}


def _work(correlation: int, name: str, stream: int, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
            "args": {"correlation": correlation, "stream": stream}}


def _trace() -> list[dict]:
    """One pass (0-1000 µs). Compute: the main thread's gemm 0-100 on stream 7, the helper's
    gemm 0-300 on stream 8. Link (stream 9): the main thread's wait 400-500 (after a gap from
    300), then the helper's wait 500-600 — its data ready at 300, launched at 50: the link sat
    idle 300-400 with it ready (head-of-line). Compute again 700-800 (launched at 60): the
    link's 400-600 ran with no compute beside it while that kernel waited, launched."""
    return [{"ph": "X", "cat": "user_annotation", "name": "mpipemoe.pass", "ts": 0, "dur": 1000},
            _launch(1, 1, MAIN), _work(1, "gemm", 7, 0, 100),
            _launch(2, 2, HELPER), _work(2, "gemm", 8, 0, 300),
            _launch(3, 3, MAIN), _work(3, "spin_for_ns", 9, 200, 100),
            _launch(4, 40, MAIN), _work(4, "spin_for_ns", 9, 400, 100),
            _launch(5, 50, HELPER), _work(5, "spin_for_ns", 9, 500, 100),
            _launch(6, 60, MAIN), _work(6, "gemm", 7, 700, 100)]


def test_the_link_without_compute_and_its_head_of_line_gap_are_accounted():
    found = link_account(_trace())
    assert found["pass_ms"] == pytest.approx(1.0) and found["link_ms"] == pytest.approx(0.3)
    assert found["exposed_ms"] == pytest.approx(0.2)          # 400-600: no compute runs
    assert found["dependency_ms"] == pytest.approx(0.2) and found["host_ms"] == pytest.approx(0.0)
    assert found["link_idle_ms"] == pytest.approx(0.1)        # 300-400
    assert found["head_of_line_ms"] == pytest.approx(0.1)     # the helper's transfer was ready at 300


def test_a_trace_without_link_waits_says_so_and_the_command_prints_a_row(tmp_path, capsys):
    with pytest.raises(ValueError, match="no emulated link waits"):
        link_account([e for e in _trace() if "spin" not in e["name"]])
    with pytest.raises(ValueError, match="no mpipemoe.pass range"):
        link_account(_trace()[1:])
    path = tmp_path / "step.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    assert main([str(path)]) == 0
    assert "| step.json.gz | 1.0 | 0.3 | 0.2 | 0.2 | 0.0 | 0.1 | 0.1 |" in capsys.readouterr().out
