"""One way to turn a low-level OSError (a full disk, a quota, a read-only folder) into the
one line a user acts on: what could not be done, why (the system's words), and the fix."""
from __future__ import annotations

import os


def os_error(error: OSError, what: str, fix: str) -> OSError:
    """``OSError("<what> (<why>): <fix>")`` keeping ``error``'s errno (raise it ``from error``)."""
    why = os.strerror(error.errno) if error.errno else (str(error).splitlines() or [type(error).__name__])[0]
    wrapped = OSError(f"{what} ({why}): {fix}")
    wrapped.errno = error.errno
    return wrapped
