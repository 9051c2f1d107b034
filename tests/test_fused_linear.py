"""The fused projections on every gemv path the config table can pick: K split into several
programs (each recomputing the row's rms over all of K and writing its own part of the
residual sum), K walked in several steps, K tails, M = 1..4. The registry-generated tests
reach only the interpreter's default configs, which take K in one step."""

from __future__ import annotations

import pytest
import torch
import triton
from hypothesis import given
from hypothesis import strategies as st

import registry
from ops import backend, elementwise, fused_linear, gemm, gemm_config, scratch
from ops.gemm_config import GemmConfig
from ops.rope_kv_store import rope_kv_store
from tests.test_rounding import ulps_from_a_midpoint
from verify import limits
from verify.bench.model import gemm_overrides
from verify.compare import check

DEVICE = backend.device()
FUSED_OPS = ["add_rms_norm_linear", "add_rms_norm_linear_silu_mul"]


def _table_key(op: str, m: int, n: int, k: int) -> tuple[int, int, int]:
    """The GEMM table entry the op looks up: the SwiGLU epilogue's weight has 2N rows."""
    return gemm_config.m_bucket(m), 2 * n if op == "add_rms_norm_linear_silu_mul" else n, k


CONFIGS = [
    GemmConfig("gemv", 1, 4, 32, num_stages=1),
    GemmConfig("gemv", 1, 8, 64, split_k=3, num_stages=2),
    GemmConfig("gemv", 1, 16, 16, split_k=8),
    GemmConfig("gemv", 1, 4, 256, num_stages=1),  # one step: the row's rms from the chunk itself
]
SHAPES = [  # m, n, k, dtype: a K tail, EVEN_K (k=128), N=1, fp32
    (1, 65, 129, "bfloat16"),
    (3, 33, 128, "bfloat16"),
    (4, 17, 100, "float16"),
    (2, 1, 17, "float32"),
]


@pytest.mark.parametrize("op", FUSED_OPS)
@pytest.mark.parametrize("config", CONFIGS, ids=GemmConfig.describe)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"M{s[0]}-N{s[1]}-K{s[2]}-{s[3]}")
def test_fused_gemv_paths_match_reference(
    monkeypatch: pytest.MonkeyPatch, op: str, config: GemmConfig, shape: tuple
) -> None:
    m, n, k, dtype = shape
    monkeypatch.setitem(gemm_config.CONFIGS, _table_key(op, m, n, k), config)
    spec = registry.get(op)
    case = spec.build({**spec.typical, "m": m, "n": n, "k": k, "dtype": dtype}, DEVICE)
    result = check(spec, case)
    assert result.passed, result.describe()


def test_prefill_sizes_run_composed_through_one_reused_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    """M > 4 runs norm then GEMM; the intermediate is allocated once (graph-safe after warm-up)."""
    monkeypatch.setattr(scratch, "_buffers", {})
    spec = registry.get("add_rms_norm_linear")
    case = spec.build({**spec.typical, "m": 9}, DEVICE)
    assert gemm_config.table_config(9, 65, 129).kernel == "tiled"
    for _ in range(2):
        result = check(spec, case)
        assert result.passed, result.describe()
    assert [tuple(t.shape) for t in scratch.held("fused intermediate")] == [(9, 129)]


def test_norm_prologue_walks_rows_longer_than_its_block(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemm, "MAX_NORM_BLOCK", 32)
    monkeypatch.setitem(
        gemm_config.CONFIGS, (1, 65, 129), GemmConfig("gemv", 1, 8, 64, split_k=3, num_stages=2)
    )
    spec = registry.get("add_rms_norm_linear")
    result = check(spec, spec.build({**spec.typical, "m": 1}, DEVICE))
    assert result.passed, result.describe()


