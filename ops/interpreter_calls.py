"""Stop Triton 3.6's interpreter from re-patching ``triton.language`` on every device-function call.

A launch patches ``tl``'s builtins to their interpreted versions once, runs every program, and
restores them. But each call of a ``@triton.jit`` helper from inside a kernel (``pdl.wait``,
``_gemv_chunk``, ``norm_rope_rows``, ...) patches them all again: ``inspect.getmembers`` over the
language modules, ~3 ms a call: skipping it took the embedded model's e2e run from 128 to 68 s. The
repeat changes nothing when the helper's modules are among those the launch already patched (every
module here imports only ``triton.language as tl``), so :func:`install` skips it then; a helper
reaching another language module is still patched as before. Compiled GPU kernels are unaffected.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import triton.language as tl
from triton.runtime import interpreter

__all__ = ["install"]

_MARKER = "_repatch_skip_installed"  # set on GridExecutor, so a reloaded module sees it too


class _Launch:
    """The language modules the running launch has patched (None outside a launch)."""

    patched: frozenset[int] | None = None


def _language_modules(fn: Callable) -> frozenset[int]:
    """The ids of the language modules ``_patch_lang`` patches for ``fn`` (as it finds them)."""
    return frozenset(
        id(value) for value in fn.__globals__.values() if inspect.ismodule(value) and value in (tl, tl.core)
    )


def _patch_lang_once(patch_lang: Callable[[Callable], Any]) -> Callable[[Callable], Any]:
    @functools.wraps(patch_lang)
    def wrapper(fn: Callable) -> Any:
        modules = _language_modules(fn)
        if _Launch.patched is not None and modules <= _Launch.patched:
            return interpreter._LangPatchScope()  # nothing to undo
        scope = patch_lang(fn)
        if _Launch.patched is not None:
            _Launch.patched |= modules
        return scope

    return wrapper


def _tracking_launch(call: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(call)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        outer, _Launch.patched = _Launch.patched, frozenset()  # the launch's own patch comes first
        try:
            call(self, *args, **kwargs)
        finally:
            _Launch.patched = outer

    return wrapper


def install() -> None:
    """Wrap the interpreter's lang patching and launches. Idempotent."""
    if getattr(interpreter.GridExecutor, _MARKER, False):
        return
    interpreter._patch_lang = _patch_lang_once(interpreter._patch_lang)
    interpreter.GridExecutor.__call__ = _tracking_launch(interpreter.GridExecutor.__call__)
    setattr(interpreter.GridExecutor, _MARKER, True)
