"""Residual add (article ops 11, 17) and the SwiGLU gate ``silu(gate) * up`` (article op 15).

Both are one kernel over rows: the operands may be row views of larger buffers (``gate`` and
``up`` are the two halves of the fused gate/up GEMM output), so each carries its row stride.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops import pdl, validate

BLOCK_N = 1024


@triton.jit
def _binary_rows_kernel(
    a_ptr, b_ptr, out_ptr, stride_a, stride_b, N, OP: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr
):
    """BLOCK_N columns of one row: ``a + b`` or ``silu(a) * b`` in fp32, rounded once."""
    pdl.release(PDL)
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    a = tl.load(a_ptr + row * stride_a + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + row * stride_b + cols, mask=mask, other=0.0).to(tl.float32)
    if OP == "add":
        c = a + b
    else:  # silu_mul
        c = a * tl.sigmoid(a) * b
    tl.store(out_ptr + row * N + cols, c.to(out_ptr.dtype.element_ty), mask=mask)


def _binary_rows(
    op: str, a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor, out: torch.Tensor | None
):
    validate.tensor(a_name, a, ndim=range(1, 9))
    validate.tensor(b_name, b)
    validate.shape(b_name, b, a.shape, f"the shape of {a_name}")
    validate.same_dtype(b_name, b, a_name, a)
    a_rows = validate.as_rows(a_name, a)
    b_rows = validate.as_rows(b_name, b)
    result = validate.output(
        out, a.shape, a.dtype, a, reads={a_name: a, b_name: b}, in_place=(a_name, b_name)
    )
    rows, n = a_rows.shape
    validate.grid_axis(a_name, triton.cdiv(n, BLOCK_N), f"a row of {n} elements")
    if rows == 0 or n == 0:
        return result
    grid = (rows, triton.cdiv(n, BLOCK_N))
    _binary_rows_kernel[grid](
        a_rows,
        b_rows,
        result,
        a_rows.stride(0),
        b_rows.stride(0),
        n,
        OP=op,
        BLOCK_N=BLOCK_N,
        **pdl.launch_options(),
    )
    return result


def add(x: torch.Tensor, y: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x + y`` computed in fp32 and rounded once."""
    return _binary_rows("add", "x", x, "y", y, out)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` computed in fp32 and rounded once."""
    return _binary_rows("silu_mul", "gate", gate, "up", up, out)
