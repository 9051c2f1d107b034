"""Token embedding lookup: copy one table row per token id.

Ids are read through their strides (the model hands a column slice of a longer token
buffer). An id outside ``[0, V)`` cannot be reported without a host sync inside a CUDA Graph,
so its row is written as NaN: loud downstream, never a silent read of another row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops import pdl, validate

BLOCK_H = 1024


@triton.jit
def _embedding_kernel(
    ids_ptr,
    table_ptr,
    out_ptr,
    S,
    stride_ib,
    stride_is,
    stride_t,
    V,
    H,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    """BLOCK_H columns of one token's table row (NaN for an id outside the table)."""
    pdl.release(PDL)
    pdl.wait(PDL)
    token = tl.program_id(0)
    b = token // S
    s = token % S
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    tok_id = tl.load(ids_ptr + b.to(tl.int64) * stride_ib + s.to(tl.int64) * stride_is).to(tl.int64)
    valid = (tok_id >= 0) & (tok_id < V)
    safe_id = tl.where(valid, tok_id, 0)
    row = tl.load(table_ptr + safe_id * stride_t + cols, mask=mask, other=0.0).to(tl.float32)
    row = tl.where(valid, row, float("nan"))
    tl.store(out_ptr + token.to(tl.int64) * H + cols, row.to(out_ptr.dtype.element_ty), mask=mask)


def embedding(ids: torch.Tensor, table: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``table[ids]``: ``ids[B, S]`` (any strides), ``table[V, H]`` -> ``[B, S, H]``."""
    validate.tensor("ids", ids, ndim=2, dtypes=validate.INDEX_DTYPES, last_dim_contiguous=False)
    validate.tensor("table", table, ndim=2)
    batch, seq = ids.shape
    vocab, hidden = table.shape
    if vocab == 0:  # an id outside the table reads row 0 (and writes NaN): there must be one
        raise ValueError(f"table: expected at least one row, got shape {tuple(table.shape)}")
    result = validate.output(
        out, (batch, seq, hidden), table.dtype, table, reads={"table": table, "ids": ids}
    )
    validate.grid_axis("table", triton.cdiv(hidden, BLOCK_H), f"a row of {hidden} elements")
    if batch * seq == 0 or hidden == 0:
        return result
    grid = (batch * seq, triton.cdiv(hidden, BLOCK_H))
    _embedding_kernel[grid](
        ids,
        table,
        result,
        seq,
        ids.stride(0),
        ids.stride(1),
        table.stride(0),
        vocab,
        hidden,
        BLOCK_H=BLOCK_H,
        **pdl.launch_options(),
    )
    return result
