"""Make the Triton interpreter (``TRITON_INTERPRET=1``) compute bfloat16 the way the GPU does.

Triton 3.6's interpreter stores bf16 tensors as numpy ``uint16`` bit patterns and then does
arithmetic on those integers:

* ``tl.dot`` multiplies the bit patterns (upstream issue triton-lang/triton#11584, fix declined);
* elementwise float ops, min/max, clamp and comparisons do the same (upstream PR #10945, closed), so
  ``2.5 + 2.0`` in bf16 gives about ``-2.9e-39``;
* the ``tl.sum`` / ``tl.cumsum`` / ``tl.cumprod`` fast paths add or multiply the bit patterns;
* fp32 -> bf16 casts (``x.to(tl.bfloat16)`` and the implicit cast in ``tl.store``) truncate where the
  GPU rounds to nearest even, int -> bf16 casts store the integer itself as the bit pattern, and
  ``tl.full(..., tl.bfloat16)`` fails (the builder has no ``get_bf16``).

``install()`` wraps the few interpreter methods where this happens. Each wrapper widens bf16
operands exactly to fp32 (``bits << 16``), runs the stock implementation on fp32, and rounds a
floating-point result back to bf16 with round-to-nearest-even (NaN stays NaN, inf stays inf) -- the
same arithmetic the GPU and torch use. Three NaN rules are also aligned with the GPU for every float
dtype: ``maxnumf``/``minnumf`` (``tl.maximum``/``tl.minimum`` default) return the non-NaN operand,
``tl.clamp`` is ``min(max(x, lo), hi)`` built from those, and ``tl.argmax``/``tl.argmin`` over
values holding a NaN follow the GPU's pairwise combine (a NaN compares false) rather than numpy's
"the first NaN wins", which is torch's rule and would pass a kernel that leaves NaN to them.

Set ``TRITON_INTERPRET=1`` before kernels are decorated with ``@triton.jit``; compiled GPU kernels
are unaffected. numpy >= 2.4 breaks the interpreter's scalar conversion (upstream issue #9171), so
``install()`` refuses to run there; the project pins ``numpy<2.4``. The patches wrap 3.6's interpreter
internals, so ``install()`` refuses other Triton releases too (3.9's interpreter, for one, tags a
comparison's result with its operands' dtype, so a mask built from a scalar comparison cannot be
stored); the project pins ``triton<3.7``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import triton
import triton.language as tl
from triton._C.libtriton import ir
from triton.runtime.interpreter import InterpreterBuilder, ReduceOps, ScanOps, TensorHandle

__all__ = ["install", "installed"]

_MARKER = "_bf16_compat_installed"  # set on InterpreterBuilder, so a reloaded module sees it too
_FP32_MAX = np.finfo(np.float32).max
TESTED_TRITON = (3, 6)  # the release whose interpreter internals the patches below wrap


# ---------------------------------------------------------------------------------------------
# bf16 <-> fp32 conversions on numpy arrays
# ---------------------------------------------------------------------------------------------


def bf16_bits_to_fp32(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> float32 values. Exact: bf16 is the top half of an fp32."""
    widened = np.asarray(bits).astype(np.uint32) << 16
    return np.asarray(widened).view(np.float32)  # asarray: keep 0-d inputs as arrays


def _fp64_to_fp32_round_to_odd(x: np.ndarray, err: np.ndarray | None = None) -> np.ndarray:
    """float64 -> float32 rounding inexact results to the neighbour with an odd last bit.

    Rounding to odd keeps enough information that a second rounding to the much narrower bf16 gives
    the same result as rounding the float64 value directly (no double-rounding error). ``err`` is
    an optional exact residual (the true value is ``x + err``) used when ``x`` itself is an fp32.
    """
    with np.errstate(all="ignore"):
        finite = np.isfinite(x)
        y = x.astype(np.float32)
        # Round-to-odd never overflows: a finite value past the fp32 range becomes +-max (odd bits).
        y = np.where(finite & np.isinf(y), np.copysign(_FP32_MAX, x).astype(np.float32), y)
        diff = x - y.astype(np.float64)  # exact; sign says on which side the true value lies
        if err is not None:
            diff = np.where(diff == 0, err, diff)
        make_odd = finite & (diff != 0) & ((y.view(np.uint32) & 1) == 0)
        toward = np.where(diff > 0, np.float32(np.inf), np.float32(-np.inf))
        return np.where(make_odd, np.nextafter(y, toward), y)


