"""Writing new keys and values into the static KV cache (article op 18)."""

from __future__ import annotations

import torch


def kv_cache_store(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: torch.Tensor
) -> None:
    """Row ``start_pos[b] + i`` of batch ``b`` gets token ``i``; rows past the capacity are dropped."""
    capacity, new = k_cache.shape[1], k.shape[1]
    for b in range(k.shape[0]):
        rows = int(start_pos[b]) + torch.arange(new, device=k.device)
        keep = rows < capacity
        k_cache[b, rows[keep]] = k[b, keep].to(k_cache.dtype)
        v_cache[b, rows[keep]] = v[b, keep].to(v_cache.dtype)
