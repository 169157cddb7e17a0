"""`mpipemoe simulate` from the command line (tier 1: no Ray, no GPU): the documented
expert-parallel comparison with its default tracking (a local MLflow store), and
`--validate`'s answers to files it cannot price."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from app.cli import main

ROOT = Path(__file__).parents[2]
PARTS = ROOT / "results" / "sim-parts-h200.json"


def test_the_expert_parallel_comparison_logs_one_mlflow_run_per_degree(tmp_path, monkeypatch, capsys):
    """docs/simulate.md's command, as written (MLflow on: the default store in the current folder)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    args = ["simulate", "--nodes", "8", "--model", "gpt-s", "--tokens", "8192", "--experts", "64",
            "--expert-parallel", "8,64", "--parts", str(PARTS)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "E = 8" in out and "E = 64" in out and "Logged 2 MLflow runs" in out
    from app.tracking.run_kinds import run_kind
    from app.tracking.store import client

    mlflow = client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = mlflow.search_runs([mlflow.get_experiment_by_name("mpipemoe-simulate").experiment_id])
    assert sorted(r.data.params["label"] for r in runs) == ["mpipemoe-ep64", "mpipemoe-ep8"]
    assert all(run_kind(r.data.tags) == "simulate" and r.data.metrics["step_ms"] > 0 for r in runs)


def _record(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("name, text, words", [
    ("empty.json", "", "the file is empty"),
    ("list.json", "[1, 2]", "not a bench record (it has no \"meta\" and \"records\")"),
    ("other.json", '{"points": []}', "not a bench record"),
    ("broken.json", "{", "not JSON"),
])
def test_validate_names_a_file_that_is_not_a_bench_record(tmp_path, capsys, name, text, words):
    path = _record(tmp_path, name, text)
    assert main(["simulate", "--validate", path, "--parts", str(PARTS), "--out", str(tmp_path / "v.json")]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"mpipemoe simulate: error: --validate {path}: {words}") and "give the JSON" in line
    assert not (tmp_path / "v.json").exists()
    missing = str(tmp_path / "missing.json")
    assert main(["simulate", "--validate", missing, "--parts", str(PARTS)]) == 1
    assert f"--validate {missing}: cannot read it (No such file or directory)" in capsys.readouterr().err


def test_validate_with_no_record_it_can_price_fails_and_leaves_out_alone(tmp_path, capsys):
    cpu = _record(tmp_path, "cpu.json", json.dumps({"meta": {"device": "cpu", "world_size": 1}, "records": []}))
    out = tmp_path / "validation.json"
    out.write_text("an earlier report")
    shutil.copy(out, tmp_path / "before")
    assert main(["simulate", "--validate", cpu, "--parts", str(PARTS), "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"mpipemoe simulate: error: --validate: no record could be simulated ({cpu}: measured on "
                          f"cpu, the parts on ")
    assert err.endswith(f"{out} left as it was (--debug shows the traceback)")
    assert out.read_text() == "an earlier report"


def test_an_out_path_below_a_file_is_refused_before_the_work(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    for argv in (["simulate", "--model", "gpt-s", "--tokens", "8192"], ["bench"], ["report"]):
        assert main([*argv, "--out", str(tmp_path / "file" / "x.json"), "--tracking-uri", "none"]) == 1
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert f"--out {tmp_path / 'file' / 'x.json'}: {tmp_path / 'file'} is a file, not a folder: give " in line, line
