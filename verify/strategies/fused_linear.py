"""Cases for ``add_rms_norm_linear``, ``add_rms_norm_linear_silu_mul`` and
``add_rms_norm_linear_rope_kv_store``: the GEMM cases
(M = 1/2/3 on the fused gemv path, larger M on the composed path, N and K tails, weight views,
bias) with the fused op's own inputs as the model passes them: x and the residual as row
views, the gate/up weight as one [2N, K] matrix (or a row slice of a wider one), norm
weights of ones or near-ones, eps."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from verify.cases import AWKWARD, MODEL_DIMS, Case, choice, dtype_of, generator, size, values
from verify.limits import Limits
from verify.strategies.common import BOOLS, EPS_NOT_FP32, Invalid, common, labels_for, replace
from verify.strategies.gemm import W_LAYOUTS, distinct_projections, m_sizes, weight_tensor
from verify.strategies.kv_cache import STARTS, _starts
from verify.strategies.norm import NORM_WEIGHTS
from verify.strategies.rope import BASES, TABLES, rope_tables, rotary_dim_of, rotary_label
from verify.strategies.rope_kv_store import token_budget

ROW_LAYOUTS = ("contiguous", "column_slice")  # the fused kernels need unit stride along K


def _rows(m: int, k: int, layout: str, dtype: torch.dtype, dist: str, gen, device) -> torch.Tensor:
    if layout == "column_slice":  # columns 3..3+K of a wider buffer: strided rows, unaligned start
        return values((m, k + 8), dtype, dist, gen, device)[:, 3 : 3 + k]
    return values((m, k), dtype, dist, gen, device)


def _shape_fields(limits: Limits) -> dict:
    return {
        "m": m_sizes(limits),
        "n": size(limits.gemm, AWKWARD + MODEL_DIMS),
        "k": size(limits.gemm, AWKWARD + MODEL_DIMS),
        "w_layout": st.sampled_from(W_LAYOUTS),
        **common(),
    }


def _labels(params: dict, *layouts: str) -> list[str]:
    out = labels_for(params, M=params["m"], N=params["n"], K=params["k"])
    out.append("fused gemv" if params["m"] <= 4 else "composed (M > 4)")
    out += [f"weight {params['w_layout']}", *layouts]
    if params["w_layout"] != "contiguous" or any("slice" in layout for layout in layouts):
        out.append("non-contiguous")
    return out


# ---- add_rms_norm_linear -----------------------------------------------------------------------


def _norm_fields(limits: Limits) -> dict:
    return {
        **_shape_fields(limits),
        "x_layout": st.sampled_from(ROW_LAYOUTS),
        "residual_layout": st.sampled_from(ROW_LAYOUTS),
        "norm_weight": st.sampled_from(NORM_WEIGHTS),
        "eps": st.sampled_from([1e-6, 1e-5]),
    }


def _norm_inputs(params: dict, gen: torch.Generator, device: torch.device) -> tuple[torch.Tensor, ...]:
    """x, the residual and the norm weight, as the model passes them."""
    m, k, dtype = params["m"], params["k"], dtype_of(params)
    x_layout = choice(params, "x_layout", ROW_LAYOUTS)
    residual_layout = choice(params, "residual_layout", ROW_LAYOUTS)
    x = _rows(m, k, x_layout, dtype, params["dist"], gen, device)
    residual = _rows(m, k, residual_layout, dtype, params["dist"], gen, device)  # tiny sums reach eps
    if choice(params, "norm_weight", NORM_WEIGHTS) == "ones":
        norm_weight = torch.ones(k, dtype=dtype, device=device)
    else:
        norm_weight = (1 + 0.1 * torch.randn(k, generator=gen, device=device)).to(dtype)
    return x, residual, norm_weight


def add_rms_norm_linear_params(limits: Limits) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({**_norm_fields(limits), "bias": st.booleans()})


def add_rms_norm_linear_build(params: dict, device: torch.device) -> Case:
    gen = generator(params, device)
    x, residual, norm_weight = _norm_inputs(params, gen, device)
    weight = weight_tensor(params, gen, device)
    has_bias = choice(params, "bias", BOOLS)
    bias = values((params["n"],), dtype_of(params), "normal", gen, device) if has_bias else None
    labels = _labels(params, f"x {params['x_layout']}", f"residual {params['residual_layout']}")
    labels.append("bias" if has_bias else "no bias")
    return Case(params, (x, residual, norm_weight, params["eps"], weight, bias), labels=tuple(labels))


def _norm_example(name: str, m: int, n: int, k: int, **extra: object) -> dict:
    base = {
        "m": m,
        "n": n,
        "k": k,
        "w_layout": "contiguous",
        "bias": False,
        "x_layout": "contiguous",
        "residual_layout": "contiguous",
        "norm_weight": "normal",
        "eps": 1e-6,
        "dtype": "bfloat16",
        "dist": "normal",
        "seed": 0,
    }
    return {"name": name, **base, **extra}


def _norm_projection_examples() -> tuple[dict, ...]:
    """The projections that follow a norm (QKV, gate/up) of the three configs, decode and prefill."""
    return tuple(
        _norm_example(
            f"{preset} {p.name} M={m} (N={p.n}, K={p.k}{', bias' if p.bias else ''})",
            m,
            p.n,
            p.k,
            bias=p.bias,
        )
        for preset, p in distinct_projections(("qkv_proj", "gate_up_proj"))
        for m in (1, 256)
    )


ADD_RMS_NORM_LINEAR_EXAMPLES = (
    _norm_example(
        "typical: 3 x 129 rows, residual slice, bias, weight row slice",
        3,
        65,
        129,
        bias=True,
        x_layout="column_slice",
        w_layout="row_slice",
        gpu=False,
    ),
    _norm_example("two rows (M=2) on the gemv path, N and K tails", 2, 37, 45, gpu=False),
    _norm_example("decode M=1, tiny x and residual: eps dominates", 1, 17, 48, dist="tiny", gpu=False),
    *_norm_projection_examples(),
    _norm_example("split-K gemv: N=64, K=4000 (K tail), large values", 1, 64, 4000, dist="large"),
    _norm_example(
        "batch decode M=4, N=1536, K=1024, residual slice", 4, 1536, 1024, residual_layout="column_slice"
    ),
    _norm_example("fp32 M=2, N=1000, K=1000, bias", 2, 1000, 1000, dtype="float32", bias=True),
    _norm_example("tiny values: eps dominates (M=1, K=896)", 1, 128, 896, dist="tiny", eps=1e-5, gpu=False),
)

ADD_RMS_NORM_LINEAR_INVALID = (
    Invalid("residual of another shape", "residual", replace("residual", lambda r: r[:, :-1])),
    Invalid("residual dtype differs from x", "residual", replace("residual", lambda r: r.float()), TypeError),
    Invalid("norm_weight of the wrong length", "norm_weight", replace("norm_weight", lambda w: w[:-1])),
    Invalid("negative eps", "eps", replace("eps", lambda e: -e)),
    *EPS_NOT_FP32,
    Invalid("weight K differs from x's", "weight", replace("weight", lambda w: w[:, :-1])),
    Invalid("bias of the wrong length", "bias", replace("bias", lambda b: b[:-1])),
    Invalid("3-d x", "x", replace("x", lambda x: x[None])),
    Invalid("x with a strided last dim", "x", replace("x", lambda x: x.new_empty(x.shape[::-1]).T)),
)


# ---- add_rms_norm_linear_silu_mul: N outputs from a [2N, K] gate/up weight ----------------------


def add_rms_norm_linear_silu_mul_params(limits: Limits) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries(_norm_fields(limits))


def add_rms_norm_linear_silu_mul_build(params: dict, device: torch.device) -> Case:
    gen = generator(params, device)
    x, residual, norm_weight = _norm_inputs(params, gen, device)
    weight = weight_tensor({**params, "n": 2 * params["n"]}, gen, device)  # gate rows, then up rows
    labels = _labels(params, f"x {params['x_layout']}", f"residual {params['residual_layout']}")
    return Case(params, (x, residual, norm_weight, params["eps"], weight), labels=tuple(labels))


def _swiglu_example(name: str, m: int, n: int, k: int, **extra: object) -> dict:
    example = _norm_example(name, m, n, k, **extra)
    del example["bias"]
    return example


ADD_RMS_NORM_LINEAR_SILU_MUL_EXAMPLES = (
    _swiglu_example(
        "typical: 3 x 129 rows, residual slice, 2 x 33 weight rows sliced from a wider weight",
        3,
        33,
        129,
        x_layout="column_slice",
        w_layout="row_slice",
        gpu=False,
    ),
    *(
        _swiglu_example(f"{preset} gate_up_proj M={m} (N={p.n // 2}, K={p.k})", m, p.n // 2, p.k)
        for preset, p in distinct_projections(("gate_up_proj",))
        for m in (1, 256)
    ),
    _swiglu_example("K in several steps with a tail: N=64, K=4000, large values", 1, 64, 4000, dist="large"),
    _swiglu_example(
        "batch decode M=4, N=4864, K=1024, residual slice", 4, 4864, 1024, residual_layout="column_slice"
    ),
    _swiglu_example("fp32 M=2, N=500, K=1000", 2, 500, 1000, dtype="float32"),
    # the composed path's normed x and gate/up outputs are the same size: two scratch buffers
    _swiglu_example("composed M=5 with 2N == K", 5, 16, 32, gpu=False),
    _swiglu_example("one output (N=1): a program's single gate/up pair", 1, 1, 96, gpu=False),
)

ADD_RMS_NORM_LINEAR_SILU_MUL_INVALID = (
    Invalid("weight with an odd number of rows", "weight", replace("weight", lambda w: w[:-1])),
    Invalid("residual of another shape", "residual", replace("residual", lambda r: r[:, :-1])),
    Invalid("norm_weight of the wrong length", "norm_weight", replace("norm_weight", lambda w: w[:-1])),
    Invalid("weight K differs from x's", "weight", replace("weight", lambda w: w[:, :-1])),
    Invalid("weight given as [K, 2N]", "weight", replace("weight", lambda w: w.T.contiguous())),
    Invalid("3-d x", "x", replace("x", lambda x: x[None])),
)


# ---- add_rms_norm_linear_rope_kv_store: the QKV projection with RoPE and the cache write --------


def add_rms_norm_linear_rope_kv_store_params(limits: Limits) -> st.SearchStrategy[dict]:
    """``m`` is S, the new tokens of each of ``b`` rows (M = B * S, the gemv path up to 4); the
    weight's rows are ``(Hq + 2 Hkv) * D``; M * N stays within the GEMM strategies' largest, and
    the composed path's ``rope_kv_store`` launch within that op's program budget."""
    fields = {
        **_norm_fields(limits),
        "m": st.one_of(st.sampled_from([1, 1, 2, 3]), size(limits.seq, AWKWARD)),
        "b": st.integers(1, limits.batch),
        "bias": st.booleans(),
        "kv_heads": st.integers(1, 3),
        "group": st.sampled_from((1, 2, 4, 7, 8)),  # MHA, article, Qwen2.5 (7), ...
        "head_dim": st.sampled_from((2, 4, 16, 34, 64, 128, 256)),
        "rotary": st.sampled_from(["full", "full", "half"]),  # half: pairs the epilogue cannot hold
        "extra_rows": st.integers(0, 6),  # cache rows beyond S
        "starts": st.sampled_from(STARTS),
        "base": st.sampled_from(BASES),
        "tables": st.sampled_from(TABLES),
    }
    del fields["n"]

    def fit(params: dict) -> dict:
        heads = params["kv_heads"] * (params["group"] + 2)
        elements = limits.gemm**2 // (heads * params["head_dim"] * params["b"])
        tokens = token_budget(limits) // params["b"]  # the composed path runs rope_kv_store
        return {**params, "m": max(1, min(params["m"], elements, tokens))}

    return st.fixed_dictionaries(fields).map(fit)


def add_rms_norm_linear_rope_kv_store_build(params: dict, device: torch.device) -> Case:
    gen = generator(params, device)
    b, s, hkv, d = params["b"], params["m"], params["kv_heads"], params["head_dim"]
    hq, dtype = hkv * params["group"], dtype_of(params)
    x, residual, norm_weight = _norm_inputs({**params, "m": b * s}, gen, device)
    n = (hq + 2 * hkv) * d
    weight = weight_tensor({**params, "n": n}, gen, device)
    has_bias = choice(params, "bias", BOOLS)
    bias = values((n,), dtype, "normal", gen, device) if has_bias else None
    capacity = s + params["extra_rows"]
    k_cache = values((b, capacity, hkv, d), dtype, "normal", gen, device)
    v_cache = values((b, capacity, hkv, d), dtype, "normal", gen, device)
    start_pos = _starts({**params, "s": s, "capacity": capacity}, gen, device)
    positions = start_pos.long()[:, None] + torch.arange(s, device=device)
    tables = choice(params, "tables", TABLES, "shared")
    cos, sin = rope_tables(positions, rotary_dim_of(params), params["base"], tables)
    labels = labels_for(params, B=b, S=s, Hkv=hkv, D=d, K=params["k"])
    rotary = rotary_label(params)  # a small head's "half" can rotate it whole, which the epilogue takes
    labels += [
        "fused gemv" if b * s <= 4 and rotary == "rotary full" else "composed",
        f"group {params['group']}",
        rotary,
        f"start {params['starts']}",
        f"weight {params['w_layout']}",
        f"x {params['x_layout']}",
        f"residual {params['residual_layout']}",
        "bias" if has_bias else "no bias",
        f"cos/sin {tables}",
    ]
    args = (x, residual, norm_weight, params["eps"], weight, bias, cos, sin, k_cache, v_cache, start_pos)
    return Case(params, args, labels=tuple(labels))


def _qkv_rope_example(
    name: str, b: int, s: int, heads: tuple[int, int, int], k: int, **extra: object
) -> dict:
    """``heads``: (kv heads, q heads per kv head, head_dim)."""
    example = _norm_example(name, s, 0, k)
    del example["n"]
    kv_heads, group, head_dim = heads
    shape = {"b": b, "kv_heads": kv_heads, "group": group, "head_dim": head_dim}
    rope = {"rotary": "full", "extra_rows": 5, "starts": "random", "base": 1000000.0}
    return {**example, **shape, **rope, **extra}


ARTICLE_HEADS, QWEN25_HEADS = (2, 4, 128), (2, 7, 64)

ADD_RMS_NORM_LINEAR_ROPE_KV_STORE_EXAMPLES = (
    _qkv_rope_example(
        "typical: 2 rows x 1 token, 4 q + 2 kv heads of 16, K=129, bias, residual slice",
        2, 1, (2, 2, 16), 129, bias=True, residual_layout="column_slice", gpu=False,
    ),
    _qkv_rope_example("article decode (8 q + 2 kv heads x 128, K=1024)", 1, 1, ARTICLE_HEADS, 1024),
    _qkv_rope_example(
        "qwen2.5-0.5b decode (14 q + 2 kv heads x 64, K=896, bias), last cache row",
        1, 1, QWEN25_HEADS, 896, bias=True, extra_rows=2047, starts="end",
    ),
    _qkv_rope_example(
        "batch decode 4 rows, rows past capacity dropped", 4, 1, ARTICLE_HEADS, 1024, starts="overflow"
    ),
    _qkv_rope_example("prefill 2 x 17 (composed), half rotary", 2, 17, (2, 4, 64), 1024, rotary="half"),
    _qkv_rope_example("head_dim 34 (17 pairs a head), fp32", 3, 1, (1, 3, 34), 100, dtype="float32",
                      gpu=False),
    _qkv_rope_example("decode 2 rows, negative start: rows before 0 dropped", 2, 1, (2, 2, 16), 129,
                      starts="underflow", gpu=False),
)  # fmt: skip


def _weight_row_dropped(args: dict) -> None:
    """One weight row fewer, and no bias (whose length would be refused first)."""
    args["weight"], args["bias"] = args["weight"][:-1], None


ADD_RMS_NORM_LINEAR_ROPE_KV_STORE_INVALID = (
    Invalid("weight rows not heads of D", "weight", _weight_row_dropped),
    Invalid("residual of another shape", "residual", replace("residual", lambda r: r[:, :-1])),
    Invalid("bias of the wrong length", "bias", replace("bias", lambda b: b[:-1])),
    Invalid("cos for another token count", "cos", replace("cos", lambda c: c[:, :0])),
    Invalid("sin of another shape", "sin", replace("sin", lambda c: c[..., :-1])),
    Invalid("v_cache of another shape", "v_cache", replace("v_cache", lambda c: c[:, :-1])),
    Invalid("start_pos as int64", "start_pos", replace("start_pos", lambda p: p.long()), TypeError),
    Invalid("3-d x", "x", replace("x", lambda x: x[None])),
)
