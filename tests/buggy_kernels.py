"""Deliberately broken copies of real kernels: the verification must catch every one.

Each mirrors its kernel in ``ops/`` with one bug a kernel author really makes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops import norm
from ops.heads import head_block, heads_per_program
from ops.rope import norm_rope_rows


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, y_ptr, flags_ptr, stride_x, N, eps, BLOCK_N: tl.constexpr, BUG: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    if BUG == "waits_for_next_row":  # an order between programs that the grid never promised:
        while tl.load(flags_ptr + row + 1, volatile=True) == 0:  # the last row waits for no one
            N = N + 0
    if BUG == "tail_dropped":  # the last partial chunk of 16 is never loaded
        mask = cols < (N // 16) * 16
    elif BUG == "off_by_one":
        mask = cols < N - 1
    else:
        mask = cols < N
    if BUG == "row_offset_wrapped":  # the row's offset wrapped to a huge one (here: 2^40 elements on)
        x = tl.load(x_ptr + row * stride_x + (1 << 40) + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    elif BUG == "tail_loaded_unmasked":  # the block read whole, the lanes past N zeroed after the load
        x = tl.where(mask, tl.load(x_ptr + row * stride_x + cols), 0.0).to(tl.float32)
        w = tl.where(mask, tl.load(w_ptr + cols), 0.0).to(tl.float32)
    else:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if BUG == "wrong_eps":  # eps added outside the square root
        inv_rms = 1.0 / (tl.sqrt(tl.sum(x * x, axis=0) / N) + eps)
    else:
        inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    tl.store(y_ptr + row * N + cols, (x * inv_rms * w).to(y_ptr.dtype.element_ty), mask=cols < N)
    tl.store(flags_ptr + row, 1)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, bug: str) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    flags = torch.zeros(rows.shape[0] + 1, dtype=torch.int32, device=x.device)
    block = triton.next_power_of_2(x.shape[-1])
    _rms_norm_kernel[(rows.shape[0],)](
        rows, weight, y, flags, rows.stride(0), x.shape[-1], eps, BLOCK_N=block, BUG=bug
    )
    return y


def rms_norm_tail_dropped(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm(x, weight, eps, "tail_dropped")


def rms_norm_off_by_one(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm(x, weight, eps, "off_by_one")


def rms_norm_wrong_eps(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm(x, weight, eps, "wrong_eps")


def rms_norm_tail_loaded_unmasked(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Right values, wrong reads: each row's block is loaded whole, past N, and the extra lanes are
    zeroed after the load; the GPU reads past the end of x and the weight (and faults at a page's end)."""
    return _rms_norm(x, weight, eps, "tail_loaded_unmasked")


