"""Bounds and race checks for kernels run by the Triton interpreter: a memcheck on the CPU.

On the GPU a load or store outside the tensors a kernel was handed faults (an illegal address),
or, a few elements past an end, quietly reads or overwrites a neighbour's bytes. The interpreter
dereferences the same addresses inside the Python process: a few elements off, it reads junk or
corrupts the heap without a word; far off, the process dies of a segmentation fault. And the
interpreter runs a launch's programs one after another, so a program that reads what another
program of the same launch writes (or two that write the same bytes) gets the same answer every
time on the CPU, where the GPU, which runs them in no set order, gets either. Either way a
verification run on CPU could pass a kernel that is wrong on the GPU, or die without naming it.

:func:`install` makes each interpreted launch record the bytes of every tensor it is passed (the
elements of the tensor as passed: a view's own elements, not the rest of its storage, since on the
GPU the caching allocator packs tensors side by side in one allocation, where a write past a view
corrupts its neighbour without a fault), and each load, store and atomic check every address its
mask enables against them before it touches memory: an address outside them raises
:class:`OutOfBounds`. The launch also records which program last stored each byte: a load of
bytes another program stored, or a store over them, raises :class:`Race`; from a launch's first
atomic on, programs may be ordering themselves through it, and that launch is no longer checked
for races. Each error names the kernel, the program and where the access fell. Compiled GPU
kernels are unaffected.

What it cannot see: an access that lands inside another tensor of the same launch (the bounds
are the union of the tensors passed: a q view running into the k view of one fused buffer
passes); a race whose reading program runs before the writing one in the interpreter's order
(loads are not recorded, so a program reading a slot a later program overwrites passes); and
the gaps of a strided view of more than ``_RUNS_CAP`` elements, which is allowed its whole span.
The reference comparison still judges the values such a kernel produces.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from triton.runtime import interpreter
from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

__all__ = ["OutOfBounds", "Race", "install"]

_MARKER = "_memcheck_installed"  # set on InterpreterBuilder, so a reloaded module sees it too


class OutOfBounds(Exception):
    """A kernel under the interpreter accessed memory outside every tensor it was passed."""


class Race(Exception):
    """A program read or overwrote bytes another program of the same launch had stored."""


_RUNS_CAP = 1 << 22  # a strided view with more elements is allowed its whole span instead


@dataclass
class _Tensor:
    """A tensor a launch was passed: its name and the byte span from its first element to past its
    last (a strided view may have gaps inside it)."""

    name: str
    start: int
    end: int


@dataclass
class _Launch:
    """The running launch: its kernel's name, its tensors, the bytes they hold as sorted disjoint
    runs, and for each storage stored to, the program that last stored each byte (-1: none)."""

    kernel: str
    tensors: list[_Tensor]
    run_starts: np.ndarray  # uint64
    run_ends: np.ndarray  # uint64, exclusive
    storage_starts: np.ndarray  # uint64, one per distinct storage
    storage_ends: np.ndarray
    writers: dict[int, np.ndarray] = field(default_factory=dict)  # by storage index
    atomics: bool = False  # an atomic ran: programs may order themselves, races are not judged


_current: list[_Launch] = []  # the running launch, if any


def _tensors(name: str, value: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors an argument carries: itself, a tuple's items, a tensor descriptor's base."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, tuple):
        for i, item in enumerate(value):
            yield from _tensors(f"{name}[{i}]", item)
    elif hasattr(value, "base") and isinstance(value.base, torch.Tensor):
        yield name, value.base


def _is_dense(t: torch.Tensor) -> bool:
    """Its elements fill its span with no gap and no overlap (contiguous up to a permutation)."""
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride(), strict=True) if n > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _runs(t: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The byte runs a tensor's elements cover, as (starts, ends)."""
    if t.numel() == 0:
        return np.empty(0, np.uint64), np.empty(0, np.uint64)
    size, base = t.element_size(), t.data_ptr()
    span = sum((n - 1) * stride for n, stride in zip(t.shape, t.stride(), strict=True)) + 1
    if _is_dense(t) or t.numel() > _RUNS_CAP:
        return np.array([base], np.uint64), np.array([base + span * size], np.uint64)
    offsets = np.zeros(1, np.int64)
    for n, stride in zip(t.shape, t.stride(), strict=True):
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64) * stride).ravel()
    offsets = np.unique(offsets)
    breaks = np.flatnonzero(np.diff(offsets) != 1) + 1
    firsts = offsets[np.r_[0, breaks]]
    lasts = offsets[np.r_[breaks - 1, offsets.size - 1]]
    return (base + firsts * size).astype(np.uint64), (base + (lasts + 1) * size).astype(np.uint64)


