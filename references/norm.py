"""RMSNorm and the fused residual-add + RMSNorm (article ops 1, 11+12, 20, qk-norm)."""

from __future__ import annotations

import torch

from references.precision import acc, out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = acc(x)
    inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return out(xf * inv_rms * acc(weight), x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused composition: the sum is rounded to the input dtype, then normalized."""
    total = out(acc(x) + acc(residual), x.dtype)
    return rms_norm(total, weight, eps), total
