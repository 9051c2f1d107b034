"""Rotary position embedding: the cos/sin table (article op 19) and rotate-half RoPE (ops 4, 5).

``inv_freq`` is computed once per (rotary_dim, base, device) with torch, exactly as HF does,
and cached, so the table kernel only multiplies and takes cos/sin, and a captured decode
graph allocates nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops import norm, pdl, validate
from ops.heads import head_block, heads_per_program

MAX_ROTARY_DIM = 2 * norm.MAX_N  # one token's half of the table is one block of registers, as a norm row is
_inv_freq_cache: dict[tuple[int, float, torch.device], torch.Tensor] = {}


def inv_freq(rotary_dim: int, base: float, device: torch.device) -> torch.Tensor:
    key = (rotary_dim, float(base), device)
    if key not in _inv_freq_cache:
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
        _inv_freq_cache[key] = 1.0 / (base**exponents)
    return _inv_freq_cache[key]


@triton.jit
def _rope_cos_sin_kernel(
    pos_ptr,
    inv_freq_ptr,
    cos_ptr,
    sin_ptr,
    S,
    stride_pb,
    stride_ps,
    HALF,
    BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    """One token: ``cos`` and ``sin`` of its position times each of the HALF inverse frequencies."""
    pdl.release(PDL)
    pdl.wait(PDL)
    token = tl.program_id(0)
    b = token // S
    s = token % S
    pos = tl.load(pos_ptr + b.to(tl.int64) * stride_pb + s.to(tl.int64) * stride_ps).to(tl.float32)
    i = tl.arange(0, BLOCK_HALF)
    mask = i < HALF
    angle = pos * tl.load(inv_freq_ptr + i, mask=mask, other=0.0)
    base = token.to(tl.int64) * HALF
    tl.store(cos_ptr + base + i, tl.cos(angle), mask=mask)
    tl.store(sin_ptr + base + i, tl.sin(angle), mask=mask)


def rope_cos_sin(
    positions: torch.Tensor,
    rotary_dim: int,
    base: float,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of ``positions * inv_freq``: fp32 ``[B, S, rotary_dim / 2]`` each."""
    validate.tensor("positions", positions, ndim=2, dtypes=validate.INDEX_DTYPES, last_dim_contiguous=False)
    rotary_dim = validate.positive("rotary_dim", rotary_dim, integer=True)
    if rotary_dim % 2 or rotary_dim > MAX_ROTARY_DIM:
        raise ValueError(f"rotary_dim: expected an even number up to {MAX_ROTARY_DIM}, got {rotary_dim}")
    base = validate.positive("base", base)
    batch, seq = positions.shape
    half = rotary_dim // 2
    cos_out, sin_out = validate.pair("out", out)
    reads = {"positions": positions}
    cos = validate.output(cos_out, (batch, seq, half), torch.float32, positions, "out[0]", reads=reads)
    sin = validate.output(
        sin_out, cos.shape, torch.float32, positions, "out[1]", reads=reads | {"out[0]": cos}
    )
    if batch * seq == 0:
        return cos, sin
    freqs = inv_freq(rotary_dim, base, positions.device)
    _rope_cos_sin_kernel[(batch * seq,)](
        positions,
        freqs,
        cos,
        sin,
        seq,
        positions.stride(0),
        positions.stride(1),
        half,
        BLOCK_HALF=triton.next_power_of_2(half),
        **pdl.launch_options(),
    )
    return cos, sin


