"""Deliberately broken copies of real kernels: the verification must catch every one.

Each mirrors its kernel in ``ops/`` with one bug a kernel author really makes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops import norm


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, stride_x, N, eps, BLOCK_N: tl.constexpr, BUG: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    if BUG == "tail_dropped":  # the last partial chunk of 16 is never loaded
        mask = cols < (N // 16) * 16
    elif BUG == "off_by_one":
        mask = cols < N - 1
    else:
        mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if BUG == "wrong_eps":  # eps added outside the square root
        inv_rms = 1.0 / (tl.sqrt(tl.sum(x * x, axis=0) / N) + eps)
    else:
        inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    tl.store(y_ptr + row * N + cols, (x * inv_rms * w).to(y_ptr.dtype.element_ty), mask=cols < N)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, bug: str) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(x.shape[-1])
    _rms_norm_kernel[(rows.shape[0],)](
        rows, weight, y, rows.stride(0), x.shape[-1], eps, BLOCK_N=block, BUG=bug
    )
    return y


def rms_norm_tail_dropped(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm(x, weight, eps, "tail_dropped")


def rms_norm_off_by_one(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm(x, weight, eps, "off_by_one")


def rms_norm_wrong_eps(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm(x, weight, eps, "wrong_eps")


def rms_norm_half_written(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Computes the right rows but only writes the first half of them."""
    y = torch.empty_like(x.contiguous())
    right = norm.rms_norm(x, weight, eps)
    rows = y.view(-1, y.shape[-1])
    rows[: rows.shape[0] // 2 + rows.shape[0] % 2].copy_(
        right.view(-1, y.shape[-1])[: rows.shape[0] // 2 + rows.shape[0] % 2]
    )
    return y
