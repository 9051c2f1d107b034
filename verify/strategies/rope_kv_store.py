"""Cases for ``rope_kv_store`` (optional qk-norm, RoPE on q and k, KV cache store in one launch):
decode and prefill, per-row start positions with rows past the capacity dropped, GQA groups 1
to 8, partial rotary dims, q/k/v as head slices of the fused QKV output or separate tensors, and
caches pre-filled with random data (stray writes show)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from hypothesis import strategies as st

from verify.cases import AWKWARD, Case, choice, dtype_of, generator, size, values
from verify.limits import Limits
from verify.strategies.common import BOOLS, Invalid, common, labels_for, replace
from verify.strategies.kv_cache import STARTS, _starts
from verify.strategies.norm import NORM_WEIGHTS, _weight
from verify.strategies.rope import (
    BASES,
    COS_SIN_INVALID,
    HEAD_DIMS,
    ROTARY,
    TABLES,
    rope_tables,
    rotary_dim_of,
    rotary_label,
)

# q, k, v: head slices of one QKV row (padded: a wider row), three contiguous tensors, or mixed
# (k contiguous beside q and v slices, as the unfused model hands them over): k and v strides differ;
# heads_padded pads every head's row (head strides D + 3), heads_padded_mixed then makes k
# contiguous, so k's and v's head strides differ too
LAYOUTS = ("fused", "fused_padded", "separate", "mixed", "heads_padded", "heads_padded_mixed")


def token_budget(limits: Limits) -> int:
    """Most new tokens ``B * S`` per case: half the other head-wise ops' largest. The kernel runs
    two programs a token (its q heads, its kv heads), which on the interpreter take 20-30 ms each
    whatever the head count, so 60 tokens keep a case within ~4 s."""
    return limits.batch * limits.seq // 2


@st.composite
def rope_kv_store_params(draw: st.DrawFn, limits: Limits) -> dict:
    # Every draw has fixed bounds and S is clamped to the budget afterwards: bounds that depend on
    # earlier draws collapse some choices to one value, and Hypothesis then shrinks toward the
    # large shapes that make them collapse instead of toward small ones.
    group = draw(st.integers(1, 8))  # q heads per kv head
    kv_heads = draw(size(limits.heads, AWKWARD))
    b = draw(size(limits.batch, AWKWARD))
    s = draw(size(limits.seq, AWKWARD))
    s = max(1, min(s, token_budget(limits) // b))
    extra = draw(st.one_of(st.just(0), size(limits.seq, AWKWARD)))  # cache rows beyond S
    return {
        "b": b,
        "s": s,
        "capacity": s + extra,
        "starts": draw(st.sampled_from(STARTS)),
        "kv_heads": kv_heads,
        "group": group,
        "head_dim": draw(st.sampled_from(HEAD_DIMS)),
        "rotary": draw(st.sampled_from(ROTARY)),
        "qk_norm": draw(st.booleans()),
        "norm_weight": draw(st.sampled_from(NORM_WEIGHTS)),
        "eps": draw(st.sampled_from([1e-6, 1e-5])),
        "layout": draw(st.sampled_from(LAYOUTS)),
        "tables": draw(st.sampled_from(TABLES)),
        "base": draw(st.sampled_from(BASES)),
        **{k: draw(v) for k, v in common().items()},
    }


def _qkv(params: dict, gen: torch.Generator, device: torch.device) -> tuple[torch.Tensor, ...]:
    """q, k, v as the model hands them over: head slices of a ``[B * S, (Hq + 2 Hkv) * D (+ pad)]``
    GEMM output viewed as ``[B, S, Hq + 2 Hkv, D]``, or three contiguous tensors."""
    b, s, hkv, d = params["b"], params["s"], params["kv_heads"], params["head_dim"]
    hq = hkv * params["group"]
    dtype, dist, layout = dtype_of(params), params["dist"], choice(params, "layout", LAYOUTS)
    if layout == "separate":
        return tuple(values((b, s, h, d), dtype, dist, gen, device) for h in (hq, hkv, hkv))
    if layout in ("heads_padded", "heads_padded_mixed"):  # every head's row padded: head strides D + 3
        heads = values((b, s, hq + 2 * hkv, d + 3), dtype, dist, gen, device)[..., :d]
        q, k, v = heads[:, :, :hq], heads[:, :, hq : hq + hkv], heads[:, :, hq + hkv :]
        return (q, k.contiguous(), v) if layout == "heads_padded_mixed" else (q, k, v)
    width = (hq + 2 * hkv) * d
    pad = 3 if layout == "fused_padded" else 0
    qkv = values((b * s, width + pad), dtype, dist, gen, device)[:, :width]
    heads = qkv.unflatten(0, (b, s)).unflatten(2, (hq + 2 * hkv, d))
    q, k, v = heads[:, :, :hq], heads[:, :, hq : hq + hkv], heads[:, :, hq + hkv :]
    return (q, k.contiguous(), v) if layout == "mixed" else (q, k, v)


def rope_kv_store_build(params: dict, device: torch.device) -> Case:
    gen = generator(params, device)
    b, s, cap, hkv, d = params["b"], params["s"], params["capacity"], params["kv_heads"], params["head_dim"]
    dtype = dtype_of(params)
    q, k, v = _qkv(params, gen, device)
    k_cache = values((b, cap, hkv, d), dtype, "normal", gen, device)
    v_cache = values((b, cap, hkv, d), dtype, "normal", gen, device)
    start_pos = _starts(params, gen, device)
    positions = start_pos.long()[:, None] + torch.arange(s, device=device)
    tables = choice(params, "tables", TABLES, "shared")
    cos, sin = rope_tables(positions, rotary_dim_of(params), params["base"], tables)
    q_norm = k_norm = None
    qk_norm = choice(params, "qk_norm", BOOLS)
    if qk_norm:
        kind = choice(params, "norm_weight", NORM_WEIGHTS)
        weight_params = {"n": d, "weight": kind, "dtype": params["dtype"]}
        q_norm, k_norm = _weight(weight_params, gen, device), _weight(weight_params, gen, device)
    labels = labels_for(params, S=s, L=cap, Hkv=hkv, D=d)
    labels += [
        "decode (S = 1)" if s == 1 else "prefill (S > 1)",
        f"start {params['starts']}",
        f"group {params['group']}",
        rotary_label(params),
        "qk-norm" if qk_norm else "no qk-norm",
        f"layout {params['layout']}",
        f"cos/sin {tables}",
    ]
    if params["layout"] != "separate":
        labels.append("non-contiguous")
    args = (q, k, v, cos, sin, k_cache, v_cache, start_pos, q_norm, k_norm, params["eps"])
    return Case(params, args, labels=tuple(labels))


def _example(
    name: str, b: int, s: int, cap: int, kv_heads: int, group: int, head_dim: int, **extra: object
) -> dict:
    return {
        "name": name,
        "b": b,
        "s": s,
        "capacity": cap,
        "starts": "random",
        "kv_heads": kv_heads,
        "group": group,
        "head_dim": head_dim,
        "rotary": "full",
        "qk_norm": False,
        "norm_weight": "normal",
        "eps": 1e-6,
        "layout": "fused",
        "base": 1000000.0,
        "dtype": "bfloat16",
        "dist": "normal",
        "seed": 0,
        **extra,
    }


ROPE_KV_STORE_EXAMPLES = (
    _example(
        "typical: 2 x 3 tokens, 4 q + 2 kv heads of 34, partial rotary, qk-norm",
        2, 3, 9, 2, 2, 34, rotary="half", qk_norm=True, gpu=False,
    ),
    _example("decode into the last row, 7-way GQA, head_dim 16", 1, 1, 9, 1, 7, 16, starts="end", gpu=False),
    _example(
        "k contiguous beside padded q and v heads (k and v head strides differ)", 1, 2, 6, 2, 2, 16,
        layout="heads_padded_mixed", gpu=False,
    ),
    _example(
        "prefill 5, 8-way GQA, fused qkv rows with padded heads", 2, 5, 12, 1, 8, 16,
        layout="fused_padded", gpu=False,
    ),
    # the interpreter tiles up to 4096 elements of heads: 40 heads of 256 take two tiles
    _example("40 q + 8 kv heads x 256, the q heads in two tiles", 1, 1, 4, 8, 5, 256, gpu=False),
    _example("article decode (8 q + 2 kv heads x 128), last cache row", 1, 1, 4096, 2, 4, 128, starts="end"),
    _example("qwen3-0.6b decode with qk-norm (16 q + 8 kv heads x 128)", 1, 1, 4096, 8, 2, 128, qk_norm=True),
    _example("qwen2.5-0.5b prefill 256 (14 q + 2 kv heads x 64)", 1, 256, 4096, 2, 7, 64, starts="zero"),
    _example(
        "qwen3 batch 4 prefill 17, rows past capacity dropped", 4, 17, 2048, 8, 2, 128,
        starts="overflow", qk_norm=True,
    ),
)  # fmt: skip


def _caches(fn: Callable) -> Callable[[dict], None]:
    """An ``Invalid.mutate`` that swaps both caches for ``fn(cache)``."""

    def mutate(args: dict) -> None:
        args["k_cache"], args["v_cache"] = fn(args["k_cache"]), fn(args["v_cache"])

    return mutate


ROPE_KV_STORE_INVALID = (
    Invalid("3-d q", "q", replace("q", lambda q: q[0])),
    Invalid("k with another head count than k_cache", "k", replace("k", lambda k: k[:, :, :-1])),
    Invalid("v of another shape", "v", replace("v", lambda v: v[:, :, :, :-1])),
    Invalid("v in another dtype than q", "v", replace("v", lambda v: v.float()), TypeError),
    *COS_SIN_INVALID,
    Invalid("v_cache of another shape", "v_cache", replace("v_cache", lambda c: c[:, :-1])),
    Invalid(
        "non-contiguous k_cache",
        "k_cache",
        replace("k_cache", lambda c: c.transpose(1, 2).contiguous().transpose(1, 2)),
    ),
    Invalid("more new tokens than cache rows", "q", _caches(lambda c: c[:, :2].contiguous())),
    Invalid("start_pos as int64", "start_pos", replace("start_pos", lambda p: p.long()), TypeError),
    Invalid("start_pos of the wrong length", "start_pos", replace("start_pos", lambda p: p[:-1])),
    Invalid("q_norm without k_norm", "k_norm", replace("k_norm", lambda _: None)),
    Invalid("k_norm without q_norm", "q_norm", replace("q_norm", lambda _: None)),
    Invalid("q_norm of the wrong length", "q_norm", replace("q_norm", lambda w: w[:-1])),
    Invalid("k_norm of the wrong length", "k_norm", replace("k_norm", lambda w: w[1:-1])),
)
