"""tools/trace_gaps.py: the host-bound account of a traced step, on a trace written by hand."""
from __future__ import annotations

import gzip
import json

import pytest

from tools.trace_gaps import account, load, main


def _event(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def _trace() -> list[dict]:
    return [_event("user_annotation", "mpipemoe.pass", 0, 900),      # an earlier pass: not accounted
            _event("kernel", "early", 100, 500),
            _event("user_annotation", "mpipemoe.pass", 1000, 1000),
            _event("cpu_op", "aten::to", 1150, 300),
            _event("cpu_op", "aten::_to_copy", 1140, 200),
            _event("cuda_runtime", "cudaLaunchKernel", 1100, 5),
            _event("cuda_runtime", "cudaLaunchKernel", 1500, 5),
            _event("kernel", "gemm", 1010, 100),                     # busy 1010-1110 and, with the
            _event("kernel", "gemm2", 1050, 100),                    # overlapping one, to 1150
            _event("gpu_memcpy", "copy", 1400, 100),                 # idle 1150-1400 (0.25 ms)
            _event("kernel", "tail", 1600, 300)]                     # idle 1500-1600 (0.1 ms)


def test_the_last_pass_is_accounted_busy_idle_and_its_gaps_with_the_host_operation_running():
    found = account(_trace(), gaps=1)
    assert found["host_ms"] == pytest.approx(1.0) and found["launches"] == 2
    assert found["busy_ms"] == pytest.approx(0.14 + 0.1 + 0.3)
    assert found["idle_ms"] == pytest.approx(0.25 + 0.1)
    assert found["gaps"] == [{"ms": pytest.approx(0.25), "before": "copy", "host": ["aten::_to_copy", "aten::to",
                                                                                        "mpipemoe.pass"]}]


def test_a_trace_without_a_pass_or_device_work_says_so(tmp_path, capsys):
    with pytest.raises(ValueError, match="no 'mpipemoe.pass' host range"):
        account([_event("kernel", "k", 0, 1)])
    with pytest.raises(ValueError, match="no device work"):
        account([_event("user_annotation", "mpipemoe.pass", 0, 10)])
    path = tmp_path / "step.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    assert len(load(path)) == len(_trace())
    assert main([str(tmp_path), "--gaps", "2"]) == 0
    out = capsys.readouterr().out
    assert "host pass 1.00 ms, device busy 0.54 ms, idle 0.35 ms, 2 launches" in out and "before copy" in out


def test_idle_time_is_summed_by_the_innermost_repository_frame_running_when_each_gap_began():
    from tools.trace_stacks import idle_by_frame

    frames = [_event("python_function", "workers/schedules.py(221): _backward", 1000, 900),
              _event("python_function", "moe_engine/dispatcher.py(239): plan_exchanged", 1140, 50),
              _event("python_function", "torch/nn/modules/module.py(1783): _call_impl", 1145, 20)]
    pass_ms, idle_ms, gaps, ranked = idle_by_frame(_trace() + frames)
    assert (pass_ms, gaps) == (pytest.approx(1.0), 2) and idle_ms == pytest.approx(0.35)
    # the gap from 1150 begins inside plan_exchanged (innermost of ours; torch's frame is not ours),
    # the one from 1500 inside _backward only
    assert ranked == [("moe_engine/dispatcher.py(239): plan_exchanged", pytest.approx(0.25), 1),
                      ("workers/schedules.py(221): _backward", pytest.approx(0.1), 1)]
