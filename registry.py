"""The shared op registry: every Triton kernel beside its naive torch reference.

One ``OpSpec`` per op, registered here and nowhere else; tests, ``verify.op`` and the
model's drill-downs all look ops up by name.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

import references.attention
import references.elementwise
import references.embedding
import references.fused_linear
import references.gemm
import references.kv_cache
import references.norm
import references.rope
import references.rope_kv_store
import references.sampling
from ops import (
    attention,
    elementwise,
    embedding,
    fused_linear,
    gemm,
    kv_cache,
    norm,
    rope,
    rope_kv_store,
    sampling,
)
from verify.cases import Case
from verify.limits import Limits
from verify.strategies import attention as s_attention
from verify.strategies import elementwise as s_elementwise
from verify.strategies import embedding as s_embedding
from verify.strategies import fused_linear as s_fused_linear
from verify.strategies import gemm as s_gemm
from verify.strategies import kv_cache as s_kv_cache
from verify.strategies import norm as s_norm
from verify.strategies import rope as s_rope
from verify.strategies import rope_kv_store as s_rope_kv_store
from verify.strategies import sampling as s_sampling
from verify.strategies.common import Invalid


@dataclass(frozen=True)
class OpSpec:
    """An op: its kernel, its reference, how to draw cases for it, and how to judge it.

    ``examples[0]`` is the op's typical small case (it runs on the interpreter): canaries,
    determinism and bad-input tests start from it. The other examples are the named shapes
    of the real models.
    """

    name: str
    impl: Callable
    reference: Callable
    params: Callable[[Limits], st.SearchStrategy[dict]]
    build: Callable[[dict, torch.device], Case]
    article_ops: tuple[int | str, ...]
    examples: tuple[dict, ...]
    invalid: tuple[Invalid, ...] = ()
    mutates: tuple[str, ...] = ()
    tolerance: str = ""
    deterministic: bool = True
    # Outputs are long fp32 sums of products (GEMMs): max_error_ratio's floor adds one fp32 ulp
    # of the summed |terms|, the same op's oracle on |inputs| (see ``verify.compare.judge``).
    sums_products: bool = False
    # An op-specific addition to max_error_ratio's floor, computed from the case's inputs: how far
    # the output may move under rounding that plain torch's error need not show (attention: one
    # fp32 ulp on each score, amplified by the softmax; see ``references.attention``).
    error_floor: Callable[..., float] | None = None
    # The contract's rules on values a kernel cannot check (device tensors read inside a CUDA
    # Graph), given the call's arguments: why a given or recorded call breaks them, or None.
    # Such a call is bad input (exit 2), not a divergence of whoever is tested.
    precondition: Callable[..., str | None] | None = None

    def __post_init__(self) -> None:
        if not self.tolerance:
            object.__setattr__(self, "tolerance", self.name)

    @property
    def typical(self) -> dict:
        return example_params(self.examples[0])


def example_params(example: dict) -> dict:
    """An example without its display fields: the params ``build`` takes."""
    return {k: v for k, v in example.items() if k not in ("name", "gpu")}


_REGISTRY: dict[str, OpSpec] = {}


def register(spec: OpSpec) -> OpSpec:
    """Add one op; a second op of the same name is refused (one entry per op)."""
    if spec.name in _REGISTRY:
        raise ValueError(f"op {spec.name!r} registered twice")
    _REGISTRY[spec.name] = spec
    return spec


def get(name: str) -> OpSpec:
    """The op called ``name``; an unknown name lists the registered ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        close = difflib.get_close_matches(str(name).lower(), list(_REGISTRY), n=1, cutoff=0.75)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise KeyError(f"unknown op {name!r}; {hint}registered: {', '.join(sorted(_REGISTRY))}") from None


def all() -> list[OpSpec]:
    """Every op, in registration order (the article's data flow)."""
    return list(_REGISTRY.values())


def names() -> list[str]:
    return list(_REGISTRY)


