"""qk-norm, RoPE on q and k, and the KV cache store, fused (article ops 4, 5, 18, qk-norm)."""

from __future__ import annotations

import torch

from references.kv_cache import kv_cache_store
from references.norm import rms_norm
from references.rope import apply_rope


def rope_kv_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start_pos: torch.Tensor,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """The unfused composition, each step rounded to the input dtype as the separate ops round."""
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    kv_cache_store(k_cache, v_cache, apply_rope(k, cos, sin), v, start_pos)
    return apply_rope(q, cos, sin)
