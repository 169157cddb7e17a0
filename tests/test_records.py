"""Tier 1: the metadata every result file carries."""
import re
import sys

from app.records import command_line, record_meta


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
    assert re.fullmatch(r"[0-9a-f]{4,40}|\?", meta["git_commit"])
    assert meta["torch"] and meta["python"].count(".") == 2
