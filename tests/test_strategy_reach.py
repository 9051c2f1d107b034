"""Every strategy still reaches the edge cases the issues name.

A correct kernel passes whether or not a strategy draws its tricky shapes, so losing one (a
bound that stops short of K tails, a choice dropped from a list) would go unnoticed by every
other test. Here each op's edge labels must appear among a fixed, derandomized set of draws.
"""

from __future__ import annotations

import collections

import pytest
from hypothesis import HealthCheck, given, settings

import registry
from model.config import PRESETS
from ops import backend
from verify import limits

SHAPES = ("M = 1", "M = 2", "M tail", "N tail", "non-contiguous")
GEMM = ("M = 1", "M = 2", "K tail", "N tail", "K = 1")
GEMM_PATHS = ("M tail", "gemv (M <= 4)", "tiled (M > 4)", "cancelling terms")  # M = 3: a tail of 4 rows
GROUPS = tuple(f"GQA group {g}" for g in (1, 2, 4, 7, 8))
SCORES = ("scores large", "scores very_negative", "scores ties")
ATTENTION = (
    "S = 1", "S = 2", "S tail", *GROUPS, *SCORES, "chunked prefill (seq_len > S)",
    "decode (S = 1) after a prefix", "seq_len = 1", "seq_lens ragged", "seq_len past capacity",
    "stale cache rows past seq_len", "head_dim 64", "head_dim 128", "head_dim 256", "scale 1", "scale 0.3",
    "longest row not the first",
)  # fmt: skip
FUSED_QKV_GROUPS = tuple(f"group {g}" for g in (1, 2, 4, 7, 8))
ROPE_COS_SIN = (
    "S = 1", "rotary_half tail", "long context position", "positions scattered",
    "positions strided along S",
)  # fmt: skip
APPLY_ROPE = (
    "S = 1", "D tail", "rotary half", "rotary quarter", "cos/sin sin_padded", "cos/sin seq_slice",
    "heads padded",
)  # fmt: skip
STARTS = ("start zero", "start end", "start overflow", "start underflow")
FUSED_QKV = ("S = 1", "K tail", "bias", *FUSED_QKV_GROUPS, *STARTS, "cos/sin seq_slice")
ROPE_KV_STORE = (
    "decode (S = 1)", "prefill (S > 1)", "qk-norm", "no qk-norm", "group 7", "group 8", "layout fused",
    "layout heads_padded", "rotary half", "cos/sin seq_slice",
)  # fmt: skip

DTYPES = ("dtype bfloat16", "dtype float16", "dtype float32")
VALUES = ("values zeros", "values tiny", "values constant_rows", "values outliers", "large magnitude")
# the value distributions an op draws where not all of VALUES: rope_cos_sin draws positions, the
# attention ops their score classes (SCORES), argmax its patterns
VALUE_CLASSES = {
    "embedding": ("values constant_rows", "values tiny", "large magnitude"),
    "kv_cache_store": ("large magnitude",),
    "argmax": ("values tiny", "large magnitude"),
    **dict.fromkeys(("rope_cos_sin", "attention", "attention_prefill", "attention_decode"), ()),
}
LAYOUTS = ("x contiguous", "x column_slice", "weight contiguous", "weight row_slice", "weight column_slice")
PATTERNS = tuple(f"pattern {p}" for p in ("ties", "nan", "nan_last", "neg_inf", "negative"))
SPLIT_K = ("K not divisible by split_k", "preallocated partials", "split_k 16")
KV_LAYOUTS = ("k/v qkv_slices", "k/v k_contiguous", "k/v v_contiguous")
ROPE_KV_LAYOUTS = tuple(f"layout {k}" for k in ("separate", "mixed", "fused_padded", "heads_padded_mixed"))

REQUIRED: dict[str, tuple[str, ...]] = {
    "embedding": (
        "S = 1",
        "V tail",
        "H tail",
        "ids edges",
        "ids repeated",
        "ids int32",
        "ids int64",
        "ids outside",
        "non-contiguous",
    ),
    "rms_norm": (*SHAPES, "3-d input", "values zeros", "large magnitude"),
    "add_rms_norm": (*SHAPES, "values zeros"),
    "add": SHAPES,
    "silu_mul": (*SHAPES, "large magnitude"),
    "rope_cos_sin": ROPE_COS_SIN,
    "apply_rope": APPLY_ROPE,
    "kv_cache_store": ("S = 1", "L = 1", *STARTS, *KV_LAYOUTS),
    "rope_kv_store": (*STARTS, *ROPE_KV_STORE, *ROPE_KV_LAYOUTS),
    "argmax": ("B = 1", "V = 1", "non-contiguous", *PATTERNS),
    "attention": (*ATTENTION, "decode path", "prefill path"),
    "attention_prefill": ATTENTION,
    "attention_decode": ATTENTION,
    "linear": (*GEMM, *GEMM_PATHS, "bias", "no bias", "x transposed", "weight transposed", *LAYOUTS),
    "linear_splitk": (*GEMM, *GEMM_PATHS, *SPLIT_K, *LAYOUTS),
    "splitk_reduce": ("M = 1", "N tail", "1 splits", "16 splits", "31 splits"),
    "add_rms_norm_linear": (*GEMM, "bias", "fused gemv", "composed (M > 4)", *LAYOUTS),
    "add_rms_norm_linear_silu_mul": (*GEMM, "fused gemv", "composed (M > 4)"),
    "add_rms_norm_linear_rope_kv_store": (*FUSED_QKV, "fused gemv", "rotary half"),
}


