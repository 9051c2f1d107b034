"""The fused qk-norm + RoPE + KV cache store: planted bugs are caught, it agrees with the unfused
ops it replaces, and it writes into a preallocated ``out`` (the CUDA Graph decode buffers). The
head tiles of the head-wise kernels: the GPU's layouts verify on the interpreter too."""

from __future__ import annotations

import types

import pytest
import torch

import registry
from ops import backend, heads, kv_cache, norm, rope
from ops.rope_kv_store import rope_kv_store
from tests import buggy_kernels
from verify.compare import check, clone_args

DEVICE = backend.device()
SPEC = registry.get("rope_kv_store")


def _case(**overrides):
    return SPEC.build({**SPEC.typical, **overrides}, DEVICE)


@pytest.mark.parametrize("bug", ["next_row", "k_with_q_norm", "rotated_backwards"])
def test_buggy_rope_kv_store_is_caught(bug: str) -> None:
    # the typical case (qk-norm, random start rows), and decode into the last row of the cache
    impl = getattr(buggy_kernels, f"rope_kv_store_{bug}")
    for case in (_case(), _case(s=1, starts="end", layout="separate")):
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


def test_eps_is_checked_only_where_qk_norm_uses_it() -> None:
    """Without qk-norm weights eps is unused, in the kernel as in the reference: any value goes."""
    args, _ = clone_args(_case(qk_norm=False))
    want = rope_kv_store(*clone_args(_case(qk_norm=False))[0])
    assert torch.equal(rope_kv_store(*args[:-1], 0.0), want)
    with pytest.raises(ValueError, match="eps: expected a positive finite number"):
        rope_kv_store(*clone_args(_case(qk_norm=True))[0][:-1], 0.0)


@pytest.mark.parametrize("on_gpu", [False, True], ids=["interpreter", "cuda"])
def test_heads_per_program(on_gpu: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter takes every head in one tile (up to 4096 elements); a GPU halves the tile
    until the grid fills about a wave, down to a head a program at decode."""
    monkeypatch.setattr(heads, "backend", types.SimpleNamespace(is_interpreter=lambda: not on_gpu))
    cases = {(16, 64, 1): (16, 1), (64, 128, 1): (32, 1), (8, 64, 32): (8, 2), (16, 64, 256): (16, 16)}
    cases |= {(0, 64, 1): (1, 1), (3, 8192, 1): (1, 1)}  # a tile is never empty
    for args, want in cases.items():
        assert heads.heads_per_program(*args) == want[on_gpu], args


@pytest.mark.parametrize(("q_heads", "kv_heads"), [(0, 2), (4, 0)])
def test_a_side_without_heads(q_heads: int, kv_heads: int) -> None:
    """No q heads, or no kv heads: the other side's programs alone run, as the unfused ops do."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(1, 2, q_heads, 32, generator=gen, device=DEVICE).bfloat16()
    k = torch.randn(1, 2, kv_heads, 32, generator=gen, device=DEVICE).bfloat16()
    v = torch.randn(1, 2, kv_heads, 32, generator=gen, device=DEVICE).bfloat16()
    cos, sin = rope.rope_cos_sin(torch.arange(2, device=DEVICE)[None], 32, 10000.0)
    caches = [torch.zeros(1, 4, kv_heads, 32, dtype=torch.bfloat16, device=DEVICE) for _ in range(4)]
    start = torch.ones(1, dtype=torch.int32, device=DEVICE)
    out = rope_kv_store(q, k, v, cos, sin, caches[0], caches[1], start)
    want = _unfused(q, k, v, cos, sin, caches[2], caches[3], start, None, None, 1e-6)
    assert torch.equal(out, want) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("apply_rope", {}),
        ("apply_rope", {"s": 16, "heads": 8}),
        ("kv_cache_store", {"heads": 3}),
        ("rope_kv_store", {}),
        ("rope_kv_store", {"s": 16, "capacity": 20, "group": 4}),
    ],
    ids=["apply_rope", "apply_rope-2-heads", "kv_cache_store", "rope_kv_store", "rope_kv_store-2-heads"],
)
def test_the_gpus_head_tiles_pass_on_the_interpreter(name: str, overrides: dict, monkeypatch) -> None:
    """The tiles a GPU takes (a head a program for these few tokens; two heads for 32 tokens of
    8 heads) pass the same check as the interpreter's whole-token tiles."""
    monkeypatch.setattr(heads, "backend", types.SimpleNamespace(is_interpreter=lambda: False))
    spec = registry.get(name)
    case = spec.build({**spec.typical, **overrides}, DEVICE)
    result = check(spec, case, spec.impl)
    assert result.passed, result
