"""The embedding kernel's promise for ids outside the table, the reference's too: the row is NaN,
never another row of the table, since a CUDA Graph cannot report it."""

from __future__ import annotations

import pytest
import torch

from ops import backend, embedding
from references.embedding import embedding as reference

DEVICE = backend.device()


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_ids_outside_the_table_give_nan_rows(id_dtype: torch.dtype) -> None:
    vocab = 10
    table = torch.randn(vocab, 33, device=DEVICE).to(torch.bfloat16)
    outside = [-1, vocab, vocab + 1, torch.iinfo(id_dtype).max, torch.iinfo(id_dtype).min]
    ids = torch.tensor([[0, *outside, vocab - 1]], dtype=id_dtype, device=DEVICE)
    rows = embedding.embedding(ids, table)[0]
    assert torch.equal(rows[0], table[0]) and torch.equal(rows[-1], table[-1])
    assert rows[1:-1].isnan().all(), [
        i for i, row in zip(outside, rows[1:-1], strict=True) if not row.isnan().all()
    ]
    assert torch.equal(rows.isnan(), reference(ids, table)[0].isnan())
