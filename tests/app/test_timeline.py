"""`mpipemoe bench --trace`: the timeline's stream account (app/bench/timeline.py) and the overlap
account every record carries (app/bench/layer_bound.py)."""
import gzip
import json

import pytest

from app.bench.layer_bound import add_overlap_account, overlap_bound_ms
from app.cli import main
from app.bench.timeline import device_busy_ms, stream_account


def kernel(name, start_us, dur_us, stream):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": start_us, "dur": dur_us, "args": {"stream": stream}}


def test_account_counts_busy_idle_and_overlap_by_role():
    trace = {"traceEvents": [
        kernel("spin_until", 0, 1000, 13),                                           # comm 0-1 ms
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 1000, "dur": 500,
         "args": {"stream": 13}},                                                     # the link's copy: comm
        kernel("cutlass_gemm_sm90", 500, 1500, 7),                                    # compute 0.5-2 ms
        kernel("vectorized_elementwise_kernel", 1800, 400, 7),                        # overlaps the GEMM
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 3000, "dur": 1000,
         "args": {"stream": 20}},                                                     # host copy 3-4 ms
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 9000},      # host: not counted
    ]}
    account = stream_account(trace)
    assert account["span_ms"] == pytest.approx(4.0)
    assert account["comm_busy_ms"] == pytest.approx(1.5)
    assert account["compute_busy_ms"] == pytest.approx(1.7)     # 0.5-2.2 ms, the union
    assert account["copy_busy_ms"] == pytest.approx(1.0)
    assert account["comm_beside_compute_ms"] == pytest.approx(1.0)  # 0.5-1.5 ms
    assert account["comm_exposed_ms"] == pytest.approx(0.5)         # 0-0.5 ms: nothing computed beside it
    assert account["all_idle_ms"] == pytest.approx(0.8)         # 2.2-3.0 ms
    assert account["compute_idle_ms"] == pytest.approx(2.3)
    assert account["device_events"] == 5


def test_account_takes_the_last_pass_by_launch_time():
    runtime = lambda corr, ts: {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1,
                                "args": {"correlation": corr}}  # noqa: E731
    with_corr = lambda event, corr: {**event, "args": {**event["args"], "correlation": corr}}  # noqa: E731
    trace = {"traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "mpipemoe.pass", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "user_annotation", "name": "mpipemoe.pass", "ts": 100, "dur": 100},
        # the device track's copy of a range, in device time: not a pass (an H100 trace's last
        # such range held 28 of ~500 kernels and none of the link's waits)
        {"ph": "X", "cat": "gpu_user_annotation", "name": "mpipemoe.pass", "ts": 2400, "dur": 50},
        runtime(1, 10), runtime(2, 150), runtime(3, 230),
        with_corr(kernel("cutlass_gemm", 20, 2000, 7), 1),      # launched in the first pass
        with_corr(kernel("cutlass_gemm", 2020, 500, 7), 2),     # launched in the second: queued behind
        with_corr(kernel("spin_until", 2520, 300, 9), 3),       # by a helper thread, after the range ended
    ]}
    account = stream_account(trace)
    assert account["span_ms"] == pytest.approx(0.8) and account["device_events"] == 2
    assert account["comm_busy_ms"] == pytest.approx(0.3)


def test_kernels_launched_through_the_driver_count_like_the_runtimes():
    """Triton launches its kernels (the emulated link's waits) with cuLaunchKernel: a trace
    files them under cuda_driver, and a pass's account and device-busy time keep them."""
    def launch(corr, ts, cat):
        return {"ph": "X", "cat": cat, "name": "launch", "ts": ts, "dur": 1, "tid": 1, "args": {"correlation": corr}}

    trace = {"traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "mpipemoe.pass", "ts": 0, "dur": 100, "tid": 1},
        launch(1, 10, "cuda_driver"), launch(2, 20, "cuda_runtime"),
        {**kernel("spin_until", 100, 1000, 13), "args": {"stream": 13, "correlation": 1}},
        {**kernel("cutlass_gemm", 200, 500, 7), "args": {"stream": 7, "correlation": 2}},
    ]}
    account = stream_account(trace)
    assert account["device_events"] == 2 and account["comm_busy_ms"] == pytest.approx(1.0)
    assert device_busy_ms(trace, "mpipemoe.pass") == pytest.approx([1.0])


