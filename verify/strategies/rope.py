"""Cases for ``rope_cos_sin`` (positions up to 32k, partial rotary dims) and ``apply_rope``
(q or k as a head slice of the fused QKV output, rotate-half over the first rotary dims)."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from references.rope import rope_cos_sin
from verify.cases import AWKWARD, Case, choice, dtype_of, generator, size, values
from verify.limits import Limits
from verify.strategies.common import INDEX_DTYPES, Invalid, common, labels_for, replace

HEAD_DIMS = (2, 4, 6, 16, 32, 34, 64, 96, 128, 256)
BASES = (10000.0, 1000000.0, 500000.0)
POSITIONS = ("consecutive", "scattered")
POSITION_STEPS = (1, 2)  # the positions' stride along S: 2 when they are every other element of a row
ROTARY = ("full", "half", "quarter")  # the rotary dims: all of head_dim, half of it, a quarter
HEAD_PADS = (0, 3)  # elements after each head's D: 3 gives head strides that are not D
COS_SIN_DTYPES = ("float32",)  # rope_cos_sin's tables are fp32 (its tolerance has no other dtype)


def _positions(params: dict, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Consecutive positions from ``start`` (prefill, decode), or scattered ones, as a view into a
    wider buffer: offset in each row, and with ``pos_step`` 2 every other element of it."""
    b, s = params["b"], params["s"]
    step = choice(params, "pos_step", POSITION_STEPS, 1)
    if choice(params, "positions", POSITIONS) == "consecutive":
        pos = params["start"] + torch.arange(s, device=device).expand(b, s)
    else:
        pos = torch.randint(0, params["start"] + s, (b, s), generator=gen, device=device)
    pos_dtype = getattr(torch, choice(params, "pos_dtype", INDEX_DTYPES))
    buffer = torch.zeros(b, step * s + 2, dtype=pos_dtype, device=device)
    buffer[:, 1 : step * s + 1 : step] = pos
    return buffer[:, 1 : step * s + 1 : step]


# cos and sin as one rope_cos_sin call makes them, sin with strides of its own, or both as the
# first S rows of longer tables (a batch stride that is not S times the row stride)
TABLES = ("shared", "sin_padded", "seq_slice")


