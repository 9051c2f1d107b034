"""Test cases: a JSON-able parameter dict, and the tensors built from it deterministically.

Hypothesis draws the parameters (small integers and choices, so it can shrink them toward
small shapes); ``build`` turns them into tensors with a seeded generator. The parameters
alone therefore reproduce a case exactly: they are what a repro command carries.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import strategies as st

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Value distributions a kernel must survive; "normal" first so shrinking lands on it.
DISTRIBUTIONS = ("normal", "zeros", "constant_rows", "large", "tiny", "outliers")
# Sizes that break kernels: powers of two and their neighbours, the model dims.
AWKWARD = (1, 2, 3, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129)
MODEL_DIMS = (896, 1024, 2048, 3072, 4864, 151936)


@dataclass
class Case:
    """One concrete call: ``args``/``kwargs`` for the op, the ``params`` that made them, edge labels.

    ``kwargs`` are the registered kernel's keyword-only extras (a preallocated buffer), beyond
    the op's contract: an outside implementation that does not take one is called without it.
    """

    params: dict[str, Any]
    args: tuple
    kwargs: dict[str, Any] = field(default_factory=dict)
    labels: tuple[str, ...] = ()

    def params_json(self) -> str:
        return json.dumps(self.params, sort_keys=True, separators=(",", ":"))


def choice(params: dict[str, Any], field: str, options: Sequence[Any], default: Any = None) -> Any:
    """``params[field]`` (``default`` where the field is absent, if one is given), refused unless it
    is one of ``options``: a typo must not fall through to some default branch of a builder.
    Types must match too (``1`` is not ``True``)."""
    value = params[field] if default is None else params.get(field, default)
    if not any(type(value) is type(option) and value == option for option in options):
        names = ", ".join(o if isinstance(o, str) else json.dumps(o) for o in options)
        raise ValueError(f"{field} {value!r}: expected one of {names}")
    return value


def dtype_of(params: dict[str, Any]) -> torch.dtype:
    return DTYPES[choice(params, "dtype", tuple(DTYPES), "bfloat16")]


def recorded(path: str, args: tuple) -> Case:
    """The case of one recorded op call (``verify.bisect``'s inputs): its dtype, which picks the
    tolerance, is that of the first floating-point argument (float32 where there is none)."""
    floats = [a.dtype for a in args if isinstance(a, torch.Tensor) and a.dtype.is_floating_point]
    dtype = str(floats[0] if floats else torch.float32).removeprefix("torch.")
    return Case({"inputs": path, "dtype": dtype}, args)


def generator(params: dict[str, Any], device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(int(params.get("seed", 0)))
    return gen


def values(
    shape: Sequence[int], dtype: torch.dtype, dist: str, gen: torch.Generator, device: torch.device
) -> torch.Tensor:
    """A tensor of ``shape`` drawn from the named distribution, generated in fp32 then rounded."""
    shape = tuple(shape)
    if dist == "zeros":
        t = torch.zeros(shape, device=device)
    elif dist == "constant_rows":
        row_shape = (*shape[:-1], 1) if shape else ()
        t = torch.randn(row_shape, generator=gen, device=device).expand(shape).contiguous()
    elif dist == "large":  # |x| up to 1e4: squares overflow fp16 and lose bf16 precision
        t = (torch.rand(shape, generator=gen, device=device) * 2 - 1) * 1e4
    elif dist == "tiny":
        t = torch.randn(shape, generator=gen, device=device) * 1e-4
    elif dist == "outliers":  # mostly unit normal, a few entries 100x larger
        t = torch.randn(shape, generator=gen, device=device)
        spikes = torch.rand(shape, generator=gen, device=device) < 0.01
        t = torch.where(spikes, t * 100, t)
    elif dist == "normal":
        t = torch.randn(shape, generator=gen, device=device)
    else:
        raise ValueError(f"dist {dist!r}: expected one of {', '.join(DISTRIBUTIONS)}")
    return t.to(dtype)


def strided_view(
    base_shape: Sequence[int],
    dtype: torch.dtype,
    dist: str,
    gen: torch.Generator,
    device: torch.device,
    pad_last: int,
) -> torch.Tensor:
    """A tensor of ``base_shape`` whose rows sit inside a wider buffer (last dim padded by ``pad_last``).

    This is how the model hands ops their inputs: column slices of a fused GEMM output.
    The padding holds random values, so a kernel that reads past the row shows it.
    """
    wide = (*base_shape[:-1], base_shape[-1] + pad_last)
    return values(wide, dtype, dist, gen, device)[..., : base_shape[-1]]


# ---- strategy building blocks ---------------------------------------------------------------


def size(cap: int, special: Sequence[int] = AWKWARD + MODEL_DIMS, low: int = 1) -> st.SearchStrategy[int]:
    """An int in ``[low, cap]``: any value, or one of the sizes that break kernels.

    The plain-integer branch comes first, so a failure shrinks toward ``low``.
    """
    picks = sorted({v for v in special if low <= v <= cap})
    branches = [st.integers(low, cap)]
    if picks:
        branches.append(st.sampled_from(picks))
    return st.one_of(*branches)


def dtype_name(choices: Sequence[str] = ("bfloat16", "float16", "float32")) -> st.SearchStrategy[str]:
    return st.sampled_from(tuple(choices))


def distribution(choices: Sequence[str] = DISTRIBUTIONS) -> st.SearchStrategy[str]:
    return st.sampled_from(tuple(choices))


def seed() -> st.SearchStrategy[int]:
    return st.integers(0, 2**16 - 1)
