"""The decoder's projections: ``x @ weight.T (+ bias)`` (article ops 2, 10, 13, 14, 16, 21).

Two kernels, one choice per shape, fixed ahead of time in ``ops.gemm_config`` (no autotune: it
would run inside CUDA Graph capture):

* ``tiled``: the Triton tutorial's matmul. Each program owns a BLOCK_M x BLOCK_N output tile
  and walks K with ``tl.dot``; tiles are visited in groups of GROUP_M rows so a strip of the
  weight is reused from L2 while it is hot. Prefill (M in the hundreds) is compute bound here.
* ``gemv``: decode (M <= 4). A matmul tile would waste most of its rows, and what counts is
  streaming the weight once at memory bandwidth, so each program owns BLOCK_N outputs and
  reads their weight rows in wide (16-byte) BLOCK_K chunks, all of them at once when K fits
  one chunk (or a chunk plus one or two whole power-of-two pieces: ``k_pieces``, down_proj's
  4864 = 4096 + 512 + 256), else through a pipelined loop, to keep enough bytes in flight. One
  step is a straight line (no loop), and takes far fewer registers, so more programs fit an SM:
  the article's decode gate_up went from 11.6-12.0 to 8.3-8.8 us in the step that way (H200,
  2026-11-30). A persistent variant (a wave of programs each streaming block after block) lost
  in the decode step (PERFORMANCE.md).

Either kernel can split K (``split_k`` programs per output tile, each over a contiguous K
range) when the output alone gives too few programs to fill the GPU (N=1024 at M=1 is 256
GEMV programs for 132 SMs): the splits write fp32 partials ``[split_k, M, N]`` and
``splitk_reduce`` sums them in a fixed order and rounds once. No atomics, so results are
deterministic. The partials live in the caller's buffer or a per-shape workspace, so a CUDA
Graph capture of a warmed-up call allocates nothing.

Both kernels read ``x`` and ``weight`` through their strides (the model passes column slices
of fused buffers); the accumulator is fp32 and the bias is added in fp32 before the single
rounding to the output dtype.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ops import pdl, scratch, validate
from ops.gemm_config import GEMV_MAX_M, MAX_SPLIT_K, GemmConfig, config_for, k_pieces, table_config

SMEM_BYTES = 227 * 1024  # shared memory a Hopper block may use: bounds the pipeline depth
MAX_NORM_BLOCK = 4096  # the norm prologue reads a row of up to this many in one step, longer in steps
# the gemv's weight loads: each element is read once a launch (see _gemv_kernel)
WEIGHT_EVICTION = tl.constexpr("evict_first")


# ---- kernels -----------------------------------------------------------------------------------


@triton.jit
def _tiled_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_os,
    stride_om,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    FP32_IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PDL: tl.constexpr,
):
    """``out[split] = x[:, K range of split] @ weight[:, same range].T``, plus bias when not split."""
    pdl.release(PDL)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    # Grouped order: GROUP_M consecutive programs share a weight strip while it sits in L2.
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past M / N re-read valid rows (wrapped), so loads need no M/N mask; the store is masked.
    rows = (offs_m % M).to(tl.int64)
    cols = (offs_n % N).to(tl.int64)
    k_start = split * k_per_split
    k_len = min(K - k_start, k_per_split)  # <= 0 for a trailing empty split: it writes zeros
    k_base = k_start.to(tl.int64)
    x_ptrs = x_ptr + k_base * stride_xk + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + k_base * stride_wk + cols[None, :] * stride_wn + offs_k[:, None] * stride_wk
    pdl.wait(PDL)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, k_len, BLOCK_K):
        if EVEN_K:  # whole blocks only: no mask, the loads stay vectorized
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:  # the K tail: masked lanes read 0 and add nothing
            a = tl.load(x_ptrs, mask=offs_k[None, :] < k_len - k, other=0.0)
            b = tl.load(w_ptrs, mask=offs_k[:, None] < k_len - k, other=0.0)
        if FP32_IEEE:  # tl.dot would use TF32 (10-bit mantissa) for fp32 operands on the GPU
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + split.to(tl.int64) * stride_os + offs_m[:, None].to(tl.int64) * stride_om
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptrs + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _inv_rms(x_row, a_row, K, eps, stride_xk, stride_ak, BLOCK_M: tl.constexpr, NORM_BLOCK: tl.constexpr):
    """``1 / rms(x + a)`` per row over all of K, the sum rounded to x's dtype first (as
    ``add_rms_norm``). NORM_BLOCK covers K (hidden sizes) so this is one round trip to L2."""
    offs = tl.arange(0, NORM_BLOCK)
    squares = tl.zeros((BLOCK_M, NORM_BLOCK), dtype=tl.float32)
    for k in range(0, K, NORM_BLOCK):
        mask = offs[None, :] < K - k
        x = tl.load(x_row + (k + offs[None, :]) * stride_xk, mask=mask, other=0.0)
        a = tl.load(a_row + (k + offs[None, :]) * stride_ak, mask=mask, other=0.0)
        total = (x.to(tl.float32) + a.to(tl.float32)).to(x_row.dtype.element_ty).to(tl.float32)
        squares += total * total
    # Triton's approximate / and sqrt, not norm.inv_rms's rounded ones: those cost the one-step
    # gemv 14 registers (gate_up 79 -> 93, 6 -> 5 programs an SM), and an ulp of fp32 rms here is
    # far below the error of the product it scales.
    return 1.0 / tl.sqrt(tl.sum(squares, axis=1) / K + eps)


@triton.jit
def _gemv_chunk(
    acc, x_ptrs, w_ptrs, a_ptrs, sum_ptrs, norm_ptrs, inv_rms, offs_k, offs_m, M, store_sum, k_left, K, eps,
    PROLOGUE: tl.constexpr, MASKED: tl.constexpr, BLOCK_M: tl.constexpr, ONE_STEP: tl.constexpr,
    w_early=None, LOADED_EARLY: tl.constexpr = False,
):  # fmt: skip
    """One BLOCK_K step of ``_gemv_kernel``: load x (through the prologue) and w (or take the
    ``w_early`` chunk loaded before the PDL wait), accumulate x * w.

    With one row the products are a ``[BLOCK_N, BLOCK_K]`` tile: a loop step adds them to ``acc``,
    one step returns them (``acc`` unused). A 2-D tile reduces within warps, where a
    ``[1, BLOCK_N, BLOCK_K]`` one went through a shared-memory layout change first."""
    k_ok = offs_k < k_left
    a = x_ptrs  # placeholders without a prologue
    scale = inv_rms
    if MASKED:  # the K tail: masked lanes read 0 and add nothing
        x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
        w = (
            w_early
            if LOADED_EARLY
            else tl.load(w_ptrs, mask=k_ok[None, :], other=0.0, eviction_policy=WEIGHT_EVICTION)
        )
        if PROLOGUE == "add_rms_norm":
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            scale = tl.load(norm_ptrs + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    else:
        x = tl.load(x_ptrs)
        w = w_early if LOADED_EARLY else tl.load(w_ptrs, eviction_policy=WEIGHT_EVICTION)
        if PROLOGUE == "add_rms_norm":
            a = tl.load(a_ptrs)
            scale = tl.load(norm_ptrs + offs_k).to(tl.float32)
    x = _gemv_prologue(x, a, scale, sum_ptrs, inv_rms, k_ok, offs_m, M, store_sum, K, eps, PROLOGUE, ONE_STEP)
    if BLOCK_M == 1 and ONE_STEP:  # the whole row times the block's rows, [BLOCK_N, BLOCK_K]
        acc = x.to(tl.float32) * w.to(tl.float32)
    elif BLOCK_M == 1:
        acc += x.to(tl.float32) * w.to(tl.float32)
    else:
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    return acc


@triton.jit
def _piece_products(x_ptr, rows, offs, stride_xm, stride_xk, w):
    """x's K range ``offs`` (a whole piece past the one-step chunk, see ``k_pieces``) times its
    loaded weight piece: the fp32 ``[BLOCK_N, PIECE]`` products of the one row."""
    x = tl.load(x_ptr + rows[:, None] * stride_xm + offs[None, :] * stride_xk)
    return x.to(tl.float32) * w.to(tl.float32)


@triton.jit
def _gemv_prologue(
    x, a, scale, sum_ptrs, inv_rms, k_ok, offs_m, M, store_sum, K, eps,
    PROLOGUE: tl.constexpr, ONE_STEP: tl.constexpr,
):  # fmt: skip
    """A loaded x chunk through the prologue, rounded to x's dtype as the unfused op's output is:
    ``"add_rms_norm"`` ((x + a) * inv_rms * scale; ``store_sum`` stores x + a to ``sum_ptrs``; with
    ``ONE_STEP`` the chunk is the whole row and gives inv_rms)."""
    if PROLOGUE == "add_rms_norm":
        total = (x.to(tl.float32) + a.to(tl.float32)).to(x.dtype)
        if store_sum:
            tl.store(sum_ptrs, total, mask=(offs_m[:, None] < M) & k_ok[None, :])
        if ONE_STEP:  # masked lanes hold 0: the sum of squares is the row's
            squares = total.to(tl.float32) * total.to(tl.float32)
            inv_rms = 1.0 / tl.sqrt(tl.sum(squares, axis=1) / K + eps)  # approximate: see _inv_rms
        x = (total.to(tl.float32) * inv_rms[:, None] * scale[None, :]).to(x.dtype)
    return x


@triton.jit
def _rope_tables(offs_m, pairs, M, N, rope, HEAD_DIM: tl.constexpr):
    """What the ``rope_kv_store`` epilogue reads besides the sums: token m's (cos, sin) of each
    pair's d, and its cache row ``start_pos[b] + s``. Loaded before the weight stream, so their
    round trip to L2 overlaps it instead of following it."""
    d = pairs % (HEAD_DIM // 2)
    m_ok = offs_m < M
    b = (offs_m // rope.seq).to(tl.int64)
    s = (offs_m % rope.seq).to(tl.int64)
    ok = m_ok[:, None] & (pairs[None, :] < N)
    cos_offs = b[:, None] * rope.cos_stride_b + s[:, None] * rope.cos_stride_s + d[None, :]
    sin_offs = b[:, None] * rope.sin_stride_b + s[:, None] * rope.sin_stride_s + d[None, :]
    c = tl.load(rope.cos + cos_offs, mask=ok, other=0.0)
    sn = tl.load(rope.sin + sin_offs, mask=ok, other=0.0)
    row = tl.load(rope.start_pos + b, mask=m_ok, other=0).to(tl.int64) + s
    return c, sn, row


@triton.jit
def _rope_kv_store_epilogue(
    acc, offs_m, pairs, M, N, q_ptr, rope, c, sn, row,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """``rope_kv_store`` (no qk-norm) on the QKV gemv's sums: pair p holds rows d and d + HEAD_DIM/2
    of head p // (HEAD_DIM/2), each sum rounded as ``linear`` rounds it; q and k pairs are rotated
    by token m's (cos, sin) of d (``c``, ``sn``) as ``ops.rope`` rotates, in fp32 and rounded once;
    q goes to row m of ``q_ptr`` ``[M, HQ * HEAD_DIM]``, k and v to cache row ``row``
    (``start_pos[b] + s`` for token m = b * S + s) when it lies in ``0 .. L - 1``."""
    HALF: tl.constexpr = HEAD_DIM // 2
    dtype = q_ptr.dtype.element_ty
    x1, x2 = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))
    x1 = x1.to(dtype).to(tl.float32)
    x2 = x2.to(dtype).to(tl.float32)
    head = pairs // HALF
    d = pairs % HALF
    b = (offs_m // rope.seq).to(tl.int64)
    ok = (offs_m < M)[:, None] & (pairs[None, :] < N)
    rotated = (head < rope.q_heads + rope.kv_heads)[None, :]  # q and k heads; v heads pass through
    y1 = tl.where(rotated, x1 * c - x2 * sn, x1).to(dtype)
    y2 = tl.where(rotated, x2 * c + x1 * sn, x2).to(dtype)

    is_q = ok & (head < rope.q_heads)[None, :]
    q_offs = offs_m[:, None].to(tl.int64) * (rope.q_heads * HEAD_DIM) + head[None, :] * HEAD_DIM + d[None, :]
    tl.store(q_ptr + q_offs, y1, mask=is_q)
    tl.store(q_ptr + q_offs + HALF, y2, mask=is_q)

    in_cache = ok & ((row >= 0) & (row < rope.capacity))[:, None]
    kv_head = head - rope.q_heads
    is_v = kv_head >= rope.kv_heads
    kv_head = tl.where(is_v, kv_head - rope.kv_heads, kv_head)
    kv_offs = ((b * rope.capacity + row)[:, None] * rope.kv_heads + kv_head[None, :]) * HEAD_DIM + d[None, :]
    is_k = in_cache & ((kv_head >= 0) & ~is_v)[None, :]
    is_v = in_cache & is_v[None, :]
    tl.store(rope.k_cache + kv_offs, y1, mask=is_k)
    tl.store(rope.k_cache + kv_offs + HALF, y2, mask=is_k)
    tl.store(rope.v_cache + kv_offs, y1, mask=is_v)
    tl.store(rope.v_cache + kv_offs + HALF, y2, mask=is_v)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    a_ptr,
    norm_ptr,
    sum_ptr,
    M,
    N,
    K,
    k_per_split,
    eps,
    stride_xm,
    stride_xk,
    stride_am,
    stride_ak,
    stride_wn,
    stride_wk,
    stride_os,
    stride_om,
    rope,  # the "rope_kv_store" epilogue's operands (a RopeArgs), else unused placeholders
    HAS_BIAS: tl.constexpr,
    PROLOGUE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr,
    ONE_STEP: tl.constexpr,
    EVEN_K: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
    EPILOGUE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    EARLY_WEIGHT: tl.constexpr,
    PIECE1: tl.constexpr,
    PIECE2: tl.constexpr,
):
    """BLOCK_N outputs of all M (<= BLOCK_M) rows, streaming their weight rows once over one K split.

    The weight is loaded ``evict_first``: each of its elements is read once, by one program, and a
    decode step streams every weight of the model (1.3 GB for the article, over 20x the L2), so at
    normal priority the weights flush from L2 what the next step reads again: the KV cache,
    activations, partials and tables. With every decode weight marked, the article step took 0.723
    ms/token against 0.738 (H100, 2026-12-07, against the code before, two rounds); marking only
    some of them gained nothing. Only plain loads carry the hint (a pipelined loop's ``cp.async``
    copies drop it), hence the one-step lm_head configs in ``ops.gemm_config``.

    ``EARLY_WEIGHT`` (one step only; ``linear(static_weight=True)``): the weight chunk is requested
    before the PDL wait, the one read the wait's contract lets through (see ``linear``).
    ``PIECE1``, ``PIECE2`` (M=1, one step, no prologue or epilogue; 0: none): K is BLOCK_K plus
    these two smaller powers of two (4864 = 4096 + 512 + 256), each read whole, so a K that is
    no power of two still streams in one unmasked step (``k_pieces``).

    ``PROLOGUE`` fuses the op that produced x into the load of each x chunk, so its output never
    goes through memory: ``"add_rms_norm"`` (x + a, normalized by the whole row's rms and scaled by
    ``norm``; the programs of the first output block also store x + a to ``sum``), rounded to x's
    dtype exactly as the unfused op's output.
    ``EPILOGUE="silu_mul"`` (no split, no bias): the weight has 2N rows, gate rows then up rows;
    a program streams the gate and up rows of BLOCK_N / 2 outputs, interleaved, rounds both sums
    to the output dtype as ``linear`` would, and stores silu(gate) * up.
    ``EPILOGUE="rope_kv_store"`` (no split): the weight is a QKV weight of 2N rows, q heads then k
    heads then v heads of HEAD_DIM rows each; a program streams BLOCK_N / 2 rotation pairs (rows
    d and d + HEAD_DIM / 2 of a head, interleaved), rounds the sums as ``linear`` would, rotates
    the q and k pairs and stores q into ``out`` and k and v into the caches
    (``_rope_kv_store_epilogue``).
    """
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    rows = (offs_m % M).to(tl.int64)
    if EPILOGUE == "none":
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = (offs_n % N).to(tl.int64)
    else:  # lanes 2p and 2p + 1 stream the two weight rows of output (or rotation pair) p
        offs_n = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N) // 2
        pair = offs_n % N
        if EPILOGUE == "silu_mul":  # gate row p, up row N + p
            first, step = pair, N
        else:  # rows d and d + HEAD_DIM / 2 of head p // (HEAD_DIM / 2)
            first, step = (pair // (HEAD_DIM // 2)) * HEAD_DIM + pair % (HEAD_DIM // 2), HEAD_DIM // 2
        cols = (first + (tl.arange(0, BLOCK_N) % 2) * step).to(tl.int64)
    k_start = split * k_per_split
    k_len = min(K - k_start, k_per_split)
    k_base = k_start.to(tl.int64)
    x_ptrs = x_ptr + k_base * stride_xk + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + k_base * stride_wk + cols[:, None] * stride_wn + offs_k[None, :] * stride_wk
    a_ptrs = a_ptr + k_base * stride_ak + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    if PIECE1 > 0:  # one step of K = BLOCK_K + PIECE1 + PIECE2, each piece read whole
        offs_piece1 = BLOCK_K + tl.arange(0, PIECE1)
        w_piece1_ptrs = w_ptr + cols[:, None] * stride_wn + offs_piece1[None, :] * stride_wk
    if PIECE2 > 0:
        offs_piece2 = BLOCK_K + PIECE1 + tl.arange(0, PIECE2)
        w_piece2_ptrs = w_ptr + cols[:, None] * stride_wn + offs_piece2[None, :] * stride_wk
    if EARLY_WEIGHT:  # written by no kernel that may still run: its stream overlaps their tail
        if EVEN_K:
            w_early = tl.load(w_ptrs, eviction_policy=WEIGHT_EVICTION)
        else:
            w_early = tl.load(w_ptrs, mask=(offs_k < K)[None, :], other=0.0, eviction_policy=WEIGHT_EVICTION)
        if PIECE1 > 0:
            w_piece1 = tl.load(w_piece1_ptrs, eviction_policy=WEIGHT_EVICTION)
        if PIECE2 > 0:
            w_piece2 = tl.load(w_piece2_ptrs, eviction_policy=WEIGHT_EVICTION)
    else:
        w_early = None
    pdl.wait(PDL)
    if PROLOGUE == "add_rms_norm":  # the norm needs the whole row, not just this split's K range
        if ONE_STEP:  # all of K arrives in the single chunk: the rms is taken there
            inv_rms = tl.zeros((BLOCK_M,), dtype=tl.float32)
        else:
            inv_rms = _inv_rms(
                x_ptr + rows[:, None] * stride_xm, a_ptr + rows[:, None] * stride_am,
                K, eps, stride_xk, stride_ak, BLOCK_M, NORM_BLOCK,
            )  # fmt: skip
        sum_ptrs = sum_ptr + offs_m[:, None].to(tl.int64) * K + k_base + offs_k[None, :]
        norm_ptrs = norm_ptr + k_base
    else:  # unused
        inv_rms = tl.zeros((BLOCK_M,), dtype=tl.float32)
        sum_ptrs = sum_ptr
        norm_ptrs = norm_ptr

    # What the epilogue reads besides the sums is loaded before the stream, so its trip to L2
    # overlaps the stream: the article decode step 0.696 vs 0.709 ms/token for the RoPE tables,
    # Qwen2.5's 0.619 vs 0.623 for the bias (H200, 2026-11-30). In the fused QKV and gate/up
    # gemvs the weight loaded ahead of the wait gained nothing or lost (see ``linear``).
    if EPILOGUE == "rope_kv_store":
        pairs = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        rope_cos, rope_sin, rope_row = _rope_tables(offs_m, pairs, M, N, rope, HEAD_DIM)
    if HAS_BIAS and EPILOGUE == "rope_kv_store":  # lane i holds weight row cols[i]
        bias = tl.load(b_ptr + cols).to(tl.float32)
    elif HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)

    if BLOCK_M == 1:  # one row: accumulate elementwise, reduce over K once after the loop
        # A 2-D tile (see _gemv_chunk). As [1, BLOCK_N, BLOCK_K], gate_up took 4 KB of shared
        # memory and 10 more CTA barriers, and on the H200 (2026-12-01) the article decode step
        # measured 0.680 ms/token with it in both paths, 0.657 with the one-step path 2-D, 0.650
        # with both (down 4.99 -> 4.82 us, lm_head 74.0 -> 72.5).
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:  # a few rows: reduce every step, a [BLOCK_M, BLOCK_N, BLOCK_K] accumulator is too big
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # K in one chunk, straight-line: no loop and no second (tail) copy of the chunk. At M=1 its
    # products stay in registers until after the release. ptxas issues most of the weight loads
    # after x's round trip; forcing them first, or reducing the chunk straight to [1, BLOCK_N]
    # (fewer registers, more programs an SM), each measured slower in the step (PERFORMANCE.md).
    if ONE_STEP:
        one_chunk_masked: tl.constexpr = not EVEN_K
        acc = _gemv_chunk(
            acc, x_ptrs, w_ptrs, a_ptrs, sum_ptrs, norm_ptrs, inv_rms, offs_k, offs_m, M, pid_n == 0,
            K, K, eps, PROLOGUE, one_chunk_masked, BLOCK_M, ONE_STEP, w_early, EARLY_WEIGHT,
        )  # fmt: skip
        if PIECE1 > 0:
            if not EARLY_WEIGHT:
                w_piece1 = tl.load(w_piece1_ptrs, eviction_policy=WEIGHT_EVICTION)
            acc_piece1 = _piece_products(x_ptr, rows, offs_piece1, stride_xm, stride_xk, w_piece1)
        if PIECE2 > 0:
            if not EARLY_WEIGHT:
                w_piece2 = tl.load(w_piece2_ptrs, eviction_policy=WEIGHT_EVICTION)
            acc_piece2 = _piece_products(x_ptr, rows, offs_piece2, stride_xm, stride_xk, w_piece2)
    else:
        # Whole BLOCK_K chunks without masks (masked loads lose their 16-byte vectors), then the
        # tail. tl.range pipelines these loads (num_stages only pipelines loads into tl.dot).
        k_full = k_len // BLOCK_K * BLOCK_K
        for _ in tl.range(0, k_full, BLOCK_K, num_stages=NUM_STAGES):
            acc = _gemv_chunk(
                acc, x_ptrs, w_ptrs, a_ptrs, sum_ptrs, norm_ptrs, inv_rms, offs_k, offs_m, M, pid_n == 0,
                BLOCK_K, K, eps, PROLOGUE, False, BLOCK_M, ONE_STEP,
            )  # fmt: skip
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
            a_ptrs += BLOCK_K * stride_ak
            sum_ptrs += BLOCK_K
            norm_ptrs += BLOCK_K
        if k_full < k_len:
            acc = _gemv_chunk(
                acc, x_ptrs, w_ptrs, a_ptrs, sum_ptrs, norm_ptrs, inv_rms, offs_k, offs_m, M, pid_n == 0,
                k_len - k_full, K, eps, PROLOGUE, True, BLOCK_M, ONE_STEP,
            )  # fmt: skip
    pdl.release(PDL)  # after the stream, not before: see ops.pdl
    if BLOCK_M == 1:
        acc = tl.sum(acc, axis=1)[None, :]
    if PIECE1 > 0:
        acc += tl.sum(acc_piece1, axis=1)[None, :]
    if PIECE2 > 0:
        acc += tl.sum(acc_piece2, axis=1)[None, :]

    if HAS_BIAS:
        acc += bias[None, :]
    if EPILOGUE == "rope_kv_store":
        _rope_kv_store_epilogue(
            acc, offs_m, pairs, M, N, out_ptr, rope, rope_cos, rope_sin, rope_row, HEAD_DIM, BLOCK_M, BLOCK_N
        )
        return
    if EPILOGUE == "silu_mul":  # silu_mul's math on the two sums, each rounded as linear's output
        gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))
        gate = gate.to(out_ptr.dtype.element_ty).to(tl.float32)
        up = up.to(out_ptr.dtype.element_ty).to(tl.float32)
        acc = gate * tl.sigmoid(gate) * up
        offs_n = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    out_ptrs = out_ptr + split.to(tl.int64) * stride_os + offs_m[:, None].to(tl.int64) * stride_om
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptrs + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _splitk_reduce_kernel(
    p_ptr,
    b_ptr,
    out_ptr,
    N,
    stride_ps,
    stride_pm,
    HAS_BIAS: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    """``out[m] = sum_s partials[s, m] (+ bias)`` in fp32, split 0 first, rounded once.

    The splits are unrolled so every load is issued before the first add waits on one.
    """
    pdl.release(PDL)
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    ptrs = p_ptr + row * stride_pm + cols
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for _ in tl.static_range(1, SPLITS):
        ptrs += stride_ps  # a pointer step per split: no int32 offset overflow on large partials
        acc += tl.load(ptrs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


REDUCE_BLOCK_N = 256


# ---- wrappers ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prologue:
    """An op the gemv kernel applies to each chunk of x as it loads it (see ``_gemv_kernel``).

    ``kind`` is ``"add_rms_norm"``: ``other`` is the residual (x's shape), ``total`` receives
    x + residual.
    """

    kind: str
    other: torch.Tensor
    norm_weight: torch.Tensor | None = None
    eps: float = 0.0
    total: torch.Tensor | None = None


class RopeArgs(NamedTuple):
    """The ``"rope_kv_store"`` epilogue's operands, passed to the kernel as one tuple argument:
    cos, sin ``[B, S, HEAD_DIM / 2]`` fp32, the caches ``[B, capacity, kv_heads, HEAD_DIM]``
    (contiguous), start_pos int32 ``[B]``; the GEMM's rows are the ``B * S`` tokens."""

    cos: torch.Tensor
    sin: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    start_pos: torch.Tensor
    cos_stride_b: int
    cos_stride_s: int
    sin_stride_b: int
    sin_stride_s: int
    seq: int
    capacity: int
    q_heads: int
    kv_heads: int

    @staticmethod
    def of(
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        start_pos: torch.Tensor,
        q_heads: int,
    ) -> RopeArgs:
        return RopeArgs(
            cos, sin, k_cache, v_cache, start_pos, cos.stride(0), cos.stride(1), sin.stride(0),
            sin.stride(1), cos.shape[1], k_cache.shape[1], q_heads, k_cache.shape[2],
        )  # fmt: skip


def _no_rope(x: torch.Tensor) -> RopeArgs:
    """The kernel's ``rope`` argument where the epilogue is not RoPE: placeholders, never read."""
    return RopeArgs(x, x, x, x, x, 0, 0, 0, 0, 1, 1, 1, 1)


def workspace(split: int, m: int, n: int, device: torch.device) -> torch.Tensor:
    """linear's split-K partials when the caller passes none (see ``ops.scratch``)."""
    return scratch.cached(
        "linear partials",
        (device, split, m, n),
        lambda: torch.empty((split, m, n), dtype=torch.float32, device=device),
    )


def check_operands(
    x: torch.Tensor, weight: torch.Tensor, last_dim_contiguous: bool = False
) -> tuple[int, int, int]:
    """``(M, N, K)`` of ``x[M, K] @ weight[N, K].T``, or an error naming the bad argument."""
    validate.tensor("x", x, ndim=2, last_dim_contiguous=last_dim_contiguous)
    validate.tensor("weight", weight, ndim=2, last_dim_contiguous=False)
    m, k = x.shape
    n, k_w = weight.shape
    if k_w != k:
        hint = ""
        if n == k:
            hint = (
                "; it looks like a [K, N] weight: linear takes weight as [N, K] "
                "(nn.Linear layout), pass weight.T"
            )
        raise ValueError(
            f"weight: expected shape [N, {k}] (K={k} is the last dim of x {tuple(x.shape)}), "
            f"got {tuple(weight.shape)}{hint}"
        )
    validate.same_dtype("weight", weight, "x", x)
    return m, n, k


def check_bias(bias: torch.Tensor | None, n: int, x: torch.Tensor) -> None:
    if bias is None:
        return
    validate.tensor("bias", bias, ndim=1)
    validate.shape("bias", bias, (n,), "N, the first dim of weight")
    validate.same_dtype("bias", bias, "x", x)


def _check_split_k(split_k: object, k: int) -> int:
    if k == 0:
        raise ValueError("x: K = 0 leaves nothing to split (linear_splitk needs K >= 1)")
    integral = isinstance(split_k, numbers.Integral) and not isinstance(split_k, bool)
    if not integral or not 1 <= split_k <= min(k, MAX_SPLIT_K):
        raise ValueError(f"split_k: expected an int from 1 to min(K={k}, {MAX_SPLIT_K}), got {split_k!r}")
    return int(split_k)


def _reduce(partials: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor) -> None:
    splits, m, n = partials.shape
    if m == 0 or n == 0:
        return
    _splitk_reduce_kernel[(m, triton.cdiv(n, REDUCE_BLOCK_N))](
        partials,
        bias if bias is not None else partials,
        y,
        n,
        partials.stride(0),
        partials.stride(1),
        HAS_BIAS=bias is not None,
        SPLITS=splits,
        BLOCK_N=REDUCE_BLOCK_N,
        **pdl.launch_options(),
    )


def _fit_stages(stages: int, elems_per_stage: int, elem_bytes: int) -> int:
    """Fewer pipeline stages where a config tuned for bf16 meets fp32 operands (twice the bytes)."""
    while stages > 1 and stages * elems_per_stage * elem_bytes > SMEM_BYTES:
        stages -= 1
    return stages


def run(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemmConfig,
    y: torch.Tensor,
    partials: torch.Tensor | None,
    prologue: Prologue | None = None,
    epilogue: str | RopeArgs = "none",
    static_weight: bool = False,
) -> torch.Tensor:
    """Launch on checked arguments: straight into ``y``, or into ``partials`` and then the reduce.
    ``static_weight``: as ``linear``'s.

    Epilogues, on gemv configs without split-K only: ``"silu_mul"``: ``y = silu(gate) * up``
    for ``[gate | up] = x @ weight.T`` (weight ``[2N, K]``, ``y`` ``[M, N]``, no bias). A
    ``RopeArgs``: ``rope_kv_store`` (no qk-norm) of ``[q | k | v] = x @ weight.T + bias`` (weight
    ``[(Hq + 2 Hkv) D, K]``), rotated q into ``y`` ``[M, Hq D]``, k and v into the caches.
    """
    rope = epilogue if isinstance(epilogue, RopeArgs) else None
    if rope is not None:
        epilogue = "rope_kv_store"
    (m, k), n = x.shape, weight.shape[0]
    if m == 0 or n == 0:
        return y
    if k == 0 and rope is not None:  # the epilogue's cache writes would be skipped
        raise ValueError("weight: the rope_kv_store epilogue needs K >= 1")
    if k == 0:  # an empty sum: the bias alone (silu(0) * 0 = 0)
        return y.copy_(bias.expand(m, n)) if bias is not None else y.zero_()
    if config.kernel == "gemv" and m > GEMV_MAX_M:
        raise ValueError(f"config: the gemv kernel takes M <= {GEMV_MAX_M}, got M={m}")
    if epilogue != "none" and (config.kernel != "gemv" or partials is not None):
        raise ValueError(f"config {config.describe()!r}: an epilogue needs a gemv without split-K")
    if epilogue == "silu_mul" and bias is not None:
        raise ValueError("bias: the silu_mul epilogue takes none")
    split = partials.shape[0] if partials is not None else 1
    # Blocks no larger than the problem (tl.dot needs >= 16 in every dim).
    block_n = max(16 if config.kernel == "tiled" else 1, min(config.block_n, triton.next_power_of_2(n)))
    outputs_per_program = block_n
    if epilogue != "none":  # block_n / 2 outputs or rotation pairs, two weight rows each
        block_n, n = max(2, block_n), n // 2
        outputs_per_program = block_n // 2
    block_k = max(16, min(config.block_k, triton.next_power_of_2(triton.cdiv(k, split))))
    # Each split covers whole K blocks, so only the last block of the last nonempty split is partial.
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    fused_bias = bias is not None and partials is None
    target = y if partials is None else partials
    out_strides = (0, n) if partials is None else (partials.stride(0), partials.stride(1))
    bias_arg = bias if fused_bias else target  # a dummy pointer when the kernel adds no bias
    if prologue is not None and config.kernel != "gemv":
        raise ValueError(f"config: only the gemv kernel fuses a prologue, got {config.kernel!r}")
    if config.kernel == "gemv":
        block_m = triton.next_power_of_2(m)
        p = prologue or Prologue("none", x)
        whole_pieces = split == 1 and m == 1 and config.num_stages == 1 and p.kind == epilogue == "none"
        pieces = k_pieces(k, block_k) if whole_pieces else (0, 0)
        one_step = split == 1 and (k <= block_k or pieces[0] > 0)
        _gemv_kernel[(triton.cdiv(n, outputs_per_program), split)](
            x,
            weight,
            bias_arg,
            target,
            p.other,
            x if p.norm_weight is None else p.norm_weight,
            x if p.total is None else p.total,
            m,
            n,
            k,
            k_per_split,
            p.eps,
            x.stride(0),
            x.stride(1),
            p.other.stride(0),
            p.other.stride(1),
            weight.stride(0),
            weight.stride(1),
            *out_strides,
            rope or _no_rope(x),
            HAS_BIAS=fused_bias,
            PROLOGUE=p.kind,
            ONE_STEP=one_step,
            EVEN_K=k % block_k == 0 or pieces[0] > 0,
            NORM_BLOCK=min(triton.next_power_of_2(k), MAX_NORM_BLOCK),
            EPILOGUE=epilogue,
            HEAD_DIM=rope.k_cache.shape[3] if rope is not None else 2,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            NUM_STAGES=_fit_stages(config.num_stages, (block_m + block_n) * block_k, x.element_size()),
            EARLY_WEIGHT=static_weight and one_step and block_m == 1,
            PIECE1=pieces[0],
            PIECE2=pieces[1],
            num_warps=config.num_warps,
            **pdl.launch_options(),
        )
    else:
        block_m = max(16, min(config.block_m, triton.next_power_of_2(m)))
        stages = _fit_stages(config.num_stages, (block_m + block_n) * block_k, x.element_size())
        _tiled_kernel[(triton.cdiv(m, block_m) * triton.cdiv(n, block_n), split)](
            x,
            weight,
            bias_arg,
            target,
            m,
            n,
            k,
            k_per_split,
            x.stride(0),
            x.stride(1),
            weight.stride(0),
            weight.stride(1),
            *out_strides,
            HAS_BIAS=fused_bias,
            EVEN_K=k % block_k == 0,
            FP32_IEEE=x.dtype == torch.float32,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            GROUP_M=config.group_m,
            num_warps=config.num_warps,
            num_stages=stages,
            **pdl.launch_options(),
        )
    if partials is not None:
        _reduce(partials, bias, y)
    return y


def launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemmConfig,
    *,
    out: torch.Tensor | None = None,
    partials: torch.Tensor | None = None,
    static_weight: bool = False,
) -> torch.Tensor:
    """``x @ weight.T + bias`` with an explicit config: what ``linear`` runs, and what benchmarks sweep.

    ``config.split_k`` is taken as given (trailing splits may be empty when K is short; they add
    zeros); with ``split_k > 1``, ``partials`` is fp32 ``[split_k, M, N]`` or None (allocated here).
    """
    _, n, _ = check_operands(x, weight)
    check_bias(bias, n, x)
    y, partials = _outputs(x, weight, bias, out, partials, config.split_k if config.split_k > 1 else None)
    return run(x, weight, bias, config, y, partials, static_weight=static_weight)


