"""Token embedding lookup (the model's input)."""

from __future__ import annotations

import torch

from references.precision import out


def embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``table[ids]``, with a NaN row for an id outside ``[0, V)``: the op's contract, since a
    kernel inside a CUDA Graph cannot report a bad id (and ``table[-1]`` would read the last row)."""
    ids = ids.long()
    inside = (ids >= 0) & (ids < table.shape[0])
    rows = table[ids.where(inside, 0)].masked_fill(~inside[..., None], float("nan"))
    return out(rows, table.dtype)
