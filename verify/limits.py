"""Size caps for generated cases, per backend: the interpreter is ~1e4x slower than the GPU."""

from __future__ import annotations

from dataclasses import dataclass

from ops import backend


@dataclass(frozen=True)
class Limits:
    """The largest size a strategy may draw along each axis."""

    rows: int  # leading rows of row-wise ops (M, B*S)
    width: int  # row width (hidden, intermediate)
    vocab: int  # vocabulary size for embedding and argmax
    seq: int  # new tokens S and cache capacity L
    batch: int
    heads: int
    gemm: int  # M, N and K of GEMMs


INTERPRETER = Limits(rows=6, width=1100, vocab=5000, seq=40, batch=3, heads=8, gemm=160)
CUDA = Limits(rows=300, width=8192, vocab=152064, seq=2100, batch=4, heads=32, gemm=5000)


def current() -> Limits:
    """The caps of the backend this process runs kernels on."""
    return CUDA if backend.name() == "cuda" else INTERPRETER