def _exact_norm_inputs(dtype: torch.dtype, m: int = 3, k: int = 64, seed: int = 17) -> tuple:
    """``x`` and ``residual`` (float64, exact in ``dtype``) on which the prologue's roundings show
    bit for bit and nothing else can: |x| in 1.25..3.75 in steps of 1/16, residual a quarter ulp
    of 1 away from zero, so the rounded sum is x and the unrounded one is not; the squares' sum is
    exact in fp32 in any order; and every normalized value lies well off a rounding midpoint of
    ``dtype``, so the kernel's fp32 rms cannot flip a rounding (asserted: the seed meets it)."""
    gen = torch.Generator().manual_seed(seed)
    magnitude = torch.randint(20, 61, (m, k), generator=gen).double() / 16
    sign = torch.where(torch.rand(m, k, generator=gen) < 0.5, -1.0, 1.0).double()
    x, residual = magnitude * sign, sign * torch.finfo(dtype).eps / 4
    assert ulps_from_a_midpoint(_normalized(x), dtype).min() > 0.005, "the seed puts a value near a midpoint"
    return x, residual


def _normalized(total: torch.Tensor) -> torch.Tensor:
    return total / torch.sqrt(total.square().mean(-1, keepdim=True) + 1e-6)


def _two_ones_a_row(k: int, shift: int, dtype: torch.dtype) -> torch.Tensor:
    """A ``[K, K]`` weight whose row n sums inputs n and n + shift (mod K): exact in fp32 in any
    order and split, so the GEMM adds nothing of its own to the comparison."""
    eye = torch.eye(k, dtype=dtype, device=DEVICE)
    return eye + eye.roll(shift, dims=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("config", [None, *CONFIGS], ids=lambda c: c.describe() if c else "table")
def test_norm_prologue_rounds_where_the_unfused_ops_do(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, config: GemmConfig | None
) -> None:
    """The gemv prologue normalizes x + residual rounded to the input dtype, as add_rms_norm does,
    and rounds the normalized x to that dtype before the product, as linear's input is. Skipping
    either rounding is closer to the fp64 oracle, so no tolerance can catch it (a kernel mutation
    run showed both passing everything else); a bitwise check on exact data can."""
    x, residual = _exact_norm_inputs(dtype)
    m, k = x.shape
    if config is not None:
        monkeypatch.setitem(gemm_config.CONFIGS, _table_key("add_rms_norm_linear", m, k, k), config)

    def pairs(h: torch.Tensor) -> torch.Tensor:  # the GEMM below, in float64, rounded once
        return (h.double() + h.double().roll(-1, dims=1)).to(dtype)

    h = _normalized(x)
    want = pairs(h.to(dtype))
    for skipped, y_skipped in (("the sum's", pairs(_normalized(x + residual).to(dtype))), ("h's", pairs(h))):
        assert not torch.equal(y_skipped, want), f"the seed cannot tell skipping {skipped} rounding"

    x_in, r_in = (t.to(dtype).to(DEVICE) for t in (x, residual))
    norm_weight = torch.ones(k, dtype=dtype, device=DEVICE)
    y, total = fused_linear.add_rms_norm_linear(x_in, r_in, norm_weight, 1e-6, _two_ones_a_row(k, 1, dtype))
    assert torch.equal(total.cpu().double(), x)
    assert torch.equal(y.cpu(), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("config", [None, *CONFIGS], ids=lambda c: c.describe() if c else "table")
def test_swiglu_epilogue_rounds_gate_and_up_as_linear_does(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, config: GemmConfig | None
) -> None:
    """The SwiGLU epilogue equals silu_mul of linear's rounded gate and up, bit for bit: on exact
    gate and up sums both paths round the same values and run the same fp32 math. Applying silu
    to the unrounded sums is closer to the oracle and passed every other test in a mutation run."""
    x, residual = _exact_norm_inputs(dtype)
    m, k = x.shape
    if config is not None:  # the op runs it without the split
        monkeypatch.setitem(gemm_config.CONFIGS, _table_key("add_rms_norm_linear_silu_mul", m, k, k), config)
    h = _normalized(x).to(dtype).double()
    gate, up = h + h.roll(-1, dims=1), h + h.roll(-2, dims=1)

    def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return (torch.nn.functional.silu(g) * u).to(dtype)

    rounded_first = swiglu(gate.to(dtype).double(), up.to(dtype).double())
    assert not torch.equal(swiglu(gate, up), rounded_first), "the seed cannot tell the roundings apart"

    x_in, r_in = (t.to(dtype).to(DEVICE) for t in (x, residual))
    norm_weight = torch.ones(k, dtype=dtype, device=DEVICE)
    weight = torch.cat([_two_ones_a_row(k, 1, dtype), _two_ones_a_row(k, 2, dtype)])
    y, _ = fused_linear.add_rms_norm_linear_silu_mul(x_in, r_in, norm_weight, 1e-6, weight)
    sums, _ = fused_linear.add_rms_norm_linear(x_in, r_in, norm_weight, 1e-6, weight)
    assert torch.equal(sums.cpu().double(), torch.cat([gate, up], dim=1).to(dtype).double())
    assert torch.equal(y, elementwise.silu_mul(sums[:, :k], sums[:, k:]))


@pytest.mark.parametrize("op", FUSED_OPS)
@given(data=st.data())
def test_one_step_gemv_prologues_on_drawn_cases(op: str, data: st.DataObject) -> None:
    """The prologue (and the SwiGLU epilogue) in the straight-line gemv (K in one chunk: the rms is
    taken from the chunk, the first block's programs store the residual sum), on the strategy's
    shapes, layouts and dtypes."""
    spec = registry.get(op)
    params = {**data.draw(spec.params(limits.current()), label="params"), "m": data.draw(st.integers(1, 4))}
    block_k = max(16, triton.next_power_of_2(params["k"]))
    config = GemmConfig("gemv", 1, data.draw(st.sampled_from([1, 4, 16])), block_k, num_stages=1)
    with gemm_overrides({_table_key(op, params["m"], params["n"], params["k"]): config}):
        result = check(spec, spec.build(params, DEVICE))
    assert result.passed, f"{config.describe()}: {result.describe()}"


def test_swiglu_epilogue_refuses_what_cannot_take_it() -> None:
    """The epilogue needs each output's whole gate and up sums in one program."""
    x, w = torch.randn(1, 64, device=DEVICE), torch.randn(8, 64, device=DEVICE)
    y = torch.empty(1, 4, device=DEVICE)
    partials = torch.empty(2, 1, 8, device=DEVICE)
    for config, parts in ((GemmConfig("tiled", 16, 16, 16), None), (GemmConfig("gemv", 1, 4, 32), partials)):
        with pytest.raises(ValueError, match="epilogue"):
            gemm.run(x, w, None, config, y, parts, epilogue="silu_mul")
    with pytest.raises(ValueError, match="even number of rows"):
        fused_linear.add_rms_norm_linear_silu_mul(x, x, torch.ones(64, device=DEVICE), 1e-6, w[:7])


ROPE_OP = "add_rms_norm_linear_rope_kv_store"
ROPE_SHAPES = [  # b, s, (kv heads, q heads per kv head, head_dim), K, dtype, bias, cache rows written
    (1, 1, (2, 2, 16), 129, "bfloat16", True, "end"),  # the last row
    (2, 2, (1, 3, 34), 128, "float16", False, "overflow"),  # M = 4; 17 pairs a head, programs straddle heads
    (3, 1, (2, 1, 2), 100, "float32", True, "overflow"),  # one pair a head; decode into a full cache
]


def _rope_params(
    b: int, s: int, heads: tuple[int, int, int], k: int, dtype: str, bias: bool, starts: str
) -> dict:
    kv_heads, group, head_dim = heads
    spec = registry.get(ROPE_OP)
    shape = {"b": b, "m": s, "kv_heads": kv_heads, "group": group, "head_dim": head_dim, "k": k}
    return {**spec.typical, **shape, "dtype": dtype, "bias": bias, "starts": starts}


def _rope_table_key(params: dict) -> tuple[int, int, int]:
    rows = params["kv_heads"] * (params["group"] + 2) * params["head_dim"]
    return gemm_config.m_bucket(params["b"] * params["m"]), rows, params["k"]


@pytest.mark.parametrize("config", CONFIGS, ids=GemmConfig.describe)
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=lambda s: "B{}-S{}-heads{}-K{}-{}-bias{}-{}".format(*s))
def test_rope_epilogue_on_every_gemv_path(
    monkeypatch: pytest.MonkeyPatch, config: GemmConfig, shape: tuple
) -> None:
    """RoPE and the cache write in the QKV gemv's epilogue (split-K configs run unsplit): into the
    cache's last row, and rows past the capacity dropped (some of a prefill's, all of a decode's)."""
    params = _rope_params(*shape)
    monkeypatch.setitem(gemm_config.CONFIGS, _rope_table_key(params), config)
    spec = registry.get(ROPE_OP)
    result = check(spec, spec.build(params, DEVICE))
    assert result.passed, result.describe()


def test_rope_epilogue_equals_the_two_ops_it_fuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bit for bit what ``add_rms_norm_linear`` then ``rope_kv_store`` compute on the same config:
    the pairing, the bias per row and the cache rows are exact, not merely within tolerance."""
    params = _rope_params(2, 1, (2, 3, 16), 129, "bfloat16", True, "end")
    monkeypatch.setitem(
        gemm_config.CONFIGS, _rope_table_key(params), GemmConfig("gemv", 1, 4, 64, num_stages=2)
    )
    case = registry.get(ROPE_OP).build(params, DEVICE)
    x, residual, norm_weight, eps, weight, bias, cos, sin, k_cache, v_cache, start_pos = case.args
    k_want, v_want = k_cache.clone(), v_cache.clone()
    q, total = fused_linear.add_rms_norm_linear_rope_kv_store(
        x, residual, norm_weight, eps, weight, bias, cos, sin, k_cache, v_cache, start_pos
    )
    qkv, total_want = fused_linear.add_rms_norm_linear(x, residual, norm_weight, eps, weight, bias)
    heads = qkv.view(2, 1, 2 * 3 + 4, 16)
    q_want = rope_kv_store(
        heads[:, :, :6], heads[:, :, 6:8], heads[:, :, 8:], cos, sin, k_want, v_want, start_pos
    )
    for got, want in ((q, q_want), (total, total_want), (k_cache, k_want), (v_cache, v_want)):
        assert torch.equal(got, want)


@given(data=st.data())
def test_rope_epilogue_on_drawn_cases(data: st.DataObject) -> None:
    """The strategy's heads, dtypes and layouts on the fused gemv (M <= 4, full rotary), one K step."""
    spec = registry.get(ROPE_OP)
    params = data.draw(spec.params(limits.current()), label="params")
    params = {
        **params,
        "b": data.draw(st.integers(1, 2)),
        "m": data.draw(st.integers(1, 2)),
        "rotary": "full",
    }
    block_k = max(16, triton.next_power_of_2(params["k"]))
    # 2 is one rotation pair a program, the fewest (run() raises a BLOCK_N of 1 to 2 for an epilogue)
    key, block_n = _rope_table_key(params), data.draw(st.sampled_from([2, 4, 16]))
    if backend.is_interpreter():  # at most 32 programs: each costs ~50 ms there, whatever its size
        block_n = max(block_n, triton.next_power_of_2(triton.cdiv(key[1], 32)))
    config = GemmConfig("gemv", 1, block_n, block_k, num_stages=1)
    with gemm_overrides({key: config}):
        result = check(spec, spec.build(params, DEVICE))
    assert result.passed, f"{config.describe()}: {result.describe()}"


def test_rope_epilogue_refuses_a_weight_that_is_not_whole_heads() -> None:
    x = torch.randn(1, 32, device=DEVICE)
    cos = torch.ones(1, 1, 8, device=DEVICE)
    caches = [torch.zeros(1, 4, 1, 16, device=DEVICE) for _ in range(2)]
    start = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    for rows in (47, 32):  # not a multiple of D; no room for a q head beside k and v
        with pytest.raises(ValueError, match="weight: expected"):
            fused_linear.add_rms_norm_linear_rope_kv_store(
                x, x, torch.ones(32, device=DEVICE), 1e-6, torch.randn(rows, 32, device=DEVICE), None,
                cos, cos, *caches, start,
            )  # fmt: skip
