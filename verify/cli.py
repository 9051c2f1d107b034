"""What every CLI shares: the usage error (exit 2), and output paths checked before the run,
so a typo in ``--json`` is reported at once rather than as a crash after minutes of work."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


class UsageError(Exception):
    """Bad command-line input: the CLIs print it and exit 2."""


def bad_environment(prog: str) -> bool:
    """True, after saying so on stderr, when ``TRITONCHECK_BACKEND`` is bad. Importing ``ops``
    selects the backend from it, so each CLI calls this first, to report a bad setting as bad
    usage (exit 2), not as a traceback with exit 1, the code for a divergence."""
    try:
        import ops  # noqa: F401
    except (ValueError, RuntimeError) as exc:  # an unknown choice; cuda without a device
        print(f"{prog}: {exc}", file=sys.stderr)
        return True
    return False


EPILOG = (
    "Exit status: 0 verified, 1 a divergence found (or the implementation under test raised), "
    "2 bad usage or input. TRITONCHECK_BACKEND=auto|cuda|interpreter picks where kernels run "
    "(auto: cuda when torch sees a GPU)."
)


def exit_with(main: Callable[[], int]) -> None:
    """Run a CLI's ``main`` and exit with its status; Ctrl-C (an implementation that hangs, say)
    ends it with the shell's 130 and one line, not a traceback from wherever it was."""
    try:
        status = main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        status = 130
    sys.exit(status)


def counted(n: int, noun: str) -> str:
    """``1 case``, ``2 cases``: a count with its noun in the right number."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def positive_int(text: str) -> int:
    """An argparse ``type`` for counts: a whole number >= 1 (argparse names the option)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1, got {value}")
    return value


def seconds_or_none(text: str) -> float | None:
    """An argparse ``type`` for a time limit: seconds > 0, or 0 for none (None)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0 (0: no limit), got {text}")
    return value or None


def add_timeout_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """``--timeout``: ``what`` (a case, a call of an injected op) running longer is a hang, which
    the run reports (exit 1) instead of hanging with it (``verify.watchdog``)."""
    from verify.watchdog import DEFAULT_S

    parser.add_argument(
        "--timeout",
        type=seconds_or_none,
        default=DEFAULT_S,
        metavar="SECONDS",
        help=f"{what} taking longer is a hang: report it, exit 1 (default {DEFAULT_S:g}; 0: no limit)",
    )


def check_output_file(option: str, path: str | None) -> None:
    """``path`` (if given) can be written: its directory exists, it is not a directory itself, and
    opening it for writing works (tried in append mode; a file made by the try is removed)."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"{option} {path}: is a directory, expected a file path")
    if not target.parent.is_dir():
        raise UsageError(f"{option} {path}: no directory {target.parent}")
    existed = target.exists()
    try:
        with open(target, "a"):
            pass
    except OSError as exc:
        raise UsageError(f"{option} {path}: cannot be written ({exc.strerror or exc})") from None
    if not existed:
        target.unlink(missing_ok=True)


def require_output_file(parser: argparse.ArgumentParser, option: str, path: str | None) -> None:
    """:func:`check_output_file` for a plain argparse CLI: a bad path is ``parser.error`` (exit 2)."""
    try:
        check_output_file(option, path)
    except UsageError as error:
        parser.error(str(error))


def check_output_dir(option: str, path: str | None) -> None:
    """``path`` (if given) is a directory or can be made one: nothing but a directory is in its way,
    and the nearest existing one takes a new directory."""
    if path is None:
        return
    for part in (Path(path), *Path(path).parents):
        if part.exists():
            if not part.is_dir():
                raise UsageError(f"{option} {path}: {part} exists and is not a directory")
            try:  # what the run will do there, tried now: make a directory in it
                os.rmdir(tempfile.mkdtemp(dir=part))
            except OSError as exc:
                raise UsageError(
                    f"{option} {path}: cannot make a directory in {part} ({exc.strerror})"
                ) from None
            return


def write_json(path: str | None, data: Any) -> None:
    """``data`` as strict JSON: NaN and infinities (an implementation's wrong values) as strings,
    which jq and JavaScript read, where bare ``NaN`` is not JSON."""
    if path:
        with open(path, "w") as f:
            json.dump(_finite(data), f, indent=2, default=str, allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan", "inf", "-inf"
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