def to_bf16_bits(values: np.ndarray, rtz: bool = False) -> np.ndarray:
    """Float (or integer) values -> bf16 bit patterns, rounding to nearest even (or toward zero).

    NaN maps to a quiet NaN with the same sign, +-inf to +-inf; finite values that round past the
    largest bf16 become inf under round-to-nearest-even.
    """
    values = np.asarray(values)
    if values.dtype != np.float32:
        values = _fp64_to_fp32_round_to_odd(values.astype(np.float64))
    bits = values.view(np.uint32)
    if rtz:
        rounded = bits >> 16
    else:
        # Add just under half an ulp, plus one if the kept part is odd: ties go to even.
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    quiet_nan = (bits >> 16) | 0x0040
    return np.where(np.isnan(values), quiet_nan, rounded).astype(np.uint16)


# ---------------------------------------------------------------------------------------------
# TensorHandle / tl.tensor helpers
# ---------------------------------------------------------------------------------------------


def _is_bf16(handle: Any) -> bool:
    return (
        isinstance(handle, TensorHandle)
        and handle.dtype.scalar == tl.bfloat16
        and handle.data.dtype == np.uint16
    )


def _widen(handle: Any) -> Any:
    """bf16 handle -> exact fp32 handle; anything else is returned unchanged."""
    if not _is_bf16(handle):
        return handle
    return TensorHandle(bf16_bits_to_fp32(handle.data), tl.float32)


def _narrow(handle: TensorHandle) -> TensorHandle:
    return TensorHandle(to_bf16_bits(handle.data), tl.bfloat16)


def _retype(tensor: tl.tensor, data: np.ndarray, scalar: tl.dtype) -> tl.tensor:
    ty = tensor.type.with_element_ty(scalar) if tensor.type.is_block() else scalar
    return tl.tensor(TensorHandle(data, scalar), ty)


# ---------------------------------------------------------------------------------------------
# Wrappers for InterpreterBuilder methods
# ---------------------------------------------------------------------------------------------

Method = Callable[..., Any]


def _elementwise(method: Method) -> Method:
    """binary_op / unary_op / ...: compute bf16 operands in fp32, round a float result to bf16.

    Comparison results (bool) come back as they are. For +, -, *, /, sqrt, computing in fp32 and
    rounding once to bf16 is exactly the correctly rounded bf16 result (24 >= 2 * 8 + 2 bits).
    """

    @functools.wraps(method)
    def wrapper(self: InterpreterBuilder, *args: Any) -> TensorHandle:
        if not any(_is_bf16(arg) for arg in args):
            return method(self, *args)
        with np.errstate(all="ignore"):
            out = method(self, *[_widen(arg) for arg in args])
        return _narrow(out) if out.data.dtype == np.float32 else out

    return wrapper


def _fma(method: Method) -> Method:
    """tl.fma: the GPU's bf16 fma rounds once, so compute x * y + z exactly and round that.

    A bf16 product is exact in float64; the sum's rounding error is recovered with TwoSum and fed
    to the round-to-odd step, so the single bf16 rounding is exact even where fp32 is not
    (x * y at a bf16 tie, z tiny). Other dtypes keep the stock behaviour.
    """

    @functools.wraps(method)
    def create_fma(
        self: InterpreterBuilder, x: TensorHandle, y: TensorHandle, z: TensorHandle
    ) -> TensorHandle:
        if not _is_bf16(z):
            return method(self, x, y, z)
        x64, y64, z64 = (bf16_bits_to_fp32(h.data).astype(np.float64) for h in (x, y, z))
        with np.errstate(all="ignore"):
            product = x64 * y64
            total = product + z64
            z_part = total - product
            residual = (product - (total - z_part)) + (z64 - z_part)
        return TensorHandle(to_bf16_bits(_fp64_to_fp32_round_to_odd(total, residual)), tl.bfloat16)

    return create_fma


def _create_maxnumf(self: InterpreterBuilder, lhs: TensorHandle, rhs: TensorHandle) -> TensorHandle:
    return self.binary_op(lhs, rhs, np.fmax)  # maxnum: a NaN operand loses to a number


def _create_minnumf(self: InterpreterBuilder, lhs: TensorHandle, rhs: TensorHandle) -> TensorHandle:
    return self.binary_op(lhs, rhs, np.fmin)


def _create_clampf(
    self: InterpreterBuilder, x: TensorHandle, lo: TensorHandle, hi: TensorHandle, propagate_nan: Any
) -> TensorHandle:
    """As the GPU lowers ClampFOp: minimum(maximum(x, lo), hi) or minnum(maxnum(x, lo), hi)."""
    if propagate_nan == ir.PROPAGATE_NAN.ALL:
        return self.create_minimumf(self.create_maximumf(x, lo), hi)
    return self.create_minnumf(self.create_maxnumf(x, lo), hi)


