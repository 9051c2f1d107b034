"""The references pinned by their contract, not by agreement with a kernel.

Every other check compares a kernel with its reference, so a reference and a kernel written with
the same slip would pass them all. These tests hold the references (and the reference model's
choice of them) to values worked out by hand or by an independent formula, for what the HF
oracle (tests/test_hf_oracle.py) does not reach: argmax's tie rule, the residual output of
`add_rms_norm`, the RoPE frequencies, attention's fp32 softmax on bf16 inputs, the refusal
of non-finite reference logits.
"""

from __future__ import annotations

import math

import pytest
import torch

import registry
from model import embedded, reference
from model import weights as model_weights
from model.config import load
from model.decoder import OPS
from references.attention import attention
from references.norm import add_rms_norm
from references.rope import rope_cos_sin
from references.sampling import argmax


def test_argmax_lowest_index_wins_ties_and_nan_counts_as_the_maximum() -> None:
    logits = torch.tensor(
        [[1.0, 3.0, 3.0, 2.0], [5.0, float("nan"), 9.0, float("nan")], [-1.0, -1.0, -1.0, -1.0]],
        dtype=torch.bfloat16,
    )
    assert argmax(logits).tolist() == [1, 1, 0]


def test_add_rms_norm_returns_the_rounded_sum_as_the_new_residual() -> None:
    # 256 + 1 is no bf16 value: that sum rounds to 256 (ties to even)
    x = torch.tensor([[1.5, -2.0, 0.25, 256.0]], dtype=torch.bfloat16)
    residual = torch.tensor([[0.25, 0.5, -0.25, 1.0]], dtype=torch.bfloat16)
    y, new_residual = add_rms_norm(x, residual, torch.ones(4, dtype=torch.bfloat16), 1e-6)
    assert new_residual.dtype == torch.bfloat16
    assert new_residual.tolist() == [[1.75, -1.5, 0.0, 256.0]]
    rms = math.sqrt((1.75**2 + 1.5**2 + 256.0**2) / 4 + 1e-6)
    expected = torch.tensor([[1.75 / rms, -1.5 / rms, 0.0, 256.0 / rms]]).to(torch.bfloat16)
    assert torch.equal(y, expected)


@pytest.mark.parametrize("base", [10000.0, 1e6])
def test_rope_cos_sin_follows_position_times_base_to_the_minus_2i_over_d(base: float) -> None:
    positions = torch.tensor([[0, 1, 7, 4095]])
    cos, sin = rope_cos_sin(positions, 8, base)
    assert cos.shape == sin.shape == (1, 4, 4) and cos.dtype == sin.dtype == torch.float32
    assert torch.equal(cos[0, 0], torch.ones(4)) and torch.equal(sin[0, 0], torch.zeros(4))
    for j, p in enumerate(positions[0].tolist()):
        for i in range(4):
            angle = p * base ** (-2 * i / 8)
            slack = 4 * 2**-24 * max(1.0, angle)  # fp32's rounding of the angle itself, and of cos/sin
            assert abs(cos[0, j, i].item() - math.cos(angle)) <= slack, (p, i)
            assert abs(sin[0, j, i].item() - math.sin(angle)) <= slack, (p, i)


def test_attention_rounds_only_its_output_on_bf16_inputs() -> None:
    """Scores, softmax and the weighted sum in fp32: within one bf16 step of the fp64 result.
    Scores rounded to bf16 before the softmax (a reference in the inputs' dtype) miss it by
    several steps over 512 keys of close scores."""
    gen = torch.Generator().manual_seed(0)
    q = (torch.randn(1, 3, 4, 64, generator=gen) * 2).to(torch.bfloat16)
    k = (torch.randn(1, 512, 2, 64, generator=gen) * 2).to(torch.bfloat16)
    v = torch.randn(1, 512, 2, 64, generator=gen).to(torch.bfloat16)
    lens = torch.tensor([500], dtype=torch.int32)
    got = attention(q, k, v, lens, 0.125)
    keys, values = k.double().repeat_interleave(2, dim=2), v.double().repeat_interleave(2, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q.double(), keys) * 0.125
    hidden = torch.arange(512)[None, :] > (500 - 3 + torch.arange(3))[:, None]  # [S, L]: past the query
    scores = scores.masked_fill(hidden[None, None], -math.inf)
    exact = torch.einsum("bhij,bjhd->bihd", torch.softmax(scores, dim=-1), values)
    step = torch.finfo(torch.bfloat16).eps * exact.abs().clamp_min(2**-20)  # one bf16 step of each value
    assert ((got.double() - exact).abs() <= step).all()


def test_the_reference_model_runs_every_op_on_its_registered_reference() -> None:
    """The yardstick must not quietly include a kernel: in fp32 on the interpreter one would
    still match HF within its tolerance."""
    path = embedded.ensure()
    weights = model_weights.load(path, load(path), "cpu")
    for fused in (True, False):
        ref = reference.build(weights, 1, 8, fused=fused)
        assert set(ref.impls) == set(OPS)
        for name in OPS:
            assert ref.impls[name] is registry.get(name).reference, name


def test_one_non_finite_reference_logit_is_refused() -> None:
    logits = torch.zeros(2, 5)
    reference.check_finite(logits, "step 0")
    for bad in (float("nan"), float("inf"), float("-inf")):
        logits[1, 3] = bad
        with pytest.raises(reference.NonFiniteReference, match="step 0"):
            reference.check_finite(logits, "step 0")
