"""Writing new keys and values into the static KV cache (article op 18)."""

from __future__ import annotations

import torch


def kv_cache_store(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: torch.Tensor
) -> None:
    """Row ``start_pos[b] + i`` of batch ``b`` gets token ``i``; rows outside the cache
    (a negative start, or at or past the capacity) are dropped.

    Written per cache row: row ``j`` takes token ``j - start_pos[b]`` when that is a new token,
    else keeps its value. No host sync and no data-dependent shapes, so the reference model
    also runs under ``torch.compile`` and CUDA Graphs (the benchmark's compiled peer).
    """
    capacity, new = k_cache.shape[1], k.shape[1]
    if new == 0:  # no token to write (a shape, not a value: no host sync)
        return
    token = torch.arange(capacity, device=k.device)[None, :] - start_pos.long()[:, None]  # [B, L]
    hit = ((token >= 0) & (token < new))[:, :, None, None]
    index = token.clamp(0, new - 1)[:, :, None, None].expand(-1, -1, *k.shape[2:])
    k_cache.copy_(torch.where(hit, torch.gather(k, 1, index).to(k_cache.dtype), k_cache))
    v_cache.copy_(torch.where(hit, torch.gather(v, 1, index).to(v_cache.dtype), v_cache))