def _dot(method: Method) -> Method:
    """tl.dot with bf16 operands: exactly fp32(a) @ fp32(b) + acc, in fp32."""

    @functools.wraps(method)
    def create_dot(
        self: InterpreterBuilder,
        a: TensorHandle,
        b: TensorHandle,
        d: TensorHandle,
        input_precision: Any,
        max_num_imprecise_acc: Any,
    ) -> TensorHandle:
        if not (_is_bf16(a) or _is_bf16(b)):
            return method(self, a, b, d, input_precision, max_num_imprecise_acc)
        out = method(self, _widen(a), _widen(b), _widen(d), input_precision, max_num_imprecise_acc)
        return _narrow(out) if _is_bf16(d) else out

    return create_dot


def _cast(method: Method) -> Method:
    """cast_impl (fp_ext, fp_trunc, fp_to_si, si_to_fp, ...): go through real values, not bits."""

    @functools.wraps(method)
    def cast_impl(self: InterpreterBuilder, src: TensorHandle, dst_type: tl.dtype) -> TensorHandle:
        dst = dst_type.scalar
        if _is_bf16(src):
            src = _widen(src)  # exact; float -> int then truncates the value toward zero
            if dst == tl.float32:
                return src
        if dst == tl.bfloat16:
            with np.errstate(all="ignore"):
                return TensorHandle(to_bf16_bits(src.data), tl.bfloat16)
        return method(self, src, dst_type)

    return cast_impl


def _fp_to_fp(method: Method) -> Method:
    """create_fp_to_fp (explicit rounding mode): fp16/fp32/fp64 -> bf16 honours RTNE and RTZ."""

    @functools.wraps(method)
    def create_fp_to_fp(
        self: InterpreterBuilder, src: TensorHandle, dst_type: tl.dtype, rounding_mode: Any
    ) -> TensorHandle:
        if dst_type.scalar == tl.bfloat16 and src.dtype.scalar in (tl.float16, tl.float32, tl.float64):
            rtz = rounding_mode == ir.ROUNDING_MODE.RTZ
            return TensorHandle(to_bf16_bits(src.data, rtz), tl.bfloat16)
        return method(self, src, dst_type, rounding_mode)

    return create_fp_to_fp


def _get_bf16(self: InterpreterBuilder, value: float) -> TensorHandle:
    """Scalar bf16 constant (``tl.full(..., tl.bfloat16)``), built as the GPU builder builds it.

    Triton's C++ ``get_bf16`` takes a C float and parses ``std::to_string(v)`` (``"%f"``, six
    decimals) into bf16, so the GPU turns e.g. 1e-7 into 0.0; do the same.
    """
    with np.errstate(all="ignore"):
        text = f"{float(np.float32(value)):f}"
    return TensorHandle(to_bf16_bits(np.array([float(text)])), tl.bfloat16)


def _tree_arg_reduce(data: np.ndarray, axis: int, larger: bool) -> tuple[np.ndarray, np.ndarray]:
    """``(value, index)`` of argmax (``larger``) or argmin along ``axis`` as the GPU's combine picks
    them: pairwise, ``a`` over ``b`` only where ``a > b`` (``a < b``) or they tie at a lower index.
    A NaN compares false, so which element wins depends on the tree, not torch's "NaN is the
    maximum" that numpy's argmax (the interpreter's) applies."""
    vals = np.moveaxis(data, axis, -1)
    idx = np.broadcast_to(np.arange(vals.shape[-1], dtype=np.int32), vals.shape)
    while vals.shape[-1] > 1:
        n = vals.shape[-1] // 2 * 2
        a, b, ia, ib = vals[..., 0:n:2], vals[..., 1:n:2], idx[..., 0:n:2], idx[..., 1:n:2]
        win = ((a > b) if larger else (a < b)) | ((a == b) & (ia < ib))
        tail = (slice(None),) * (vals.ndim - 1) + (slice(n, None),)  # an odd one out goes up as it is
        vals = np.concatenate([np.where(win, a, b), vals[tail]], axis=-1)
        idx = np.concatenate([np.where(win, ia, ib), idx[tail]], axis=-1)
    return vals[..., 0], idx[..., 0]


