"""Cases for ``linear``, ``linear_splitk`` and ``splitk_reduce``: M = 1..5 (decode, and both sides
of the gemv/tiled boundary), N and K tails and the model's widths (4864 ...) where the size cap
allows, bias on and off, x and weight as the views the model passes (a column slice of a wider
buffer, a transposed view, a row slice of a fused weight, a transposed ``[K, N]`` storage),
split_k 1..8 and up to the kernel's 64 with K not divisible, and every projection shape of the
three model configs on the GPU."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from model.config import PRESETS, ModelConfig
from ops.gemm_config import GEMV_MAX_M
from verify.cases import AWKWARD, MODEL_DIMS, Case, choice, dtype_of, generator, size, strided_view, values
from verify.limits import Limits
from verify.strategies.common import BOOLS, Invalid, common, labels_for, padding, replace

X_LAYOUTS = ("contiguous", "column_slice", "transposed")
W_LAYOUTS = ("contiguous", "row_slice", "column_slice", "transposed")


# ---- the projections of the model configs -----------------------------------------------------


@dataclass(frozen=True)
class Projection:
    """One GEMM of the decoder: ``[M, k] @ [n, k].T``."""

    name: str
    n: int
    k: int
    bias: bool = False


def config_projections(cfg: ModelConfig) -> tuple[Projection, ...]:
    """The five projections of one decoder config (fused QKV and fused gate/up, as the model runs them)."""
    hidden, heads, kv_heads, head_dim = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    return (
        Projection("qkv_proj", (heads + 2 * kv_heads) * head_dim, hidden, cfg.qkv_bias),
        Projection("o_proj", hidden, heads * head_dim),
        Projection("gate_up_proj", 2 * cfg.intermediate_size, hidden),
        Projection("down_proj", hidden, cfg.intermediate_size),
        Projection("lm_head", cfg.vocab_size, hidden),
    )


MODEL_PROJECTIONS: dict[str, tuple[Projection, ...]] = {
    name: config_projections(cfg) for name, cfg in PRESETS.items()
}


# ---- tensors -----------------------------------------------------------------------------------


def _x(params: dict, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    m, k, dtype, dist = params["m"], params["k"], dtype_of(params), params["dist"]
    layout = choice(params, "x_layout", X_LAYOUTS)
    if layout == "column_slice":  # columns 3..3+K of a wider buffer: strided rows, unaligned start
        return values((m, k + 8), dtype, dist, gen, device)[:, 3 : 3 + k]
    if layout == "transposed":  # stored [K, M]: stride 1 along M
        return values((k, m), dtype, dist, gen, device).T
    return values((m, k), dtype, dist, gen, device)


def weight_tensor(params: dict, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    n, k, dtype = params["n"], params["k"], dtype_of(params)
    layout = choice(params, "w_layout", W_LAYOUTS)
    if layout == "row_slice":  # rows 7..7+N of a fused weight (e.g. the K part of a fused QKV)
        return values((n + 12, k), dtype, "normal", gen, device)[7 : 7 + n]
    if layout == "column_slice":  # the first K columns of wider rows
        return strided_view((n, k), dtype, "normal", gen, device, 9)
    if layout == "transposed":  # a [K, N] storage viewed as [N, K]: stride 1 along N
        return values((k, n), dtype, "normal", gen, device).T
    return values((n, k), dtype, "normal", gen, device)


def _cancel(params: dict, x: torch.Tensor, weight: torch.Tensor) -> None:
    """With ``cancel``: x's second half of K repeats its first, and the weight's second half is
    minus its first scaled by 1 + 2^-6, so every output is ~2^-6 of its terms: an error of an
    input ulp per product (products or K-block partials rounded to the dtype) is then many output
    ulps, where on plain random data it hides below plain torch's own rounding."""
    if not choice(params, "cancel", BOOLS, False):
        return
    h = x.shape[1] // 2
    x[:, h : 2 * h].copy_(x[:, :h])
    weight[:, h : 2 * h].copy_((-weight[:, :h].float() * (1 + 2**-6)).to(weight.dtype))


def _labels(params: dict) -> list[str]:
    out = labels_for(params, M=params["m"], N=params["n"], K=params["k"])
    out += [f"x {params['x_layout']}", f"weight {params['w_layout']}"]
    if choice(params, "cancel", BOOLS, False):
        out.append("cancelling terms")
    if params["x_layout"] != "contiguous" or params["w_layout"] != "contiguous":
        out.append("non-contiguous")
    out.append(f"gemv (M <= {GEMV_MAX_M})" if params["m"] <= GEMV_MAX_M else f"tiled (M > {GEMV_MAX_M})")
    return out


