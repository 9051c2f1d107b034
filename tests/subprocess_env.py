"""The environment the CLI tests start their commands in: a user's shell's, not pytest's."""

from __future__ import annotations

import os


def user_env() -> dict[str, str]:
    """``os.environ`` without ``TRITON_INTERPRET``. The suite's own process sets it (``ops.backend``,
    the interpreter tests), and a command inheriting it would hide what only a fresh shell shows:
    triton imported before ``ops`` chose the interpreter (``ops.backend``)."""
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
