"""Outputs that share memory with what a kernel reads, and the edges of the argument checks.

A kernel whose output overlaps an input it is still reading returns a silently wrong result
(an audit found it for ``linear(x, w, out=x)`` on the gemv path and for the fused norm+GEMM ops
given the residual as their sum output), so the wrappers refuse any overlap except the exact
in-place forms an op supports, which must still match the reference.
"""

from __future__ import annotations

import math

import pytest
import torch

from ops import (
    attention,
    backend,
    elementwise,
    embedding,
    fused_linear,
    gemm,
    kv_cache,
    norm,
    rope,
    rope_kv_store,
    validate,
)
from references import norm as ref_norm

DEVICE = backend.device()
BF16 = torch.bfloat16


def randn(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    """New values each call (torch's generator, seeded before every test by conftest): two operands
    of one shape (x and the residual) must differ, or an op that reads one for the other would
    still match."""
    return torch.randn(shape, dtype=torch.float32).to(DEVICE, dtype)


def test_overlap_is_by_byte_span() -> None:
    from ops.validate import overlap

    base = randn(4, 8)
    assert overlap(base, base[1:3])
    assert not overlap(base[:2], base[2:])
    assert not overlap(base, base.clone())
    assert overlap(base[:, :4], base[:, 4:])  # interleaved rows: conservatively an overlap
    assert not overlap(base[:0], base)
    rows = torch.from_dlpack(base[1:3])  # the same bytes through another storage object
    assert rows.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    assert overlap(base[0:2], rows) and overlap(rows, base[2:]) and not overlap(rows, base[3:])


def test_aliasing_through_another_storage_object_is_refused() -> None:
    base, w = randn(4, 8), randn(8)
    with pytest.raises(ValueError, match="out: shares memory with x"):
        norm.rms_norm(torch.from_dlpack(base[1:4]), w, 1e-6, out=base[0:3])
    with pytest.raises(ValueError, match="out: shares memory with x"):
        norm.rms_norm(base[0:3], w, 1e-6, out=torch.from_dlpack(base[1:4]))


def _linear_out_x():
    x = randn(3, 64)
    gemm.linear(x, randn(64, 64), out=x)


def _fused_sum_is_residual():
    x, res = randn(2, 32), randn(2, 32)
    fused_linear.add_rms_norm_linear(x, res, randn(32), 1e-6, randn(48, 32), out=(randn(2, 48), res))


def _silu_fused_sum_is_x():
    x = randn(2, 32)
    fused_linear.add_rms_norm_linear_silu_mul(
        x, randn(2, 32), randn(32), 1e-6, randn(64, 32), out=(randn(2, 32), x)
    )


def _splitk_reduce_into_partials():
    partials = randn(2, 3, 8, dtype=torch.float32)
    gemm.splitk_reduce(partials, torch.float32, out=partials[0])


def _add_rms_norm_same_outputs():
    t = randn(2, 16)
    norm.add_rms_norm(randn(2, 16), randn(2, 16), randn(16), 1e-6, out=(t, t))


def _rope_table_same_outputs():
    t = torch.empty(1, 2, 4, device=DEVICE)
    rope.rope_cos_sin(torch.zeros(1, 2, dtype=torch.int32, device=DEVICE), 8, 1e4, out=(t, t))


def _embedding_into_table():
    table = randn(8, 16)
    embedding.embedding(
        torch.zeros(1, 2, dtype=torch.int64, device=DEVICE), table, out=table[:2].view(1, 2, 16)
    )


def _caches_alias():
    cache = randn(1, 8, 2, 16)
    kv_cache.kv_cache_store(
        cache, cache, randn(1, 1, 2, 16), randn(1, 1, 2, 16), torch.zeros(1, dtype=torch.int32, device=DEVICE)
    )


def _rope_kv_store_out_in_cache():
    k_cache, v_cache = randn(1, 8, 1, 16), randn(1, 8, 1, 16)
    cos = torch.ones(1, 1, 8, device=DEVICE)
    q = randn(1, 1, 2, 16)
    out = k_cache[:, :2].reshape(1, 1, 2, 16)
    rope_kv_store.rope_kv_store(
        q,
        randn(1, 1, 1, 16),
        randn(1, 1, 1, 16),
        cos,
        cos * 0,
        k_cache,
        v_cache,
        torch.zeros(1, dtype=torch.int32, device=DEVICE),
        out=out,
    )


def _attention_out_in_v_cache():
    v_cache = randn(1, 8, 1, 64)
    attention.attention(
        randn(1, 1, 1, 64),
        randn(1, 8, 1, 64),
        v_cache,
        torch.full((1,), 4, dtype=torch.int32, device=DEVICE),
        0.125,
        out=v_cache[:, :1],
    )


def _rms_norm_out_shifted_over_x():
    base = randn(5, 16)  # out overlaps x one row down: in place means x itself
    norm.rms_norm(base[:4], randn(16), 1e-6, out=base[1:])


def _decode_scratch_max_is_sum():
    q, k_cache = randn(1, 1, 1, 64), randn(1, 64, 1, 64)
    scratch = attention.decode_scratch(q, k_cache)
    attention.attention_decode(
        q,
        k_cache,
        randn(1, 64, 1, 64),
        torch.full((1,), 50, dtype=torch.int32, device=DEVICE),
        0.125,
        scratch=scratch._replace(max=scratch.sum),
    )


@pytest.mark.parametrize(
    ("call", "names"),
    [
        (_linear_out_x, "out: shares memory with x"),
        (_fused_sum_is_residual, "out[1]: shares memory with residual"),
        (_silu_fused_sum_is_x, "out[1]: shares memory with x"),
        (_splitk_reduce_into_partials, "out: shares memory with partials"),
        (_add_rms_norm_same_outputs, "out[1]: shares memory with out[0]"),
        (_rope_table_same_outputs, "out[1]: shares memory with out[0]"),
        (_embedding_into_table, "out: shares memory with table"),
        (_caches_alias, "v_cache: shares memory with k_cache"),
        (_rope_kv_store_out_in_cache, "out: shares memory with k_cache"),
        (_attention_out_in_v_cache, "out: shares memory with v_cache"),
        (_decode_scratch_max_is_sum, "scratch.sum: shares memory with scratch.max"),
        (_rms_norm_out_shifted_over_x, "out: shares memory with x"),
    ],
)
def test_outputs_sharing_memory_with_what_the_kernel_reads_are_refused(call, names: str) -> None:
    with pytest.raises(ValueError, match=names.replace("[", r"\[").replace("]", r"\]")):
        call()


def test_the_supported_in_place_forms_still_match_the_reference() -> None:
    x, res, w = randn(3, 32), randn(3, 32), randn(32)
    want = ref_norm.rms_norm(x, w, 1e-6)
    assert torch.equal(norm.rms_norm(x, w, 1e-6, out=x), want.to(x.dtype))
    x, res = randn(3, 32), randn(3, 32)
    want_y, want_sum = norm.add_rms_norm(x.clone(), res.clone(), w, 1e-6)
    y, total = norm.add_rms_norm(x, res, w, 1e-6, out=(x, res))
    assert torch.equal(y, want_y) and torch.equal(total, want_sum)
    a, b = randn(2, 16), randn(2, 16)
    want = elementwise.add(a, b)
    assert torch.equal(elementwise.add(a, b, out=b), want)


@pytest.mark.parametrize("bad", [math.nan, math.inf, 0.0, True])  # a bool is no number
def test_eps_and_scale_must_be_positive_and_finite(bad: float) -> None:
    with pytest.raises(ValueError, match="eps: expected a positive finite number"):
        norm.rms_norm(randn(2, 16), randn(16), bad)
    with pytest.raises(ValueError, match="scale: expected a positive finite number"):
        attention.attention(
            randn(1, 1, 1, 64),
            randn(1, 8, 1, 64),
            randn(1, 8, 1, 64),
            torch.full((1,), 4, dtype=torch.int32, device=DEVICE),
            bad,
        )


def test_numpy_scalars_pass_and_tensors_are_refused_as_scalars() -> None:
    import numpy as np

    x, w = randn(2, 16), randn(16)
    assert torch.equal(norm.rms_norm(x, w, np.float32(1e-6)), norm.rms_norm(x, w, 1e-6))
    a, weight = randn(2, 80), randn(4, 80)
    assert torch.equal(gemm.linear_splitk(a, weight, np.int64(2)), gemm.linear_splitk(a, weight, 2))
    positions = torch.arange(3, device=DEVICE).view(1, 3)
    cos, sin = rope.rope_cos_sin(positions, np.int64(8), np.float64(1e4))
    want_cos, want_sin = rope.rope_cos_sin(positions, 8, 1e4)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    with pytest.raises(ValueError, match=r"^eps: expected a positive finite number \(a Python or numpy"):
        norm.rms_norm(x, w, torch.tensor(1e-6))


def test_a_scale_that_overflows_the_kernels_fp32_is_refused() -> None:
    q, cache = randn(1, 1, 1, 64), randn(1, 8, 1, 64)
    seq_lens = torch.full((1,), 4, dtype=torch.int32, device=DEVICE)
    limit = validate.FP32_MAX / attention.LOG2E
    with pytest.raises(ValueError, match=r"scale: expected at most 2\.359e\+38"):
        attention.attention(q, cache, cache.clone(), seq_lens, 1.001 * limit)
    assert (
        attention.attention(q * 1e-30, cache * 1e-10, cache.clone(), seq_lens, 0.999 * limit).isfinite().all()
    )


def test_empty_and_degenerate_shapes() -> None:
    assert gemm.linear(randn(0, 32), randn(16, 32)).shape == (0, 16)
    assert norm.rms_norm(randn(0, 65), randn(65), 1e-6).shape == (0, 65)
    assert elementwise.silu_mul(randn(3, 0), randn(3, 0)).shape == (3, 0)
    with pytest.raises(ValueError, match="table: expected at least one row"):
        embedding.embedding(torch.zeros(1, 2, dtype=torch.int64, device=DEVICE), randn(0, 16))
    with pytest.raises(ValueError, match="K = 0 leaves nothing to split"):
        gemm.linear_splitk(randn(2, 0), randn(4, 0), 1)
    start = torch.zeros(1, dtype=torch.int32, device=DEVICE)  # head_dim 0 below: nothing to write
    kv_cache.kv_cache_store(randn(1, 4, 2, 0), randn(1, 4, 2, 0), randn(1, 2, 2, 0), randn(1, 2, 2, 0), start)


@pytest.mark.parametrize(
    ("op", "tokens"),
    [("kv_cache_store", "s"), ("rope_kv_store", "s"), ("add_rms_norm_linear_rope_kv_store", "m")],
)
def test_a_call_with_no_new_token_matches_the_reference(op: str, tokens: str) -> None:
    """No token to write is a valid call (the kernels return at once); the references raised on
    it, so ``verify.op --case`` called it bad input."""
    import registry
    from verify.compare import check

    spec = registry.get(op)
    result = check(spec, spec.build({**spec.typical, tokens: 0}, DEVICE))
    assert result.passed and result.raised is None, result.describe()


def test_output_pairs_and_scratch_of_the_wrong_kind() -> None:
    with pytest.raises(TypeError, match="out: expected None or a pair of tensors"):
        norm.add_rms_norm(randn(2, 16), randn(2, 16), randn(16), 1e-6, out=randn(2, 16))
    with pytest.raises(TypeError, match="out: expected None or a pair of tensors"):
        norm.add_rms_norm(randn(2, 16), randn(2, 16), randn(16), 1e-6, out=(randn(2, 16),) * 3)
    with pytest.raises(TypeError, match="scratch: expected None or a DecodeScratch from decode_scratch"):
        q, cache = randn(1, 1, 1, 64), randn(1, 64, 1, 64)
        attention.attention_decode(
            q,
            cache,
            cache.clone(),
            torch.full((1,), 8, dtype=torch.int32, device=DEVICE),
            0.125,
            scratch=(1, 2, 3),
        )
    with pytest.raises(TypeError, match="scratch: expected None or a DecodeScratch"):  # unused there
        q, cache = randn(1, 1, 1, 64), randn(1, 64, 1, 64)
        seq_lens = torch.full((1,), 8, dtype=torch.int32, device=DEVICE)
        attention.attention(q, cache, cache.clone(), seq_lens, 0.125, path="prefill", scratch=123)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda: gemm.linear_splitk(randn(1, 80), randn(4, 80), True),
            ValueError,
            "split_k: expected an int",
        ),
        (
            lambda: gemm.linear_splitk(randn(1, 80), randn(4, 80), gemm.MAX_SPLIT_K + 1),
            ValueError,
            r"^split_k: expected an int from 1 to min\(K=80, 64\)",
        ),
        (
            lambda: gemm.splitk_reduce(randn(gemm.MAX_SPLIT_K + 1, 1, 4, dtype=torch.float32), BF16),
            ValueError,
            "partials: expected 1..64 splits",
        ),
        (
            lambda: rope.rope_cos_sin(torch.zeros(1, 2, dtype=torch.int32, device=DEVICE), 2**34, 1e4),
            ValueError,
            r"rotary_dim: expected an even number up to 65536, got 17179869184",  # not a 34 GB table
        ),
        (
            lambda: gemm.linear(randn(2, 16), randn(4, 16).to_sparse()),
            TypeError,
            "weight: expected a dense \\(strided\\) tensor, got layout torch.sparse_coo",
        ),
        (
            lambda: gemm.linear(randn(2, 16), randn(4, 16), partials="junk"),  # a shape that does not split
            TypeError,
            "partials: expected a torch.Tensor, got str",
        ),
        (
            lambda: rope.rope_cos_sin(torch.zeros(1, 2, dtype=torch.int32, device=DEVICE), 8.0, 1e4),
            ValueError,
            r"rotary_dim: expected a positive int \(a Python or numpy scalar\), got 8\.0",
        ),
        (
            lambda: norm.rms_norm(torch.tensor(1.0, dtype=BF16, device=DEVICE), randn(1), 1e-6),
            ValueError,
            r"x: expected 1 to 8 dims, got shape \(\)",
        ),
        (
            lambda: norm.rms_norm(randn(1, norm.MAX_N + 1), randn(norm.MAX_N + 1), 1e-6),
            ValueError,
            "x: last dim 32769 exceeds",
        ),
        (
            lambda: gemm.linear(randn(3, 32), randn(16, 32), out=randn(16, 3)),
            ValueError,
            r"out: expected shape \(3, 16\)",  # as many elements, another shape
        ),
    ],
)
def test_values_at_the_edge_of_a_check_are_refused(call, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        call()
