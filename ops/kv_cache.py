"""Write new keys and values into the static KV cache in place (article op 18).

``start_pos`` is a device tensor so a captured decode graph writes the right row at every
step. Rows outside the cache (a negative start or at or past the capacity) are not written: a
host check would need a sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops import pdl, validate
from ops.heads import head_block, heads_per_program


@triton.jit
def _kv_cache_store_kernel(
    kc_ptr,
    vc_ptr,
    k_ptr,
    v_ptr,
    start_ptr,
    S,
    L,
    H,
    D,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """BLOCK_H kv heads of one token: its k and v rows copied to cache row ``start_pos[b] + s``
    (a row outside the cache is not written)."""
    pdl.release(PDL)
    pdl.wait(PDL)
    token = tl.program_id(0)
    head, head_ok = head_block(tl.program_id(1), H, BLOCK_H)
    b = (token // S).to(tl.int64)
    s = (token % S).to(tl.int64)
    row = tl.load(start_ptr + b).to(tl.int64) + s
    d = tl.arange(0, BLOCK_D)
    mask = head_ok & (row < L) & (row >= 0) & (d < D)
    k = tl.load(k_ptr + b * stride_kb + s * stride_ks + head * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + b * stride_vb + s * stride_vs + head * stride_vh + d, mask=mask)
    dst = ((b * L + row) * H + head) * D + d
    tl.store(kc_ptr + dst, k, mask=mask)
    tl.store(vc_ptr + dst, v, mask=mask)


def kv_cache_store(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: torch.Tensor
) -> None:
    """Copy ``k, v[B, S, Hkv, D]`` into rows ``start_pos[b] .. start_pos[b] + S - 1`` of the caches."""
    validate.tensor("k_cache", k_cache, ndim=4)
    validate.contiguous("k_cache", k_cache)
    validate.tensor("v_cache", v_cache, ndim=4)
    validate.contiguous("v_cache", v_cache)
    validate.shape("v_cache", v_cache, k_cache.shape, "the shape of k_cache")
    validate.same_dtype("v_cache", v_cache, "k_cache", k_cache)
    batch, capacity, heads, dim = k_cache.shape
    validate.tensor("k", k, ndim=4)
    validate.tensor("v", v, ndim=4)
    validate.same_dtype("k", k, "k_cache", k_cache)
    validate.same_dtype("v", v, "k_cache", k_cache)
    seq = k.shape[1]
    validate.shape("k", k, (batch, seq, heads, dim), "[B, S, Hkv, D] matching k_cache")
    validate.shape("v", v, k.shape, "the shape of k")
    validate.tensor("start_pos", start_pos, ndim=1, dtypes=(torch.int32,))
    validate.shape("start_pos", start_pos, (batch,), "one start row per batch entry")
    if seq > capacity:
        raise ValueError(f"k: {seq} new tokens do not fit a cache of capacity {capacity}")
    read = {"k": k, "v": v, "start_pos": start_pos}
    validate.disjoint("k_cache", k_cache, read)
    validate.disjoint("v_cache", v_cache, read | {"k_cache": k_cache})
    if batch * seq * heads * dim == 0:
        return
    block_d = triton.next_power_of_2(dim)
    block_h = heads_per_program(heads, block_d, batch * seq)
    _kv_cache_store_kernel[(batch * seq, triton.cdiv(heads, block_h))](
        k_cache,
        v_cache,
        k,
        v,
        start_pos,
        seq,
        capacity,
        heads,
        dim,
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        **pdl.launch_options(),
    )
