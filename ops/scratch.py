"""Buffers a kernel needs besides its output (split-K partials, decode-split partials, a fused
op's composed intermediate), one per (owner, key), made on first use -- the warm-up before
any CUDA Graph capture -- and never freed, so a captured graph's pointers stay valid. Launches
on one stream run in order, so every call with the same key shares the buffer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_buffers: dict[tuple, Any] = {}


def cached(owner: str, key: tuple, make: Callable[[], T]) -> T:
    """The buffer ``make()`` built on the first call with this ``(owner, key)``."""
    full_key = (owner, *key)
    if full_key not in _buffers:
        _buffers[full_key] = make()
    return _buffers[full_key]


def held(owner: str | None = None) -> list[Any]:
    """The buffers ``owner`` (None: every owner) holds, oldest first (the check poisons them before a run)."""
    return [buffer for key, buffer in _buffers.items() if owner is None or key[0] == owner]
