"""Greedy sampling: argmax over the vocabulary, with ``torch.argmax`` semantics.

One program scans one row in blocks, keeping the best value and the lowest index holding it;
the first NaN, if any, wins (NaN counts as the maximum).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops import validate

BLOCK_V = 4096


@triton.jit
def _argmax_kernel(logits_ptr, out_ptr, stride_row, V, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_V)
    best_val = -float("inf")
    best_idx = 0
    first_nan = V
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        in_row = cols < V
        x = tl.load(logits_ptr + row * stride_row + cols, mask=in_row, other=-float("inf")).to(tl.float32)
        is_nan = x != x
        first_nan = tl.minimum(first_nan, tl.min(tl.where(is_nan & in_row, cols, V), axis=0))
        x = tl.where(is_nan, -float("inf"), x)
        block_max, block_arg = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        better = block_max > best_val
        best_idx = tl.where(better, start + block_arg, best_idx)
        best_val = tl.where(better, block_max, best_val)
    result = tl.where(first_nan < V, first_nan, best_idx)
    tl.store(out_ptr + row, result.to(tl.int64))


def argmax(logits: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Index of the largest logit per row: ``logits[B, V]`` -> ``int64[B]``."""
    validate.tensor("logits", logits, ndim=2)
    batch, vocab = logits.shape
    if vocab == 0:
        raise ValueError(
            f"logits: expected a vocabulary of at least 1 entry, got shape {tuple(logits.shape)}"
        )
    result = validate.output(out, (batch,), torch.int64, logits)
    if batch:
        _argmax_kernel[(batch,)](
            logits, result, logits.stride(0), vocab, BLOCK_V=min(BLOCK_V, triton.next_power_of_2(vocab))
        )
    return result