def _merged(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted, disjoint runs covering the same bytes."""
    if not starts.size:
        return starts, ends
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], np.maximum.accumulate(ends[order])
    fresh = np.r_[True, starts[1:] > ends[:-1]]
    last = np.r_[np.flatnonzero(fresh)[1:] - 1, starts.size - 1]
    return starts[fresh], ends[last]


def _launch(kernel: str, named: dict[str, Any]) -> _Launch:
    passed = [(name, t) for arg, value in named.items() for name, t in _tensors(arg, value)]
    runs = [_runs(t) for _, t in passed]
    run_starts, run_ends = _merged(
        np.concatenate([r[0] for r in runs] or [np.empty(0, np.uint64)]),
        np.concatenate([r[1] for r in runs] or [np.empty(0, np.uint64)]),
    )
    storages = sorted({(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for _, t in passed})
    spans = [
        _Tensor(name, int(starts[0]), int(ends[-1]))
        for (name, _), (starts, ends) in zip(passed, runs, strict=True)
        if starts.size
    ]
    return _Launch(
        kernel,
        spans,
        run_starts,
        run_ends,
        np.array([p for p, _ in storages], np.uint64),
        np.array([p + n for p, n in storages], np.uint64),
    )


def _distance(nbytes: int) -> str:
    """A distance in bytes as a person reads it: exact when small, in binary units when far."""
    if nbytes < 1 << 20:
        return f"{nbytes} bytes"
    unit, scale = next((u, 1 << s) for u, s in (("TiB", 40), ("GiB", 30), ("MiB", 20)) if nbytes >= 1 << s)
    return f"{nbytes / scale:.1f} {unit}"


def _where(launch: _Launch, address: int) -> str:
    """Where an address fell, as a person reads it: between a strided view's elements, past the end
    of, or before, the nearest tensor."""
    nearest = []
    for t in launch.tensors:
        if t.start <= address < t.end:
            return f"{address - t.start} bytes into {t.name}'s span, between its elements (a strided view)"
        if address >= t.end:
            past = "just past" if address == t.end else f"{_distance(address - t.end)} past"
            nearest.append((address - t.end, f"{past} the end of {t.name}"))
        else:
            nearest.append((t.start - address, f"{_distance(t.start - address)} before {t.name}"))
    return min(nearest)[1] if nearest else "the kernel was passed no tensor"


def _named(launch: _Launch, address: int) -> str:
    """A stored byte as "N bytes into NAME", NAME the first tensor whose span holds it."""
    for t in launch.tensors:
        if t.start <= address < t.end:
            return f"{address - t.start} bytes into {t.name}"
    return f"address {address:#x}"


def _program() -> tuple[int, tuple[int, int, int]]:
    """The running program: its index in launch order, and its (x, y, z) ids."""
    builder = interpreter.interpreter_builder
    x, y, z = (int(i) for i in builder.grid_idx)
    gx, gy, _ = builder.grid_dim
    return x + gx * (y + gy * z), (x, y, z)


def _ids(index: int) -> tuple[int, int, int]:
    gx, gy, _ = interpreter.interpreter_builder.grid_dim
    return index % gx, index // gx % gy, index // (gx * gy)


def _check(ptrs: TensorHandle, mask: np.ndarray | None, access: str) -> None:
    """``access``: "load", "store" or "atomic". Bounds first, then races."""
    if not _current:
        return
    launch = _current[-1]
    addresses = ptrs.data if mask is None else ptrs.data[np.broadcast_to(mask, ptrs.data.shape).astype(bool)]
    addresses = np.asarray(addresses, dtype=np.uint64).ravel()
    if not addresses.size:
        return
    size = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
    slot = np.searchsorted(launch.run_starts, addresses, side="right").astype(np.int64) - 1
    inside = (slot >= 0) & (addresses + np.uint64(size) <= launch.run_ends[np.maximum(slot, 0)])
    if not inside.all():
        bad = addresses[~inside]
        article = "an" if access == "atomic" else "a"
        raise OutOfBounds(
            f"{launch.kernel}, program {_program()[1]}: {article} {access} of {bad.size} of {addresses.size} "
            f"addresses outside every tensor it was passed; the first {_where(launch, int(bad[0]))}"
        )
    launch.atomics |= access == "atomic"
    if not launch.atomics:
        _check_races(launch, addresses, size, access)


def _check_races(launch: _Launch, addresses: np.ndarray, size: int, access: str) -> None:
    """Raise :class:`Race` where another program of the launch stored these bytes; record a store's."""
    program, ids = _program()
    slot = np.searchsorted(launch.storage_starts, addresses, side="right").astype(np.int64) - 1
    first_byte = (addresses - launch.storage_starts[slot]).astype(np.int64)
    for index in np.unique(slot).tolist():
        where = first_byte[slot == index]
        covered = (where[:, None] + np.arange(size)).ravel()
        writers = launch.writers.get(index)
        if writers is None:
            if access == "load":
                continue
            nbytes = int(launch.storage_ends[index] - launch.storage_starts[index])
            writers = launch.writers[index] = np.full(nbytes, -1, dtype=np.int64)
        earlier = writers[covered]
        clash = (earlier >= 0) & (earlier != program)
        if clash.any():
            first = int(np.argmax(clash))
            other = _ids(int(earlier[first]))
            at = _named(launch, int(launch.storage_starts[index]) + int(covered[first]))
            if access == "load":
                what = f"a load of what program {other} stored earlier in this launch"
            else:
                what = f"a store over what program {other} stored earlier in this launch"
            raise Race(
                f"{launch.kernel}, program {ids}: {what} ({at}); the GPU runs a "
                "launch's programs in no set order, so this is a race"
            )
        if access == "store":
            writers[covered] = program


def _checked(method: Callable, access: str, ptr_at: int, mask_at: int | None = None) -> Callable:
    """A builder method that checks its pointers (argument ``ptr_at``, masked by ``mask_at``) first."""

    @functools.wraps(method)
    def wrapper(self: InterpreterBuilder, *args: Any, **kwargs: Any) -> Any:  # descriptor loads pass keywords
        mask = None if mask_at is None else args[mask_at]
        _check(args[ptr_at], None if mask is None else mask.data, access)
        return method(self, *args, **kwargs)

    return wrapper


def _recording(call: Callable[..., None]) -> Callable[..., None]:
    """GridExecutor.__call__, with the launch's tensor ranges current while its programs run."""

    @functools.wraps(call)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        named = {**dict(zip(self.arg_names, args, strict=False)), **kwargs}  # defaults unnamed
        _current.append(_launch(getattr(self.fn, "__name__", "kernel"), named))
        try:
            call(self, *args, **kwargs)
        finally:
            _current.pop()

    return wrapper


def install() -> None:
    """Wrap the interpreter's launches and memory accesses. Idempotent."""
    if getattr(InterpreterBuilder, _MARKER, False):
        return
    builder = InterpreterBuilder
    # (ptrs, mask, other, ...), (ptrs, value, mask, ...), (op, ptr, val, mask, ...), (ptr, cmp, val, ...)
    builder.create_masked_load = _checked(builder.create_masked_load, "load", 0, 1)
    builder.create_masked_store = _checked(builder.create_masked_store, "store", 0, 2)
    builder.create_atomic_rmw = _checked(builder.create_atomic_rmw, "atomic", 1, 3)
    builder.create_atomic_cas = _checked(builder.create_atomic_cas, "atomic", 0)
    interpreter.GridExecutor.__call__ = _recording(interpreter.GridExecutor.__call__)
    setattr(builder, _MARKER, True)