# fmt: off
register(OpSpec(
    "embedding", embedding.embedding, references.embedding.embedding,
    s_embedding.embedding_params, s_embedding.embedding_build, ("input",),
    s_embedding.EMBEDDING_EXAMPLES, s_embedding.EMBEDDING_INVALID,
))
register(OpSpec(
    "rms_norm", norm.rms_norm, references.norm.rms_norm,
    s_norm.rms_norm_params, s_norm.rms_norm_build, (1, 12, 20, "qk-norm"),
    s_norm.RMS_NORM_EXAMPLES, s_norm.RMS_NORM_INVALID,
))
register(OpSpec(
    "add_rms_norm", norm.add_rms_norm, references.norm.add_rms_norm,
    s_norm.add_rms_norm_params, s_norm.add_rms_norm_build, (11, 12),
    s_norm.ADD_RMS_NORM_EXAMPLES, s_norm.ADD_RMS_NORM_INVALID,
))
register(OpSpec(
    "add", elementwise.add, references.elementwise.add,
    s_elementwise.add_params, s_elementwise.add_build, (11, 17),
    s_elementwise.ADD_EXAMPLES, s_elementwise.ADD_INVALID,
))
register(OpSpec(
    "silu_mul", elementwise.silu_mul, references.elementwise.silu_mul,
    s_elementwise.silu_mul_params, s_elementwise.silu_mul_build, (15,),
    s_elementwise.SILU_MUL_EXAMPLES, s_elementwise.SILU_MUL_INVALID,
))
register(OpSpec(
    "rope_cos_sin", rope.rope_cos_sin, references.rope.rope_cos_sin,
    s_rope.rope_cos_sin_params, s_rope.rope_cos_sin_build, (19,),
    s_rope.ROPE_COS_SIN_EXAMPLES, s_rope.ROPE_COS_SIN_INVALID,
    precondition=references.rope.positions_past_judging,
))
register(OpSpec(
    "apply_rope", rope.apply_rope, references.rope.apply_rope,
    s_rope.apply_rope_params, s_rope.apply_rope_build, (4, 5),
    s_rope.APPLY_ROPE_EXAMPLES, s_rope.APPLY_ROPE_INVALID,
))
register(OpSpec(
    "kv_cache_store", kv_cache.kv_cache_store, references.kv_cache.kv_cache_store,
    s_kv_cache.kv_cache_store_params, s_kv_cache.kv_cache_store_build, (18,),
    s_kv_cache.KV_CACHE_STORE_EXAMPLES, s_kv_cache.KV_CACHE_STORE_INVALID,
    mutates=("k_cache", "v_cache"),
))
register(OpSpec(  # qk-norm (optional) + RoPE on q and k + kv_cache_store, in one launch
    "rope_kv_store", rope_kv_store.rope_kv_store, references.rope_kv_store.rope_kv_store,
    s_rope_kv_store.rope_kv_store_params, s_rope_kv_store.rope_kv_store_build, (4, 5, 18, "qk-norm"),
    s_rope_kv_store.ROPE_KV_STORE_EXAMPLES, s_rope_kv_store.ROPE_KV_STORE_INVALID,
    mutates=("k_cache", "v_cache"),
))
register(OpSpec(
    "argmax", sampling.argmax, references.sampling.argmax,
    s_sampling.argmax_params, s_sampling.argmax_build, ("sampling",),
    s_sampling.ARGMAX_EXAMPLES, s_sampling.ARGMAX_INVALID,
))
register(OpSpec(
    "attention", attention.attention, references.attention.attention,
    s_attention.attention_params, s_attention.attention_build, (6, 7, 8),
    s_attention.ATTENTION_EXAMPLES, s_attention.ATTENTION_INVALID,
    error_floor=references.attention.score_rounding_floor,
    precondition=references.attention.seq_lens_below_s,
))
register(OpSpec(  # the same op forced onto the prefill kernel, at every S
    "attention_prefill", attention.attention_prefill, references.attention.attention,
    s_attention.attention_params, s_attention.attention_build, (6, 7, 8),
    s_attention.ATTENTION_EXAMPLES, s_attention.ATTENTION_INVALID, tolerance="attention",
    error_floor=references.attention.score_rounding_floor,
    precondition=references.attention.seq_lens_below_s,
))
register(OpSpec(  # the same op forced onto the split-KV decode kernels
    "attention_decode", attention.attention_decode, references.attention.attention,
    s_attention.attention_decode_params, s_attention.attention_build, (6, 7, 8),
    s_attention.ATTENTION_DECODE_EXAMPLES, s_attention.ATTENTION_INVALID, tolerance="attention",
    error_floor=references.attention.score_rounding_floor,
    precondition=references.attention.seq_lens_below_s,
))
register(OpSpec(
    "linear", gemm.linear, references.gemm.linear,
    s_gemm.linear_params, s_gemm.linear_build, (2, 10, 13, 14, 16, 21),
    s_gemm.LINEAR_EXAMPLES, s_gemm.LINEAR_INVALID, sums_products=True,
))
register(OpSpec(
    "linear_splitk", gemm.linear_splitk, references.gemm.linear_splitk,
    s_gemm.linear_splitk_params, s_gemm.linear_splitk_build, (16, 21),
    s_gemm.LINEAR_SPLITK_EXAMPLES, s_gemm.LINEAR_SPLITK_INVALID, sums_products=True,
))
register(OpSpec(
    "splitk_reduce", gemm.splitk_reduce, references.gemm.splitk_reduce,
    s_gemm.splitk_reduce_params, s_gemm.splitk_reduce_build, (21,),
    s_gemm.SPLITK_REDUCE_EXAMPLES, s_gemm.SPLITK_REDUCE_INVALID, sums_products=True,
))
register(OpSpec(  # decode's QKV GEMM with qk-norm models: the norm before it in its prologue
    "add_rms_norm_linear", fused_linear.add_rms_norm_linear, references.fused_linear.add_rms_norm_linear,
    s_fused_linear.add_rms_norm_linear_params, s_fused_linear.add_rms_norm_linear_build, (11, 12, 2),
    s_fused_linear.ADD_RMS_NORM_LINEAR_EXAMPLES, s_fused_linear.ADD_RMS_NORM_LINEAR_INVALID,
    sums_products=True,
))
register(OpSpec(  # decode's gate/up GEMM: the norm in its prologue, the SwiGLU gate in its epilogue
    "add_rms_norm_linear_silu_mul", fused_linear.add_rms_norm_linear_silu_mul,
    references.fused_linear.add_rms_norm_linear_silu_mul,
    s_fused_linear.add_rms_norm_linear_silu_mul_params, s_fused_linear.add_rms_norm_linear_silu_mul_build,
    (11, 12, 13, 14, 15), s_fused_linear.ADD_RMS_NORM_LINEAR_SILU_MUL_EXAMPLES,
    s_fused_linear.ADD_RMS_NORM_LINEAR_SILU_MUL_INVALID, sums_products=True,
))
register(OpSpec(  # decode's QKV GEMM: the norm in its prologue, RoPE and the cache write in its epilogue
    "add_rms_norm_linear_rope_kv_store", fused_linear.add_rms_norm_linear_rope_kv_store,
    references.fused_linear.add_rms_norm_linear_rope_kv_store,
    s_fused_linear.add_rms_norm_linear_rope_kv_store_params,
    s_fused_linear.add_rms_norm_linear_rope_kv_store_build, (11, 12, 2, 4, 5, 18),
    s_fused_linear.ADD_RMS_NORM_LINEAR_ROPE_KV_STORE_EXAMPLES,
    s_fused_linear.ADD_RMS_NORM_LINEAR_ROPE_KV_STORE_INVALID,
    mutates=("k_cache", "v_cache"), sums_products=True,
))
# fmt: on
