"""Residual add (article ops 11, 17) and the SwiGLU gate (article op 15)."""

from __future__ import annotations

import torch

from references.precision import acc, out


def add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return out(acc(x) + acc(y), x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g = acc(gate)
    return out(g * torch.sigmoid(g) * acc(up), gate.dtype)
