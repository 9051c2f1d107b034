"""RMSNorm, and residual add fused into RMSNorm (article ops 1, 11+12, 20, qk-norm).

One program normalizes one row held whole in registers: the hidden sizes of these models
(<= 8192) fit, and a single pass reads each element once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops import pdl, validate

MAX_N = 32768  # one row lives in registers; larger rows would spill badly


@triton.jit
def inv_rms(sum_sq, n, eps):
    """``1 / sqrt(sum_sq / n + eps)``, each step rounded to nearest as torch's fp32 is. On the GPU
    Triton's ``/`` and ``tl.sqrt`` are approximate instructions (the thorough profile found fp32
    add_rms_norm 2 ulps off where plain torch was exact); once a row, their cost is nothing."""
    mean = tl.div_rn(sum_sq, tl.zeros_like(sum_sq) + n)
    return tl.div_rn(tl.full(sum_sq.shape, 1.0, tl.float32), tl.sqrt_rn(mean + eps))


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, y_ptr, R, stride_outer, stride_row, N, eps, BLOCK_N: tl.constexpr, PDL: tl.constexpr
):
    """One whole row (``BLOCK_N >= N``): its sum of squares, then every element scaled."""
    pdl.release(PDL)
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x_row = x_ptr + (row // R) * stride_outer + (row % R) * stride_row
    x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * inv_rms(tl.sum(x * x, axis=0), N, eps) * w
    tl.store(y_ptr + row * N + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, sum_ptr, stride_x, stride_r, N, eps, BLOCK_N: tl.constexpr, PDL: tl.constexpr
):
    """One whole row: ``x + residual`` stored in the input dtype, then that sum normalized."""
    pdl.release(PDL)
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    # The sum is an output in the input dtype; normalize the rounded value, as the unfused ops would.
    total = (x + r).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * N + cols, total, mask=mask)
    s = total.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = s * inv_rms(tl.sum(s * s, axis=0), N, eps) * w
    tl.store(y_ptr + row * N + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _launch_config(n: int) -> tuple[int, int]:
    block = triton.next_power_of_2(n)
    return block, min(max(block // 256, 1), 16)


def _check_norm_args(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[int, float]:
    validate.tensor("x", x, ndim=range(1, 9))
    validate.tensor("weight", weight, ndim=1)
    n = x.shape[-1]
    validate.shape("weight", weight, (n,), "the last dim of x")
    eps = validate.positive("eps", eps, fp32=True)
    if n > MAX_N:
        raise ValueError(f"x: last dim {n} exceeds the {MAX_N} a single-row kernel supports")
    return n, eps


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim, in fp32, rounded once."""
    n, eps = _check_norm_args(x, weight, eps)
    validate.same_dtype("weight", weight, "x", x)
    grid = validate.as_row_grid("x", x)  # per-head rows of a fused QKV view work too (qk-norm)
    y = validate.output(out, x.shape, x.dtype, x, reads={"x": x, "weight": weight}, in_place=("x",))
    outer, per_outer = grid.shape[0], grid.shape[1]
    if outer * per_outer == 0 or n == 0:
        return y
    block, warps = _launch_config(n)
    _rms_norm_kernel[(outer * per_outer,)](
        grid,
        weight,
        y,
        per_outer,
        grid.stride(0),
        grid.stride(1),
        n,
        eps,
        BLOCK_N=block,
        num_warps=warps,
        **pdl.launch_options(),
    )
    return y


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(rms_norm(x + residual), x + residual)`` in one pass over the row."""
    n, eps = _check_norm_args(x, weight, eps)
    validate.tensor("residual", residual)
    validate.shape("residual", residual, x.shape, "the shape of x")
    validate.same_dtype("residual", residual, "x", x)
    validate.same_dtype("weight", weight, "x", x)
    x_rows = validate.as_rows("x", x)
    r_rows = validate.as_rows("residual", residual)
    y_out, sum_out = validate.pair("out", out)
    inputs = {"x": x, "residual": residual, "weight": weight}  # each program reads its row first
    in_place = ("x", "residual")
    y = validate.output(y_out, x.shape, x.dtype, x, "out[0]", reads=inputs, in_place=in_place)
    total = validate.output(
        sum_out, x.shape, x.dtype, x, "out[1]", reads=inputs | {"out[0]": y}, in_place=in_place
    )
    if x_rows.shape[0] == 0 or n == 0:
        return y, total
    block, warps = _launch_config(n)
    _add_rms_norm_kernel[(x_rows.shape[0],)](
        x_rows,
        r_rows,
        weight,
        y,
        total,
        x_rows.stride(0),
        r_rows.stride(0),
        n,
        eps,
        BLOCK_N=block,
        num_warps=warps,
        **pdl.launch_options(),
    )
    return y, total
