"""Argument checks shared by every launch wrapper.

A kernel given a layout it does not expect reads the wrong memory silently, so wrappers check
rank, shape, dtype, device and strides first and raise an error that names the argument.
"""

from __future__ import annotations

import math
import numbers
import struct
from collections.abc import Iterable, Sequence

import torch

from ops import backend

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
FP32_MAX = torch.finfo(torch.float32).max
FP32_TINY = float(torch.tensor(1, dtype=torch.int32).view(torch.float32))  # the least subnormal


def _names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def tensor(
    name: str,
    t: object,
    *,
    ndim: int | Sequence[int] | None = None,
    dtypes: Sequence[torch.dtype] | None = FLOAT_DTYPES,
    last_dim_contiguous: bool = True,
) -> torch.Tensor:
    """Check one tensor argument: type, device, rank, dtype and unit stride in the last dim."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:  # a sparse tensor has no storage a kernel could read
        raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}")
    want = backend.device()
    if t.device.type != want.type:
        raise ValueError(
            f"{name}: expected a tensor on {want.type} (backend {backend.name()}), got {t.device}"
        )
    if want.type == "cuda" and t.device.index != torch.cuda.current_device():  # kernels launch there
        current = torch.cuda.current_device()
        raise ValueError(f"{name}: expected a tensor on the current device cuda:{current}, got {t.device}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            consecutive = len(allowed) > 2 and allowed == tuple(range(allowed[0], allowed[-1] + 1))
            shown = f"{allowed[0]} to {allowed[-1]}" if consecutive else " or ".join(map(str, allowed))
            raise ValueError(f"{name}: expected {shown} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in ({_names(dtypes)}), got {t.dtype}")
    if t.is_neg() or t.is_conj():  # a lazy view (z.conj().imag): its memory holds the unnegated values
        raise ValueError(
            f"{name}: has torch's negative or conjugate bit set, which a kernel reading its memory would "
            f"not apply; pass {name}.resolve_neg()"
        )
    if last_dim_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name}: the last dim must have stride 1, got strides {t.stride()} for shape {tuple(t.shape)}"
        )
    return t


def same_dtype(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(f"{name}: expected dtype {ref.dtype} to match {ref_name}, got {t.dtype}")


def shape(name: str, t: torch.Tensor, expected: Sequence[int], what: str = "") -> None:
    if tuple(t.shape) != tuple(expected):
        hint = f" ({what})" if what else ""
        raise ValueError(f"{name}: expected shape {tuple(expected)}{hint}, got {tuple(t.shape)}")


def contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous tensor, got strides {t.stride()} for shape {tuple(t.shape)}"
        )


def positive(name: str, value: object, *, integer: bool = False, fp32: bool = False) -> int | float:
    """A positive int, or a positive finite number (NaN and inf would only spread through the
    output), returned as a Python scalar: numpy scalars pass, a tensor (which a launch would take
    for a pointer) or a bool does not. ``fp32``: the kernel takes it as an fp32, where it must
    stay positive and finite too (an ``eps`` of 1e-46 is 0 there, one of 1e39 inf)."""
    kind = numbers.Integral if integer else numbers.Real
    want = "a positive int" if integer else "a positive finite number"
    if isinstance(value, bool) or not isinstance(value, kind):
        shown = type(value).__name__ if isinstance(value, torch.Tensor) else repr(value)
        raise ValueError(f"{name}: expected {want} (a Python or numpy scalar), got {shown}")
    try:
        scalar = int(value) if integer else float(value)
    except OverflowError:  # an int past the float range
        raise ValueError(f"{name}: expected {want}, got an int past the float range") from None
    if not 0 < scalar < math.inf:
        raise ValueError(f"{name}: expected {want}, got {value!r}")
    if fp32 and not 0 < _as_fp32(scalar) < math.inf:
        raise ValueError(
            f"{name}: expected a positive finite number as an fp32 (the kernel computes in fp32: "
            f"{FP32_TINY:.4g} to {FP32_MAX:.4g}), got {value!r}"
        )
    return scalar


MAX_GRID_YZ = 65535  # CUDA's limit on a launch grid's second and third axes


def grid_axis(name: str, programs: int, what: str) -> None:
    """``programs`` fit the launch grid's second axis; past it the launch fails with CUDA's bare
    "invalid argument", naming nothing."""
    if programs > MAX_GRID_YZ:
        raise ValueError(
            f"{name}: {what} takes {programs} programs on the launch grid's second axis, past CUDA's "
            f"{MAX_GRID_YZ}: not supported"
        )


def _as_fp32(value: float) -> float:
    """``value`` rounded to fp32 on the host, no tensor made (a decode step under capture calls this)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # past fp32's range: inf there
        return math.inf


