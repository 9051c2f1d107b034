"""Pick where kernels run: compiled Triton on CUDA, or the Triton interpreter on CPU.

The choice must be made before any kernel is decorated with ``@triton.jit`` (the interpreter
is chosen at decoration time), so ``ops/__init__.py`` calls :func:`configure` first thing.
Force a backend with ``TRITONCHECK_BACKEND=cuda|interpreter`` (``auto`` is the default).
"""

from __future__ import annotations

import os
import sys

import torch

ENV_VAR = "TRITONCHECK_BACKEND"
CHOICES = ("auto", "cuda", "interpreter")

_selected: str | None = None


def _resolve(requested: str) -> str:
    if requested not in CHOICES:
        raise ValueError(f"{ENV_VAR}={requested!r}: expected one of {', '.join(CHOICES)}")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "interpreter"
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"{ENV_VAR}=cuda but torch sees no CUDA device")
    return requested


def _check_language_interpreted() -> None:
    """``triton.language``'s own jitted helpers (``tl.sum``, ``tl.max``, ...) take the mode of
    the moment triton was first imported: imported before the interpreter was chosen, they stay
    compiled-mode functions and every kernel using them fails under the interpreter ("Cannot
    call @triton.jit'd outside of the scope of a kernel"). Say so, with the cure, instead."""
    language = sys.modules.get("triton.language")
    if language is None:
        return
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(language.sum, InterpretedFunction):
        raise RuntimeError(
            "triton was imported before the interpreter backend was chosen, so its library "
            "functions cannot run interpreted: import ops before anything that imports triton "
            "(torch.compile and torch._dynamo do), or set TRITON_INTERPRET=1 in the environment"
        )


def configure() -> str:
    """Select the backend once per process and prepare Triton for it."""
    global _selected
    if _selected is None:
        selected = _resolve(os.environ.get(ENV_VAR, "auto"))
        if selected == "interpreter":
            os.environ["TRITON_INTERPRET"] = "1"
            _check_language_interpreted()
            from ops import interpreter_calls, interpreter_compat, interpreter_memcheck

            interpreter_compat.install()  # checks the Triton release the patches wrap
            interpreter_calls.install()
            interpreter_memcheck.install()
        elif os.environ.get("TRITON_INTERPRET") == "1":
            raise RuntimeError("TRITON_INTERPRET=1 is set but the cuda backend was selected")
        _selected = selected
    return _selected


def name() -> str:
    return configure()


def device() -> torch.device:
    """The device tensors must live on for the selected backend."""
    return torch.device("cuda" if configure() == "cuda" else "cpu")


def is_interpreter() -> bool:
    return configure() == "interpreter"
