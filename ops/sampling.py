"""Greedy sampling: argmax over the vocabulary, with ``torch.argmax`` semantics.

A 151936-wide row scanned by one program is a chain of dependent block reductions (~70 us
on the H200, as long as the whole lm_head GEMM), so the row is cut into chunks: one program
per chunk finds the chunk's best value, the lowest index holding it and its first NaN, and a
second small kernel picks among the chunks, lowest chunk first. NaN counts as the maximum
(the first NaN wins), ties go to the lowest index. The per-chunk partials live in a scratch
buffer made on first use per shape (``ops.scratch``) and reused after.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops import backend, pdl, scratch, validate

BLOCK_V = 2048  # one chunk: 75 programs for the 151936-wide vocabulary
INTERPRETER_BLOCK_V = 256  # small chunks on CPU, so the tests' vocabularies span many of them


@triton.jit
def _argmax_chunk_kernel(
    logits_ptr, val_ptr, idx_ptr, nan_ptr, stride_row, V, CHUNKS, BLOCK_V: tl.constexpr, PDL: tl.constexpr
):
    """BLOCK_V logits of one row: their max (NaN left out), its lowest index, and the first NaN's
    index (V where there is none)."""
    pdl.release(PDL)
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    in_row = cols < V
    x = tl.load(logits_ptr + row * stride_row + cols, mask=in_row, other=-float("inf")).to(tl.float32)
    is_nan = x != x
    first_nan = tl.min(tl.where(is_nan & in_row, cols, V), axis=0)
    x = tl.where(is_nan, -float("inf"), x)
    best, arg = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    slot = row * CHUNKS + chunk
    tl.store(val_ptr + slot, best)
    tl.store(idx_ptr + slot, (chunk * BLOCK_V + arg).to(tl.int64))
    tl.store(nan_ptr + slot, first_nan.to(tl.int64))


@triton.jit
def _argmax_pick_kernel(
    val_ptr, idx_ptr, nan_ptr, out_ptr, V, CHUNKS, BLOCK_C: tl.constexpr, PDL: tl.constexpr
):
    """One row: the first NaN's index if the row holds one, else the best chunk's index."""
    pdl.release(PDL)
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, BLOCK_C)
    ok = chunks < CHUNKS
    vals = tl.load(val_ptr + row * CHUNKS + chunks, mask=ok, other=-float("inf"))
    first_nan = tl.min(tl.load(nan_ptr + row * CHUNKS + chunks, mask=ok, other=V), axis=0)
    # chunks in index order and ties to the left: the lowest index of the best value wins
    _, best_chunk = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
    best_idx = tl.load(idx_ptr + row * CHUNKS + best_chunk)
    tl.store(out_ptr + row, tl.where(first_nan < V, first_nan, best_idx))


def _partials(
    device: torch.device, batch: int, chunks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-chunk best value, its index and the first NaN's index (see ``ops.scratch``)."""
    return scratch.cached(
        "argmax partials",
        (device, batch, chunks),
        lambda: (
            torch.empty((batch, chunks), dtype=torch.float32, device=device),
            torch.empty((batch, chunks), dtype=torch.int64, device=device),
            torch.empty((batch, chunks), dtype=torch.int64, device=device),
        ),
    )


def argmax(logits: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Index of the largest logit per row: ``logits[B, V]`` -> ``int64[B]``."""
    validate.tensor("logits", logits, ndim=2)
    batch, vocab = logits.shape
    if vocab == 0:
        raise ValueError(
            f"logits: expected a vocabulary of at least 1 entry, got shape {tuple(logits.shape)}"
        )
    result = validate.output(out, (batch,), torch.int64, logits, reads={"logits": logits})
    if batch == 0:
        return result
    validate.grid_axis("logits", triton.cdiv(vocab, BLOCK_V), f"a vocabulary of {vocab}")  # the GPU's chunks
    block = INTERPRETER_BLOCK_V if backend.is_interpreter() else BLOCK_V
    block = min(block, triton.next_power_of_2(vocab))
    chunks = triton.cdiv(vocab, block)
    values, indices, nans = _partials(logits.device, batch, chunks)
    _argmax_chunk_kernel[(batch, chunks)](
        logits, values, indices, nans, logits.stride(0), vocab, chunks, BLOCK_V=block, **pdl.launch_options()
    )
    _argmax_pick_kernel[(batch,)](
        values,
        indices,
        nans,
        result,
        vocab,
        chunks,
        BLOCK_C=triton.next_power_of_2(chunks),
        **pdl.launch_options(),
    )
    return result
