"""The fused qk-norm + RoPE + KV cache store: planted bugs are caught, it agrees with the unfused
ops it replaces, and it writes into a preallocated ``out`` (the CUDA Graph decode buffers)."""

from __future__ import annotations

import pytest
import torch

import registry
from ops import backend, kv_cache, norm, rope
from ops.rope_kv_store import rope_kv_store
from tests import buggy_kernels
from verify.compare import check, clone_args

DEVICE = backend.device()
SPEC = registry.get("rope_kv_store")


def _case(**overrides):
    return SPEC.build({**SPEC.typical, **overrides}, DEVICE)


@pytest.mark.parametrize("bug", ["next_row", "k_with_q_norm", "rotated_backwards"])
def test_buggy_rope_kv_store_is_caught(bug: str) -> None:
    # the typical case (qk-norm, random start rows), and decode one row before the end of the cache
    impl = getattr(buggy_kernels, f"rope_kv_store_{bug}")
    for case in (_case(), _case(s=1, starts="overflow", layout="separate")):
        assert not check(SPEC, case, impl).passed, case.params_json()


def _unfused(q, k, v, cos, sin, k_cache, v_cache, start_pos, q_norm, k_norm, eps):
    if q_norm is not None:
        q, k = norm.rms_norm(q, q_norm, eps), norm.rms_norm(k, k_norm, eps)
    kv_cache.kv_cache_store(k_cache, v_cache, rope.apply_rope(k, cos, sin), v, start_pos)
    return rope.apply_rope(q, cos, sin)


def _steps(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference in rounding steps of the dtype at the magnitude of each head row."""
    row_max = torch.maximum(a.double().abs(), b.double().abs()).amax(dim=-1, keepdim=True)
    return float(
        ((a.double() - b.double()).abs() / (torch.finfo(a.dtype).eps * row_max.clamp_min(1e-30))).max()
    )


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"qk_norm": False},
        {"starts": "overflow", "dtype": "float16"},
        {"dtype": "float32", "rotary": "full"},
    ],
    ids=["typical", "no-norm", "overflow-fp16", "fp32"],
)
def test_matches_the_unfused_ops(overrides: dict) -> None:
    """v is copied bitwise and rows outside the new ones are untouched, exactly as the unfused ops
    leave them (the tolerance rule alone would allow one ulp there); q and k within two rounding
    steps of their row (the norm's sum of squares is added in another order, so the normalized
    value can round one step apart, and a rotation that cancels keeps that absolute difference)."""
    case = _case(**overrides)
    fused_args, _ = clone_args(case)
    unfused_args, _ = clone_args(case)
    out = rope_kv_store(*fused_args)
    want = _unfused(*unfused_args)
    assert torch.equal(fused_args[6], unfused_args[6]), "v_cache differs from kv_cache_store's"
    start = case.args[7].long()[:, None]
    row = torch.arange(case.params["capacity"], device=DEVICE)[None, :]
    kept = (row < start) | (row >= start + case.params["s"])  # [B, L]: rows the op must not write
    assert torch.equal(fused_args[5][kept], case.args[5][kept]), "k_cache written outside the new rows"
    assert _steps(fused_args[5], unfused_args[5]) <= 2.0 and _steps(out, want) <= 2.0


def test_preallocated_out_is_used_and_checked() -> None:
    args, _ = clone_args(_case())
    q = args[0]
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=DEVICE)
    got = rope_kv_store(*args, out=out)
    assert got is out and torch.isfinite(out).all()
    assert torch.equal(out, rope_kv_store(*clone_args(_case())[0]))
    with pytest.raises(ValueError, match="out"):
        rope_kv_store(*args, out=out[:, :, :-1].contiguous())
    with pytest.raises(TypeError, match="out"):
        rope_kv_store(*args, out=out.float())
