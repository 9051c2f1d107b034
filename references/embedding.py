"""Token embedding lookup (the model's input)."""

from __future__ import annotations

import torch

from references.precision import out


def embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return out(table[ids.long()], table.dtype)
