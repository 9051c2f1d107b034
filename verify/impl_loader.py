"""Load an outside implementation given as ``module:fn`` or ``path/to/file.py:fn`` (or a module whose
functions are named after the ops they implement)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import sysconfig
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType


class ImplError(Exception):
    """The implementation could not be loaded or does not fit the op's signature."""


def load(
    spec: str, option: str = "--impl", default_fn: str | None = None, timeout: float | None = None
) -> Callable:
    """The function ``spec`` names; errors name ``option``, the argument that gave it. Given
    ``default_fn`` (an op's name), a bare ``MODULE`` or ``FILE.py`` names its function of that name.
    ``timeout``: see :func:`load_module`."""
    target, sep, fn_name = spec.rpartition(":")
    if not sep and default_fn and spec:
        target, fn_name = spec, default_fn
    if not target or not fn_name:
        form = "MODULE[:FN] or FILE.py[:FN]" if default_fn else "MODULE:FN or FILE.py:FN"
        raise ImplError(f"{option}: {spec!r} is not {form}")
    fn = getattr(load_module(target, option, timeout), fn_name, None)
    if not callable(fn):
        raise ImplError(f"{option}: {target} has no callable {fn_name!r}")
    return fn


def load_module(target: str, option: str = "--impl", timeout: float | None = None) -> ModuleType:
    """The module ``target`` names, ``MODULE`` or ``FILE.py``, imported with ``os._exit`` refused.
    An import running past ``timeout`` seconds (None: no limit) ends the process with 2: it could
    not be loaded, as one that raises."""
    from verify.watchdog import Watchdog

    def hung(subject: str, seconds: float) -> None:
        from verify.cli import prog

        print(
            f"{prog()}: {option}: importing {subject} did not finish in {seconds:g} s (--timeout)",
            file=sys.stderr,
        )

    try:
        with Watchdog(timeout, hung, status=2).watching(target):
            if target.endswith(".py"):
                path = Path(target).resolve()
                if not path.is_file():
                    raise ImplError(f"{option}: no file {path}")
                return _exec_file(path)
            return importlib.import_module(target)
    except (ImplError, KeyboardInterrupt):
        raise
    except BaseException as exc:  # sys.exit() or os._exit() at import must not end the CLI with its code
        message = f"importing {target} failed: {type(exc).__name__}: {exception_text(exc)}"
        raise ImplError(f"{option}: {message}") from exc


# modules an implementation file imported from its own directory: name -> that directory
_imported_beside: dict[str, str] = {}
_LIBRARIES = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")})
# one copy of these serves every implementation: Python's libraries and this project
_SHARED = tuple(Path(p) for p in (*_LIBRARIES, Path(__file__).resolve().parent.parent))


def _exec_file(path: Path):
    """The module ``path`` holds, run with its directory first on ``sys.path`` as ``python
    path`` would run it, so it imports the modules beside it; taken off again afterwards, so
    later imports (another file's) do not search it. Modules another implementation imported
    from its own directory are dropped from ``sys.modules`` first (their importer keeps them),
    so two files with a ``helpers.py`` beside each (``verify.bisect --inject`` twice) each
    get their own, not the one loaded first."""
    module_name = f"_impl_{path.stem}_{abs(hash(path)) % 10**8}"
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(loader_spec)
    directory = str(path.parent)
    for name, other in list(_imported_beside.items()):
        if other != directory:
            sys.modules.pop(name, None)
            del _imported_beside[name]
    before = set(sys.modules)
    sys.modules[module_name] = module
    sys.path.insert(0, directory)
    try:
        loader_spec.loader.exec_module(module)
    finally:
        if directory in sys.path:  # unless the module took it off itself
            sys.path.remove(directory)
        for name in set(sys.modules) - before - {module_name}:
            origin = Path(getattr(sys.modules[name], "__file__", None) or "/")
            if origin.parent == path.parent and not any(origin.is_relative_to(p) for p in _SHARED):
                _imported_beside[name] = directory
    return module


