"""Per-op, per-dtype tolerances read from ``tolerances.toml`` (the one place numbers live)."""

from __future__ import annotations

import functools
import tomllib
from dataclasses import dataclass
from pathlib import Path

import torch

PATH = Path(__file__).resolve().parent.parent / "tolerances.toml"
RULES = ("allclose", "max_error_ratio", "exact")
BACKENDS = ("cuda", "interpreter")  # ops.backend's names


@dataclass(frozen=True)
class Tolerance:
    """How one op's output in one dtype is judged.

    ``allclose``: ``|impl - ref| <= atol + rtol * |ref|`` elementwise.
    ``max_error_ratio``: ``max|impl - oracle| <= k * max|lowp - oracle| + ulps * ulp(max|oracle|) + atol``,
    where the oracle is the reference in fp64 and ``lowp`` the reference computed in the op's own
    dtype (where that breaks down, the fp32 reference: ``verify.compare.judge``); ``atol``
    (default 0) covers a documented absolute limit such as flushed subnormals, and ``ulps``
    (default 1) a documented per-element error such as the GPU's approximate fp32 math; an op
    with an ``error_floor`` (attention: what one fp32 ulp on every score does) adds
    ``floor_ulps`` (default 1) times it.
    ``exact``: bitwise equality (copies, indices).
    """

    rule: str
    atol: float = 0.0
    rtol: float = 0.0
    max_error_ratio: float = 0.0
    ulps: float = 1.0
    floor_ulps: float = 1.0


def dtype_key(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.cache
def _table(path: Path = PATH) -> dict:
    """The file, read once; a sub-table of an op that is neither a dtype nor a backend (a
    misspelt ``[op.interpeter]``) is refused rather than never looked up."""
    with open(path, "rb") as f:
        table = tomllib.load(f)
    for key, section in table.items():
        for sub, value in section.items() if isinstance(section, dict) else ():
            is_dtype = isinstance(getattr(torch, sub, None), torch.dtype)
            if isinstance(value, dict) and not is_dtype and sub not in BACKENDS:
                raise ValueError(f"{path}: [{key}.{sub}] is neither a dtype nor a backend {BACKENDS}")
    return table


def rule(key: str, path: Path = PATH) -> str:
    return _table(path).get(key, {}).get("rule", "allclose")


def lookup(key: str, dtype: torch.dtype, path: Path = PATH, *, backend: str | None = None) -> Tolerance:
    """The tolerance for op ``key`` at ``dtype`` on ``backend``: ``[key.backend]``'s dtype
    entry, else ``[key.dtype]``, else ``[default.dtype]``. A backend table holds the tighter
    numbers of exact arithmetic where the general ones are set by the GPU's (its approximate
    exp, sqrt and division, its fp32 dot order): the interpreter runs numpy's."""
    table = _table(path)
    section = table.get(key, {})
    rule = section.get("rule", "allclose")
    if rule not in RULES:
        raise ValueError(f"{path}: [{key}] rule {rule!r} is not one of {RULES}")
    if rule == "exact":
        return Tolerance("exact")
    name = dtype_key(dtype)
    numbers = section.get(backend, {}).get(name) or section.get(name) or table.get("default", {}).get(name)
    if numbers is None:
        raise KeyError(f"{path}: no tolerance for op {key!r} at dtype {name} and no [default.{name}]")
    if rule == "max_error_ratio":
        if "max_error_ratio" not in numbers:
            raise KeyError(f"{path}: [{key}] uses max_error_ratio but gives no ratio for {name}")
        ratio = float(numbers["max_error_ratio"])
        atol, ulps = float(numbers.get("atol", 0.0)), float(numbers.get("ulps", 1.0))
        floor_ulps = float(numbers.get("floor_ulps", 1.0))
        return Tolerance(rule, atol=atol, max_error_ratio=ratio, ulps=ulps, floor_ulps=floor_ulps)
    return Tolerance(rule, atol=float(numbers["atol"]), rtol=float(numbers["rtol"]))


def setting(section: str, key: str, path: Path = PATH) -> float:
    """A model-level number (``[e2e]``, ``[bisect]``) from the same file."""
    try:
        return float(_table(path)[section][key])
    except KeyError:
        raise KeyError(f"{path}: no {key} in [{section}]") from None
