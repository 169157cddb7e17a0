"""How a message to the user reads, in every layer: a low-level OSError (a full disk, a
quota, a read-only folder) turned into the one line a user acts on (what could not be done,
why in the system's words, and the fix), and the ``mpipemoe`` command as the user can type
it again, for the fixes and hints that name one (``lm.data``'s "prepare the data again with
`mpipemoe data prepare ...`" as much as the commands' own)."""
from __future__ import annotations

import os
import shutil
import sys


def os_error(error: OSError, what: str, fix: str) -> OSError:
    """``OSError("<what> (<why>): <fix>")`` keeping ``error``'s errno (raise it ``from error``)."""
    why = os.strerror(error.errno) if error.errno else (str(error).splitlines() or [type(error).__name__])[0]
    wrapped = OSError(f"{what} ({why}): {fix}")
    wrapped.errno = error.errno
    return wrapped


def _as_typed(path: str) -> str:
    """``path`` relative to the current directory when it lies below it, else absolute."""
    absolute = os.path.abspath(path)
    relative = os.path.relpath(absolute)
    return relative if not relative.startswith("..") else absolute


def invocation() -> str:
    """The ``mpipemoe`` command as the user can type it in this shell: ``mpipemoe`` when
    that name on PATH is the program running, else the path it was started by
    (``.venv/bin/mpipemoe``), or ``.venv/bin/python -m app.cli`` when started that way.
    Called from Python (tests, notebooks), plain ``mpipemoe``."""
    started_by = sys.argv[0] if sys.argv else ""
    if os.path.basename(started_by) == "mpipemoe":
        on_path = shutil.which("mpipemoe")
        if on_path and os.path.realpath(on_path) == os.path.realpath(started_by):
            return "mpipemoe"
        return _as_typed(started_by)
    if started_by.endswith(os.path.join("app", "cli.py")):
        return f"{_as_typed(sys.executable)} -m app.cli"
    return "mpipemoe"
