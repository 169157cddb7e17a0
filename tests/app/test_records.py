"""Tier 1: the metadata every result file carries."""
import json
import re
import sys
from pathlib import Path

import pytest

from app.tracking.records import BenchPoint, BenchResult, CapacityResult, RecordMeta, command_line, record_meta


def test_command_line_reads_as_the_user_typed_it(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/venv/bin/mpipemoe", "bench", "--tokens", "4096"])
    assert command_line("bench") == "mpipemoe bench --tokens 4096"
    monkeypatch.setattr(sys, "argv", ["pytest", "-q"])  # called from elsewhere: argv as is
    assert command_line("bench") == "pytest -q"


def test_record_meta_names_command_date_hardware_and_code(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["mpipemoe", "capacity"])
    meta = record_meta("capacity", use_gpu=False)
    assert meta["command"] == "mpipemoe capacity"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", meta["date"])
    assert meta["hardware"].startswith("cpu (")
    assert re.fullmatch(r"[0-9a-f]{7}(\+dirty)?|\?", meta["git_commit"])
    assert meta["torch"] and meta["python"].count(".") == 2


def _script(folder, name="mpipemoe"):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_hints_print_the_command_as_the_user_can_type_it(tmp_path, monkeypatch):
    """`resume with:` and the like: `mpipemoe` only when PATH finds this very program."""
    from lm.errors import invocation

    script = _script(tmp_path / ".venv" / "bin")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # the README's set-up not done: not on PATH
    monkeypatch.setattr(sys, "argv", [".venv/bin/mpipemoe", "train"])
    assert invocation() == ".venv/bin/mpipemoe"
    monkeypatch.setattr(sys, "argv", [str(script), "train"])  # started by its absolute path
    assert invocation() == ".venv/bin/mpipemoe"
    monkeypatch.setenv("PATH", f"{script.parent}:/usr/bin:/bin")  # source .venv/bin/activate
    assert invocation() == "mpipemoe"
    other = _script(tmp_path / "elsewhere")  # another mpipemoe first on PATH: not this one
    monkeypatch.setenv("PATH", f"{other.parent}:{script.parent}")
    assert invocation() == ".venv/bin/mpipemoe"
    monkeypatch.chdir(tmp_path / "elsewhere")  # outside the folder: the absolute path
    assert invocation() == str(script)
    monkeypatch.setattr(sys, "argv", [str(tmp_path / "app" / "cli.py"), "train"])  # python -m app.cli
    assert invocation().endswith(" -m app.cli")


def test_generated_records_default_to_the_ignored_out_folder():
    """bench, capacity, calibrate, simulate --validate and report never default to results/."""
    import argparse
    from pathlib import Path

    from app.commands import calibrate
    from app.commands import capacity
    from app.commands import bench
    from app.commands import simulate
    from app.commands import report
    from app.tracking.records import DEFAULT_OUT_DIR

    defaults = {}
    for module in (bench, calibrate, capacity, report, simulate):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        args = parser.parse_args([])
        defaults[module.__name__] = getattr(args, "out", None) or getattr(args, "profiles", None)
    assert defaults["app.commands.calibrate"] == f"{DEFAULT_OUT_DIR}/profiles.json"
    assert defaults["app.commands.report"].startswith(f"{DEFAULT_OUT_DIR}/")
    assert all(value is None or value.startswith(f"{DEFAULT_OUT_DIR}/") for value in defaults.values()), defaults
    ignored = (Path(__file__).parents[2] / ".gitignore").read_text().split()
    assert f"/{DEFAULT_OUT_DIR}/" in ignored


# -- typed result files: every committed one reads and writes back as it was -------------------

RESULTS = Path(__file__).resolve().parents[2] / "results"


@pytest.mark.parametrize("path", sorted(RESULTS.glob("**/bench-*.json")), ids=lambda p: p.name)
def test_every_committed_bench_json_round_trips(path):
    data = json.loads(path.read_text())
    result = BenchResult.from_json(data)
    assert result.to_json() == data
    assert all(isinstance(point, BenchPoint) and point.fwd_bwd_ms > 0 for point in result.records)


@pytest.mark.parametrize("path", sorted(RESULTS.glob("**/capacity-*.json")), ids=lambda p: p.name)
def test_every_committed_capacity_json_round_trips(path):
    data = json.loads(path.read_text())
    result = CapacityResult.from_json(data)
    assert result.to_json() == data
    assert all(r.largest_batch_size is None or r.at_largest["batch_size"] == r.largest_batch_size
               for r in result.results)


def test_committed_results_are_found():
    assert len(list(RESULTS.glob("**/bench-*.json"))) >= 10 and list(RESULTS.glob("**/capacity-*.json"))


def test_meta_from_record_meta_keeps_its_key_order(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["mpipemoe", "bench"])
    written = {**record_meta("bench", use_gpu=False), "device": "cpu", "world_size": 1}
    assert list(RecordMeta.from_json(written).to_json()) == list(written)


def test_a_point_lacking_a_field_names_it():
    with pytest.raises(ValueError, match="fwd_bwd_ms"):
        BenchPoint.from_json({"engine": "fastmoe"})


def test_unknown_top_level_keys_are_refused():
    with pytest.raises(ValueError, match="surprise"):
        CapacityResult.from_json({"meta": {"command": "c", "date": "d"}, "results": [], "surprise": 1})


@pytest.mark.parametrize("path", sorted(RESULTS.glob("**/bench-*.json")), ids=lambda p: p.name)
def test_bench_markdown_is_the_same_from_the_typed_result(path):
    from app.bench.layer_summary import markdown_table  # torch: only this test needs it
    from tools.render_records import render

    data = json.loads(path.read_text())
    if "records" in data:  # summaries derived with today's yardsticks, as tools/render_records.py does
        data = {**data, "summaries": json.loads(json.dumps(render(path, derived_only=True)))}
    assert markdown_table(BenchResult.from_json(data)) == markdown_table(data)  # early files too


def test_git_commit_is_the_code_that_ran_even_in_a_copy_without_git(tmp_path, monkeypatch):
    """The package's own tree, not the working directory's; a copy without .git reads the
    commit stamped before it was made (tools/stamp-commit.sh), +dirty included."""
    import shutil
    import subprocess

    from app.tracking.records import COMMIT_STAMP, git_commit, source_commit, write_commit_stamp

    checkout = tmp_path / "checkout"
    (checkout / "app").mkdir(parents=True)
    (checkout / "app" / "code.py").write_text("x = 1\n")
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(checkout)], check=True)
    subprocess.run([*git, "add", "app/code.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    elsewhere = tmp_path / "elsewhere"  # the working directory: another checkout, another commit
    subprocess.run(["git", "init", "-q", str(elsewhere)], check=True)
    monkeypatch.chdir(elsewhere)
    assert git_commit(checkout) == head[:7]
    (checkout / "app" / "code.py").write_text("x = 2\n")
    assert git_commit(checkout) == head[:7] + "+dirty"
    assert write_commit_stamp(checkout) == head + "+dirty"
    copy = tmp_path / "copy"  # what the GPU machine gets: the tree and the stamp, no .git
    shutil.copytree(checkout, copy, ignore=shutil.ignore_patterns(".git"))
    assert source_commit(copy).commit == head and git_commit(copy) == head[:7] + "+dirty"
    (copy / COMMIT_STAMP).unlink()
    assert git_commit(copy) == "?"  # neither git nor a stamp: nothing is made up
    (copy / COMMIT_STAMP).write_text("not a commit\n")
    assert git_commit(copy) == "?"
    with pytest.raises(ValueError, match="not the top of a git checkout"):
        write_commit_stamp(copy)


def test_the_commit_stamp_is_ignored_by_git_and_written_by_the_tool():
    from app.tracking.records import CHECKOUT, COMMIT_STAMP

    import subprocess
    assert subprocess.run(["git", "-C", str(CHECKOUT), "check-ignore", "-q", COMMIT_STAMP]).returncode == 0
    assert COMMIT_STAMP in (CHECKOUT / "tools" / "stamp-commit.sh").read_text()
