"""Bounds and race checks for kernels run by the Triton interpreter: a memcheck on the CPU.

On the GPU a load or store outside the tensors a kernel was handed faults (an illegal address),
or, a few elements past an end, quietly reads or overwrites a neighbour's bytes. The interpreter
dereferences the same addresses inside the Python process: a few elements off, it reads junk or
corrupts the heap without a word; far off, the process dies of a segmentation fault. And the
interpreter runs a launch's programs one after another, so a program that reads what another
program of the same launch writes (or two that write the same bytes) gets the same answer every
time on the CPU, where the GPU, which runs them in no set order, gets either. Either way a
verification run on CPU could pass a kernel that is wrong on the GPU, or die without naming it.

:func:`install` makes each interpreted launch record the byte range of every tensor it is passed
(its whole storage, as a memory checker on the GPU sees the allocation), and each load, store and
atomic check every address its mask enables against those ranges before it touches memory: an
address outside them raises :class:`OutOfBounds`. The launch also records which program last
stored each byte: a load of bytes another program stored, or a store over them, raises
:class:`Race`; from a launch's first atomic on, programs may be ordering themselves through it,
and that launch is no longer checked for races. Each error names the kernel, the program and
where the access fell. Compiled GPU kernels are unaffected.
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


@dataclass
class _Launch:
    """The running launch: its kernel's name, its tensors' byte ranges (sorted by start), and for
    each tensor stored to, the program that last stored each byte (-1: none)."""

    kernel: str
    names: tuple[str, ...]
    starts: np.ndarray  # uint64
    ends: np.ndarray  # uint64, exclusive
    writers: dict[int, np.ndarray] = field(default_factory=dict)  # by range index
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


def _launch(kernel: str, named: dict[str, Any]) -> _Launch:
    ranges = sorted(
        (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes(), name)
        for arg, value in named.items()
        for name, t in _tensors(arg, value)
    )
    starts = np.array([r[0] for r in ranges], dtype=np.uint64)
    ends = np.array([r[0] + r[1] for r in ranges], dtype=np.uint64)
    return _Launch(kernel, tuple(r[2] for r in ranges), starts, ends)


def _where(launch: _Launch, address: int) -> str:
    """Where an address fell, as a person reads it: past the end of, or before, the nearest tensor."""
    nearest = []
    for start, end, name in zip(launch.starts.tolist(), launch.ends.tolist(), launch.names, strict=True):
        if address >= end:
            past = "just past" if address == end else f"{address - end} bytes past"
            nearest.append((address - end, f"{past} the end of {name}"))
        else:
            nearest.append((start - address, f"{start - address} bytes before {name}"))
    return min(nearest)[1] if nearest else "the kernel was passed no tensor"


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
    slot = np.searchsorted(launch.starts, addresses, side="right").astype(np.int64) - 1
    inside = (slot >= 0) & (addresses + np.uint64(size) <= launch.ends[np.maximum(slot, 0)])
    if not inside.all():
        bad = addresses[~inside]
        article = "an" if access == "atomic" else "a"
        raise OutOfBounds(
            f"{launch.kernel}, program {_program()[1]}: {article} {access} of {bad.size} of {addresses.size} "
            f"addresses outside every tensor it was passed; the first {_where(launch, int(bad[0]))}"
        )
    launch.atomics |= access == "atomic"
    if not launch.atomics:
        _check_races(launch, addresses, slot, size, access)


def _check_races(launch: _Launch, addresses: np.ndarray, slot: np.ndarray, size: int, access: str) -> None:
    """Raise :class:`Race` where another program of the launch stored these bytes; record a store's."""
    program, ids = _program()
    first_byte = (addresses - launch.starts[slot]).astype(np.int64)
    for index in np.unique(slot).tolist():
        where = first_byte[slot == index]
        covered = (where[:, None] + np.arange(size)).ravel()
        writers = launch.writers.get(index)
        if writers is None:
            if access == "load":
                continue
            nbytes = int(launch.ends[index] - launch.starts[index])
            writers = launch.writers[index] = np.full(nbytes, -1, dtype=np.int64)
        earlier = writers[covered]
        clash = (earlier >= 0) & (earlier != program)
        if clash.any():
            first = int(np.argmax(clash))
            other, name, offset = _ids(int(earlier[first])), launch.names[index], int(covered[first])
            if access == "load":
                what = f"a load of what program {other} stored earlier in this launch"
            else:
                what = f"a store over what program {other} stored earlier in this launch"
            raise Race(
                f"{launch.kernel}, program {ids}: {what} ({offset} bytes into {name}); the GPU runs a "
                "launch's programs in no set order, so this is a race"
            )
        if access == "store":
            writers[covered] = program


def _checked(method: Callable, access: str, ptr_at: int, mask_at: int | None = None) -> Callable:
    """A builder method that checks its pointers (argument ``ptr_at``, masked by ``mask_at``) first."""

    @functools.wraps(method)
    def wrapper(self: InterpreterBuilder, *args: Any) -> Any:
        mask = None if mask_at is None else args[mask_at]
        _check(args[ptr_at], None if mask is None else mask.data, access)
        return method(self, *args)

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
