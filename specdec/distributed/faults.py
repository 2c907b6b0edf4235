"""How tensor-parallel ranks fail: one error type, one bound on every wait, one-line messages."""

from __future__ import annotations

import os

from specdec.errors import ExecutorError

TIMEOUT_S = float(os.environ.get("SPECDEC_TP_TIMEOUT", "120"))  # every wait between ranks


class TPError(ExecutorError):
    """A tensor-parallel rank died, raised or stopped answering."""


def first_line(e: BaseException) -> str:
    """The first line of ``e``, without gloo's ``[source.cc:123]`` prefix, at most 200 chars."""
    line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    if line.startswith("[") and "] " in line:
        line = line.partition("] ")[2]
    return line[:200]
