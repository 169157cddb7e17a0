"""``mpipemoe train --config FILE.toml`` (tier 1: no Ray): the file's options, flags over them,
and the refusals that name the key and the fix."""
from __future__ import annotations

import argparse

import pytest

from app.commands.train import add_arguments, job_from_args
from app.jobs.train_config import config_keys, read_train_config


def _job(tmp_path, text: str, *flags: str):
    path = tmp_path / "run.toml"
    path.write_text(text)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return job_from_args(parser.parse_args(["--config", str(path), "--storage-path", str(tmp_path), *flags]))


def test_a_config_file_sets_the_job_and_flags_override_it(tmp_path):
    text = 'preset = "tiny-gpt"\nsteps = 200\nlr-schedule = "wsd"\ndecay_fraction = 0.3\ntop-k = 1\nuse-gpu = false\n'
    job = _job(tmp_path, text, "--steps", "300")
    assert (job.steps, job.lr_schedule, job.decay_fraction, job.top_k, job.use_gpu) == (300, "wsd", 0.3, 1, False)
    assert _job(tmp_path, text).steps == 200


@pytest.mark.parametrize("text, words", [
    ("stepz = 3\n", "unknown key 'stepz': use the options of `mpipemoe train`: preset, engine, steps,"),
    ("[model]\nnum-experts = 8\n", "unknown key 'model'"),  # flat keys: no tables
    ("steps = [1, 2]\n", "steps = [1, 2] is invalid: give one value"),
    ("steps = \n", "not valid TOML"),
])
def test_a_bad_config_file_is_refused_naming_the_key_and_the_fix(tmp_path, text, words):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"^--config .*bad\.toml: ") as error:
        read_train_config(path)
    assert words in str(error.value)


def test_config_values_are_checked_like_flags_and_a_missing_file_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"TrainJob\.steps=0 is invalid: give an integer >= 1"):
        _job(tmp_path, "steps = 0\n")
    with pytest.raises(ValueError, match=r"--config .*nowhere\.toml: cannot read it .*give an existing TOML file"):
        read_train_config(tmp_path / "nowhere.toml")
    assert "parent-run-id" not in config_keys() and "decay-fraction" in config_keys()


def test_the_documented_config_file_makes_the_documented_job(tmp_path):
    """docs/training.md §4: its ``toml`` block, then ``--config run.toml --steps 300``."""
    import re
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "training.md").read_text()
    (text,) = re.findall(r"```toml\n# run\.toml\n(.*?)```", doc, flags=re.S)
    assert "mpipemoe train --config run.toml --steps 300" in doc
    job = _job(tmp_path, text, "--steps", "300")
    assert (job.steps, job.lr_schedule, job.decay_fraction, job.top_k, job.eval_every) == (300, "wsd", 0.3, 1, 50)


def test_config_given_twice_is_refused_naming_both_files(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit) as stop:
        parser.parse_args(["--config", "bad.toml", "--config", "good.toml"])
    assert stop.value.code == 2
    assert "--config given twice (bad.toml and good.toml): give one file" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["cfg.yaml", "cfg.yml", "cfg.json"])
def test_a_config_in_another_format_is_answered_with_what_train_reads(tmp_path, name):
    path = tmp_path / name
    path.write_text("steps: 3\n")
    with pytest.raises(ValueError, match=rf"^--config .*{name}: train reads TOML files only \(one `option = value` "
                                         rf"line per option of `mpipemoe train`, e.g. steps = 200\): write the "
                                         rf"options as FILE.toml$"):
        read_train_config(path)


def test_the_resume_owned_data_shards_key_is_refused_in_a_config_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("data-shards = 3\n")
    with pytest.raises(ValueError, match=r"data-shards is set by a resume from the recorded run, not by a file: "
                                         r"drop it"):
        read_train_config(path)
    assert "data-shards" not in config_keys()
