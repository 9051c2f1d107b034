"""Rotary position embedding: the cos/sin table (article op 19) and its application (ops 4, 5)."""

from __future__ import annotations

import torch

from references.precision import acc, compute_dtype, out


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``position * base**(-2i/rotary_dim)`` for i < rotary_dim/2, as HF computes them."""
    dt = torch.float64 if compute_dtype() == torch.float64 else torch.float32
    exponents = torch.arange(0, rotary_dim, 2, device=positions.device, dtype=torch.int64).to(dt) / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    angles = positions.to(dt)[..., None] * inv_freq
    return out(torch.cos(angles), torch.float32), out(torch.sin(angles), torch.float32)


JUDGED_POSITIONS = 2**18  # one fp32 ulp of an angle this large (inv_freq 1) is 1/32 rad


def positions_past_judging(positions: torch.Tensor, rotary_dim: int, base: float) -> str | None:
    """Why a call's positions are past what the fp64 oracle check can judge, or None. Past
    ``JUDGED_POSITIONS`` the fp32 angle's own rounding moves cos and sin by more than the
    ``max_error_ratio`` rule's cap (1/32 of the output), so every fp32 implementation, torch's
    included, would be judged wrong."""
    if positions.numel() == 0:
        return None
    far = int(positions.abs().max())
    if far <= JUDGED_POSITIONS:
        return None
    return (
        f"positions: {far} is past {JUDGED_POSITIONS} (2**18), where one fp32 ulp of the angle is 1/32 "
        "rad or more: fp32's own rounding there, torch's included, is past what the check can judge"
    )


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first ``2 * cos.shape[-1]`` dims of each head; the rest pass through."""
    half = cos.shape[-1]
    xf = acc(x)
    x1, x2, rest = xf[..., :half], xf[..., half : 2 * half], xf[..., 2 * half :]
    c, s = acc(cos)[:, :, None, :], acc(sin)[:, :, None, :]
    rotated = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)
    return out(rotated, x.dtype)