def rms_norm_reads_far_outside_x(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reads each row 2^40 elements past x, as a wrapped or garbage offset does: on the GPU an illegal
    address, which leaves the device unusable; under the interpreter's memcheck an OutOfBounds."""
    return _rms_norm(x, weight, eps, "row_offset_wrapped")


def rms_norm_waits_for_next_row(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Never returns: each program waits for the next row's flag, and the last row has no next."""
    return _rms_norm(x, weight, eps, "waits_for_next_row")


def rms_norm_half_written(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Computes the right rows but only writes the first half of them."""
    y = torch.empty_like(x.contiguous())
    right = norm.rms_norm(x, weight, eps)
    rows = y.view(-1, y.shape[-1])
    rows[: rows.shape[0] // 2 + rows.shape[0] % 2].copy_(
        right.view(-1, y.shape[-1])[: rows.shape[0] // 2 + rows.shape[0] % 2]
    )
    return y


# ---- GEMM ----------------------------------------------------------------------------------------


@triton.jit
def _linear_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    HAS_BIAS: tl.constexpr,
    BUG: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    if BUG == "contiguous_weight_assumed":  # ignores the weight's strides: wrong for any view
        stride_wn = K
        stride_wk = 1
    x_ptrs = x_ptr + (offs_m % M)[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + (offs_n % N)[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if BUG == "k_tail_dropped":  # only whole K blocks: the last K % BLOCK_K terms are never summed
        for _ in range(0, K // BLOCK_K):
            acc = tl.dot(tl.load(x_ptrs), tl.load(w_ptrs), acc)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
    else:
        for k in range(0, K, BLOCK_K):
            a = tl.load(x_ptrs, mask=offs_k[None, :] < K - k, other=0.0)
            b = tl.load(w_ptrs, mask=offs_k[:, None] < K - k, other=0.0)
            acc = tl.dot(a, b, acc)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, bug: str) -> torch.Tensor:
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, 16), triton.cdiv(n, 32))
    _linear_kernel[grid](
        x,
        weight,
        bias if bias is not None else x,
        y,
        m,
        n,
        k,
        x.stride(0),
        x.stride(1),
        weight.stride(0),
        weight.stride(1),
        HAS_BIAS=bias is not None,
        BUG=bug,
        BLOCK_M=16,
        BLOCK_N=32,
        BLOCK_K=32,
    )
    return y


def linear_k_tail_dropped(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return _linear(x, weight, bias, "k_tail_dropped")


def linear_contiguous_weight_assumed(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return _linear(x, weight, bias, "contiguous_weight_assumed")


def linear_splitk_k_tail_dropped(
    x: torch.Tensor, weight: torch.Tensor, split_k: int, *, partials: torch.Tensor | None = None
) -> torch.Tensor:
    return _linear(x, weight, None, "k_tail_dropped")


def splitk_reduce_last_split_dropped(partials: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """An off-by-one in the loop over splits (``range(S - 1)``)."""
    return partials[: max(1, partials.shape[0] - 1)].sum(0).to(out_dtype)


# ---- attention ---------------------------------------------------------------------------------


@triton.jit
def _attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    seq_lens_ptr,
    o_ptr,
    qk_scale,
    S,
    L,
    HQ,
    HKV,
    stride_qb,
    stride_qs,
    stride_qh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BUG: tl.constexpr,
):
    """ops.attention's prefill kernel, every step masked, with one bug."""
    m_block = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // HQ).to(tl.int64)
    h = bh % HQ
    if BUG == "gqa_modulo":  # kv heads interleaved instead of grouped
        kvh = h % HKV
    else:
        kvh = h // GROUP
    seq_len = tl.load(seq_lens_ptr + b)
    kv_len = tl.minimum(seq_len, L)
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    pos = seq_len - S + offs_m
    if BUG == "causal_off_by_one":  # each query also sees the next row
        pos += 1
    q = tl.load(
        q_ptr + b * stride_qb + offs_m[:, None] * stride_qs + h * stride_qh + offs_d[None, :],
        mask=(offs_m < S)[:, None],
        other=0.0,
    )
    kv_base = (b * L * HKV + kvh) * HEAD_DIM
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in range(0, kv_len, BLOCK_N):
        keys = start + offs_n
        in_cache = keys < kv_len
        offsets = kv_base + keys[:, None] * HKV * HEAD_DIM + offs_d[None, :]
        k = tl.load(k_ptr + offsets, mask=in_cache[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(in_cache[None, :] & (keys[None, :] <= pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
        if BUG == "no_rescale":  # the running sums are not rescaled when the max grows
            alpha = tl.full([BLOCK_M], 1.0, tl.float32)
        else:
            alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + offsets, mask=in_cache[:, None], other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_rows = (b * S + offs_m) * HQ + h
    tl.store(
        o_ptr + o_rows[:, None] * HEAD_DIM + offs_d[None, :],
        o.to(o_ptr.dtype.element_ty),
        (offs_m < S)[:, None],
    )


def _attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    bug: str,
) -> torch.Tensor:
    batch, seq, q_heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _attention_kernel[(triton.cdiv(seq, 16), batch * q_heads)](
        q, k_cache, v_cache, seq_lens, o, scale * 1.4426950408889634, seq, k_cache.shape[1], q_heads,
        kv_heads, q.stride(0), q.stride(1), q.stride(2),
        GROUP=q_heads // kv_heads, HEAD_DIM=dim, BLOCK_M=16, BLOCK_N=16, BUG=bug,
    )  # fmt: skip
    return o


def attention_causal_off_by_one(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    return _attention(q, k_cache, v_cache, seq_lens, scale, "causal_off_by_one")


def attention_gqa_modulo(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    return _attention(q, k_cache, v_cache, seq_lens, scale, "gqa_modulo")


def attention_no_rescale(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    return _attention(q, k_cache, v_cache, seq_lens, scale, "no_rescale")


# ---- fused qk-norm + RoPE + KV cache store --------------------------------------------------------


@triton.jit
def _rope_kv_store_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, start_ptr, qw_ptr, kw_ptr, out_ptr, eps,
    S, L, HQ, HKV, D, HALF, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    HAS_NORM: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_REST: tl.constexpr, BLOCK_D: tl.constexpr, BUG: tl.constexpr,
):  # fmt: skip
    """ops.rope_kv_store's kernel (cos and sin contiguous), with one bug."""
    token = tl.program_id(0)
    block = tl.program_id(1)
    b = (token // S).to(tl.int64)
    s = (token % S).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    mask = i < HALF
    j = 2 * HALF + tl.arange(0, BLOCK_REST)
    rest_mask = j < D
    c = tl.load(cos_ptr + token.to(tl.int64) * HALF + i, mask=mask, other=0.0)
    sn = tl.load(sin_ptr + token.to(tl.int64) * HALF + i, mask=mask, other=0.0)
    if BUG == "rotated_backwards":  # x1 * c + x2 * s, x2 * c - x1 * s: the angle's sign flipped
        sn = -sn
    q_blocks = tl.cdiv(HQ, BLOCK_HQ)
    if block < q_blocks:
        head, q_ok = head_block(block, HQ, BLOCK_HQ)
        x_rows = q_ptr + b * stride_qb + s * stride_qs + head * stride_qh
        q1, q2, q_rest = norm_rope_rows(x_rows, qw_ptr, c, sn, eps, D, HALF, HAS_NORM, BLOCK_HALF, BLOCK_REST)
        out_rows = out_ptr + (token.to(tl.int64) * HQ + head) * D
        tl.store(out_rows + i, q1, mask=q_ok & mask)
        tl.store(out_rows + HALF + i, q2, mask=q_ok & mask)
        tl.store(out_rows + j, q_rest, mask=q_ok & rest_mask)
    else:
        kvh, kv_ok = head_block(block - q_blocks, HKV, BLOCK_HKV)
        row = tl.load(start_ptr + b).to(tl.int64) + s
        if BUG == "next_row":  # one cache row too far
            row += 1
        row_ok = kv_ok & (row < L) & (row >= 0)
        k_rows = k_ptr + b * stride_kb + s * stride_ks + kvh * stride_kh
        if BUG == "k_with_q_norm":  # k normalized with q's weights
            kw_ptr = qw_ptr
        k1, k2, k_rest = norm_rope_rows(k_rows, kw_ptr, c, sn, eps, D, HALF, HAS_NORM, BLOCK_HALF, BLOCK_REST)
        dst = ((b * L + row) * HKV + kvh) * D
        tl.store(kc_ptr + dst + i, k1, mask=row_ok & mask)
        tl.store(kc_ptr + dst + HALF + i, k2, mask=row_ok & mask)
        tl.store(kc_ptr + dst + j, k_rest, mask=row_ok & rest_mask)
        d = tl.arange(0, BLOCK_D)
        v = tl.load(v_ptr + b * stride_vb + s * stride_vs + kvh * stride_vh + d, mask=d < D)
        tl.store(vc_ptr + dst + d, v, mask=row_ok & (d < D))


def _rope_kv_store(q, k, v, cos, sin, k_cache, v_cache, start_pos, q_norm, k_norm, eps, bug):
    batch, seq, q_heads, dim = q.shape
    kv_heads, half = k_cache.shape[2], cos.shape[-1]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    rest = dim - 2 * half
    block_half = triton.next_power_of_2(half)
    block_hq = heads_per_program(q_heads, block_half, batch * seq)
    block_hkv = heads_per_program(kv_heads, block_half, batch * seq)
    blocks = triton.cdiv(q_heads, block_hq) + triton.cdiv(kv_heads, block_hkv)
    _rope_kv_store_kernel[(batch * seq, blocks)](
        q, k, v, cos.contiguous(), sin.contiguous(), k_cache, v_cache, start_pos,
        q if q_norm is None else q_norm, q if k_norm is None else k_norm, out, eps,
        seq, k_cache.shape[1], q_heads, kv_heads, dim, half,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        HAS_NORM=q_norm is not None, BLOCK_HQ=block_hq, BLOCK_HKV=block_hkv, BLOCK_HALF=block_half,
        BLOCK_REST=triton.next_power_of_2(rest) if rest else 1, BLOCK_D=triton.next_power_of_2(dim), BUG=bug,
    )  # fmt: skip
    return out


def rope_kv_store_next_row(
    q, k, v, cos, sin, k_cache, v_cache, start_pos, q_norm=None, k_norm=None, eps=1e-6
):
    return _rope_kv_store(q, k, v, cos, sin, k_cache, v_cache, start_pos, q_norm, k_norm, eps, "next_row")


def rope_kv_store_k_with_q_norm(
    q, k, v, cos, sin, k_cache, v_cache, start_pos, q_norm=None, k_norm=None, eps=1e-6
):
    return _rope_kv_store(
        q, k, v, cos, sin, k_cache, v_cache, start_pos, q_norm, k_norm, eps, "k_with_q_norm"
    )


def rope_kv_store_rotated_backwards(
    q, k, v, cos, sin, k_cache, v_cache, start_pos, q_norm=None, k_norm=None, eps=1e-6
):
    return _rope_kv_store(
        q, k, v, cos, sin, k_cache, v_cache, start_pos, q_norm, k_norm, eps, "rotated_backwards"
    )


# ---- embedding -------------------------------------------------------------------------------------


@triton.jit
def _embedding_unchecked_kernel(
    ids_ptr, table_ptr, out_ptr, S, stride_ib, stride_is, stride_t, H, BLOCK_H: tl.constexpr
):
    token = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    tok_id = tl.load(ids_ptr + (token // S).to(tl.int64) * stride_ib + (token % S).to(tl.int64) * stride_is)
    row = tl.load(table_ptr + tok_id.to(tl.int64) * stride_t + cols, mask=mask)  # no check that 0 <= id < V
    tl.store(out_ptr + token.to(tl.int64) * H + cols, row, mask=mask)


def embedding_unchecked_ids(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Right for every id in the table; an id far outside it reads unmapped memory (on the GPU, a
    fault that takes the device down with it)."""
    batch, seq = ids.shape
    out = torch.empty(batch, seq, table.shape[1], dtype=table.dtype, device=table.device)
    _embedding_unchecked_kernel[(batch * seq,)](
        ids, table, out, seq, ids.stride(0), ids.stride(1), table.stride(0), table.shape[1],
        BLOCK_H=triton.next_power_of_2(table.shape[1]),
    )  # fmt: skip
    return out


# ---- argmax ----------------------------------------------------------------------------------------


@triton.jit
def _argmax_last_chunk_picks_kernel(logits_ptr, val_ptr, idx_ptr, nan_ptr, out_ptr, stride_row, V, CHUNKS,
                                    BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
    first_nan = tl.min(tl.where((x != x) & (cols < V), cols, V), axis=0)
    best, arg = tl.max(tl.where(x != x, -float("inf"), x), axis=0, return_indices=True,
                       return_indices_tie_break_left=True)  # fmt: skip
    tl.store(val_ptr + row * CHUNKS + chunk, best)
    tl.store(idx_ptr + row * CHUNKS + chunk, (chunk * BLOCK_V + arg).to(tl.int64))
    tl.store(nan_ptr + row * CHUNKS + chunk, first_nan.to(tl.int64))
    if chunk == CHUNKS - 1:  # "the last chunk's program runs last": true on the interpreter only
        chunks = tl.arange(0, BLOCK_C)
        ok = chunks < CHUNKS
        vals = tl.load(val_ptr + row * CHUNKS + chunks, mask=ok, other=-float("inf"))
        nan = tl.min(tl.load(nan_ptr + row * CHUNKS + chunks, mask=ok, other=V), axis=0)
        _, best_chunk = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
        best_idx = tl.load(idx_ptr + row * CHUNKS + best_chunk)
        tl.store(out_ptr + row, tl.where(nan < V, nan, best_idx))


def argmax_picked_by_the_last_chunk(logits: torch.Tensor) -> torch.Tensor:
    """One launch instead of two: the last chunk's program picks among the chunks' partials, which
    other programs of the same launch store (no atomic ticket to say they are all there)."""
    batch, vocab = logits.shape
    block = min(256, triton.next_power_of_2(vocab))
    chunks = triton.cdiv(vocab, block)
    values = torch.empty(batch, chunks, dtype=torch.float32, device=logits.device)
    indices, nans = (torch.empty(batch, chunks, dtype=torch.int64, device=logits.device) for _ in range(2))
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    _argmax_last_chunk_picks_kernel[(batch, chunks)](
        logits, values, indices, nans, out, logits.stride(0), vocab, chunks,
        BLOCK_V=block, BLOCK_C=triton.next_power_of_2(chunks),
    )  # fmt: skip
    return out
