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
from ops import backend, fused_linear, gemm, scratch
from ops.gemm import GemmConfig
from verify import limits
from verify.bench.model import gemm_overrides
from verify.compare import check

DEVICE = backend.device()
FUSED_OPS = ["add_rms_norm_linear", "add_rms_norm_linear_silu_mul"]


def _table_key(op: str, m: int, n: int, k: int) -> tuple[int, int, int]:
    """The GEMM table entry the op looks up: the SwiGLU epilogue's weight has 2N rows."""
    return gemm.m_bucket(m), 2 * n if op == "add_rms_norm_linear_silu_mul" else n, k


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
    monkeypatch.setitem(gemm.CONFIGS, _table_key(op, m, n, k), config)
    spec = registry.get(op)
    case = spec.build({**spec.typical, "m": m, "n": n, "k": k, "dtype": dtype}, DEVICE)
    result = check(spec, case)
    assert result.passed, result.describe()


def test_prefill_sizes_run_composed_through_one_reused_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    """M > 4 runs norm then GEMM; the intermediate is allocated once (graph-safe after warm-up)."""
    monkeypatch.setattr(scratch, "_buffers", {})
    spec = registry.get("add_rms_norm_linear")
    case = spec.build({**spec.typical, "m": 9}, DEVICE)
    assert gemm.table_config(9, 65, 129).kernel == "tiled"
    for _ in range(2):
        result = check(spec, case)
        assert result.passed, result.describe()
    assert [tuple(t.shape) for t in scratch.held("fused intermediate")] == [(9, 129)]


def test_norm_prologue_walks_rows_longer_than_its_block(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemm, "MAX_NORM_BLOCK", 32)
    monkeypatch.setitem(gemm.CONFIGS, (1, 65, 129), GemmConfig("gemv", 1, 8, 64, split_k=3, num_stages=2))
    spec = registry.get("add_rms_norm_linear")
    result = check(spec, spec.build({**spec.typical, "m": 1}, DEVICE))
    assert result.passed, result.describe()


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
