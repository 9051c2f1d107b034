"""Cases for ``add`` (residual stream) and ``silu_mul`` (the two halves of the fused gate/up output)."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from verify.cases import AWKWARD, MODEL_DIMS, Case, choice, dtype_of, generator, size, strided_view, values
from verify.limits import Limits
from verify.strategies.common import BOOLS, Invalid, common, labels_for, lead_dims, padding, replace

WIDTHS = AWKWARD + MODEL_DIMS[:-1]


def add_params(limits: Limits) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries(
        {"lead": lead_dims(limits.rows), "n": size(limits.width, WIDTHS), "pad": padding(), **common()}
    )


def add_build(params: dict, device: torch.device) -> Case:
    gen = generator(params, device)
    shape = (*params["lead"], params["n"])
    dtype = dtype_of(params)
    x = strided_view(shape, dtype, params["dist"], gen, device, params["pad"])
    y = values(shape, dtype, "normal", gen, device)
    labels = labels_for(params, N=params["n"], M=math.prod(params["lead"]))
    if params["pad"]:
        labels.append("non-contiguous")
    return Case(params, (x, y), labels=tuple(labels))


def silu_mul_params(limits: Limits) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries(
        {
            "m": size(limits.rows, AWKWARD),
            "n": size(limits.width, WIDTHS),
            "fused": st.booleans(),
            "up_pad": padding(),
            **common(),
        }
    )


def silu_mul_build(params: dict, device: torch.device) -> Case:
    """With ``fused``, gate and up are the halves of one ``[M, 2N]`` buffer, as the model passes them."""
    gen = generator(params, device)
    m, n, dtype, fused = params["m"], params["n"], dtype_of(params), choice(params, "fused", BOOLS)
    if fused:
        gate_up = values((m, 2 * n), dtype, params["dist"], gen, device)
        gate, up = gate_up[:, :n], gate_up[:, n:]
    else:
        gate = values((m, n), dtype, params["dist"], gen, device)
        up = strided_view((m, n), dtype, params["dist"], gen, device, params.get("up_pad", 0))
    labels = labels_for(params, N=n, M=m)
    if fused or params.get("up_pad", 0):
        labels.append("non-contiguous")
    return Case(params, (gate, up), labels=tuple(labels))


def _add_example(name: str, lead: list[int], n: int, **extra: object) -> dict:
    return {
        "name": name,
        "lead": lead,
        "n": n,
        "pad": 0,
        "dtype": "bfloat16",
        "dist": "normal",
        "seed": 0,
        **extra,
    }


def _silu_example(name: str, m: int, n: int, **extra: object) -> dict:
    return {
        "name": name,
        "m": m,
        "n": n,
        "fused": True,
        "dtype": "bfloat16",
        "dist": "normal",
        "seed": 0,
        **extra,
    }


ADD_EXAMPLES = (
    _add_example("typical: 3 x 65, strided", [3], 65, pad=2, gpu=False),
    _add_example("article decode residual", [1, 1], 1024, gpu=False),
    _add_example("a row past one 1024-wide block (N=1100)", [2], 1100, gpu=False),
    _add_example("article prefill residual", [1, 256], 1024),
    _add_example("qwen2.5 residual, large values", [4, 33], 896, dist="large"),
)
SILU_MUL_EXAMPLES = (
    _silu_example("typical: 3 x 65 fused", 3, 65, gpu=False),
    _silu_example("fp32 to 1e4: exp overflows", 5, 33, dtype="float32", dist="large", gpu=False),
    _silu_example("article decode (intermediate 4864)", 1, 4864, gpu=False),
    _silu_example("article prefill 256 x 4864", 256, 4864),
    _silu_example("qwen3-0.6b prefill (intermediate 3072)", 129, 3072, dist="large"),
)
ADD_INVALID = (
    Invalid("y of another shape", "y", replace("y", lambda y: y[..., :-1])),
    Invalid("y dtype differs from x", "y", replace("y", lambda y: y.float()), TypeError),
    Invalid("x with last-dim stride 2", "x", replace("x", lambda x: x.repeat_interleave(2, -1)[..., ::2])),
)
SILU_MUL_INVALID = (
    Invalid("up of another shape", "up", replace("up", lambda u: u[:-1])),
    Invalid("up dtype differs from gate", "up", replace("up", lambda u: u.float()), TypeError),
    Invalid(
        "gate with last-dim stride 2", "gate", replace("gate", lambda g: g.repeat_interleave(2, -1)[..., ::2])
    ),
)
