"""Fused projections: by definition the composition of the unfused references.

Each intermediate (the residual sum, the normalized row, the gate/up and QKV sums) is rounded to
the input dtype where the unfused ops round it: those roundings are part of what the fused
op computes, so they are applied even in the fp64 oracle (``rounded``; ``out`` alone would
keep fp64 there), which then differs from the kernel only by its final rounding and fp32
summation order, not by a bf16 step of every intermediate element.
"""

from __future__ import annotations

import torch

from references.elementwise import add, silu_mul
from references.gemm import linear
from references.norm import rms_norm
from references.precision import rounded
from references.rope_kv_store import rope_kv_store


def add_rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    total = add(x, residual)
    h = rms_norm(rounded(total, x.dtype), norm_weight, eps)
    return linear(rounded(h, x.dtype), weight, bias), total


def add_rms_norm_linear_silu_mul(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    gate_up, total = add_rms_norm_linear(x, residual, norm_weight, eps, weight)
    gate_up = rounded(gate_up, x.dtype)
    n = weight.shape[0] // 2
    return silu_mul(gate_up[:, :n], gate_up[:, n:]), total


def add_rms_norm_linear_rope_kv_store(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start_pos: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    qkv, total = add_rms_norm_linear(x, residual, norm_weight, eps, weight, bias)
    batch, seq = cos.shape[:2]
    kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
    heads = rounded(qkv, x.dtype).reshape(batch, seq, qkv.shape[-1] // dim, dim)  # not -1: seq may be 0
    q_heads = heads.shape[2] - 2 * kv_heads
    k, v = heads[:, :, q_heads : q_heads + kv_heads], heads[:, :, q_heads + kv_heads :]
    return rope_kv_store(heads[:, :, :q_heads], k, v, cos, sin, k_cache, v_cache, start_pos), total
