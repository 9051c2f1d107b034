"""Projections: ``x @ weight.T + bias`` (article ops 2, 10, 13, 14, 16, 21), split-K included."""

from __future__ import annotations

import torch

from references.precision import acc, out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = acc(x) @ acc(weight).T
    if bias is not None:
        y = y + acc(bias)
    return out(y, x.dtype)


def linear_splitk(
    x: torch.Tensor, weight: torch.Tensor, split_k: int, *, partials: torch.Tensor | None = None
) -> torch.Tensor:
    """Splitting K only changes the order of the sum: the answer is the plain product.

    ``partials`` is the kernel's scratch buffer (cases may pass one); the reference needs none.
    """
    return linear(x, weight)


def splitk_reduce(partials: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The partials added one split after another, as a split-K reduce does, then rounded once.

    The partials are fp32 by contract and every reduce of them adds in fp32 at least, so the
    sum stays in their dtype (fp64 for the oracle) whatever the compute dtype: plain torch
    "in bf16" is the same fp32 sum, rounded once."""
    wide = torch.promote_types(partials.dtype, torch.float32)
    total = partials[0].to(wide)
    for partial in partials[1:]:
        total = total + partial.to(wide)
    return out(total, out_dtype)
