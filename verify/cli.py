"""What every CLI shares: the usage error (exit 2), and output paths checked before the run,
so a typo in ``--json`` is reported at once rather than as a crash after minutes of work."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

end_process = os._exit  # the real one, kept: while an implementation runs os._exit raises (verify.watchdog)


class UsageError(Exception):
    """Bad command-line input: the CLIs print it and exit 2."""


def bad_environment(prog: str) -> bool:
    """True, after saying so on stderr, when ``TRITONCHECK_BACKEND`` is bad. Importing ``ops``
    selects the backend from it: a bad setting is bad usage (exit 2), not a traceback with exit 1,
    the code for a divergence."""
    try:
        import ops  # noqa: F401
    except (ValueError, RuntimeError) as exc:  # an unknown choice; cuda without a device
        print(f"{prog}: {exc}", file=sys.stderr)
        return True
    return False


def parse_args(
    prog: str, parser: Callable[[], argparse.ArgumentParser], argv: list[str] | None
) -> argparse.Namespace | None:
    """``argv`` parsed by the parser ``parser()`` builds, or None after saying that
    ``TRITONCHECK_BACKEND`` is bad (exit 2). The setting is checked after parsing, so that
    ``--help`` and argparse's own errors answer whatever it says: building a parser imports no
    ``ops`` (the argument helpers below live here for that)."""
    args = parser().parse_args(argv)
    return None if bad_environment(prog) else args


EPILOG = (
    "Exit status: 0 verified, 1 a divergence found (or the implementation under test raised), "
    "2 bad usage or input. TRITONCHECK_BACKEND=auto|cuda|interpreter picks where kernels run "
    "(auto: cuda when torch sees a GPU)."
)


class _ReaderMayLeave:
    """``sys.stdout`` whose reader may stop reading (``| head -1``, ``| grep -q VERIFIED``): what
    is written after that goes to /dev/null, so the run still ends with its own verdict, not a
    ``BrokenPipeError`` traceback and status 1, the code for a divergence."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def _gone(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())  # what is still buffered drains there too
        os.close(devnull)

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._gone()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._gone()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def exit_with(main: Callable[[], int]) -> None:
    """Run a CLI's ``main`` and exit with its status; Ctrl-C (an implementation that hangs, say)
    ends it with the shell's 130 and one line, not a traceback from wherever it was, and a
    :class:`UsageError` raised late (a ``--json`` that cannot be written after all) with 2. A
    reader of stdout that leaves early does not change the status."""
    sys.stdout = _ReaderMayLeave(sys.stdout)
    try:
        status = main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        status = 130
    except UsageError as exc:
        print(f"{prog(main.__module__)}: {exc}", file=sys.stderr)
        status = 2
    sys.exit(status)


def prog(module: str = "__main__") -> str:
    """The CLI's name as ``python -m`` ran ``module`` (``verify.op``; ``verify.bench`` for its
    ``__main__``)."""
    spec = getattr(sys.modules.get(module), "__spec__", None)
    return spec.name.removesuffix(".__main__") if spec is not None else module


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
    """An argparse ``type`` for a time limit: seconds > 0, or 0 for none (None). Past
    ``threading.TIMEOUT_MAX`` (292 years on Linux) the watchdog's timer cannot be set: refused, not
    left to die on its thread and watch nothing."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0 (0: no limit), got {text}")
    if value > threading.TIMEOUT_MAX:
        raise argparse.ArgumentTypeError(
            f"expected at most {threading.TIMEOUT_MAX:.0f} seconds (0: no limit), got {text}"
        )
    return value or None


DEFAULT_S = 300.0  # far past any one call's time, JIT compiles and the interpreter included


def add_timeout_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """``--timeout``: ``what`` (a case, a call of an injected op) running longer is a hang, which
    the run reports (exit 1) instead of hanging with it (``verify.watchdog``)."""
    parser.add_argument(
        "--timeout",
        type=seconds_or_none,
        default=DEFAULT_S,
        metavar="SECONDS",
        help=f"{what} taking longer is a hang: report it, exit 1; an implementation's import taking longer "
        f"exits 2 (default {DEFAULT_S:g}; 0: no limit; at most {threading.TIMEOUT_MAX:.0f})",
    )


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``--inject`` and their ``--timeout``, as every model-level CLI takes them."""
    parser.add_argument(
        "--model",
        metavar="DIR|PRESET",
        help="checkpoint directory or preset name (default: the embedded tiny model)",
    )
    parser.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="OP=IMPL@LAYERS",
        help="swap one op's implementation in layers of the Triton model (repeatable): OP is a registered "
        "op, IMPL is MODULE:FN or FILE.py:FN (a bare MODULE or FILE.py: its function named OP), LAYERS "
        "a layer number, a comma list (0,3) or 'all'",
    )
    add_timeout_argument(parser, "a call of an injected op")


def add_shape_arguments(parser: argparse.ArgumentParser, presets: list[str], default: str) -> None:
    """``--preset`` or ``--config``: the model shape a benchmark times, on random weights."""
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--preset", default=default, choices=presets, help=f"shape (default {default})")
    shape.add_argument(
        "--config",
        metavar="PATH",
        help="a model's config.json, or its checkpoint directory: that shape instead of a preset "
        "(its weights are not read)",
    )


def shape_config(parser: argparse.ArgumentParser, path: str) -> Any:
    """The ``ModelConfig`` that ``--config`` names; a usage error (exit 2) where it does not parse."""
    from model import config as model_config

    try:
        return model_config.load(path)
    except model_config.ConfigError as exc:
        parser.error(f"--config: {exc}")


