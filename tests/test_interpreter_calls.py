"""``ops.interpreter_calls``: a helper called from an interpreted kernel no longer re-patches the
language on every call, and still computes the same."""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available() and os.environ.get("TRITONCHECK_BACKEND", "auto") != "interpreter":
    pytest.skip(
        "ops.interpreter_calls patches the Triton interpreter only; this run uses the CUDA backend",
        allow_module_level=True,
    )
os.environ["TRITON_INTERPRET"] = "1"  # before any @triton.jit below

import triton
import triton.language as tl
from triton.runtime import interpreter

from ops import interpreter_calls

interpreter_calls.install()


@triton.jit
def _add_one(x):
    return x + 1.0


@triton.jit
def _add_n_kernel(x_ptr, out_ptr, CALLS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    for _ in tl.static_range(CALLS):
        x = _add_one(x)
    tl.store(out_ptr + offs, x)


def _builtin_patches(monkeypatch: pytest.MonkeyPatch, calls: int) -> int:
    """How many times the launch of ``_add_n_kernel`` (2 programs) patches a language module."""
    count = 0
    patch_builtin = interpreter._patch_builtin

    def counting(*args: object) -> None:
        nonlocal count
        count += 1
        patch_builtin(*args)

    monkeypatch.setattr(interpreter, "_patch_builtin", counting)
    x = torch.arange(32, dtype=torch.float32)
    out = torch.empty_like(x)
    _add_n_kernel[(2,)](x, out, CALLS=calls, BLOCK=16)
    assert torch.equal(out, x + calls)
    return count


def test_helper_calls_inside_a_launch_do_not_patch_again(monkeypatch: pytest.MonkeyPatch) -> None:
    once = _builtin_patches(monkeypatch, 1)
    assert once > 0
    # stock 3.6 patches the language again on each of the 16 helper calls: 68 against 12 for 1 call
    assert _builtin_patches(monkeypatch, 8) == once


def test_a_helper_reaching_another_language_module_is_still_patched(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only modules the launch patched are skipped: a helper whose globals hold ``tl.core`` itself
    (a module that did ``from triton.language import core``) gets it patched."""

    def helper() -> None: ...

    monkeypatch.setattr(interpreter_calls._Launch, "patched", frozenset({id(tl)}))
    monkeypatch.setitem(helper.__globals__, "_core_for_this_test", tl.core)
    scope = interpreter._patch_lang(helper)
    try:
        assert scope._changes, "tl.core was not patched"
        assert interpreter_calls._Launch.patched == {id(tl), id(tl.core)}
    finally:
        scope.restore()


def test_install_is_idempotent() -> None:
    patch_lang, call = interpreter._patch_lang, interpreter.GridExecutor.__call__
    interpreter_calls.install()
    assert (interpreter._patch_lang, interpreter.GridExecutor.__call__) == (patch_lang, call)