def _outputs(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor | None,
    partials: torch.Tensor | None,
    splits: int | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``out [M, N]`` and fp32 ``partials [splits, M, N]`` (None without ``splits``): checked or
    new. Programs read x, weight and bias while others write these, so they share no memory."""
    m, n = x.shape[0], weight.shape[0]
    inputs = {"x": x, "weight": weight, "bias": bias}
    if splits is None:
        partials = None
    else:
        validate.grid_axis(
            "weight", triton.cdiv(n, REDUCE_BLOCK_N), f"reducing the split-K partials of N = {n}"
        )
        partials = validate.output(partials, (splits, m, n), torch.float32, x, "partials", reads=inputs)
    y = validate.output(out, (m, n), x.dtype, x, reads=inputs | {"partials": partials})
    return y, partials


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    partials: torch.Tensor | None = None,
    static_weight: bool = False,
) -> torch.Tensor:
    """``x[M, K] @ weight[N, K].T + bias[N]`` in fp32, rounded once, with the table's config.

    ``partials``: the fp32 split-K buffer of shape :func:`ops.gemm_config.partials_shape`, used
    only when the shape's config splits K (otherwise only its type, rank and dtype are checked);
    without it a per-shape workspace is used, so after one warm-up call
    a CUDA Graph capture of ``linear`` allocates nothing either way.

    ``static_weight=True`` promises that no kernel that may still be running writes ``weight``
    (a loaded model's weights; not a weight an op just computed). Under PDL a one-step M=1 gemv
    then requests its weight chunk before waiting on the kernel before it, so the stream
    overlaps that kernel's tail: the article decode step with o_proj so measured 0.632-0.633
    ms/token against 0.649-0.650, Qwen2.5-0.5B's 0.521-0.522 against 0.535-0.536 (H200,
    2026-12-01, same call); Qwen3-0.6B's with o_proj and down in one step 0.644-0.645 against
    0.715. The fused QKV gemv gained nothing more from it (0.632) and the fused gate/up gemv lost
    (0.675 against 0.632), so those ops do not take it. The same bits either way.
    """
    m, n, k = check_operands(x, weight)
    config = table_config(m, n, k)
    if config.split_k == 1:
        if partials is not None:  # unused here, but the same call may split on another backend
            validate.tensor("partials", partials, ndim=3, dtypes=(torch.float32,))
        partials = None
    elif partials is None:
        partials = workspace(config.split_k, m, n, x.device)
    return launch(x, weight, bias, config, out=out, partials=partials, static_weight=static_weight)


def linear_splitk(
    x: torch.Tensor,
    weight: torch.Tensor,
    split_k: int,
    *,
    partials: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ weight.T`` as ``split_k`` fp32 partials over contiguous K ranges, then ``splitk_reduce``.

    ``partials``: a preallocated fp32 ``[split_k, M, N]`` buffer (then nothing is allocated for
    it, so the call can be captured in a CUDA Graph); it holds the partials afterwards.
    """
    m, n, k = check_operands(x, weight)
    split_k = _check_split_k(split_k, k)
    config = config_for(m, n, k)  # gemv only at M <= GEMV_MAX_M (tests/test_gemm.py holds the table to it)
    y, partials = _outputs(x, weight, None, out, partials, split_k)
    return run(x, weight, None, config, y, partials)


def splitk_reduce(
    partials: torch.Tensor, out_dtype: torch.dtype, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``partials[0] + partials[1] + ...`` over the split dim in fp32, in that order, rounded once."""
    validate.tensor("partials", partials, ndim=3, dtypes=(torch.float32,))
    if out_dtype not in validate.FLOAT_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in validate.FLOAT_DTYPES)
        raise TypeError(f"out_dtype: expected one of ({names}), got {out_dtype!r}")
    splits, m, n = partials.shape
    if not 1 <= splits <= MAX_SPLIT_K:
        raise ValueError(
            f"partials: expected 1..{MAX_SPLIT_K} splits in dim 0, got shape {tuple(partials.shape)}"
        )
    validate.grid_axis("partials", triton.cdiv(n, REDUCE_BLOCK_N), f"N = {n}")
    y = validate.output(out, (m, n), out_dtype, partials, reads={"partials": partials})
    _reduce(partials, None, y)
    return y