def add_cache_argument(parser: argparse.ArgumentParser) -> None:
    """``--cache-len``: the KV cache a server would allocate, not just the run's length. The
    decode kernels pick their splits by capacity and share the valid rows out among them, so
    a mostly empty cache takes paths a cache sized to the run never does."""
    parser.add_argument(
        "--cache-len",
        type=positive_int,
        metavar="ROWS",
        help="KV cache capacity (default: just what the run needs), up to max_position_embeddings",
    )


def parse_ids(text: str) -> list[int]:
    """``--prompt-ids``: comma-separated token ids."""
    parts = text.split(",") if text.strip() else []  # "1,,2": an error, not [1, 2]
    if not all(re.fullmatch(r"\s*-?[0-9]+\s*", t) for t in parts):  # int() takes "1_0" and full-width digits
        raise UsageError(f"--prompt-ids {text!r}: expected comma-separated integers")
    return [int(t) for t in parts]


def checked_ids(option: str, ids: list[int], vocab: int) -> list[int]:
    """``ids`` once each is a token of the vocabulary, checked as Python ints: a huge one would
    overflow the tensor before any later check could name the option."""
    if not ids:
        raise UsageError(f"{option}: the prompt is empty")
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise UsageError(f"{option}: token id {bad} is outside the vocabulary [0, {vocab})")
    return ids


def check_output_file(option: str, path: str | None, reads: Iterable[tuple[str, str | None]] = ()) -> None:
    """``path`` (if given) can be written: its directory exists, it is not a directory itself, and
    opening it for writing works (tried in append mode; a file made by the try is removed). An
    earlier run's file there is emptied: a run that ends before writing its own (killed, or a hang
    ended by the watchdog's backstop) must not leave that one to be read as this run's. ``reads``
    are the run's other paths, ``(option, path)``: files it reads or writes, and directories it
    reads (a checkpoint), whose files the output must not be, checked before anything is emptied."""
    if path is None:
        return
    if not path:
        raise UsageError(f"{option}: the path is empty, expected a file path")
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"{option} {path}: is a directory, expected a file path")
    if path.endswith(("/", os.sep)):  # Path drops the slash; open() would not
        raise UsageError(f"{option} {path}: ends with {path[-1]!r}, expected a file path")
    if not target.parent.is_dir():
        raise UsageError(f"{option} {path}: no directory {target.parent}")
    existed = target.exists()
    for other_option, other in reads:
        clash = _clash(target, existed, other_option, other) if other else None
        if clash:
            raise UsageError(f"{option} {path}: {clash}")
    try:
        with open(target, "a"):
            pass
    except OSError as exc:
        raise UsageError(f"{option} {path}: cannot be written ({exc.strerror or exc})") from None
    if not existed:
        target.unlink(missing_ok=True)
    elif target.is_file():  # not a device or a pipe (--json /dev/stdout)
        os.truncate(target, 0)


def _clash(target: Path, existed: bool, option: str, other: str) -> str | None:
    """How writing ``target`` would clobber the run's path ``other``: it is that file (a link to it
    included), or an existing file in that directory. None when it would not."""
    path = Path(other)
    if path.is_dir():
        inside = existed and target.resolve().is_relative_to(path.resolve())
        return f"is a file of {option} {other}, which this run reads" if inside else None
    same = target.resolve() == path.resolve()
    same = same or (existed and path.exists() and os.path.samefile(target, path))  # a hard link
    return f"is the same file as {option} {other}" if same else None


def impl_file(spec: str | None) -> str | None:
    """The FILE.py an implementation ``spec`` (``FILE.py[:FN]``, ``OP=FILE.py[:FN]@LAYERS``) names,
    or None for a module or no spec."""
    if not spec:
        return None
    impl = spec.partition("=")[2].rpartition("@")[0] if "=" in spec else spec
    target = impl.rpartition(":")[0] if ":" in impl else impl
    return target if target.endswith(".py") else None


def model_reads(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """What a model-level CLI reads (:func:`add_model_arguments`): the ``--model`` directory, or
    for the embedded default and a preset the cache their checkpoints are built in, and the
    ``--inject`` files; for :func:`check_output_file`."""
    from model.embedded import default_cache_dir

    if args.model and Path(args.model).is_dir():
        model = ("--model", args.model)
    else:  # a later check refuses a --model that is neither
        model = ("the checkpoint cache", str(default_cache_dir()))
    return [model] + [("--inject", impl_file(text)) for text in args.inject]


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
    if not path:
        raise UsageError(f"{option}: the path is empty, expected a directory path")
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
    which jq and JavaScript read, where bare ``NaN`` is not JSON. A write that fails even so (a full
    disk) is a :class:`UsageError` naming ``--json``: an output problem, not a divergence."""
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump(_finite(data), f, indent=2, default=str, allow_nan=False)
    except OSError as exc:
        raise UsageError(f"--json {path}: {exc.strerror or exc}") from None


def write_report_json(prog: str, path: str | None, data: Any) -> None:
    """:func:`write_json` for a report that may run on the watchdog's thread, which ends the
    process when the report returns, so an exception there would go unseen: a failed write is
    said there and exits 2. On the main thread it raises, as :func:`write_json` does."""
    try:
        write_json(path, data)
    except UsageError as exc:
        if threading.current_thread() is threading.main_thread():
            raise
        print(f"{prog}: {exc}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        end_process(2)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan", "inf", "-inf"
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