def test_device_busy_counts_the_work_launched_in_each_range_from_any_thread_less_the_excluded():
    """A floor of a phase's device time: the union of what it launched (autograd launches a
    backward from its own thread), the device's wait for the host not counted, and the work
    launched inside an excluded range on the same thread left out."""
    def runtime(corr, ts, tid):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "tid": tid,
                "args": {"correlation": corr}}

    def device(corr, start, dur, stream=7, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": "k", "ts": start, "dur": dur, "args": {"stream": stream,
                                                                                        "correlation": corr}}

    def mark(name, ts, dur, tid=1):
        return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur, "tid": tid}

    trace = {"traceEvents": [
        mark("fwd", 0, 100), mark("bwd", 100, 100), mark("fwd", 1000, 100),
        mark("copy", 10, 5, tid=1), mark("copy", 150, 5, tid=2),
        {"ph": "X", "cat": "gpu_user_annotation", "name": "fwd", "ts": 0, "dur": 5000, "tid": 9},  # device track
        runtime(1, 5, 1), runtime(2, 12, 1), runtime(3, 40, 1),             # the first forward
        runtime(4, 120, 2), runtime(5, 152, 2), runtime(6, 152, 1),         # the backward, from thread 2
        runtime(7, 1010, 1),                                                # the second forward
        device(1, 100, 300), device(2, 400, 200, cat="gpu_memcpy"),         # the excluded copy (thread 1)
        device(3, 1000, 100, stream=9),                                     # after a wait for the host
        device(4, 2000, 500), device(5, 2200, 100),                         # copy excluded on thread 2
        device(6, 2400, 200, cat="gpu_memset"),                             # thread 1 launched it: kept
        device(7, 5000, 250),
    ]}
    assert device_busy_ms(trace, "fwd", excluding="copy") == pytest.approx([0.4, 0.25])
    assert device_busy_ms(trace, "fwd") == pytest.approx([0.6, 0.25])
    assert device_busy_ms(trace, "bwd", excluding="copy") == pytest.approx([0.6])  # 2000-2600: the union
    assert device_busy_ms(trace, "absent") == []


def test_a_blocking_all_to_all_on_the_compute_stream_is_still_communication():
    trace = {"traceEvents": [kernel("spin_until", 0, 1000, 7), kernel("cutlass_gemm", 1000, 1000, 7)]}
    account = stream_account(trace)
    assert (account["comm_busy_ms"], account["compute_busy_ms"], account["comm_beside_compute_ms"],
            account["comm_exposed_ms"]) == pytest.approx((1.0, 1.0, 0.0, 1.0))


def test_overlap_account_is_the_share_of_the_ideal_saving():
    records = [{"engine": "fastmoe", "partitions": 1, "fwd_bwd_ms": 50.0, "all_to_all_ms": 24.0, "expert_ms": 26.0},
               {"engine": "mpipemoe", "partitions": 4, "fwd_bwd_ms": 38.0, "all_to_all_ms": 24.0, "expert_ms": 26.0},
               {"engine": "dense-floor", "partitions": 1, "fwd_bwd_ms": 20.0}]
    add_overlap_account(records)
    bound = overlap_bound_ms(24.0, 26.0, 4)
    assert records[1]["overlap_bound_ms"] == pytest.approx(32.0) == pytest.approx(bound)  # the pipeline model
    assert records[1]["floor_ms"] == 26.0  # timed alone: the longer stage
    assert records[1]["realized_saving"] == pytest.approx((50 - 38) / (50 - 26))
    assert records[0]["realized_saving"] == 0.0 and "overlap_bound_ms" not in records[2]  # FastMoE saves nothing


def test_own_pass_floor_is_per_phase_and_a_pass_may_beat_the_pipeline_model():
    """Measured on an H100 (bert-l 32k, emulated 8x8, 1/S3): the offload copies ran beside the
    All-to-All at n = 1, 23.75 ms against a serial model of 27.07; the per-phase floor holds."""
    stages = {"comm_fwd_ms": 6.04, "comm_bwd_ms": 6.04, "compute_fwd_ms": 6.16, "compute_bwd_ms": 8.83}
    records = [{"engine": "fastmoe", "partitions": 1, "fwd_bwd_ms": 21.39, "comm_fwd_ms": 6.04, "comm_bwd_ms": 6.04,
                "compute_fwd_ms": 3.21, "compute_bwd_ms": 5.37},
               {"engine": "mpipemoe", "partitions": 1, "fwd_bwd_ms": 23.75, **stages}]
    add_overlap_account(records)
    s3 = records[1]
    assert s3["overlap_bound_ms"] == pytest.approx(27.07) and s3["fwd_bwd_ms"] < s3["overlap_bound_ms"]
    assert s3["floor_ms"] == s3["phase_floor_ms"] == pytest.approx(6.16 + 8.83)
    assert s3["bound_ratio"] == pytest.approx(23.75 / 14.99) and s3["realized_saving"] < 0  # slower than FastMoE
    assert records[0]["floor_ms"] == pytest.approx(6.04 + 6.04)


def test_bench_trace_writes_one_timeline_per_engine_and_setting(tmp_path):
    out, traces = tmp_path / "bench.json", tmp_path / "traces"
    assert main(["bench", "--emulate", "1x2", "--tokens", "128", "--rounds", "1", "--repeats", "1",
                 "--partitions", "2", "--strategies", "S3", "--tracking-uri", "none", "--out", str(out),
                 "--trace", str(traces)]) == 0
    records = json.loads(out.read_text())["records"]
    traced = [r for r in records if r["engine"] != "dense-floor"]
    assert len(traced) == 4 and all(r["transfer_ctas"] == 1 for r in records)
    for record in traced:
        with gzip.open(record["trace_file"], "rt") as handle:
            trace = json.load(handle)
        assert any(e.get("name", "").startswith("aten::") for e in trace["traceEvents"])
        assert "timeline" in record  # empty on CPU: no device events
    assert sorted(p.name for p in traces.iterdir()) == sorted(r["trace_file"].split("/")[-1] for r in traced)
