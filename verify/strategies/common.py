"""Building blocks shared by the per-op strategies."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from hypothesis import strategies as st

from verify.cases import AWKWARD, DISTRIBUTIONS, distribution, dtype_name, seed, size

BOOLS = (False, True)  # the options of a flag field (drawn with st.booleans()), for cases.choice
INDEX_DTYPES = ("int64", "int32")  # token ids and positions


@st.composite
def lead_dims(draw: st.DrawFn, cap: int, max_dims: int = 3) -> list[int]:
    """1 to ``max_dims`` leading dims whose product stays within ``cap`` (shrinks to ``[1]``)."""
    n = draw(st.integers(1, max_dims))
    dims: list[int] = []
    for _ in range(n):
        room = cap // max(1, math.prod(dims))
        dims.append(draw(size(max(1, room), AWKWARD)))
    return dims


def common(dists: tuple[str, ...] = DISTRIBUTIONS, dtypes: tuple[str, ...] | None = None) -> dict:
    """Fields most cases carry: dtype, value distribution, seed."""
    return {
        "dtype": dtype_name() if dtypes is None else dtype_name(dtypes),
        "dist": distribution(dists),
        "seed": seed(),
    }


def padding() -> st.SearchStrategy[int]:
    """Extra columns around a row: 0 is contiguous, anything else makes a strided view."""
    return st.one_of(st.just(0), st.integers(1, 17))


@dataclass(frozen=True)
class Invalid:
    """A bad input the wrapper must refuse: ``mutate`` edits the named args of a valid case."""

    what: str
    arg: str  # the argument the error message must name
    mutate: Callable[[dict], None]
    error: type[Exception] = ValueError


# an eps the kernels cannot take as an fp32, or not as a float at all
EPS_NOT_FP32 = (
    Invalid("eps zero as an fp32 (1e-46)", "eps", lambda args: args.update(eps=1e-46)),
    Invalid("eps inf as an fp32 (1e39)", "eps", lambda args: args.update(eps=1e39)),
    Invalid("eps an int past the float range", "eps", lambda args: args.update(eps=10**400)),
)


def labels_for(params: dict, **sizes: int) -> list[str]:
    """Edge classes a case covers, for ``verify.op``'s coverage report (Hypothesis events)."""
    out = [f"dtype {params.get('dtype', 'bfloat16')}"]
    dist = params.get("dist", "normal")
    if dist == "large":
        out.append("large magnitude")
    elif dist != "normal":
        out.append(f"values {dist}")
    for name, n in sizes.items():
        if n == 1:
            out.append(f"{name} = 1")
        elif n == 2:
            out.append(f"{name} = 2")
        elif n % 16:
            out.append(f"{name} tail")
    return out


def replace(name: str, fn: Callable) -> Callable[[dict], None]:
    """An ``Invalid.mutate`` that swaps argument ``name`` for ``fn(old value)``."""

    def mutate(args: dict) -> None:
        args[name] = fn(args[name])

    return mutate
