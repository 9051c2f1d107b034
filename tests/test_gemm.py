"""GEMM-specific tests the registry-generated ones cannot express: every kernel path and split
under forced configs, the keyword-only buffers (``out``, ``partials``) really used and checked,
the config table and its lookup, and CUDA Graph capture with preallocated buffers (GPU)."""

from __future__ import annotations

import re

import pytest
import torch
import triton
from hypothesis import event, given
from hypothesis import strategies as st

import registry
from ops import backend, gemm, gemm_config, scratch
from ops.gemm_config import GemmConfig
from verify import limits
from verify.compare import check
from verify.strategies.gemm import MODEL_PROJECTIONS

DEVICE = backend.device()
LINEAR = registry.get("linear")


def _linear_case(m: int, n: int, k: int, **extra: object):
    params = {**LINEAR.typical, "m": m, "n": n, "k": k, **extra}
    return LINEAR.build(params, DEVICE)


# ---- every kernel path, with and without split-K ------------------------------------------------

CONFIGS = [
    GemmConfig("gemv", 1, 4, 32),
    GemmConfig("gemv", 1, 8, 64, split_k=3, num_stages=2),
    GemmConfig("gemv", 1, 16, 16, split_k=8),
    GemmConfig("gemv", 1, 4, 256, num_stages=1),  # one step (straight line) for K <= 256
    GemmConfig("gemv", 1, 16, 128, num_stages=1),  # one step and EVEN_K at K=128
    GemmConfig("gemv", 1, 4, 64, num_stages=1),  # a loop without cp.async (guessed decode, K > 8191)
    GemmConfig("tiled", 16, 32, 32),
    GemmConfig("tiled", 32, 64, 64, split_k=4, group_m=2),
    GemmConfig("tiled", 64, 16, 16, split_k=2, group_m=1),
]
SHAPES = [  # m, n, k, extra params: tails, EVEN_K (k=128), N=1, every layout, bias on/off, fp32
    (1, 65, 129, {"bias": True, "x_layout": "column_slice", "w_layout": "row_slice"}),
    (3, 33, 128, {"bias": False, "x_layout": "transposed", "w_layout": "transposed"}),
    (2, 1, 17, {"bias": True, "x_layout": "contiguous", "w_layout": "column_slice", "dtype": "float32"}),
    (37, 70, 100, {"bias": True, "x_layout": "column_slice", "w_layout": "transposed", "dtype": "float16"}),
    (130, 65, 64, {"bias": False, "x_layout": "transposed", "w_layout": "contiguous"}),
]


PATHS = [
    pytest.param(config, shape, id=f"{config.describe()}-M{shape[0]}-N{shape[1]}-K{shape[2]}")
    for config in CONFIGS
    for shape in SHAPES
    if (config.kernel == "tiled" or shape[0] <= gemm_config.GEMV_MAX_M)
]


@pytest.mark.parametrize(("config", "shape"), PATHS)
def test_every_kernel_path_matches_reference(config: GemmConfig, shape: tuple) -> None:
    m, n, k, extra = shape
    case = _linear_case(m, n, k, **extra)
    result = check(LINEAR, case, lambda x, w, b: gemm.launch(x, w, b, config))
    assert result.passed, result.describe()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(
    "config", [GemmConfig("tiled", 16, 16, 16), GemmConfig("gemv", 1, 16, 16)], ids=GemmConfig.describe
)
def test_accumulates_in_fp32_over_many_k_blocks(config: GemmConfig, dtype: str) -> None:
    """256 K blocks: an accumulator rounded to bf16/fp16 after each block fails the tolerance
    (the strategies' CPU sizes, K <= 160 in 64-128-wide blocks, round it only a few times, within
    it; a mutation run planted that bug in the tiled kernel and every other test passed; the gemv's
    per-lane sums need K = 4096 before bf16 rounding shows)."""
    m = 5 if config.kernel == "tiled" else 1
    case = _linear_case(m, 16, 4096, bias=False, x_layout="contiguous", w_layout="contiguous", dtype=dtype)
    result = check(LINEAR, case, lambda x, w, b: gemm.launch(x, w, b, config))
    assert result.passed, result.describe()


@given(data=st.data())
def test_one_step_gemv_matches_reference_on_drawn_cases(data: st.DataObject) -> None:
    """The straight-line gemv (all of K in one chunk: the decode path of qkv, o and gate_up) with
    any block width, on the strategy's shapes and layouts, with M = 1..4."""
    params = {**data.draw(LINEAR.params(limits.current()), label="params"), "m": data.draw(st.integers(1, 4))}
    block_k = max(16, triton.next_power_of_2(params["k"]))
    config = GemmConfig("gemv", 1, data.draw(st.sampled_from([1, 2, 4, 16])), block_k, num_stages=1)
    event("EVEN_K" if params["k"] == block_k else "K tail")
    result = check(LINEAR, LINEAR.build(params, DEVICE), lambda x, w, b: gemm.launch(x, w, b, config))
    assert result.passed, f"{config.describe()}: {result.describe()}"