def test_every_op_has_its_edges_listed() -> None:
    assert set(REQUIRED) == {spec.name for spec in registry.all()}


@pytest.mark.parametrize("op", sorted(REQUIRED))
def test_strategy_reaches_the_named_edges(op: str) -> None:
    spec, device, seen = registry.get(op), backend.device(), collections.Counter()

    @settings(
        max_examples=300, database=None, derandomize=True, deadline=None,
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    @given(spec.params(limits.current()))
    def draw(params: dict) -> None:
        seen.update(spec.build(params, device).labels)

    draw()
    dtypes = DTYPES if op != "rope_cos_sin" else ()  # rope_cos_sin: fp32 tables only
    wanted = REQUIRED[op] + dtypes + VALUE_CLASSES.get(op, VALUES)
    missing = [label for label in wanted if label not in seen]
    assert not missing, f"{op}: 300 draws never reached {missing}"


GEMM_OPS = ("linear", "linear_splitk", "add_rms_norm_linear", "add_rms_norm_linear_silu_mul")


def _gpu_draws(op: str) -> list[dict]:
    """1000 derandomized parameter draws at the GPU's caps (no tensors: this runs on CPU too)."""
    drawn: list[dict] = []

    @settings(
        max_examples=1000, database=None, derandomize=True, deadline=None,
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    @given(registry.get(op).params(limits.CUDA))
    def draw(params: dict) -> None:
        drawn.append(params)

    draw()
    return drawn


@pytest.mark.parametrize("op", GEMM_OPS)
def test_gpu_draws_reach_the_model_widths(op: str) -> None:
    """On the GPU's caps the GEMM strategies draw the model's own widths, not only the awkward
    small ones: M = 1, N = every preset's intermediate size (4864 is no multiple of common
    BLOCK_N), K = those (down_proj's K) for the plain GEMMs and a hidden size for the fused
    norm + GEMM ops (the named examples hold each preset's exact shapes). Only parameters are
    drawn here (no tensors), so this runs on CPU too.

    1000 draws, not 300: a model width comes up in 1.5-2.4% of draws, and derandomized draws are
    not the same in every process (Hypothesis mixes in integer constants it finds in the loaded
    modules of this project, so they depend on what else the worker imported): 300 draws missed
    N = 3072 in one full `pytest -n auto` run (2026-12-02); 1000 leave a miss at about 1e-6."""
    seen: dict[str, set[int]] = {"m": set(), "n": set(), "k": set()}
    for params in _gpu_draws(op):
        for axis, values in seen.items():
            values.add(params[axis])
    intermediate = {c.intermediate_size for c in PRESETS.values()}  # gate/up's N, down's K
    hidden = {c.hidden_size for c in PRESETS.values()}  # the fused ops' K (the norm's width)
    wanted = {"m": {1}, "n": intermediate, "k": intermediate if op.startswith("linear") else set()}
    missing = [f"{axis} = {v}" for axis, values in wanted.items() for v in sorted(values - seen[axis])]
    if not op.startswith("linear") and not seen["k"] & hidden:
        missing.append(f"k = a hidden size {sorted(hidden)}")
    assert not missing, f"{op}: 1000 draws at the GPU's caps never reached {missing}"


@pytest.mark.parametrize(
    ("op", "field", "wanted"),
    [
        *((op, "n", (3072, 4864)) for op in ("rms_norm", "add_rms_norm", "add", "silu_mul")),
        # one 16-row tail, and both sides of the prefill kernel's 128-row block
        *((op, "s", (17, 127, 129)) for op in ("attention", "attention_prefill")),
    ],
)
def test_gpu_draws_reach_the_named_sizes(op: str, field: str, wanted: tuple[int, ...]) -> None:
    """The sizes the issues name that only the GPU's caps reach: the MLP widths for the row ops
    (the interpreter's named examples hold 4864), S past one prefill block for attention. Each
    comes up in 1-5% of draws; 1000 draws, as above."""
    seen = {params[field] for params in _gpu_draws(op)}
    assert not set(wanted) - seen, f"{op}: 1000 draws at the GPU's caps never reached {field} in {wanted}"


def test_gpu_draws_preallocate_split_k_partials_only_of_a_bounded_size() -> None:
    """A preallocated ``[split, M, N]`` partials buffer is cloned for every reference run of the
    check, once in fp64; unbounded, one 64 x 4900 x 4900 case took ~25 GB and ran an 80 GB H100
    out of memory beside the suite's other workers. Larger cases let the kernel allocate its own."""
    from verify.strategies.gemm import PREALLOC_MAX_ELEMENTS

    drawn = _gpu_draws("linear_splitk")
    preallocated = [p["split_k"] * p["m"] * p["n"] for p in drawn if p["prealloc"]]
    assert preallocated and max(preallocated) <= PREALLOC_MAX_ELEMENTS
    assert any(p["split_k"] * p["m"] * p["n"] > PREALLOC_MAX_ELEMENTS for p in drawn)  # the bound bites
