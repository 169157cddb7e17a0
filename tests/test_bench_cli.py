"""Tier 2: ``mpipemoe bench`` end to end on CPU (gloo ranks): one record per engine and
setting, the command/hardware/date metadata, and the Markdown table beside the JSON."""
import json

from app.cli import main


def test_bench_writes_records_for_every_engine_and_grid_point(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", "--tokens", "64", "--partitions", "1,2", "--strategies", "none,S3",
                 "--warmup", "1", "--repeats", "1", "--world-size", "2", "--tracking-uri", "none",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    meta = result["meta"]
    assert meta["world_size"] == 2 and meta["hardware"].startswith("cpu") and meta["date"]
    assert meta["settings"]["tokens"] == [64] and meta["settings"]["partitions"] == [1, 2]
    chosen = sorted((r["engine"], r["chosen_by"]) for r in result["records"] if r["chosen_by"] != "grid")
    assert chosen == [("fastermoe", "baseline"), ("fastmoe", "baseline"), ("mpipemoe", "auto")]
    grid = {(r["partitions"], r["strategy"]) for r in result["records"]
            if r["engine"] == "mpipemoe" and r["chosen_by"] == "grid"}
    assert grid == {(1, "none"), (1, "S3"), (2, "none"), (2, "S3")}
    for record in result["records"]:
        assert record["fwd_bwd_ms"] > 0 and record["world_size"] == 2
    assert "| tiny | 64 |" in out.with_suffix(".md").read_text()
