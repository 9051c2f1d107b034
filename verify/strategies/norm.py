"""Cases for ``rms_norm`` and ``add_rms_norm``: row widths of the real models, awkward widths,
1 to 3 leading dims (qk-norm runs on ``[B, S, H, D]``), strided rows, extreme values."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from verify.cases import AWKWARD, MODEL_DIMS, Case, choice, dtype_of, generator, size, strided_view
from verify.limits import Limits
from verify.strategies.common import EPS_NOT_FP32, Invalid, common, labels_for, lead_dims, padding, replace

WIDTHS = AWKWARD + MODEL_DIMS[:-1]  # every norm width but the vocabulary
NORM_WEIGHTS = ("normal", "ones")  # a norm weight of near-ones, or exactly ones


def _fields(limits: Limits) -> dict:
    return {
        "lead": lead_dims(limits.rows),
        "n": size(limits.width, WIDTHS),
        "pad": padding(),
        "eps": st.sampled_from([1e-6, 1e-5]),
        "weight": st.sampled_from(NORM_WEIGHTS),
        **common(),
    }


def rms_norm_params(limits: Limits) -> st.SearchStrategy[dict]:
    # head_gap: x is [..., H, D] taken from a wider [..., H + gap, D] buffer (qk-norm on the QKV output)
    return st.fixed_dictionaries({**_fields(limits), "head_gap": st.one_of(st.just(0), st.integers(1, 3))})


def add_rms_norm_params(limits: Limits) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({**_fields(limits), "residual_pad": padding()})


def _weight(params: dict, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    dtype = dtype_of(params)
    if choice(params, "weight", NORM_WEIGHTS) == "ones":
        return torch.ones(params["n"], dtype=dtype, device=device)
    return (1 + 0.1 * torch.randn(params["n"], generator=gen, device=device)).to(dtype)


def _labels(params: dict) -> tuple[str, ...]:
    out = labels_for(params, N=params["n"], M=math.prod(params["lead"]))
    if params["pad"] or params.get("residual_pad") or params.get("head_gap"):
        out.append("non-contiguous")
    if len(params["lead"]) > 1:
        out.append(f"{len(params['lead']) + 1}-d input")
    return tuple(out)


def rms_norm_build(params: dict, device: torch.device) -> Case:
    gen = generator(params, device)
    lead, gap = params["lead"], params.get("head_gap", 0)
    shape = (*lead[:-1], lead[-1] + gap, params["n"])
    x = strided_view(shape, dtype_of(params), params["dist"], gen, device, params["pad"])[..., : lead[-1], :]
    return Case(params, (x, _weight(params, gen, device), params["eps"]), labels=_labels(params))


def add_rms_norm_build(params: dict, device: torch.device) -> Case:
    gen = generator(params, device)
    shape = (*params["lead"], params["n"])
    dtype = dtype_of(params)
    x = strided_view(shape, dtype, params["dist"], gen, device, params["pad"])
    residual = strided_view(shape, dtype, "normal", gen, device, params["residual_pad"])
    return Case(params, (x, residual, _weight(params, gen, device), params["eps"]), labels=_labels(params))


def _example(name: str, lead: list[int], n: int, **extra: object) -> dict:
    base = {
        "lead": lead,
        "n": n,
        "pad": 0,
        "eps": 1e-6,
        "weight": "normal",
        "dtype": "bfloat16",
        "dist": "normal",
        "seed": 0,
    }
    return {"name": name, **base, **extra}


RMS_NORM_EXAMPLES = (
    _example("typical: 3 rows of 65, strided", [3], 65, pad=3, gpu=False),
    _example("article decode row (hidden 1024)", [1], 1024, gpu=False),
    _example("article prefill 256 x 1024", [1, 256], 1024),
    _example("qwen2.5 hidden 896, large values", [1, 64], 896, dist="large", gpu=False),
    _example("qwen3 qk-norm on the fused QKV output", [1, 256, 16], 128, head_gap=16),
    _example("intermediate width 4864, strided", [2, 7], 4864, pad=5, gpu=False),
    _example("tiny values hit eps", [3], 1024, dist="tiny", eps=1e-5, gpu=False),
    _example("fp16 large values: squares overflow fp16", [2], 96, dist="large", dtype="float16", gpu=False),
)
# add_rms_norm takes every shape but the qk-norm head view (the model's qk-norm adds nothing)
ADD_RMS_NORM_EXAMPLES = (
    *({**e, "residual_pad": 0} for e in RMS_NORM_EXAMPLES if "head_gap" not in e),
    _example("qwen2.5 residual add, strided residual", [2, 5], 896, residual_pad=7, gpu=False),
)


RMS_NORM_INVALID = (
    Invalid("weight of the wrong length", "weight", replace("weight", lambda w: w[:-1])),
    Invalid("2-d weight", "weight", replace("weight", lambda w: w[None])),
    Invalid("weight dtype differs from x", "weight", replace("weight", lambda w: w.float()), TypeError),
    Invalid("negative eps", "eps", replace("eps", lambda e: -e)),
    *EPS_NOT_FP32,
    Invalid(
        "transposed x (last-dim stride != 1)", "x", replace("x", lambda x: x.new_empty(x.shape[::-1]).t())
    ),
)
ADD_RMS_NORM_INVALID = (
    *RMS_NORM_INVALID,
    Invalid("residual of another shape", "residual", replace("residual", lambda r: r[..., :-1])),
    Invalid("residual dtype differs from x", "residual", replace("residual", lambda r: r.float()), TypeError),
)