def _nan_aware_arg_reduce(method: Method) -> Method:
    """ReduceOps.min_max: argmax/argmin over values holding a NaN as the GPU computes them (see
    ``_tree_arg_reduce``), so a kernel that leaves NaN to ``tl.argmax`` fails on CPU as on the GPU."""

    @functools.wraps(method)
    def wrapper(self: Any, input: Any, val_reduce_op: Any, idx_reduce_op: Any = None) -> Any:
        values = input[0] if isinstance(input, tuple) else input
        data = values.handle.data
        if idx_reduce_op not in (np.argmax, np.argmin) or not np.isnan(data).any():
            return method(self, input, val_reduce_op, idx_reduce_op)
        val, idx = _tree_arg_reduce(data, self.axis, larger=idx_reduce_op is np.argmax)
        if self.keep_dims:
            val, idx = np.expand_dims(val, self.axis), np.expand_dims(idx, self.axis)
        return self.to_tensor(val, values.dtype), self.to_tensor(idx, tl.int32)

    return wrapper


def _fast_path_in_fp32(method: Method) -> Method:
    """ReduceOps.sum/min_max and ScanOps.cumsum/cumprod fast paths: run on fp32 values.

    Sums accumulate in fp32 and round to bf16 once (per output element, or per prefix for scans).
    The GPU rounds each combine step to bf16 in its own tree order, so long rows can differ by a
    few bf16 ulps; max/min/argmax/argmin are exact.
    """

    @functools.wraps(method)
    def wrapper(self: Any, input: Any, *args: Any, **kwargs: Any) -> Any:
        if not (isinstance(input, tl.tensor) and input.dtype == tl.bfloat16):
            return method(self, input, *args, **kwargs)
        widened = _retype(input, bf16_bits_to_fp32(input.handle.data), tl.float32)
        with np.errstate(all="ignore"):
            out = method(self, widened, *args, **kwargs)

        def narrow(t: Any) -> Any:
            if isinstance(t, tl.tensor) and t.dtype == tl.float32:
                return _retype(t, to_bf16_bits(t.handle.data), tl.bfloat16)
            return t  # e.g. the int32 index of argmax

        return type(out)(narrow(t) for t in out) if isinstance(out, (list, tuple)) else narrow(out)

    return wrapper


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def _check_versions() -> None:
    """numpy 2.4 breaks the interpreter; another Triton release's interpreter has other internals."""
    if _major_minor(np.__version__) >= (2, 4):
        raise RuntimeError(
            f"numpy {np.__version__} is installed, but numpy 2.4 breaks the Triton interpreter's scalar "
            "conversion (upstream triton issue 9171); install numpy<2.4 (the project pins numpy<2.4)."
        )
    if _major_minor(triton.__version__) != TESTED_TRITON:
        raise RuntimeError(
            f"triton {triton.__version__} is installed, but the interpreter backend is patched and "
            f"tested for Triton {TESTED_TRITON[0]}.{TESTED_TRITON[1]} (the GPU image's release); "
            "install triton==3.6.* or run on a GPU (the project pins triton<3.7)."
        )


def install() -> None:
    """Patch triton.runtime.interpreter so bf16 is computed as on the GPU. Idempotent."""
    _check_versions()
    if installed():
        return
    builder = InterpreterBuilder

    def wrap(cls: type, name: str, wrapper: Callable[[Method], Method]) -> None:
        setattr(cls, name, wrapper(getattr(cls, name)))

    # Elementwise: every float binary op (fadd, fsub, fmul, fdiv, frem, min/max, fcmp*) goes through
    # binary_op, and every unary math op (exp, log, sqrt, sin, cos, floor, ...) through unary_op.
    for name in ("binary_op", "unary_op", "create_rsqrt", "create_erf"):
        wrap(builder, name, _elementwise)
    wrap(builder, "create_fma", _fma)
    builder.create_maxnumf = _create_maxnumf
    builder.create_minnumf = _create_minnumf
    builder.create_clampf = _create_clampf
    # create_select (tl.where) and create_fabs already work on bf16: they only move or mask bits.
    wrap(builder, "create_dot", _dot)
    wrap(builder, "cast_impl", _cast)  # create_fp_ext, create_fp_trunc, create_fp_to_si, ... call it
    wrap(builder, "create_fp_to_fp", _fp_to_fp)
    builder.get_bf16 = _get_bf16

    # tl.reduce / tl.associative_scan fast paths; the generic combine_fn paths run the patched
    # builder ops above and need nothing more.
    wrap(ReduceOps, "sum", _fast_path_in_fp32)
    wrap(ReduceOps, "min_max", _nan_aware_arg_reduce)  # inside the fp32 path: it sees fp32 values
    wrap(ReduceOps, "min_max", _fast_path_in_fp32)
    wrap(ScanOps, "cumsum", _fast_path_in_fp32)
    wrap(ScanOps, "cumprod", _fast_path_in_fp32)

    setattr(builder, _MARKER, True)


def installed() -> bool:
    """True once install() has patched the interpreter in this process."""
    return bool(getattr(InterpreterBuilder, _MARKER, False))
