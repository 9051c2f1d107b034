"""Head tiles: the head-wise kernels (RoPE, the KV cache write) take a token's heads as one
``[BLOCK_H, ...]`` tile per program instead of a program per head row."""

from __future__ import annotations

import triton
import triton.language as tl

from ops import backend


@triton.jit
def head_block(block, H, BLOCK_H: tl.constexpr):
    """Head block ``block`` of ``H`` as ``[BLOCK_H, 1]`` columns, to offset row starts by: (head
    indices to read, as int64, and which are real). The padding past ``H`` re-reads the last
    head, so every read is in bounds; its stores are masked."""
    heads = (block * BLOCK_H + tl.arange(0, BLOCK_H))[:, None]
    return tl.minimum(heads, H - 1).to(tl.int64), heads < H


GPU_PROGRAMS = 128  # about a wave of these small programs on an H200 (132 SMs)


def heads_per_program(heads: int, row_block: int, tokens: int) -> int:
    """Heads a program takes as one tile of ``row_block``-wide rows, for ``tokens`` tokens.

    The interpreter runs programs one by one at a cost per operation, not per element (a head
    row a program ran at 10-25 ms), so it takes all the heads, up to 4096 elements a tile. A
    GPU halves the tile until the grid fills about a wave: at decode's one token that keeps the
    layout the kernels had before tiles, a head a program (Qwen3-0.6B's step: 0.721 ms/token
    against 0.719-0.720 for the per-head kernel), and a 256-token prefill runs whole tiles
    (1.66 ms against 1.86-1.89). Whole tiles at decode measured 0.733, but at 4 warps, whose
    lowering of them turned out poor (``ops/rope_kv_store.py``): untimed at 2.
    """
    per = max(1, min(triton.next_power_of_2(heads), 4096 // row_block))  # >= 1 with no heads too
    if backend.is_interpreter():
        return per
    while per > 1 and tokens * triton.cdiv(heads, per) < GPU_PROGRAMS:
        per //= 2
    return per
