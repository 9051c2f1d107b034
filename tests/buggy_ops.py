"""Bugs a kernel author really makes, as drop-in ops for ``--inject``: the tools must find each
at the right layer and op. Each wraps the real kernel and gets one thing wrong."""

from __future__ import annotations

import torch

from ops import attention as attention_ops
from ops import fused_linear, kv_cache, norm, rope

TINY_ROPE_BASE = 10000.0  # the embedded tiny model's rope_theta: the no-offset bug recomputes the table


def rms_norm_wrong_eps(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """eps read from the wrong config field: 0.1 instead of 1e-6."""
    return norm.rms_norm(x, weight, 0.1)


def rms_norm_in_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 inputs silently computed in bf16: off by bf16 rounding, far outside fp32's tolerance."""
    return norm.rms_norm(x.bfloat16(), weight.bfloat16(), eps).to(x.dtype)


def add_rms_norm_wrong_eps(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return norm.add_rms_norm(x, residual, weight, 0.1)


def apply_rope_no_offset(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates as if the new tokens started at position 0: right in prefill, wrong in decode."""
    batch, seq = x.shape[:2]
    positions = torch.arange(seq, device=x.device).expand(batch, seq)
    cos0, sin0 = rope.rope_cos_sin(positions, 2 * cos.shape[-1], TINY_ROPE_BASE)
    return rope.apply_rope(x, cos0, sin0)


def kv_cache_store_next_row(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: torch.Tensor
) -> None:
    """Writes one row too far: the classic off-by-one in the cache position."""
    kv_cache.kv_cache_store(k_cache, v_cache, k, v, start_pos + 1)


def attention_gqa_tiled(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Query head h reads kv head ``h % Hkv`` instead of ``h // (Hq / Hkv)``."""
    group = q.shape[2] // k_cache.shape[2]
    tiled_k = k_cache.repeat(1, 1, group, 1)  # kv0, kv1, kv0, kv1, ...: the tiling bug
    tiled_v = v_cache.repeat(1, 1, group, 1)
    return attention_ops.attention(q, tiled_k, tiled_v, seq_lens, scale)


def add_rms_norm_linear_silu_mul_swapped_halves(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """silu applied to the up half: the fused gate/up weight's halves read in the wrong order."""
    n = weight.shape[0] // 2
    swapped = torch.cat([weight[n:], weight[:n]])
    return fused_linear.add_rms_norm_linear_silu_mul(x, residual, norm_weight, eps, swapped)