@triton.jit
def norm_rope_rows(
    x_rows,
    w_ptr,
    c,
    sn,
    eps,
    D,
    HALF,
    HAS_NORM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_REST: tl.constexpr,
):
    """Head rows as (rotated first half, rotated second half, pass-through rest), each
    ``[R, BLOCK_HALF]`` (``[R, BLOCK_REST]``) and rounded to the rows' dtype; with ``HAS_NORM``
    each row is first RMS-normalized by ``w_ptr`` and ``eps`` (``ops.rope_kv_store``). ``x_rows``
    is a ``[R, 1]`` block of row starts, every one readable. ``BLOCK_REST`` >= 1: with no
    pass-through dims it is a masked stub."""
    dtype = x_rows.dtype.element_ty
    i = tl.arange(0, BLOCK_HALF)
    mask = i < HALF
    j = 2 * HALF + tl.arange(0, BLOCK_REST)
    rest_mask = j < D
    x1 = tl.load(x_rows + i, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_rows + HALF + i, mask=mask, other=0.0).to(tl.float32)
    rest = tl.load(x_rows + j, mask=rest_mask, other=0.0).to(tl.float32)
    if HAS_NORM:  # rms_norm over the whole row (all three parts), rounded as the separate op rounds
        # the scale is requested with the row, before the reduction, so the two trips overlap
        w1 = tl.load(w_ptr + i, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + i, mask=mask, other=0.0).to(tl.float32)
        wr = tl.load(w_ptr + j, mask=rest_mask, other=0.0).to(tl.float32)
        sum_sq = (
            tl.sum(x1 * x1, axis=-1, keep_dims=True)
            + tl.sum(x2 * x2, axis=-1, keep_dims=True)
            + tl.sum(rest * rest, axis=-1, keep_dims=True)
        )
        inv_rms = norm.inv_rms(sum_sq, D, eps)
        x1 = (x1 * inv_rms * w1).to(dtype).to(tl.float32)
        x2 = (x2 * inv_rms * w2).to(dtype).to(tl.float32)
        rest = (rest * inv_rms * wr).to(dtype).to(tl.float32)
    y1 = (x1 * c - x2 * sn).to(dtype)
    y2 = (x2 * c + x1 * sn).to(dtype)
    return y1, y2, rest.to(dtype)  # rest holds dtype values already: the cast back is exact


@triton.jit
def _apply_rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    S,
    H,
    D,
    HALF,
    stride_xb,
    stride_xs,
    stride_xh,
    stride_cb,
    stride_cs,
    stride_sb,
    stride_ss,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_REST: tl.constexpr,
    PDL: tl.constexpr,
):
    """BLOCK_H heads of one token, each rotated by the token's cos/sin (rotate-half pairs ``i``,
    ``i + HALF``); dims past ``2 * HALF`` are copied."""
    pdl.release(PDL)
    pdl.wait(PDL)
    token = tl.program_id(0)
    head, head_ok = head_block(tl.program_id(1), H, BLOCK_H)
    b = (token // S).to(tl.int64)
    s = (token % S).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    mask = i < HALF
    c = tl.load(cos_ptr + b * stride_cb + s * stride_cs + i, mask=mask, other=0.0)
    sn = tl.load(sin_ptr + b * stride_sb + s * stride_ss + i, mask=mask, other=0.0)
    x_rows = x_ptr + b * stride_xb + s * stride_xs + head * stride_xh
    y1, y2, rest = norm_rope_rows(x_rows, x_rows, c, sn, 0.0, D, HALF, False, BLOCK_HALF, BLOCK_REST)
    out_rows = out_ptr + (token.to(tl.int64) * H + head) * D
    tl.store(out_rows + i, y1, mask=head_ok & mask)
    tl.store(out_rows + HALF + i, y2, mask=head_ok & mask)
    j = 2 * HALF + tl.arange(0, BLOCK_REST)  # partial rotary: the dims past 2 * HALF pass through
    tl.store(out_rows + j, rest, mask=head_ok & (j < D))


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Rotate-half RoPE on the first ``2 * cos.shape[-1]`` dims of every head of ``x[B, S, H, D]``."""
    validate.tensor("x", x, ndim=4)
    validate.tensor("cos", cos, ndim=3, dtypes=(torch.float32,))
    validate.tensor("sin", sin, ndim=3, dtypes=(torch.float32,))
    batch, seq, heads, dim = x.shape
    half = cos.shape[-1]
    validate.shape("cos", cos, (batch, seq, half), "[B, S, rotary_dim / 2] matching x")
    validate.shape("sin", sin, cos.shape, "the shape of cos")
    if not 0 < 2 * half <= dim:
        raise ValueError(f"cos: rotary_dim {2 * half} must be in 1..head_dim ({dim}) of x")
    reads = {"x": x, "cos": cos, "sin": sin}
    result = validate.output(out, x.shape, x.dtype, x, reads=reads, in_place=("x",))
    if batch * seq * heads == 0:
        return result
    rest = dim - 2 * half
    block_half = triton.next_power_of_2(half)
    block_h = heads_per_program(heads, block_half, batch * seq)
    _apply_rope_kernel[(batch * seq, triton.cdiv(heads, block_h))](
        x,
        cos,
        sin,
        result,
        seq,
        heads,
        dim,
        half,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        cos.stride(0),
        cos.stride(1),
        sin.stride(0),
        sin.stride(1),
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        BLOCK_REST=triton.next_power_of_2(rest) if rest else 1,  # 1: an always-masked stub
        **pdl.launch_options(),
    )
    return result
