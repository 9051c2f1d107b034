"""Optional qk-norm, RoPE on q and k, and the KV cache store, fused into one launch
(article ops 4, 5, 18 and qk-norm).

Per layer the decoder would otherwise launch rms_norm(q), rms_norm(k) (Qwen3), apply_rope(q),
apply_rope(k) and kv_cache_store: 3 to 5 launches of a few microseconds of work each, where
launch cost dominates decode. Here each program takes one token's q heads or its kv heads
(``ops.heads.heads_per_program`` of them as one tile) and reads each head row once: q heads
are rotated into ``out``; for kv heads the rotated k and plain v go straight into the cache row
``start_pos[b] + s`` (rows outside ``0..L-1`` are not written, as in ``kv_cache_store``).

The result matches the unfused ops: the normalized row is rounded to the input dtype before
the rotation (the separate rms_norm op outputs in that dtype), and the rotation is the same
fp32 ``x1 * c - x2 * s, x2 * c + x1 * s`` as ``ops.rope`` (its ``norm_rope_rows``), rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops import pdl, validate
from ops.heads import head_block, heads_per_program
from ops.rope import norm_rope_rows


@triton.jit
def _rope_kv_store_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    kc_ptr,
    vc_ptr,
    start_ptr,
    qw_ptr,
    kw_ptr,
    out_ptr,
    eps,
    S,
    L,
    HQ,
    HKV,
    D,
    HALF,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_sb,
    stride_ss,
    HAS_NORM: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_REST: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program ``(token, block)``: a block of that token's q heads, or of its kv heads (the blocks
    after q's), each normalized (with ``HAS_NORM``) and rotated; k and v go to the caches' row
    ``start_pos[b] + s``, q to ``out``."""
    pdl.release(PDL)
    pdl.wait(PDL)
    token = tl.program_id(0)
    block = tl.program_id(1)
    b = (token // S).to(tl.int64)
    s = (token % S).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    mask = i < HALF
    j = 2 * HALF + tl.arange(0, BLOCK_REST)
    rest_mask = j < D
    c = tl.load(cos_ptr + b * stride_cb + s * stride_cs + i, mask=mask, other=0.0)
    sn = tl.load(sin_ptr + b * stride_sb + s * stride_ss + i, mask=mask, other=0.0)
    q_blocks = tl.cdiv(HQ, BLOCK_HQ)
    if block < q_blocks:  # q heads: rotate into out[b, s, head]
        head, q_ok = head_block(block, HQ, BLOCK_HQ)
        x_rows = q_ptr + b * stride_qb + s * stride_qs + head * stride_qh
        q1, q2, q_rest = norm_rope_rows(x_rows, qw_ptr, c, sn, eps, D, HALF, HAS_NORM, BLOCK_HALF, BLOCK_REST)
        out_rows = out_ptr + (token.to(tl.int64) * HQ + head) * D
        tl.store(out_rows + i, q1, mask=q_ok & mask)
        tl.store(out_rows + HALF + i, q2, mask=q_ok & mask)
        tl.store(out_rows + j, q_rest, mask=q_ok & rest_mask)
    else:  # kv heads: rotated k and plain v into cache row start_pos[b] + s, if it exists
        kvh, kv_ok = head_block(block - q_blocks, HKV, BLOCK_HKV)
        row = tl.load(start_ptr + b).to(tl.int64) + s
        # v is requested with the cache row, not after k's math: its read is in bounds either way
        d = tl.arange(0, BLOCK_D)
        v = tl.load(v_ptr + b * stride_vb + s * stride_vs + kvh * stride_vh + d, mask=d < D)
        row_ok = kv_ok & (row < L) & (row >= 0)
        k_rows = k_ptr + b * stride_kb + s * stride_ks + kvh * stride_kh
        k1, k2, k_rest = norm_rope_rows(k_rows, kw_ptr, c, sn, eps, D, HALF, HAS_NORM, BLOCK_HALF, BLOCK_REST)
        dst = ((b * L + row) * HKV + kvh) * D
        tl.store(kc_ptr + dst + i, k1, mask=row_ok & mask)
        tl.store(kc_ptr + dst + HALF + i, k2, mask=row_ok & mask)
        tl.store(kc_ptr + dst + j, k_rest, mask=row_ok & rest_mask)
        tl.store(vc_ptr + dst + d, v, mask=row_ok & (d < D))


def rope_kv_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start_pos: torch.Tensor,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Optional qk-norm, then RoPE on q (returned) and k (stored with v into the caches in place).

    The composition ``rms_norm`` (q and k, when ``q_norm``/``k_norm`` are given), ``apply_rope``
    (q and k), ``kv_cache_store(k_cache, v_cache, k_rot, v, start_pos)`` in one launch.
    """
    validate.tensor("q", q, ndim=4)
    validate.tensor("k", k, ndim=4)
    validate.tensor("v", v, ndim=4)
    if (q_norm is None) != (k_norm is None):
        given, missing = ("q_norm", "k_norm") if k_norm is None else ("k_norm", "q_norm")
        raise ValueError(
            f"{missing}: expected a tensor since {given} is given (qk-norm normalizes q and k), got None"
        )
    if q_norm is not None:
        validate.tensor("q_norm", q_norm, ndim=1)
        validate.tensor("k_norm", k_norm, ndim=1)
        eps = validate.positive("eps", eps, fp32=True)
    else:
        eps = 0.0  # no qk-norm: eps is unused, and any value is accepted, as the reference does
    batch, seq, q_heads, dim = q.shape
    check_cos_sin_caches(cos, sin, k_cache, v_cache, start_pos, batch, seq, dim, q)
    capacity, kv_heads = k_cache.shape[1], k_cache.shape[2]
    validate.shape("k", k, (batch, seq, kv_heads, dim), "[B, S, Hkv, D] matching q and k_cache")
    validate.shape("v", v, k.shape, "the shape of k")
    for name, t in (("k", k), ("v", v)):
        validate.same_dtype(name, t, "q", q)
    if q_norm is not None:
        validate.shape("q_norm", q_norm, (dim,), "the head_dim of q")
        validate.shape("k_norm", k_norm, (dim,), "the head_dim of k")
        validate.same_dtype("q_norm", q_norm, "q", q)
        validate.same_dtype("k_norm", k_norm, "q", q)
    half = cos.shape[-1]
    read = {"q": q, "k": k, "v": v, "q_norm": q_norm, "k_norm": k_norm}
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        validate.disjoint(name, cache, read)
    read |= {"k_cache": k_cache, "v_cache": v_cache}
    result = validate.output(out, q.shape, q.dtype, q, reads=read, in_place=("q",))
    if batch * seq * (q_heads + kv_heads) == 0:
        return result

    rest = dim - 2 * half
    block_half = triton.next_power_of_2(half)
    block_hq = heads_per_program(q_heads, block_half, batch * seq)
    block_hkv = heads_per_program(kv_heads, block_half, batch * seq)
    blocks = triton.cdiv(q_heads, block_hq) + triton.cdiv(kv_heads, block_hkv)
    _rope_kv_store_kernel[(batch * seq, blocks)](
        q,
        k,
        v,
        cos,
        sin,
        k_cache,
        v_cache,
        start_pos,
        q if q_norm is None else q_norm,  # unused without qk-norm
        q if k_norm is None else k_norm,
        result,
        eps,
        seq,
        capacity,
        q_heads,
        kv_heads,
        dim,
        half,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        cos.stride(0),
        cos.stride(1),
        sin.stride(0),
        sin.stride(1),
        HAS_NORM=q_norm is not None,
        BLOCK_HQ=block_hq,
        BLOCK_HKV=block_hkv,
        BLOCK_HALF=block_half,
        BLOCK_REST=triton.next_power_of_2(rest) if rest else 1,  # 1: an always-masked stub
        BLOCK_D=triton.next_power_of_2(dim),
        num_warps=2,  # 4 warps lowered a one-head tile with qk-norm to 3x the instructions
        **pdl.launch_options(),
    )
    return result


def check_cos_sin_caches(
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start_pos: torch.Tensor,
    batch: int,
    seq: int,
    dim: int,
    q: torch.Tensor,
    q_name: str = "q",
) -> None:
    """The rotation tables, caches and start rows for ``batch * seq`` new tokens of head_dim
    ``dim`` (q in ``q``'s dtype): what ``rope_kv_store`` and the QKV projection with it in its
    epilogue (``ops.fused_linear``, whose q comes from its argument ``x``) both take; errors about
    q name ``q_name``."""
    validate.tensor("cos", cos, ndim=3, dtypes=(torch.float32,))
    validate.tensor("sin", sin, ndim=3, dtypes=(torch.float32,))
    validate.tensor("k_cache", k_cache, ndim=4)
    validate.tensor("v_cache", v_cache, ndim=4)
    validate.tensor("start_pos", start_pos, ndim=1, dtypes=(torch.int32,))
    validate.contiguous("k_cache", k_cache)
    validate.contiguous("v_cache", v_cache)
    capacity, kv_heads = k_cache.shape[1], k_cache.shape[2]
    validate.shape("k_cache", k_cache, (batch, capacity, kv_heads, dim), f"[B, L, Hkv, D] matching {q_name}")
    validate.shape("v_cache", v_cache, k_cache.shape, "the shape of k_cache")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        validate.same_dtype(name, t, q_name, q)
    half = cos.shape[-1]
    validate.shape("cos", cos, (batch, seq, half), f"[B, S, rotary_dim / 2] matching {q_name}")
    validate.shape("sin", sin, cos.shape, "the shape of cos")
    if not 0 < 2 * half <= dim:
        raise ValueError(f"cos: rotary_dim {2 * half} must be in 1..head_dim ({dim}) of the heads")
    validate.shape("start_pos", start_pos, (batch,), "one start row per batch entry")
    if seq > capacity:
        raise ValueError(f"{q_name}: {seq} new tokens a row do not fit k_cache of capacity {capacity}")
    read = {"cos": cos, "sin": sin, "start_pos": start_pos}
    validate.disjoint("k_cache", k_cache, read)
    validate.disjoint("v_cache", v_cache, read | {"k_cache": k_cache})