# one step over K = block_k + one or two smaller powers of two, each read whole (ops.gemm.k_pieces)
IN_PIECES = [
    pytest.param(
        GemmConfig("gemv", 1, 8, 64, num_stages=1),
        (1, 40, 112, {"bias": True, "x_layout": "column_slice", "w_layout": "row_slice"}),
        id="pieces 64+32+16",
    ),
    pytest.param(
        GemmConfig("gemv", 1, 4, 64, num_stages=1),
        (1, 33, 96, {"bias": False, "x_layout": "transposed", "w_layout": "transposed", "dtype": "float16"}),
        id="pieces 64+32 fp16",
    ),
]


@pytest.mark.parametrize(("config", "shape"), IN_PIECES)
def test_k_in_whole_pieces_matches_reference(config: GemmConfig, shape: tuple) -> None:
    m, n, k, extra = shape
    assert gemm.k_pieces(k, config.block_k) != (0, 0)  # the case still takes the pieces path
    case = _linear_case(m, n, k, **extra)
    result = check(LINEAR, case, lambda x, w, b: gemm.launch(x, w, b, config))
    assert result.passed, result.describe()


@given(data=st.data())
def test_k_in_whole_pieces_matches_reference_on_drawn_cases(data: st.DataObject) -> None:
    """The one-step gemv over K = a power of two plus one or two smaller ones, each read whole
    (the decode down_proj's path: 4864 = 4096 + 512 + 256), on the strategy's N, layouts, dtypes
    and bias, any block width."""
    params = {**data.draw(LINEAR.params(limits.current()), label="params"), "m": 1}
    params["k"] = data.draw(st.sampled_from([48, 80, 96, 112, 144, 160]), label="k")
    block_k = 1 << (params["k"].bit_length() - 1)
    assert gemm.k_pieces(params["k"], block_k) != (0, 0)
    event(f"K = {block_k} + " + " + ".join(str(p) for p in gemm.k_pieces(params["k"], block_k) if p))
    config = GemmConfig("gemv", 1, data.draw(st.sampled_from([1, 2, 4, 16])), block_k, num_stages=1)
    result = check(LINEAR, LINEAR.build(params, DEVICE), lambda x, w, b: gemm.launch(x, w, b, config))
    assert result.passed, f"{config.describe()}: {result.describe()}"


EARLY_EVEN_K = (GemmConfig("gemv", 1, 16, 128, num_stages=1), (1, 40, 128, {"bias": True}))


@pytest.mark.parametrize(
    ("config", "shape"), [*PATHS, *IN_PIECES, pytest.param(*EARLY_EVEN_K, id="one step EVEN_K M1")]
)
def test_static_weight_gives_the_same_bits(config: GemmConfig, shape: tuple) -> None:
    """``static_weight=True`` (the one-step M=1 gemv requests its weight before the PDL wait, on
    the GPU) computes what the plain launch computes, bit for bit, on every path: the early
    chunk, its K tail, its whole pieces and layouts, and the paths that ignore the promise."""
    m, n, k, extra = shape
    x, w, b = _linear_case(m, n, k, **extra).args
    plain = gemm.launch(x, w, b, config)
    early = gemm.launch(x, w, b, config, static_weight=True)
    assert torch.equal(plain.view(torch.uint8), early.view(torch.uint8))


def test_gemv_config_refuses_large_m() -> None:
    x, w, b = _linear_case(5, 8, 8).args
    with pytest.raises(ValueError, match="config"):
        gemm.launch(x, w, b, GemmConfig("gemv", 1, 4, 32))


BUGGY = [
    ("linear", "linear_k_tail_dropped"),
    ("linear", "linear_contiguous_weight_assumed"),
    ("linear_splitk", "linear_splitk_k_tail_dropped"),
    ("splitk_reduce", "splitk_reduce_last_split_dropped"),
]


@pytest.mark.parametrize(("op", "fn"), BUGGY, ids=[fn for _, fn in BUGGY])
def test_broken_gemm_kernels_are_caught(op: str, fn: str) -> None:
    """The typical case, and it with a transposed weight: each bug shows on one of them."""
    from tests import buggy_kernels

    spec = registry.get(op)
    variants = [spec.typical] + (
        [{**spec.typical, "w_layout": "transposed"}] if op != "splitk_reduce" else []
    )
    results = [check(spec, spec.build(p, DEVICE), getattr(buggy_kernels, fn)) for p in variants]
    assert not all(r.passed for r in results)