def fits_dtype(params: dict) -> bool:
    # |x| up to 1e4 times unit weights over K terms overflows fp16 (65504) for any implementation.
    return not (params["dtype"] == "float16" and params["dist"] == "large")


def m_sizes(limits: Limits) -> st.SearchStrategy[int]:
    """Decode sizes half the time: 1..4 take the gemv path, 5 is the first the tiled kernel
    takes (ops.gemm_config.GEMV_MAX_M); else any M up to the cap."""
    return st.one_of(st.sampled_from([1, 2, 3, 4, 5]), size(limits.gemm, AWKWARD))


def split_counts(limits: Limits) -> st.SearchStrategy[int]:
    """1..8 half the time, else past the reduce's first 8: up to ops.gemm_config.MAX_SPLIT_K (64) on the
    GPU, 31 on the interpreter, where every split is another pass over the programs."""
    return st.one_of(st.integers(1, 8), st.sampled_from([16, 31, 64] if limits.gemm >= 1024 else [16, 31]))


def _shape_fields(limits: Limits) -> dict:
    return {
        "m": m_sizes(limits),
        "n": size(limits.gemm, AWKWARD + MODEL_DIMS),
        "k": size(limits.gemm, AWKWARD + MODEL_DIMS),
        "x_layout": st.sampled_from(X_LAYOUTS),
        "w_layout": st.sampled_from(W_LAYOUTS),
        **common(),
    }


# ---- linear ------------------------------------------------------------------------------------


def linear_params(limits: Limits) -> st.SearchStrategy[dict]:
    fields = {**_shape_fields(limits), "cancel": st.booleans(), "bias": st.booleans()}
    return st.fixed_dictionaries(fields).filter(fits_dtype)


def linear_build(params: dict, device: torch.device) -> Case:
    gen = generator(params, device)
    x = _x(params, gen, device)
    weight = weight_tensor(params, gen, device)
    _cancel(params, x, weight)
    has_bias = choice(params, "bias", BOOLS)
    bias = values((params["n"],), dtype_of(params), "normal", gen, device) if has_bias else None
    labels = [*_labels(params), "bias" if has_bias else "no bias"]
    return Case(params, (x, weight, bias), labels=tuple(labels))


def _example(name: str, m: int, n: int, k: int, **extra: object) -> dict:
    base = {
        "m": m,
        "n": n,
        "k": k,
        "bias": False,
        "x_layout": "contiguous",
        "w_layout": "contiguous",
        "dtype": "bfloat16",
        "dist": "normal",
        "seed": 0,
    }
    return {"name": name, **base, **extra}


def _splitk_example(name: str, m: int, n: int, k: int, split_k: int, **extra: object) -> dict:
    example = _example(name, m, n, k, **{"split_k": split_k, "prealloc": False, **extra})
    del example["bias"]
    return example


def distinct_projections(names: tuple[str, ...] | None = None) -> list[tuple[str, Projection]]:
    """``(preset, projection)`` for every distinct shape (N, K, bias) of the three configs, in
    preset order, optionally only the projections with these names."""
    seen: set[tuple[int, int, bool]] = set()
    out = []
    for preset, projs in MODEL_PROJECTIONS.items():
        for p in projs:
            if (names is None or p.name in names) and (p.n, p.k, p.bias) not in seen:
                seen.add((p.n, p.k, p.bias))
                out.append((preset, p))
    return out


def _projection_examples() -> tuple[dict, ...]:
    """Every distinct projection shape of the three configs, at decode (M=1) and prefill (M=256)."""
    return tuple(
        _example(
            f"{preset} {p.name} {phase} (M={m}, N={p.n}, K={p.k}{', bias' if p.bias else ''})",
            m,
            p.n,
            p.k,
            bias=p.bias,
        )
        for preset, p in distinct_projections()
        for m, phase in ((1, "decode"), (256, "prefill"))
    )