def check_signature(fn: Callable, reference: Callable, op: str, option: str = "--impl") -> None:
    """The outside function must take the op's positional arguments (extra ones, keyword-only
    ones too, need defaults).

    Its own names for them are its business, but a contract name at another position is an
    argument order that would be judged as a divergence: refused as bad usage instead.
    """
    want = [p.name for p in inspect.signature(reference).parameters.values() if p.kind != p.KEYWORD_ONLY]
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return  # builtins without a signature: let the call decide
    name = getattr(fn, "__name__", None) or f"a {type(fn).__name__} object"  # functools.partial has none
    keyword_only = [p.name for p in params if p.kind == p.KEYWORD_ONLY and p.default is p.empty]
    if keyword_only:  # the op's arguments come by position; its keywords (out=, ...) only at times
        raise ImplError(
            f"{option}: {name} requires the keyword-only argument {keyword_only[0]!r}, which "
            f"{op} is not called with (its signature: {', '.join(want)}): give it a default"
        )
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if len(positional) < len(want) or len(required) > len(want):
        got = ", ".join(p.name for p in positional)
        raise ImplError(f"{option}: {name}({got}) does not match the {op} signature ({', '.join(want)})")
    for i, p in enumerate(positional[: len(want)]):
        if p.name in want and want.index(p.name) != i:
            got = ", ".join(p.name for p in positional)
            raise ImplError(
                f"{option}: {name}({got}) takes {p.name!r} at position {i}; the {op} signature "
                f"({', '.join(want)}) has it at {want.index(p.name)}"
            )


# frames of Python's libraries and of this tool itself (its checks, its interpreter layers): not
# where an implementation went wrong
_NOT_USER_CODE = (
    *_LIBRARIES,
    str(Path(__file__).parent),
    str(Path(__file__).parent.parent / "ops" / "interpreter_"),
)


TEXT_LIMIT = 2000  # characters of an exception's message a report repeats


def exception_text(exc: BaseException) -> str:
    """An exception's message for a report: one whose ``__str__`` raises is named so, not a second
    traceback; a huge one is cut."""
    try:
        text = str(exc)
    except Exception as inner:
        return f"<its message could not be made: {type(inner).__name__}>"
    return text if len(text) <= TEXT_LIMIT else text[:TEXT_LIMIT] + f" ... ({len(text)} characters)"


def failure_site(exc: BaseException) -> str:
    """Where an implementation failed, as traceback lines: its own deepest frame (outside Python's
    libraries and this tool, so its line shows however deep the libraries it called went), the
    frame that raised, and the exception. A kernel that raised under the Triton interpreter (an
    ``InterpreterError`` wrapping it) is shown by the exception it raised, from inside the kernel."""
    if type(exc).__name__ == "InterpreterError" and exc.__cause__ is not None:
        exc = exc.__cause__
    frames = traceback.extract_tb(exc.__traceback__)
    mode = next((i for i, f in enumerate(frames) if f.name == "__torch_dispatch__"), None)
    if mode is not None:  # a torch op raised inside the check's poisoning mode: the site is its caller
        import torch  # loaded already: the mode is torch's

        frames = frames[:mode]
        torch_dir = Path(torch.__file__).parent
        while len(frames) > 1 and Path(frames[-1].filename).is_relative_to(torch_dir):
            frames = frames[:-1]
    own = [f for f in frames if not f.filename.startswith(_NOT_USER_CODE)]
    shown = ([own[-1]] if own and own[-1] is not frames[-1] else []) + frames[-1:]
    here = Path.cwd()
    for frame in shown:  # paths under the working directory as the user typed them
        if Path(frame.filename).is_relative_to(here):
            frame.filename = str(Path(frame.filename).relative_to(here))
    return "".join(traceback.format_list(shown) + traceback.format_exception_only(exc))
