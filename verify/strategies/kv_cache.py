"""Cases for ``kv_cache_store``: caches pre-filled with random data (stray writes show), k and v
as head slices of the fused QKV output (or one of them contiguous), per-row start positions, rows
past the capacity."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from verify.cases import AWKWARD, Case, choice, dtype_of, generator, size, values
from verify.limits import Limits
from verify.strategies.common import Invalid, common, labels_for, replace

# where each batch row's new tokens start: anywhere they fit, row 0, the cache's last rows, or
# partly past the capacity (those rows must be dropped)
STARTS = ("random", "zero", "end", "overflow", "underflow")
# k and v as head slices of one QKV row, or one of them contiguous (the unfused model hands over
# a rotated, contiguous k beside a slice v): their strides then differ
KV_LAYOUTS = ("qkv_slices", "k_contiguous", "v_contiguous")


def kv_cache_store_params(limits: Limits) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries(
        {
            "b": size(limits.batch, AWKWARD),
            "capacity": size(limits.seq, AWKWARD),
            "s": size(limits.seq, AWKWARD),
            "heads": size(limits.heads, AWKWARD),
            "head_dim": st.sampled_from([2, 16, 34, 64, 128, 256]),
            "q_heads": st.integers(0, 4),  # query heads before k in the fused QKV row
            "starts": st.sampled_from(STARTS),
            "layout": st.sampled_from(KV_LAYOUTS),
            **common(dists=("normal", "large")),
        }
    ).filter(lambda p: p["s"] <= p["capacity"])


def _starts(params: dict, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    b, cap, s = params["b"], params["capacity"], params["s"]
    starts = choice(params, "starts", STARTS)
    if starts == "zero":
        start = torch.zeros(b, dtype=torch.int64, device=device)
    elif starts == "end":  # the last rows of the cache
        start = torch.full((b,), cap - s, device=device)
    elif starts == "overflow":  # at least the last row falls past the capacity (all of them from
        # a start at or past it, as a decode into a full cache): those rows must be dropped
        start = torch.randint(cap - s + 1, cap + 3, (b,), generator=gen, device=device)
    elif starts == "underflow":  # a negative start: the rows before row 0 must be dropped
        start = torch.randint(-s, 0, (b,), generator=gen, device=device)
    else:
        start = torch.randint(0, cap - s + 1, (b,), generator=gen, device=device)
    return start.to(torch.int32)


def kv_cache_store_build(params: dict, device: torch.device) -> Case:
    gen = generator(params, device)
    b, cap, s, h, d = params["b"], params["capacity"], params["s"], params["heads"], params["head_dim"]
    dtype = dtype_of(params)
    k_cache = values((b, cap, h, d), dtype, "normal", gen, device)
    v_cache = values((b, cap, h, d), dtype, "normal", gen, device)
    qh = params["q_heads"]
    qkv = values((b, s, qh + 2 * h, d), dtype, params["dist"], gen, device)
    k, v = qkv[:, :, qh : qh + h], qkv[:, :, qh + h :]
    layout = choice(params, "layout", KV_LAYOUTS, "qkv_slices")
    if layout == "k_contiguous":
        k = k.contiguous()
    elif layout == "v_contiguous":
        v = v.contiguous()
    labels = labels_for(params, S=s, L=cap, H=h)
    labels += [f"start {params['starts']}", f"k/v {layout}", "non-contiguous"]
    return Case(params, (k_cache, v_cache, k, v, _starts(params, gen, device)), labels=tuple(labels))


def _example(
    name: str, b: int, cap: int, s: int, heads: int, head_dim: int, starts: str, **extra: object
) -> dict:
    return {
        "name": name,
        "b": b,
        "capacity": cap,
        "s": s,
        "heads": heads,
        "head_dim": head_dim,
        "q_heads": 8,
        "starts": starts,
        "dtype": "bfloat16",
        "dist": "normal",
        "seed": 0,
        **extra,
    }


KV_CACHE_STORE_EXAMPLES = (
    _example("typical: batch 2, 3 new rows into capacity 9", 2, 9, 3, 2, 34, "random", q_heads=2, gpu=False),
    _example("article decode into a 4096 cache, last row", 1, 4096, 1, 2, 128, "end"),
    _example("article prefill 256 rows", 1, 4096, 256, 2, 128, "zero"),
    _example("qwen3 batch 4, rows past capacity dropped", 4, 2048, 17, 8, 128, "overflow", q_heads=16),
)
KV_CACHE_STORE_INVALID = (
    Invalid("v_cache of another shape", "v_cache", replace("v_cache", lambda c: c[:, :-1])),
    Invalid("k with another head count", "k", replace("k", lambda k: k[:, :, :-1])),
    Invalid("start_pos as int64", "start_pos", replace("start_pos", lambda p: p.long()), TypeError),
    Invalid("start_pos of the wrong length", "start_pos", replace("start_pos", lambda p: p[:-1])),
    Invalid(
        "non-contiguous k_cache",
        "k_cache",
        replace("k_cache", lambda c: c.transpose(1, 2).contiguous().transpose(1, 2)),
    ),
)