# ---- the keyword-only buffers --------------------------------------------------------------------


def test_preallocated_partials_are_used() -> None:
    """Every split is written into the caller's buffer (NaN before), and they add up to the product."""
    x, w, _ = _linear_case(3, 65, 129).args
    partials = torch.full((5, 3, 65), float("nan"), dtype=torch.float32, device=DEVICE)
    out = torch.empty((3, 65), dtype=x.dtype, device=DEVICE)
    y = gemm.linear_splitk(x, w, 5, partials=partials, out=out)
    assert y is out
    assert torch.isfinite(partials).all(), "a split left its partial unwritten"
    full = x.float() @ w.float().T
    torch.testing.assert_close(partials.sum(0), full, rtol=1e-5, atol=1e-4)
    assert (partials.abs().sum(dim=(1, 2)) > 0).sum() > 1, "the K range was not split"
    torch.testing.assert_close(y, gemm.splitk_reduce(partials, x.dtype), rtol=0, atol=0)


def test_linear_without_partials_reuses_one_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(gemm_config.CONFIGS, (1, 65, 129), GemmConfig("gemv", 1, 8, 32, split_k=3))
    monkeypatch.setattr(scratch, "_buffers", {})
    case = _linear_case(1, 65, 129, bias=True)
    for _ in range(2):
        result = check(LINEAR, case)
        assert result.passed, result.describe()
    assert [tuple(t.shape) for t in scratch.held("linear partials")] == [(3, 1, 65)]


def test_linear_follows_the_table_and_uses_its_partials(monkeypatch: pytest.MonkeyPatch) -> None:
    config = GemmConfig("gemv", 1, 8, 32, split_k=3)
    monkeypatch.setitem(gemm_config.CONFIGS, (1, 65, 129), config)
    assert gemm_config.config_for(1, 65, 129) == config
    assert gemm_config.partials_shape(1, 65, 129) == (3, 1, 65)
    partials = torch.full((3, 1, 65), float("nan"), dtype=torch.float32, device=DEVICE)
    case = _linear_case(1, 65, 129, bias=True)
    result = check(LINEAR, case, lambda x, w, b: gemm.linear(x, w, b, partials=partials))
    assert result.passed, result.describe()
    assert torch.isfinite(partials).all()


def test_bad_keyword_buffers_are_refused() -> None:
    x, w, b = _linear_case(3, 65, 129, bias=True).args
    with pytest.raises(ValueError, match="out"):
        gemm.linear(x, w, b, out=torch.empty((3, 66), dtype=x.dtype, device=DEVICE))
    with pytest.raises(TypeError, match="out"):
        gemm.linear(x, w, b, out=torch.empty((3, 65), dtype=torch.float32, device=DEVICE))
    with pytest.raises(TypeError, match="partials"):
        gemm.linear_splitk(x, w, 2, partials=torch.empty((2, 3, 65), dtype=x.dtype, device=DEVICE))
    with pytest.raises(ValueError, match="partials"):
        gemm.linear_splitk(x, w, 2, partials=torch.empty((2, 3, 64), dtype=torch.float32, device=DEVICE))
    with pytest.raises(ValueError, match="partials"):  # a strided view cannot be written as [S, M, N]
        wide = torch.empty((2, 3, 80), dtype=torch.float32, device=DEVICE)
        gemm.linear_splitk(x, w, 2, partials=wide[:, :, :65])
    p = torch.zeros((2, 3, 65), dtype=torch.float32, device=DEVICE)
    with pytest.raises(TypeError, match="out"):
        gemm.splitk_reduce(p, torch.bfloat16, out=torch.empty((3, 65), dtype=torch.float16, device=DEVICE))


def test_shape_errors_say_what_was_expected() -> None:
    x, w, _ = _linear_case(3, 65, 129).args
    with pytest.raises(ValueError, match=r"weight: .*\[K, N\] weight.*pass weight\.T"):
        gemm.linear(x, w.T.contiguous())
    short_x, short_w = x[:, :5], w[:, :5]
    with pytest.raises(ValueError, match=r"split_k: .*K=5"):
        gemm.linear_splitk(short_x, short_w, 6)


# ---- the config table ---------------------------------------------------------------------------


