"""Pick where kernels run: compiled Triton on CUDA, or the Triton interpreter on CPU.

The choice must be made before any kernel is decorated with ``@triton.jit`` (the interpreter
is chosen at decoration time), so ``ops/__init__.py`` calls :func:`configure` first thing.
Force a backend with ``TRITONCHECK_BACKEND=cuda|interpreter`` (``auto`` is the default).
"""

from __future__ import annotations

import os

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


def configure() -> str:
    """Select the backend once per process and prepare Triton for it."""
    global _selected
    if _selected is None:
        _selected = _resolve(os.environ.get(ENV_VAR, "auto"))
        if _selected == "interpreter":
            os.environ["TRITON_INTERPRET"] = "1"
            from ops import interpreter_calls, interpreter_compat

            interpreter_compat.install()  # checks the Triton release both patch
            interpreter_calls.install()
        elif os.environ.get("TRITON_INTERPRET") == "1":
            raise RuntimeError("TRITON_INTERPRET=1 is set but the cuda backend was selected")
    return _selected


def name() -> str:
    return configure()


def device() -> torch.device:
    """The device tensors must live on for the selected backend."""
    return torch.device("cuda" if configure() == "cuda" else "cpu")


def is_interpreter() -> bool:
    return configure() == "interpreter"
