"""The precision a reference computes in.

References are written once and run three ways: the normal reference (fp32 math on the
op's own, already rounded, inputs, result cast to the input dtype), the fp64 oracle (fp64
math, result left in fp64) and the plain low-precision baseline (math in the input dtype, as
naive torch would do it), which the ``max_error_ratio`` rule compares against.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

# Plain module state, not a ContextVar: torch.compile traces a global read as a guarded
# constant, so the compiled plain-bf16 peer of the benchmark traces the bf16 math.
_compute: torch.dtype | None = None
_keep_output = False


@contextlib.contextmanager
def computing_in(dtype: torch.dtype | None, *, keep_output_dtype: bool = False) -> Iterator[None]:
    """Run references with math in ``dtype`` (None: the default fp32)."""
    global _compute, _keep_output
    saved = _compute, _keep_output
    _compute, _keep_output = dtype, keep_output_dtype
    try:
        yield
    finally:
        _compute, _keep_output = saved


# The op's own dtype while the oracle runs on fp64 copies of its inputs (see ``rounded``).
_storage: torch.dtype | None = None


@contextlib.contextmanager
def oracle(storage: torch.dtype | None = None) -> Iterator[None]:
    """fp64 math, outputs left in fp64: the yardstick for ``max_error_ratio``.

    ``storage``: the dtype the op's inputs came in, for intermediates its definition rounds.
    """
    global _storage
    saved, _storage = _storage, storage
    try:
        with computing_in(torch.float64, keep_output_dtype=True):
            yield
    finally:
        _storage = saved


def compute_dtype() -> torch.dtype:
    return _compute or torch.float32


def acc(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the compute dtype (fp32 unless a context says otherwise)."""
    return x.to(compute_dtype())


def out(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast a result to the op's output dtype, except in the oracle, which keeps full precision."""
    return y if _keep_output else y.to(dtype)


def rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An intermediate that the op's definition rounds to ``dtype`` (a fused op reproducing the
    unfused pair): rounded in every mode, in the oracle to the op's storage dtype."""
    target = _storage if _keep_output and _storage is not None else dtype
    return t.to(target).to(t.dtype)


def ulp(dtype: torch.dtype, magnitude: float) -> float:
    """The spacing of ``dtype`` at ``magnitude``: one rounding step of the output."""
    info = torch.finfo(dtype)
    if magnitude <= info.tiny:
        return info.tiny * info.eps
    return 2.0 ** (torch.tensor(magnitude, dtype=torch.float64).log2().floor().item()) * info.eps
