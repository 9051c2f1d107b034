"""Causal attention over the KV cache (article ops 6, 7, 8), in two kernel paths.

``attention(q[B,S,Hq,D], k_cache[B,L,Hkv,D], v_cache, seq_lens int32[B], scale)``: query ``i`` of
batch row ``b`` sits at position ``seq_lens[b] - S + i`` and sees cache rows ``0 ..`` its own
position; head ``h`` reads kv head ``h // (Hq / Hkv)``.

Both paths are flash attention: scores live only in registers, softmax is computed online in
fp32 (running max ``m``, running sum ``l``, rescaled accumulator), base-2 exponentials with
``log2(e)`` folded into the scale.

* Prefill (many new tokens): one program per (block of ``BLOCK_M`` queries, batch, q head),
  as in the Triton fused-attention tutorial. Cache rows every query of the block may see are
  processed without a mask, the diagonal band with one; the heaviest blocks start first.
* Decode (``S x Hq/Hkv <= DECODE_MAX_ROWS`` query rows per kv head: one token, a few
  speculative ones, a small chunk): a one-token step has too few query blocks to fill the GPU,
  so the cache is split instead ("flash-decoding"). One program per (split, batch, kv head)
  holds all the queries of the kv group, loads each K/V tile once, and writes its partial
  (running max, running sum, unnormalized accumulator) to fp32 scratch; a second kernel
  rescales the splits to their common max and sums them. The split count depends only on the
  cache capacity ``L`` (and batch, heads, device), never on the device ``seq_lens``, so one
  captured CUDA Graph replays at every length; the rows a split covers do follow ``seq_len``
  (the valid rows' tiles shared out over the splits), so a short sequence in a long cache keeps
  its splits busy: in a 32768-row cache holding 1024 rows, 6.1-6.4 us against 10.9-11.0 with
  splits sized for the full cache (H200, 2026-12-02). Splits past ``seq_len`` write a neutral
  partial (max ``-inf``, sum 0, accumulator 0).

  Variants that measured slower in the article decode step on the H200 (2026-11-30, one run,
  each twice, ms/token): this design 0.899; requesting each split's first K/V block before
  ``seq_len`` arrives 0.921 (again on 94f3bfb, a split being one 32-row tile: 0.718 vs
  0.694); that plus the combine done by the last split program to finish (an arrival counter
  instead of the second launch) 0.925. Loading the first tile's cache rows older than the new
  token into registers before the PDL wait (they were written by earlier steps; the new row
  loaded after it, ``seq_len`` read early and checked after): 0.641-0.642 against 0.632
  (2026-12-02, same call, two rounds), the split kernel 3.63 us in the step against 3.17. What
  won instead, the same day: asking L2 for the first tile before the wait (under ``PDL``), the
  loads left as they were: 0.622 and 0.622 against 0.630 and 0.630, the split kernel 2.86-2.94
  us against 3.14-3.30. A split kernel that writes the
  output itself when the cache is a single split is kept (``DIRECT``: no combine launch).
  Combining the splits in the prologue of the o_proj gemv instead (every gemv program
  combines the whole attention row as it loads x; commit b9426ce) measured 0.903 ms/token
  against 0.708 (H200, 2026-11-30, same call): its 128 programs each read the row's 53 KB of
  partials from L2 and the projection took 9-15 us against 3.4 for combine + o_proj. A split
  kernel without ``tl.dot`` (a program per query row, one warp, 2-D products reduced in
  registers, no shared memory) measured 0.670 against 0.650 (2026-12-01): the padded dot runs
  on the tensor cores, one warp's FMAs take longer than the dot's shared-memory trips.

``seq_lens`` is never read on the host (a captured graph replays at every length), so device
values the wrapper cannot check are made safe in the kernel instead: ``seq_len > L`` reads
only the ``L`` rows there are, and a query that sees no row (``seq_len < S``) gets zeros.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ops import backend, pdl, validate
from ops import scratch as buffers

PATHS = ("auto", "prefill", "decode")
DECODE_MAX_ROWS = 64  # query rows (new tokens x q heads per kv head) one decode program holds
HEAD_DIMS = (16, 32, 64, 128, 256)  # powers of two: tiles need no head-dim mask
MAX_SPLITS = 128  # caps the combine kernel's work and the scratch size
COMBINE_CHUNK = 32  # splits the combine kernel loads at once
COMBINE_BLOCK_D = 64  # head dims per combine program: a D=128 row is two programs
LOG2E = 1.4426950408889634
# Integer sizes the kernels take at run time but do not specialize on (Triton otherwise compiles
# a variant per size that is 1 or a multiple of 16): here they only bound loops and masks, and
# K/V addresses stay 16-byte aligned through the HEAD_DIM constexpr. Without this the thorough
# profile's 500 attention_decode draws compiled 146 kernel variants (over 7 minutes on the H200,
# compiling); with it 52. Strides keep their specialization: it is what aligns the q loads.
SIZES = ("S", "L", "HQ", "HKV", "GROUP")


@dataclass(frozen=True)
class PrefillConfig:
    """A prefill launch: a program holds ``block_m`` queries and walks the cache ``block_n`` rows
    a step."""

    block_m: int  # queries per program
    block_n: int  # cache rows per step
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class DecodeConfig:
    """A decode launch: the cache is cut into splits so that about ``target_programs`` programs
    run at batch 1 (flash-decoding), each walking its split ``block_n`` rows a step."""

    block_n: int  # cache rows per step
    num_warps: int
    num_stages: int
    target_programs: int  # aim for about this many (split, batch, kv head) programs
    combine_chunk: int = COMBINE_CHUNK  # splits combined at once; more go to the busy-splits combine


class DecodeScratch(NamedTuple):
    """Preallocated fp32 partials of the decode path (a CUDA Graph must allocate nothing).

    Max and sum are kept apart, not folded into a log-sum-exp: at |max| ~ 500 (log2 units) an
    fp32 log-sum-exp keeps only ~3e-5 of the sum, where the split weights ``2^(m - max m)``
    are exact differences of nearby numbers.
    """

    acc: torch.Tensor  # [B, S, Hq, splits, D]: sum over the split's rows of 2^(score - m) * v
    max: torch.Tensor  # [B, S, Hq, splits]: m, the split's max scaled score (log2 units)
    sum: torch.Tensor  # [B, S, Hq, splits]: sum over the split's rows of 2^(score - m)


# ---- kernels -----------------------------------------------------------------------------------


@triton.jit
def _attend_block(
    acc,
    m_i,
    l_i,
    q,
    k_base,
    v_base,
    start,
    pos,
    kv_len,
    stride_n,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step of the rows in ``acc`` over the cache rows ``start ..
    start + BLOCK_N``.

    Unmasked steps cover rows every query may see (all below ``kv_len``); masked steps hide
    rows at or past ``kv_len`` and rows after the query's position ``pos``.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    keys = start + offs_n
    # The block's first row in 64 bits, once per block (rows past 2**31 / stride_n, a cache of
    # 2**31 elements a batch row, overflow 32); the offsets within the block stay 32-bit.
    k_base += tl.cast(start, tl.int64) * stride_n  # an int in the interpreter's loop: no .to()
    v_base += tl.cast(start, tl.int64) * stride_n
    offsets = offs_n[:, None] * stride_n + offs_d[None, :]
    # V is loaded with K, before the scores need K: a decode split is often one block, so
    # nothing else would overlap the two trips to memory.
    if MASKED:
        in_cache = keys < kv_len
        k = tl.load(k_base + offsets, mask=in_cache[:, None], other=0.0)
        v = tl.load(v_base + offsets, mask=in_cache[:, None], other=0.0)
    else:
        k = tl.load(k_base + offsets)
        v = tl.load(v_base + offsets)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if MASKED:
        s = tl.where(in_cache[None, :] & (keys[None, :] <= pos[:, None]), s, float("-inf"))
    # Running max of the scaled scores (qk_scale > 0); the scale folds into one FMA below.
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    # A row that has seen no visible key yet keeps m = -inf; subtract 0 there, not -inf (NaN).
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(s * qk_scale - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=SIZES)
def _prefill_kernel(
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
    GROUP,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    """BLOCK_M queries of one (batch, q head): flash attention over the cache rows up to the
    block's last query position, whole tiles visible to every query first, then masked ones."""
    pdl.release(PDL)
    pdl.wait(PDL)
    # Causal blocks late in the sequence do the most work: launch them first.
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // HQ).to(tl.int64)
    h = bh % HQ
    seq_len = tl.load(seq_lens_ptr + b)
    kv_len = tl.minimum(tl.maximum(seq_len, 0), L)

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < S
    pos = seq_len - S + offs_m
    q = tl.load(
        q_ptr + b * stride_qb + offs_m[:, None].to(tl.int64) * stride_qs + h * stride_qh + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    kv_offset = (b * L * HKV + h // GROUP) * HEAD_DIM
    stride_n = HKV * HEAD_DIM

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    first = seq_len - S + m_block * BLOCK_M  # the block's first query position
    last = seq_len - S + tl.minimum(m_block * BLOCK_M + BLOCK_M, S) - 1
    # Rows 0..first are visible to every query of the block: whole tiles of them need no mask.
    full_end = tl.maximum(tl.minimum(first + 1, kv_len), 0) // BLOCK_N * BLOCK_N
    end = tl.maximum(tl.minimum(last + 1, kv_len), 0)
    for start in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, k_ptr + kv_offset, v_ptr + kv_offset, start, pos, kv_len,
            stride_n, qk_scale, HEAD_DIM, BLOCK_N, False, DOT_PRECISION,
        )  # fmt: skip
    for start in range(full_end, end, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, k_ptr + kv_offset, v_ptr + kv_offset, start, pos, kv_len,
            stride_n, qk_scale, HEAD_DIM, BLOCK_N, True, DOT_PRECISION,
        )  # fmt: skip

    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l = 0 only for a query that sees no row
    o_rows = (b * S + offs_m) * HQ + h
    o_ptrs = o_ptr + o_rows[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _split_len(kv_len, SPLITS, BLOCK_N: tl.constexpr):
    """Rows per split at this length: the valid rows' tiles shared out over the splits, so a
    short sequence in a long cache still spreads over them (the split count is the capacity's)."""
    return tl.maximum(tl.cdiv(tl.cdiv(kv_len, BLOCK_N), SPLITS), 1) * BLOCK_N


@triton.jit(do_not_specialize=(*SIZES, "SPLITS", "SPLIT_SIZE"))
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    seq_lens_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    o_ptr,
    qk_scale,
    S,
    L,
    HQ,
    HKV,
    SPLITS,
    SPLIT_SIZE,
    stride_qb,
    stride_qs,
    stride_qh,
    GROUP,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DIRECT: tl.constexpr,
    SPREAD: tl.constexpr,
    PDL: tl.constexpr,
):
    """One split of the cache rows for one kv group: its softmax partials, or with ``DIRECT``
    (a single split) the normalized output itself, so no combine launch follows.

    ``SPLIT_SIZE`` rows per split cover the whole capacity. With ``SPREAD`` (that is more than a
    tile) a split covers a share of the valid rows' tiles instead (``_split_len``), so a short
    sequence in a long cache keeps as many splits busy as it has tiles (up to the split count).

    Under ``PDL`` each program first asks L2 for the K and V rows of its split's
    first tile in a full cache, a prefetch per 128-byte line, whatever ``seq_len`` turns out to
    be: the loads after the wait then find them there rather than in DRAM."""
    pdl.release(PDL)
    split = tl.program_id(0)
    bk = tl.program_id(1)
    b = (bk // HKV).to(tl.int64)
    kvh = bk % HKV
    kv_offset = (b * L * HKV + kvh) * HEAD_DIM
    stride_n = HKV * HEAD_DIM
    if PDL:  # the split's first K and V tile into L2 while the kernel before this one ends
        LINE: tl.constexpr = min(HEAD_DIM, 1024 // k_ptr.dtype.element_ty.primitive_bitwidth)
        ROW_LINES: tl.constexpr = HEAD_DIM // LINE  # elements of a 128-byte line, lines of a row
        lines = tl.arange(0, 2 * BLOCK_N * ROW_LINES)  # K's rows' lines, then V's
        row = split * SPLIT_SIZE + (lines // ROW_LINES) % BLOCK_N
        offset = tl.where(row < L, row.to(tl.int64) * stride_n + (lines % ROW_LINES) * LINE, 0)
        pdl.prefetch_l2(tl.where(lines < BLOCK_N * ROW_LINES, k_ptr, v_ptr) + kv_offset + offset)
    pdl.wait(PDL)
    seq_len = tl.load(seq_lens_ptr + b)
    kv_len = tl.minimum(tl.maximum(seq_len, 0), L)

    # Row r holds query r // GROUP of q head kvh * GROUP + r % GROUP: the whole kv group.
    rows = tl.arange(0, BLOCK_H)
    i = rows // GROUP
    h = kvh * GROUP + rows % GROUP
    row_ok = i < S
    pos = seq_len - S + i
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + b * stride_qb + i[:, None] * stride_qs + h[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    split_len = _split_len(kv_len, SPLITS, BLOCK_N) if SPREAD else SPLIT_SIZE
    start = split * split_len
    end = tl.minimum(start + split_len, kv_len)
    # Rows up to the first query's position are visible to all rows of the group.
    full_end = tl.maximum(tl.minimum(seq_len - S + 1, end), start)
    full_end = start + (full_end - start) // BLOCK_N * BLOCK_N
    for n in range(start, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, k_ptr + kv_offset, v_ptr + kv_offset, n, pos, kv_len,
            stride_n, qk_scale, HEAD_DIM, BLOCK_N, False, DOT_PRECISION,
        )  # fmt: skip
    for n in range(full_end, end, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, k_ptr + kv_offset, v_ptr + kv_offset, n, pos, kv_len,
            stride_n, qk_scale, HEAD_DIM, BLOCK_N, True, DOT_PRECISION,
        )  # fmt: skip

    out_rows = (b * S + i) * HQ + h
    if DIRECT:  # a row that saw no key (l = 0, acc = 0) outputs 0, as the combine would
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = o_ptr + out_rows[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        # An empty split (past seq_len, or before a query's position) leaves m = -inf, l = 0 and
        # acc = 0: a neutral partial, written like any other so no stale scratch is ever read.
        part_rows = out_rows * SPLITS + split
        tl.store(part_acc_ptr + part_rows[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_max_ptr + part_rows, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part_rows, l_i, mask=row_ok)


@triton.jit
def _combine_chunk(m_run, total, acc, part_acc_ptr, part_max_ptr, part_sum_ptr, row, first, BUSY,
                   SPLITS, offs_d, HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
    """Fold splits ``first .. first + CHUNK`` (those below ``BUSY``) into the running max, sum and
    accumulator: rescaled by ``2^(m - max m)``, as in the split kernel's online softmax."""
    offs_c = tl.arange(0, CHUNK)
    chunk = row * SPLITS + first + offs_c  # as written: row * SPLITS + (first + offs_c) ran slower
    ok = first + offs_c < BUSY
    m = tl.load(part_max_ptr + chunk, mask=ok, other=float("-inf"))
    sums = tl.load(part_sum_ptr + chunk, mask=ok, other=0.0)
    part = tl.load(part_acc_ptr + chunk[:, None] * HEAD_DIM + offs_d[None, :], ok[:, None], other=0.0)
    m_new = tl.maximum(m_run, tl.max(m, 0))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no split saw the row yet: weights 0
    alpha = tl.math.exp2(m_run - m_use)
    w = tl.math.exp2(m - m_use)
    total = total * alpha + tl.sum(w * sums, 0)
    acc = acc * alpha + tl.sum(part * w[:, None], 0)
    return m_new, total, acc


@triton.jit(do_not_specialize=("SPLITS",))
def _decode_combine_kernel(
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    o_ptr,
    SPLITS,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    """BLOCK_D dims of one output row: every split's partial, combined chunk by chunk with a
    running max, so a chunk's max, sum and acc loads go out together (one trip to L2 per chunk,
    not a trip for the maxima and then one for the rest). Launched for ``SPLITS <= CHUNK`` only,
    so the loop runs once; written as a loop because that form measured at parity and another
    did not (PERFORMANCE.md, ae0893c)."""
    pdl.release(PDL)
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)  # (b, i, h) in the output's row order
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m_run = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for first in range(0, SPLITS, CHUNK):
        m_run, total, acc = _combine_chunk(m_run, total, acc, part_acc_ptr, part_max_ptr, part_sum_ptr,
                                           row, first, SPLITS, SPLITS, offs_d, HEAD_DIM, CHUNK)  # fmt: skip
    o = acc / tl.where(total == 0.0, 1.0, total)
    tl.store(o_ptr + row * HEAD_DIM + offs_d, o.to(o_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=("SPLITS", "ROWS_PER_BATCH", "L"))
def _decode_combine_busy_kernel(
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    seq_lens_ptr,
    o_ptr,
    SPLITS,
    ROWS_PER_BATCH,
    L,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    """:func:`_decode_combine_kernel` for more splits than a chunk: only the splits that hold
    rows at this ``seq_len`` are read. The first chunk goes out with the ``seq_len`` load; the
    loop over the rest stops at the last busy split (the others are neutral and would add exactly
    nothing). A kernel of its own, so that one chunk of splits (the article decode step's 13)
    runs the same machine code as before this path existed: the first tries, one kernel for both
    (and a chunk's indices summed in another order), measured 0.627-0.636 ms/token there against
    0.621-0.622 (H200, 2026-12-02, three calls), the combine 1.35-1.9 us against 1.25-1.4."""
    pdl.release(PDL)
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)  # (b, i, h) in the output's row order
    seq_len = tl.load(seq_lens_ptr + row // ROWS_PER_BATCH)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m_run = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    m_run, total, acc = _combine_chunk(m_run, total, acc, part_acc_ptr, part_max_ptr, part_sum_ptr, row,
                                       0, SPLITS, SPLITS, offs_d, HEAD_DIM, CHUNK)  # fmt: skip
    kv_len = tl.minimum(tl.maximum(seq_len, 0), L)
    busy = tl.cdiv(kv_len, _split_len(kv_len, SPLITS, BLOCK_N))
    for first in range(CHUNK, busy, CHUNK):
        m_run, total, acc = _combine_chunk(m_run, total, acc, part_acc_ptr, part_max_ptr, part_sum_ptr,
                                           row, first, busy, SPLITS, offs_d, HEAD_DIM, CHUNK)  # fmt: skip
    o = acc / tl.where(total == 0.0, 1.0, total)
    tl.store(o_ptr + row * HEAD_DIM + offs_d, o.to(o_ptr.dtype.element_ty))


# ---- launch configuration ----------------------------------------------------------------------


@functools.cache
def _sm_count() -> int:
    if backend.is_interpreter():
        return 2
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def prefill_config(head_dim: int, dtype: torch.dtype) -> PrefillConfig:
    """Tiles for the prefill path (H200 best guesses; ``python -m verify.bench attention --sweep``)."""
    if backend.is_interpreter():  # small tiles: block tails and both loop stages run on small cases
        return PrefillConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)
    if head_dim <= 64:
        cfg = PrefillConfig(block_m=128, block_n=64, num_warps=4, num_stages=3)
    elif head_dim <= 128:
        cfg = PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
    else:
        cfg = PrefillConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)
    if dtype == torch.float32:  # twice the shared memory per tile
        cfg = PrefillConfig(cfg.block_m, max(16, cfg.block_n // 2), cfg.num_warps, 2)
    return cfg


def decode_config(head_dim: int, dtype: torch.dtype, capacity: int) -> DecodeConfig:
    """Tiles and split target for the decode path over a cache of ``capacity`` rows.

    Measured on the H200 at head_dim 128 unless said (bf16; fp32 takes half the rows, so the
    same bytes). Up to 512 rows, 32-row tiles: in the article decode step (385 rows) 0.722
    ms/token against 0.744 for 64 rows; 16 rows lost twice (2026-11-30). Up to 2048, 64-row tiles
    (``verify.bench attention``, 2026-12-02: cache 1024 4.37-4.43 us in three of four runs, 5.21
    in the fourth, against 5.23-5.30 in all four for 128 rows; this size's timings are noisy).
    Past 2048, 128-row tiles: against 64 rows, same call, two rounds (2026-12-02, after the
    split kernel's L2 prefetch of its first tile), cache 4096 6.34 and 6.34 us against 6.89 and
    7.02; 16384 10.75 and 10.75 against 13.31 and 13.72; 32768 14.84-14.90 against 16.99-17.47.
    A program per SM, so that where the tiles outnumber the SMs a split walks several of them
    and the combine has fewer partials: at 16384 rows 128-row tiles at two per SM took
    15.82-16.12 us. With two kv heads at batch 1 (the article, Qwen2.5) the target changes no
    split count up to 8192 rows (the tile count bounds them); with eight (the Qwen3-0.6B shape)
    it halves them past 1088 rows: at 4096, 16 splits of two tiles, 9.60-9.62 us against 12.79
    at two per SM in the sweep (``verify.bench attention --sweep``, 2026-12-02), at 2048 7.34
    against more than 7.6, and the whole model at a 4065-row cache decodes at 0.834 ms/token
    against 0.920 (same call, two rounds). 64-row tiles at 4096 there (9.16-9.23 us) are not
    taken: the config does not see the kv heads, and at 16384 rows 128 won. At head_dim 64
    (Qwen2.5), cache 4096, 128-row tiles at 8 warps and 2 stages took 5.57 us against 6.24 at 4
    warps and 3 (the sweep). The boundaries (512: between 385 and 1024 rows; 2048: between 1024
    and 4096) are guesses.
    """
    if backend.is_interpreter():
        # chunks of 2 splits: the interpreter's few splits still reach the busy-splits combine
        return DecodeConfig(
            block_n=16, num_warps=1, num_stages=1, target_programs=2 * _sm_count(), combine_chunk=2
        )
    warps, stages = 4, 3
    if capacity <= 512:
        block_n = max(16, 4096 // head_dim)
    elif capacity <= 2048:
        block_n = max(16, 8192 // head_dim)
    else:
        block_n = min(128, max(16, 16384 // head_dim))  # K and V tiles of at most 32 KiB each
        if head_dim <= 64:
            warps, stages = 8, 2
    if dtype == torch.float32:
        block_n = max(16, block_n // 2)
    return DecodeConfig(block_n=block_n, num_warps=warps, num_stages=stages, target_programs=_sm_count())


def decode_splits(batch: int, kv_heads: int, capacity: int, config: DecodeConfig) -> tuple[int, int]:
    """``(splits, rows per split)`` for a cache of ``capacity`` rows: a function of shapes only."""
    blocks = max(1, triton.cdiv(capacity, config.block_n))
    wanted = max(1, triton.cdiv(config.target_programs, batch * kv_heads))
    per_split = max(triton.cdiv(blocks, min(wanted, MAX_SPLITS)), 1)
    return triton.cdiv(blocks, per_split), per_split * config.block_n


def decode_scratch(
    q: torch.Tensor, k_cache: torch.Tensor, config: DecodeConfig | None = None
) -> DecodeScratch:
    """Allocate the decode path's partials for these shapes (once, before graph capture)."""
    batch, seq, q_heads, dim = q.shape
    config = config or decode_config(dim, q.dtype, k_cache.shape[1])
    splits, _ = decode_splits(batch, k_cache.shape[2], k_cache.shape[1], config)
    rows = (batch, seq, q_heads, splits)
    return DecodeScratch(
        torch.empty((*rows, dim), dtype=torch.float32, device=q.device),
        torch.empty(rows, dtype=torch.float32, device=q.device),
        torch.empty(rows, dtype=torch.float32, device=q.device),
    )


def _cached_scratch(q: torch.Tensor, k_cache: torch.Tensor, config: DecodeConfig) -> DecodeScratch:
    """One scratch per shape (``ops.scratch``): callers that pass ``out`` only (the model's
    static buffers) thus allocate nothing after a warm-up call."""
    splits, _ = decode_splits(q.shape[0], k_cache.shape[2], k_cache.shape[1], config)
    return buffers.cached(
        "attention decode", (q.device, *q.shape, splits), lambda: decode_scratch(q, k_cache, config)
    )


def uses_decode_path(new_tokens: int, group: int) -> bool:
    """What ``path="auto"`` picks: decode when the whole kv group's queries fit one program."""
    return new_tokens * group <= DECODE_MAX_ROWS


# ---- wrappers ----------------------------------------------------------------------------------


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 inputs: no silent TF32 rounding


def _check_args(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor, scale: float
) -> float:
    """Check the arguments before any launch; return ``scale`` as a Python float."""
    validate.tensor("q", q, ndim=4)
    validate.tensor("k_cache", k_cache, ndim=4)
    validate.contiguous("k_cache", k_cache)
    validate.tensor("v_cache", v_cache, ndim=4)
    validate.contiguous("v_cache", v_cache)
    validate.shape("v_cache", v_cache, k_cache.shape, "the shape of k_cache")
    validate.same_dtype("k_cache", k_cache, "q", q)
    validate.same_dtype("v_cache", v_cache, "q", q)
    batch, capacity, kv_heads, dim = k_cache.shape
    _, seq, q_heads, _ = q.shape
    validate.shape("q", q, (batch, seq, q_heads, dim), "[B, S, Hq, D] with B and D of k_cache")
    if dim not in HEAD_DIMS:
        raise ValueError(f"q: head_dim {dim} is not supported; expected one of {HEAD_DIMS}")
    if kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(f"q: {q_heads} q heads is not a multiple of the caches' {kv_heads} kv heads")
    if seq > capacity:
        raise ValueError(f"q: {seq} new tokens do not fit a cache of capacity {capacity}")
    validate.tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,))
    validate.shape("seq_lens", seq_lens, (batch,), "one length per batch entry")
    scale = validate.positive("scale", scale)
    if scale * LOG2E > validate.FP32_MAX:  # the kernels scale by it in fp32: it would be inf there
        raise ValueError(
            f"scale: expected at most {validate.FP32_MAX / LOG2E:.4g} (scale * log2(e) is an fp32), "
            f"got {scale!r}"
        )
    return scale


def _check_scratch(scratch: DecodeScratch, q: torch.Tensor, splits: int, others: dict) -> None:
    """``scratch`` as :func:`decode_scratch` makes it: three fp32 buffers, sharing no memory with
    each other or with ``others`` (the op's inputs and output); its type is checked already."""
    rows = (*q.shape[:3], splits)
    for name, t, shape in (
        ("scratch.acc", scratch.acc, (*rows, q.shape[3])),
        ("scratch.max", scratch.max, rows),
        ("scratch.sum", scratch.sum, rows),
    ):
        validate.tensor(name, t, dtypes=(torch.float32,))
        validate.shape(name, t, shape, "from decode_scratch(q, k_cache)")
        validate.contiguous(name, t)
        validate.disjoint(name, t, others)
        others = others | {name: t}


def launch_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    o: torch.Tensor,
    config: PrefillConfig,
) -> None:
    """Launch the prefill kernel on checked arguments (``attention`` checks; sweeps call this)."""
    batch, seq, q_heads, dim = q.shape
    _, capacity, kv_heads, _ = k_cache.shape
    validate.grid_axis("q", batch * q_heads, f"B x Hq = {batch} x {q_heads} (a program row per query head)")
    grid = (triton.cdiv(seq, config.block_m), batch * q_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, seq_lens, o, scale * LOG2E, seq, capacity, q_heads, kv_heads,
        q.stride(0), q.stride(1), q.stride(2),
        GROUP=q_heads // kv_heads, HEAD_DIM=dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        DOT_PRECISION=_dot_precision(q.dtype), num_warps=config.num_warps, num_stages=config.num_stages,
        **pdl.launch_options(),
    )  # fmt: skip


def launch_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    o: torch.Tensor,
    scratch: DecodeScratch,
    config: DecodeConfig,
) -> None:
    """Launch the split and combine kernels on checked arguments, ``scratch`` sized for ``config``
    (the split kernel alone, writing ``o``, when the cache is one split)."""
    batch, seq, q_heads, dim = q.shape
    _, capacity, kv_heads, _ = k_cache.shape
    group = q_heads // kv_heads
    splits, split_size = decode_splits(batch, kv_heads, capacity, config)
    validate.grid_axis(
        "k_cache", batch * kv_heads, f"B x Hkv = {batch} x {kv_heads} (a program row per kv head)"
    )
    _decode_split_kernel[(splits, batch * kv_heads)](
        q, k_cache, v_cache, seq_lens, scratch.acc, scratch.max, scratch.sum, o, scale * LOG2E, seq,
        capacity, q_heads, kv_heads, splits, split_size, q.stride(0), q.stride(1), q.stride(2),
        GROUP=group, HEAD_DIM=dim, BLOCK_H=max(16, triton.next_power_of_2(seq * group)),
        BLOCK_N=config.block_n, DOT_PRECISION=_dot_precision(q.dtype), DIRECT=splits == 1,
        SPREAD=split_size > config.block_n, num_warps=config.num_warps,
        num_stages=config.num_stages, **pdl.launch_options(),
    )  # fmt: skip
    if splits == 1:
        return
    block_d, chunk = min(dim, COMBINE_BLOCK_D), min(config.combine_chunk, triton.next_power_of_2(splits))
    grid = (batch * seq * q_heads, dim // block_d)
    if splits <= chunk:
        _decode_combine_kernel[grid](
            scratch.acc, scratch.max, scratch.sum, o, splits, HEAD_DIM=dim, BLOCK_D=block_d, CHUNK=chunk,
            num_warps=2, **pdl.launch_options(),
        )  # fmt: skip
        return
    _decode_combine_busy_kernel[grid](
        scratch.acc, scratch.max, scratch.sum, seq_lens, o, splits, seq * q_heads, capacity,
        HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_N=config.block_n, CHUNK=chunk, num_warps=2,
        **pdl.launch_options(),
    )  # fmt: skip


def attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    scratch: DecodeScratch | None = None,
    path: str = "auto",
) -> torch.Tensor:
    """Causal GQA attention of the ``S`` new queries over the first ``seq_lens[b]`` cache rows.

    ``q`` may be any view with unit stride in the last dim (a head slice of the fused QKV
    output); the caches must be contiguous. ``path`` picks the kernel ("auto": decode when
    ``S * Hq/Hkv <= DECODE_MAX_ROWS``). For CUDA Graph capture pass ``out`` and, on the decode
    path, ``scratch`` from :func:`decode_scratch`: then nothing is allocated (without
    ``scratch``, a per-shape one is allocated on the first call and reused after). ``seq_lens``
    is a device tensor and is not checked against ``S`` and ``L`` (that would need a host sync).
    """
    scale = _check_args(q, k_cache, v_cache, seq_lens, scale)
    if path not in PATHS:
        raise ValueError(f"path: expected one of {PATHS}, got {path!r}")
    batch, seq, q_heads, dim = q.shape
    group = q_heads // k_cache.shape[2]
    decode = uses_decode_path(seq, group) if path == "auto" else path == "decode"
    if decode and seq * group > DECODE_MAX_ROWS:
        raise ValueError(
            f"q: the decode path holds at most {DECODE_MAX_ROWS} query rows per kv head, "
            f"got {seq} tokens x {group} heads"
        )
    inputs = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "seq_lens": seq_lens}
    o = validate.output(out, q.shape, q.dtype, q, reads=inputs, in_place=("q",))  # q rows read first
    if scratch is not None and not isinstance(scratch, DecodeScratch):  # checked on either path
        raise TypeError(
            f"scratch: expected None or a DecodeScratch from decode_scratch(), got {type(scratch).__name__}"
        )
    if o.numel() == 0:
        return o
    if not decode:
        launch_prefill(q, k_cache, v_cache, seq_lens, scale, o, prefill_config(dim, q.dtype))
        return o
    config = decode_config(dim, q.dtype, k_cache.shape[1])
    if scratch is None:
        scratch = _cached_scratch(q, k_cache, config)
    else:
        splits = decode_splits(batch, k_cache.shape[2], k_cache.shape[1], config)[0]
        _check_scratch(scratch, q, splits, inputs | {"out": o})
    launch_decode(q, k_cache, v_cache, seq_lens, scale, o, scratch, config)
    return o


def attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`attention` forced onto the prefill kernel (any ``S``)."""
    return attention(q, k_cache, v_cache, seq_lens, scale, out=out, path="prefill")


def attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    scratch: DecodeScratch | None = None,
) -> torch.Tensor:
    """:func:`attention` forced onto the split-KV decode kernels (``S * Hq/Hkv <= DECODE_MAX_ROWS``)."""
    return attention(q, k_cache, v_cache, seq_lens, scale, out=out, scratch=scratch, path="decode")
