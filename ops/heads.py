"""Head tiles: the head-wise kernels (RoPE, the KV cache write) take a token's heads as one
``[BLOCK_H, ...]`` tile per program instead of a program per head row."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def head_block(block, H, BLOCK_H: tl.constexpr):
    """Head block ``block`` of ``H``: (head indices to read, as int64, and which are real). The
    padding past ``H`` re-reads the last head, so every read is in bounds; its stores are masked."""
    heads = block * BLOCK_H + tl.arange(0, BLOCK_H)
    return tl.minimum(heads, H - 1).to(tl.int64), heads < H


def heads_per_program(heads: int, row_block: int) -> int:
    """Heads a program takes as one tile of ``row_block``-wide rows: all of them, up to 4096
    elements a tile. Why: on the interpreter a program costs per operation, not per element (a
    head row a program ran at 10-25 ms), and on a GPU a head row is too little work for one."""
    return min(triton.next_power_of_2(heads), max(1, 4096 // row_block))
