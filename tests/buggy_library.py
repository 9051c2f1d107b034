"""A user's op library, its functions named after the ops they implement (``verify.op --all --impl
tests/buggy_library.py``, ``--inject kv_cache_store=tests/buggy_library.py@1``): one right, two
wrong, and a helper that is no op."""

from __future__ import annotations

import torch

from references import elementwise
from tests.buggy_ops import kv_cache_store_next_row as kv_cache_store  # noqa: F401 (an op of the library)


def add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return elementwise.add(x, y)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The activation applied to the wrong half."""
    return elementwise.silu_mul(up, gate)


def rows(x: torch.Tensor) -> int:
    return x.shape[0]