LINEAR_EXAMPLES = (
    _example(
        "typical: 3 x 129 @ (65 x 129).T + bias, x and weight slices",
        3,
        65,
        129,
        bias=True,
        x_layout="column_slice",
        w_layout="row_slice",
        gpu=False,
    ),
    *_projection_examples(),
    _example("split-K decode with a K tail (M=1, N=1024, K=4000)", 1, 1024, 4000),
    _example("batch decode M=3, N=4864, K=4863, weight row slice", 3, 4864, 4863, w_layout="row_slice"),
    _example("skinny M=7, lm_head N=151936, transposed x", 7, 151936, 896, x_layout="transposed"),
    _example(
        "M=300, N=1000, K=1000, fp16 + bias, weight stored [K, N]",
        300,
        1000,
        1000,
        dtype="float16",
        bias=True,
        w_layout="transposed",
    ),
    _example("fp32 M=33, N=1536, K=1024, large values", 33, 1536, 1024, dtype="float32", dist="large"),
    _example(
        "decode M=1, qkv N=1152 K=896 + bias, outliers", 1, 1152, 896, bias=True, dist="outliers", gpu=False
    ),
    _example(
        "tiled M=5, K=129 past one block, x and weight transposed",
        5,
        17,
        129,
        x_layout="transposed",
        w_layout="transposed",
        gpu=False,
    ),
    _example(
        "gemv M=2, K=129 in several steps, x and weight transposed",
        2,
        17,
        129,
        x_layout="transposed",
        w_layout="transposed",
        gpu=False,
    ),
    _example("cancelling terms, gemv M=1 K=64 in one step", 1, 17, 64, cancel=True, gpu=False),
    _example("cancelling terms across K blocks, tiled M=5 K=160", 5, 17, 160, cancel=True, gpu=False),
    # the interpreter's drawn M stays under 3 row tiles, one group of GROUP_M (8): 9 x 2 tiles
    # make a second, partial group
    _example("tiled 9 x 2 tiles, a partial last group of rows, + bias", 530, 65, 17, bias=True, gpu=False),
    _example("tiled M=5, N=130 (3 N tiles) + bias", 5, 130, 33, bias=True, gpu=False),
)


LINEAR_INVALID = (
    Invalid("weight K differs from x's", "weight", replace("weight", lambda w: w[:, :-1])),
    Invalid(
        "weight given as [K, N] instead of [N, K]", "weight", replace("weight", lambda w: w.T.contiguous())
    ),
    Invalid("bias of the wrong length", "bias", replace("bias", lambda b: b[:-1])),
    Invalid("2-d bias", "bias", replace("bias", lambda b: b[None])),
    Invalid("fp32 weight with bf16 x", "weight", replace("weight", lambda w: w.float()), TypeError),
    Invalid("bias dtype differs from x", "bias", replace("bias", lambda b: b.float()), TypeError),
    Invalid("1-d x", "x", replace("x", lambda x: x[0])),
    Invalid("3-d x", "x", replace("x", lambda x: x[None])),
)


# ---- linear_splitk -----------------------------------------------------------------------------


def linear_splitk_params(limits: Limits) -> st.SearchStrategy[dict]:
    fields = {
        **_shape_fields(limits),
        "cancel": st.booleans(),
        "split_k": split_counts(limits),
        "prealloc": st.booleans(),
    }
    drawn = st.fixed_dictionaries(fields).filter(lambda p: p["split_k"] <= p["k"] and fits_dtype(p))
    return drawn.map(_bounded_prealloc)


# The check clones a case's buffers for each reference run, once in fp64: a preallocated 64 x
# 4900 x 4900 partials buffer took ~25 GB and ran an 80 GB H100 out of memory beside the suite's
# other workers. The model's buffers are [split, 1, N]; past 2**26 elements (256 MB) the kernel
# allocates its own, which the case still checks.
PREALLOC_MAX_ELEMENTS = 1 << 26


def _bounded_prealloc(params: dict) -> dict:
    small = params["split_k"] * params["m"] * params["n"] <= PREALLOC_MAX_ELEMENTS
    return {**params, "prealloc": params["prealloc"] and small}


def linear_splitk_build(params: dict, device: torch.device) -> Case:
    gen = generator(params, device)
    x = _x(params, gen, device)
    weight = weight_tensor(params, gen, device)
    _cancel(params, x, weight)
    split = params["split_k"]
    labels = [*_labels(params), f"split_k {split}"]
    if params["k"] % split:
        labels.append("K not divisible by split_k")
    kwargs = {}
    if choice(params, "prealloc", BOOLS):
        # the CUDA Graph path: the caller's buffer, NaN-filled so unwritten splits show
        shape = (split, params["m"], params["n"])
        kwargs["partials"] = torch.full(shape, float("nan"), dtype=torch.float32, device=device)
        labels.append("preallocated partials")
    return Case(params, (x, weight, split), kwargs, labels=tuple(labels))