def rope_tables(
    positions: torch.Tensor, rotary_dim: int, base: float, tables: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference cos and sin ``[B, S, rotary_dim / 2]`` for ``positions``; with ``"sin_padded"``
    sin is a view into a wider buffer, so its row strides differ from cos's (a kernel that
    addresses sin with cos's strides reads the wrong rows); with ``"seq_slice"`` both are the first
    S rows of NaN-padded ``[B, S + 2, rotary_dim / 2]`` tables (a kernel that takes a table as
    contiguous over ``[B, S]`` reads the wrong rows from the second batch row on)."""
    cos, sin = rope_cos_sin(positions, rotary_dim, base)
    if tables == "seq_slice":
        b, s, n = cos.shape
        cos, sin = (torch.cat([t, t.new_full((b, 2, n), float("nan"))], dim=1)[:, :s] for t in (cos, sin))
    if tables == "sin_padded":
        n = sin.shape[-1]
        wide = torch.full((*sin.shape[:-1], n + 3), float("nan"), dtype=sin.dtype, device=sin.device)
        wide[..., :n] = sin
        sin = wide[..., :n]
    return cos, sin


def _position_fields(limits: Limits) -> dict:
    return {
        "b": size(limits.batch, AWKWARD),
        "s": size(limits.seq, AWKWARD),
        "start": st.one_of(st.integers(0, 64), st.sampled_from([4095, 32767, 131071])),
        "positions": st.sampled_from(POSITIONS),
        "pos_step": st.sampled_from(POSITION_STEPS),
        "pos_dtype": st.sampled_from(INDEX_DTYPES),
        "base": st.sampled_from(BASES),
        "seed": st.integers(0, 2**16 - 1),
    }


def rope_cos_sin_params(limits: Limits) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries(
        {
            **_position_fields(limits),
            "rotary_dim": st.sampled_from(HEAD_DIMS),
            "dtype": st.sampled_from(COS_SIN_DTYPES),
        }
    )


def rope_cos_sin_build(params: dict, device: torch.device) -> Case:
    choice(params, "dtype", COS_SIN_DTYPES)
    positions = _positions(params, generator(params, device), device)
    labels = labels_for(params, S=params["s"], rotary_half=params["rotary_dim"] // 2)
    labels += [f"positions {params['positions']}", "non-contiguous"]
    if choice(params, "pos_step", POSITION_STEPS, 1) > 1:
        labels.append("positions strided along S")
    if params["start"] >= 4095:
        labels.append("long context position")
    return Case(params, (positions, params["rotary_dim"], params["base"]), labels=tuple(labels))


def apply_rope_params(limits: Limits) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries(
        {
            **_position_fields(limits),
            "heads": size(limits.heads, AWKWARD),
            "head_dim": st.sampled_from(HEAD_DIMS),
            "rotary": st.sampled_from(ROTARY),
            "head_offset": st.integers(0, 3),  # x starts this many heads into the fused QKV row
            "head_pad": st.sampled_from(HEAD_PADS),  # each head's row padded: head stride D + pad
            "tables": st.sampled_from(TABLES),
            **common(),
        }
    )


def rotary_dim_of(params: dict) -> int:
    d = params["head_dim"]
    rd = {"full": d, "half": d // 2, "quarter": d // 4}[choice(params, "rotary", ROTARY)]
    return max(2, rd - rd % 2)


def rotary_label(params: dict) -> str:
    """The share of head_dim that is rotated, as drawn: a small head rounds "half" or "quarter"
    up to 2 dims, which can be all of them (or half)."""
    d, rd = params["head_dim"], rotary_dim_of(params)
    return "rotary " + {d: "full", d / 2: "half", d / 4: "quarter"}.get(rd, "partial")


def apply_rope_build(params: dict, device: torch.device) -> Case:
    gen = generator(params, device)
    b, s, h, d, off = params["b"], params["s"], params["heads"], params["head_dim"], params["head_offset"]
    pad = choice(params, "head_pad", HEAD_PADS, 0)
    qkv = values((b, s, off + h + 2, d + pad), dtype_of(params), params["dist"], gen, device)
    x = qkv[:, :, off : off + h, :d]
    tables = choice(params, "tables", TABLES, "shared")
    cos, sin = rope_tables(_positions(params, gen, device), rotary_dim_of(params), params["base"], tables)
    labels = labels_for(params, S=s, H=h, D=d)
    labels += [rotary_label(params), f"cos/sin {tables}", "non-contiguous"]
    if pad:
        labels.append("heads padded")
    return Case(params, (x, cos, sin), labels=tuple(labels))


def _cos_sin_example(name: str, b: int, s: int, rotary_dim: int, start: int, **extra: object) -> dict:
    return {
        "name": name,
        "b": b,
        "s": s,
        "start": start,
        "positions": "consecutive",
        "pos_dtype": "int64",
        "base": 1000000.0,
        "rotary_dim": rotary_dim,
        "dtype": "float32",
        "seed": 0,
        **extra,
    }


def _rope_example(name: str, b: int, s: int, heads: int, head_dim: int, start: int, **extra: object) -> dict:
    return {
        "name": name,
        "b": b,
        "s": s,
        "start": start,
        "positions": "consecutive",
        "pos_dtype": "int64",
        "base": 1000000.0,
        "heads": heads,
        "head_dim": head_dim,
        "rotary": "full",
        "head_offset": 0,
        "dtype": "bfloat16",
        "dist": "normal",
        "seed": 0,
        **extra,
    }


ROPE_COS_SIN_EXAMPLES = (
    _cos_sin_example("typical: 2 x 5 positions, rotary 34", 2, 5, 34, 7, gpu=False),
    _cos_sin_example("article decode at position 32767", 1, 1, 128, 32767, gpu=False),
    _cos_sin_example("article prefill 2048", 1, 2048, 128, 0),
    _cos_sin_example("qwen2.5 head_dim 64, scattered", 4, 100, 64, 4095, positions="scattered", gpu=False),
)
APPLY_ROPE_EXAMPLES = (
    _rope_example(
        "typical: 2 x 3 tokens, 3 heads of 34, partial",
        2,
        3,
        3,
        34,
        5,
        rotary="half",
        head_offset=1,
        gpu=False,
    ),
    _rope_example("article q decode (8 heads x 128)", 1, 1, 8, 128, 4095, gpu=False),
    _rope_example("article k prefill 256 (2 kv heads) in fused QKV", 1, 256, 2, 128, 0, head_offset=8),
    _rope_example("qwen2.5 q prefill (14 heads x 64)", 1, 129, 14, 64, 0),
)
ROPE_COS_SIN_INVALID = (
    Invalid("odd rotary_dim", "rotary_dim", replace("rotary_dim", lambda r: r + 1)),
    Invalid("zero base", "base", replace("base", lambda _: 0.0)),
    Invalid("1-d positions", "positions", replace("positions", lambda p: p[0])),
)
COS_SIN_INVALID = (  # any op that takes a cos/sin table beside x[B, S, H, D]
    Invalid("cos of another batch", "cos", replace("cos", lambda c: c[:1].expand(3, *c.shape[1:]))),
    Invalid("sin shape differs from cos", "sin", replace("sin", lambda t: t[..., :-1])),
    Invalid(
        "rotary_dim larger than head_dim",
        "cos",
        lambda a: a.update(cos=a["cos"].repeat(1, 1, 40), sin=a["sin"].repeat(1, 1, 40)),
    ),
)
APPLY_ROPE_INVALID = (*COS_SIN_INVALID, Invalid("3-d x", "x", replace("x", lambda x: x[0])))
