"""Whether an implementation's returned outputs are new memory, as the op contract says.

An output that overlaps an input, another output, or a buffer the implementation keeps between
calls reads right in the check that made it and is overwritten under its caller later (the
model passes ``out=`` where it wants a static buffer). Overlap is judged by byte ranges, so two
outputs cut from one fresh allocation are told apart, and aliases through another storage
object (DLPack, numpy) are still caught.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

Span = tuple[torch.device, int, int]  # device, first byte, one past the last


def _span(t: torch.Tensor) -> Span:
    """The bytes a (non-empty) tensor's elements can reach through its strides."""
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return t.device, t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _storage_span(t: torch.Tensor) -> Span:
    """An input's whole storage: a view into the rest of it aliases the input too."""
    storage = t.untyped_storage()
    return t.device, storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def _overlap(a: Span, b: Span) -> bool:
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


class ReturnedMemory:
    """The outputs of one run's latest calls, kept alive up to ``budget`` bytes so the allocator
    cannot hand their memory out again: a later output inside it is a buffer kept between calls
    (a ring of them too, or one per shape, while the run's recent outputs fit the budget)."""

    def __init__(self, budget: int = 1 << 28) -> None:
        self.budget = budget
        self._kept: collections.deque[torch.Tensor] = collections.deque()
        self._bytes = 0

    def holds(self, t: torch.Tensor) -> bool:
        return any(_overlap(_span(t), _span(k)) for k in self._kept)

    def keep(self, outputs: list[torch.Tensor]) -> None:
        for t in outputs:
            self._kept.append(t)
            self._bytes += t.nbytes
        while self._bytes > self.budget and len(self._kept) > len(outputs):
            old = self._kept.popleft()
            self._bytes -= old.nbytes


def not_new(
    returned: list[tuple[str, Any]], inputs: list[tuple[str, Any]], earlier: ReturnedMemory | None = None
) -> str:
    """Why the returned tensors are not new memory, or ''. ``returned`` and ``inputs`` are
    (name, value) pairs; ``earlier`` holds the run's recent outputs (the check then keeps these)."""
    outputs = [  # a sparse or meta tensor has no memory to share; the verdict names its layout or device
        (n, t)
        for n, t in returned
        if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type != "meta" and t.numel()
    ]
    sources = [
        (f"input {n}", _storage_span(a)) for n, a in inputs if isinstance(a, torch.Tensor) and a.numel()
    ]
    problem = ""
    for name, t in outputs:
        span = _span(t)
        shared = next((other for other, s in sources if _overlap(span, s)), None)
        if shared is not None:
            problem = f"{name} shares memory with {shared}: outputs must be new tensors"
            break
        if earlier is not None and earlier.holds(t):
            problem = (
                f"{name} is memory an earlier call returned (a buffer kept between calls): "
                "outputs must be new tensors"
            )
            break
        sources.append((name, span))
    if earlier is not None:
        earlier.keep([t for _, t in outputs])
    return problem
