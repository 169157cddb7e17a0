"""What every result file carries besides its numbers: the command that made it, when,
on what hardware, with which code (docs/design.md §7: benchmark results are data). How the
user ran the command, for hints they can type again, is ``lm.errors.invocation``.
torch is imported only where the hardware is named: `mpipemoe simulate` and `report`
read this module without loading it (about a second).
"""
from __future__ import annotations

import platform
import subprocess
import sys
import time

# Where commands write generated records unless told otherwise (`--out`): a folder that
# .gitignore ignores, never the committed results/.
DEFAULT_OUT_DIR = "out"


def command_line(subcommand: str) -> str:
    """The command as a user would retype it: ``mpipemoe <subcommand> <args>``."""
    if sys.argv[1:2] == [subcommand]:
        return " ".join(["mpipemoe", *sys.argv[1:]])
    return " ".join(sys.argv)


def utc_timestamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def hardware_name(use_gpu: bool) -> str:
    """``NVIDIA H200 (140 GiB)`` for GPU 0, or ``cpu (<processor>)``."""
    import torch

    if use_gpu and torch.cuda.is_available():
        memory_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
        return f"{torch.cuda.get_device_name(0)} ({memory_gib:.0f} GiB)"
    return f"cpu ({platform.processor() or platform.machine()})"


def git_commit() -> str:
    """The short commit of the working directory, or ``?`` outside a git checkout."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=5).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def record_meta(subcommand: str, use_gpu: bool) -> dict:
    """command, date, hardware, git commit, torch and Python versions."""
    import torch

    return {"command": command_line(subcommand), "date": utc_timestamp(), "hardware": hardware_name(use_gpu),
            "git_commit": git_commit(), "torch": torch.__version__, "python": platform.python_version()}