LINEAR_SPLITK_EXAMPLES = (
    _splitk_example(
        "typical: 3 x 129, split 3, transposed weight, preallocated partials",
        3,
        65,
        129,
        3,
        w_layout="transposed",
        prealloc=True,
        gpu=False,
    ),
    _splitk_example(
        "tiled M=5, split 3 of K=64 (whole blocks), cancelling terms", 5, 17, 64, 3, cancel=True, gpu=False
    ),
    _splitk_example("article down_proj decode, split 8 (K=4864)", 1, 1024, 4864, 8, prealloc=True),
    _splitk_example("article lm_head decode, split 4 (N=151936, K=1024)", 1, 151936, 1024, 4),
    _splitk_example("qwen2.5 down_proj decode, split 5, K tail (K=4863)", 1, 896, 4863, 5),
    _splitk_example("batch decode M=2 (gemv), split 3, K=1000", 2, 1536, 1000, 3, x_layout="column_slice"),
    _splitk_example("prefill M=256, split 3, K tail (K=3071)", 256, 1024, 3071, 3),
    _splitk_example("skinny M=16, split 8, weight row slice", 16, 1152, 896, 8, w_layout="row_slice"),
)


# The generic bad-input test passes only positional arguments, so a wrong buffer is made by
# changing split_k under the typical case's preallocated partials (wrong dtypes: tests/test_gemm.py).
LINEAR_SPLITK_INVALID = (
    Invalid("split_k of 0", "split_k", replace("split_k", lambda s: 0)),
    Invalid("split_k larger than K", "split_k", lambda a: a.update(split_k=a["x"].shape[1] + 1)),
    Invalid("split_k not an int", "split_k", replace("split_k", float)),
    Invalid("weight K differs from x's", "weight", replace("weight", lambda w: w[:, :-1])),
    Invalid("fp32 weight with bf16 x", "weight", replace("weight", lambda w: w.float()), TypeError),
    Invalid("partials buffer made for fewer splits", "partials", replace("split_k", lambda s: s + 1)),
)


# ---- splitk_reduce -----------------------------------------------------------------------------


# Partials of at most this many elements (268 MB of fp32). Drawn up to 64 x 5000 x 8192 (10 GB),
# one case took 40 GB of GPU memory with the copies a check makes (the impl's, the reference's,
# the fp64 oracle's), a third of the H200 for one of the thorough profile's 16 workers
# (2026-12-02); the reduce's paths (split counts, M = 1, N tails, strided rows) need no such size.
REDUCE_ELEMENTS = 1 << 26


def _reduce_within_budget(params: dict) -> dict:
    """M cut down so that the partials hold at most ``REDUCE_ELEMENTS``."""
    return {**params, "m": min(params["m"], max(1, REDUCE_ELEMENTS // (params["s"] * params["n"])))}


def splitk_reduce_params(limits: Limits) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries(
        {
            "s": split_counts(limits),
            "m": m_sizes(limits),
            "n": size(limits.width, AWKWARD),
            "pad": padding(),
            **common(),
        }
    ).map(_reduce_within_budget)


def splitk_reduce_build(params: dict, device: torch.device) -> Case:
    """Partials are fp32; ``dtype`` is the output dtype. With ``pad``, rows sit in a wider buffer."""
    gen = generator(params, device)
    shape = (params["s"], params["m"], params["n"])
    partials = strided_view(shape, torch.float32, params["dist"], gen, device, params["pad"])
    labels = [*labels_for(params, M=params["m"], N=params["n"]), f"{params['s']} splits"]
    if params["pad"]:
        labels.append("non-contiguous")
    return Case(params, (partials, dtype_of(params)), labels=tuple(labels))


def _reduce_example(name: str, s: int, m: int, n: int, **extra: object) -> dict:
    base = {"s": s, "m": m, "n": n, "pad": 0, "dtype": "bfloat16", "dist": "normal", "seed": 0}
    return {"name": name, **base, **extra}


SPLITK_REDUCE_EXAMPLES = (
    _reduce_example("typical: 3 splits of 3 x 65, strided rows", 3, 3, 65, pad=2, gpu=False),
    # one split already in the output dtype: a reduce that hands back its input (a view) is wrong
    _reduce_example("one split of 2 x 3 to fp32", 1, 2, 3, dtype="float32", gpu=False),
    _reduce_example("down_proj decode: 8 splits of 1 x 1024", 8, 1, 1024, gpu=False),
    _reduce_example("lm_head decode: 4 splits of 1 x 151936, large values", 4, 1, 151936, dist="large"),
    _reduce_example("prefill: 2 splits of 256 x 1024 to fp16", 2, 256, 1024, dtype="float16"),
)
SPLITK_REDUCE_INVALID = (
    Invalid("bf16 partials", "partials", replace("partials", lambda p: p.bfloat16()), TypeError),
    Invalid("2-d partials", "partials", replace("partials", lambda p: p[0])),
    Invalid("integer out_dtype", "out_dtype", replace("out_dtype", lambda d: torch.int32), TypeError),
    Invalid(
        "out_dtype given as a string", "out_dtype", replace("out_dtype", lambda d: "bfloat16"), TypeError
    ),
)