def pair(name: str, value: object) -> tuple[object, object]:
    """An optional pair of outputs: ``None`` or a 2-tuple (either item may be None)."""
    if value is None:
        return None, None
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"{name}: expected None or a pair of tensors, got {type(value).__name__}")
    return value[0], value[1]


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors may share memory: intersecting byte spans on one device. Addresses, not
    storage objects, decide: ``torch.from_numpy`` or DLPack can alias bytes across two storages.
    Interleaved views that touch no common element count too: the check is conservative."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    (a0, a1), (b0, b1) = _byte_span(a), _byte_span(b)
    return a0 < b1 and b0 < a1


def disjoint(name: str, t: torch.Tensor, others: dict[str, object], in_place: Sequence[str] = ()) -> None:
    """``t``, which a kernel writes, shares no memory with ``others``, which it reads or writes too;
    an op that works in place may be handed the very same tensor as one of ``in_place``."""
    for other_name, other in others.items():
        if not isinstance(other, torch.Tensor) or not overlap(t, other):
            continue
        view = (other.data_ptr(), other.shape, other.stride(), other.dtype)
        if other_name in in_place and (t.data_ptr(), t.shape, t.stride(), t.dtype) == view:
            continue
        how = f" (in place it must be {other_name} itself)" if other_name in in_place else ""
        raise ValueError(
            f"{name}: shares memory with {other_name}, which the kernel also uses while it writes "
            f"{name}{how}; pass a separate tensor"
        )


def as_row_grid(name: str, t: torch.Tensor) -> torch.Tensor:
    """View ``t[..., R, N]`` as ``[outer, R, N]`` without a copy: two row strides, which covers
    per-head rows of a fused QKV output (``[B, S, H, D]`` with a gap between tokens)."""
    if t.dim() == 1:
        return t.view(1, 1, -1)
    if t.numel() == 0:  # nothing to view: the caller launches nothing
        return t.new_empty((0, *t.shape[-2:]))
    try:
        return t.view(-1, t.shape[-2], t.shape[-1])
    except RuntimeError:
        raise ValueError(
            f"{name}: dims before the last two cannot be flattened (shape {tuple(t.shape)}, strides "
            f"{t.stride()}); pass a tensor whose leading dims share one stride"
        ) from None


def as_rows(name: str, t: torch.Tensor) -> torch.Tensor:
    """View ``t[..., N]`` as ``[rows, N]`` without a copy, or refuse the layout."""
    if t.numel() == 0:  # nothing to view: the caller launches nothing
        return t.new_empty((math.prod(t.shape[:-1]), t.shape[-1]))
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        raise ValueError(
            f"{name}: leading dims cannot be flattened into evenly spaced rows (shape {tuple(t.shape)}, "
            f"strides {t.stride()}); pass a tensor whose rows share one stride"
        ) from None


def output(
    out: torch.Tensor | None,
    shape: Sequence[int],
    dtype: torch.dtype,
    like: torch.Tensor,
    name: str = "out",
    *,
    reads: dict[str, object] | None = None,
    in_place: Sequence[str] = (),
) -> torch.Tensor:
    """A new contiguous output, or the caller's preallocated one (CUDA Graph decode) once checked:
    its shape, dtype and layout, and that it shares no memory with ``reads`` (see :func:`disjoint`;
    a new one cannot)."""
    if out is None:
        return torch.empty(tuple(shape), dtype=dtype, device=like.device)
    tensor(name, out, dtypes=(dtype,))
    shape_ = tuple(shape)
    if tuple(out.shape) != shape_:
        raise ValueError(f"{name}: expected shape {shape_}, got {tuple(out.shape)}")
    contiguous(name, out)
    disjoint(name, out, reads or {}, in_place)
    return out