def test_m_buckets() -> None:
    assert [gemm_config.m_bucket(m) for m in (1, 2, 4, 5, 16, 17, 64, 65, 256, 257, 10**6)] == [
        1, 4, 4, 16, 16, 64, 64, 256, 256, 4096, 4096,
    ]  # fmt: skip


@pytest.mark.parametrize("preset", sorted(MODEL_PROJECTIONS))
def test_table_covers_every_model_projection(preset: str) -> None:
    for proj in MODEL_PROJECTIONS[preset]:
        for m in (1, 256):
            assert (m, proj.n, proj.k) in gemm_config.CONFIGS, (
                f"{preset} {proj.name} M={m} is not in the table"
            )
            config = gemm_config.config_for(m, proj.n, proj.k)
            assert config is gemm_config.CONFIGS[(m, proj.n, proj.k)]
            assert config.kernel == "tiled" or m <= gemm_config.GEMV_MAX_M


@pytest.mark.parametrize("m", [1, 3, 4, 5, 16, 33, 64, 200, 1000])
@pytest.mark.parametrize(("n", "k"), [(7, 9), (1000, 100), (1024, 4864), (3000, 50000), (151936, 896)])
def test_default_config_is_valid(m: int, n: int, k: int) -> None:
    config = gemm_config.default_config(m, n, k)
    assert (config.kernel == "gemv") == (m <= gemm_config.GEMV_MAX_M)
    launched = gemm_config.table_config(m, n, k)
    assert launched.split_k <= max(1, -(-k // launched.block_k)), "more splits than K blocks"


@pytest.mark.parametrize(
    ("n", "k", "one_step"),
    [(2048, 1536, True), (17920, 1536, True), (1024, 3072, True), (4096, 2560, True), (1024, 6000, False),
     (1536, 8960, False)],
)  # fmt: skip
def test_guessed_decode_configs_keep_the_weight_hint(
    monkeypatch: pytest.MonkeyPatch, n: int, k: int, one_step: bool
) -> None:
    """An unlisted M=1 shape past K = 1024 streams its weight in plain loads (num_stages=1: a
    pipelined loop's cp.async copies drop evict_first), in one step where K allows: K's power of
    two (masked, at most a quarter wasted), or one plus whole pieces."""
    monkeypatch.setattr(backend, "is_interpreter", lambda: False)  # the GPU's guesses, not the CPU's
    config = gemm_config.default_config(1, n, k)
    assert (config.num_stages, config.split_k) == (1, 1), config.describe()
    assert config.block_n * config.block_k <= gemm_config.DECODE_ELEMENTS
    assert (k <= config.block_k or gemm.k_pieces(k, config.block_k) != (0, 0)) == one_step, config.describe()
    if k <= config.block_k:
        assert 4 * k >= 3 * config.block_k, config.describe()
    if not one_step:  # several steps: the width measured best in the step, not the widest
        assert config.block_k == gemm_config.DECODE_STEP_K, config.describe()
    # too few programs for the GPU: the pipelined loop (split where K is long enough)
    assert gemm_config.default_config(1, 256, k).num_stages > 1


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="kernel"):
        GemmConfig("mma", 16, 16, 16)
    with pytest.raises(ValueError, match="block_n"):
        GemmConfig("tiled", 16, 48, 16)
    with pytest.raises(ValueError, match="split_k"):
        GemmConfig("tiled", 16, 16, 16, split_k=0)


# ---- GPU: CUDA Graph capture, fp32 precision -----------------------------------------------------


def _allocations_in_capture(graph: torch.cuda.CUDAGraph, fn) -> int:
    before = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
    with torch.cuda.graph(graph):
        fn()
    return torch.cuda.memory_stats().get("allocation.all.allocated", 0) - before


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")  # the deliberately empty capture below
@pytest.mark.parametrize("own_partials", [True, False], ids=["partials given", "workspace"])
@pytest.mark.parametrize(
    ("m", "n", "k"), [(1, 1024, 4864), (1, 1536, 1024), (256, 1024, 3072), (7, 1024, 3000)]
)
def test_cuda_graph_capture_allocates_nothing(m: int, n: int, k: int, own_partials: bool) -> None:
    """After one warm-up call the captured call allocates nothing, and replays on new inputs."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    shape = gemm_config.partials_shape(m, n, k)
    partials = torch.empty(shape, device="cuda", dtype=torch.float32) if shape and own_partials else None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gemm.linear(x, w, out=out, partials=partials)  # compile outside capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    # torch's capture itself allocates (2 blocks on the H200 run of 2026-11-29, whatever the
    # kernel): count an empty capture's allocations and require the GEMM's to add none
    overhead = _allocations_in_capture(torch.cuda.CUDAGraph(), lambda: None)
    graph = torch.cuda.CUDAGraph()
    assert _allocations_in_capture(graph, lambda: gemm.linear(x, w, out=out, partials=partials)) == overhead
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    # the replay read the new x: the same kernel launched eagerly on it gives the same bits
    # (accuracy itself is test_ops' business)
    torch.testing.assert_close(out, gemm.linear(x, w), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k"), [(2048, 1536), (1536, 8960), (4096, 2560)])
def test_guessed_decode_configs_match_reference_at_full_size(n: int, k: int) -> None:
    """default_config's M=1 guesses for an unlisted model (scripts/compile_sm90.py GUESSED_DECODE)
    on full-size shapes: masked one step, a power of two plus a piece, 4096-wide steps."""
    assert (1, n, k) not in gemm_config.CONFIGS
    case = _linear_case(1, n, k, bias=True, x_layout="contiguous", w_layout="contiguous")
    result = check(LINEAR, case)
    assert result.passed, f"{gemm_config.table_config(1, n, k).describe()}: {result.describe()}"


@pytest.mark.gpu
def test_fp32_inputs_are_not_rounded_to_tf32() -> None:
    x = torch.randn(64, 4096, device="cuda", dtype=torch.float32)
    w = torch.randn(256, 4096, device="cuda", dtype=torch.float32)
    exact = x.double() @ w.double().T
    for config in (gemm_config.default_config(64, 256, 4096), GemmConfig("tiled", 64, 64, 64, split_k=4)):
        err = (gemm.launch(x, w, None, config).double() - exact).abs().max().item()
        assert err < 1e-3, f"{config.describe()}: error {err:.3g} (TF32 would give ~1e-1)"


def test_config_descriptions_parse_back() -> None:
    for config in gemm_config.CONFIGS.values():
        assert gemm_config.GemmConfig.parse(config.describe()) == config
    assert gemm_config.GemmConfig.parse("gemv n2 k512 splitK4 w4 s4").split_k == 4
    for bad in (
        "gemv n8 k1024 w4 s2 p264",
        "gemv 8 k512 w4 s4",
        "gemv n8 k512 w4",
        "gemv n8 k512 w4 s4 s3",
        "tiled 64 k64 w4 s3",
    ):
        with pytest.raises(ValueError, match=r"expected e\.g\."):
            gemm_config.GemmConfig.parse(bad)
    for bad, message in (
        ("gemv n3 k512 w4 s4", "config.block_n: expected a power of two, got 3"),
        ("gemv n0 k512 w4 s4", "config.block_n: expected a power of two, got 0"),
        ("gemv n8 k512 w64 s1", "config.num_warps: expected at most 32, got 64"),
        ("gemv n8 k512 w4 s0", "config.num_stages: expected at least 1, got 0"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            gemm_config.GemmConfig.parse(bad)


def test_fp32_floor_is_an_ulp_of_the_summed_terms_and_still_catches_a_dropped_term() -> None:
    """A CPU thorough-profile draw: K=139, one output of -3.9 summed from terms of total size
    ~100. The kernel is 4 fp32 ulps of the output off, plain torch (another order) luckily 0.1:
    one fp32 ulp of the summed |terms| is the honest floor. Dropping a term is still caught."""
    spec = registry.get("linear")
    params = {"bias": True, "dist": "normal", "dtype": "float32", "k": 139, "m": 1, "n": 1, "seed": 1}
    case = spec.build({**params, "w_layout": "column_slice", "x_layout": "contiguous"}, DEVICE)
    assert check(spec, case).passed
    dropped = check(spec, case, lambda x, w, bias=None: gemm.linear(x[:, :-1], w[:, :-1], bias))
    assert not dropped.passed


@pytest.mark.parametrize("order", ["reverse", "fp64"])
def test_splitk_reduce_in_another_order_is_verified(order: str) -> None:
    """Where large partials cancel, another fp32 order (or an exact fp64 sum) differs from the
    reference's order by ulps of the partials, far more than of the output: still right."""
    from verify.cases import Case

    def reduce(partials: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        if order == "fp64":
            return partials.double().sum(0).to(out_dtype)
        total = partials[-1].clone()
        for partial in reversed(partials[:-1]):
            total = total + partial
        return total.to(out_dtype)

    spec = registry.get("splitk_reduce")
    params = {"dist": "large", "dtype": "float32", "m": 1, "n": 32, "pad": 0, "s": 3, "seed": 0}
    case = spec.build(params, DEVICE)
    assert isinstance(case, Case)
    result = check(spec, case, reduce, order)
    assert result.passed, result.outputs[0].reason
