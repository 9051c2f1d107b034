"""Greedy sampling: argmax over the vocabulary."""

from __future__ import annotations

import torch


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Lowest index wins ties, NaN counts as the maximum: exactly ``torch.argmax``."""
    return torch.argmax(logits, dim=-1)
