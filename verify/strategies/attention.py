"""Cases for ``attention`` and its two kernel paths: GQA groups 1 to 8, decode and chunked
prefill (``seq_len > S``), ragged ``seq_lens`` across the batch, scores large enough to overflow
a softmax without max subtraction, all very negative, or all tied, q as a head slice of the fused
QKV output, and cache rows past ``seq_len`` full of large random values (reading them shows)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from hypothesis import strategies as st

from ops.attention import DECODE_MAX_ROWS, HEAD_DIMS, uses_decode_path
from verify.cases import AWKWARD, Case, choice, dtype_name, dtype_of, generator, seed, size, values
from verify.limits import Limits
from verify.strategies.common import Invalid, labels_for, replace

GROUPS = (1, 2, 4, 7, 8)  # q heads per kv head: MHA, the article (4), Qwen2.5-0.5B (7), ...
SCORES = ("normal", "large", "very_negative", "ties")
LENS = ("same", "ragged", "past_capacity")
# the softmax scale given to the op: the models' 1/sqrt(D), none, and one that is neither (a kernel
# that ignores the argument and uses 1/sqrt(D) passes the first alone)
SCALES = {"1/sqrt(D)": lambda d: 1.0 / math.sqrt(d), "1": lambda d: 1.0, "0.3": lambda d: 0.3}
GARBAGE = 100.0  # magnitude of cache rows past seq_len: a kernel that reads them is far off


def _budget(limits: Limits) -> int:
    """Most score elements ``B * Hq * S * L`` per case: the fp64 oracle holds several such
    tensors, and the interpreter's time grows with them (6400 there, 17.6M on a GPU)."""
    return 4 * limits.seq**2


@st.composite
def _attention_params(draw: st.DrawFn, limits: Limits, decode_only: bool) -> dict:
    # Every size has fixed bounds and is clamped to the budget afterwards (as rope_kv_store's):
    # bounds that depend on earlier draws made Hypothesis shrink toward the larger shapes that
    # collapse them (group 7 stopped at S=22, not 17).
    budget = _budget(limits)
    group = draw(st.sampled_from(GROUPS))
    s = draw(size(limits.seq, AWKWARD))
    kv_heads = draw(st.integers(1, limits.heads))
    b = draw(size(limits.batch, AWKWARD))
    lens = draw(st.sampled_from(LENS))
    past = draw(st.one_of(st.just(0), size(limits.seq, AWKWARD, low=0)))
    s = min(s, math.isqrt(budget // group), DECODE_MAX_ROWS // group if decode_only else limits.seq)
    kv_heads = max(1, min(kv_heads, limits.heads // group, budget // (group * s * s)))
    b = max(1, min(b, budget // (group * kv_heads * s * s)))
    room = budget // (b * group * kv_heads * s) - s  # cache rows before the new ones the budget allows
    past = max(0, min(past, room))
    if lens == "ragged" and b > 1 and room >= 1:  # ragged rows differ only below a prefix
        past = max(past, 1)
    return {
        "b": b,
        "kv_heads": kv_heads,
        "group": group,
        "head_dim": draw(st.sampled_from(HEAD_DIMS)),
        "s": s,
        "past": past,  # cache rows before the new tokens (the longest batch row)
        "slack": draw(st.one_of(st.just(0), st.integers(1, 17))),  # capacity past the longest row
        "lens": lens,
        "scores": draw(st.sampled_from(SCORES)),
        "scale": draw(st.sampled_from(tuple(SCALES))),
        "q_offset": draw(st.integers(0, 3)),  # q starts this many heads into the fused QKV row
        "dtype": draw(dtype_name()),
        "seed": draw(seed()),
    }


def attention_params(limits: Limits) -> st.SearchStrategy[dict]:
    return _attention_params(limits, decode_only=False)


def attention_decode_params(limits: Limits) -> st.SearchStrategy[dict]:
    """Only shapes the decode path takes: ``S * group <= DECODE_MAX_ROWS``."""
    return _attention_params(limits, decode_only=True)


def capacity(params: dict) -> int:
    return params["s"] + params["past"] + params["slack"]


def _seq_lens(params: dict, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    b, s, longest, cap = params["b"], params["s"], params["s"] + params["past"], capacity(params)
    kind = choice(params, "lens", LENS)
    if kind == "ragged":  # one row the longest, another S (so they differ), in drawn places (a
        # kernel reading one row's length for all passes whenever that row is the longest)
        lens = torch.randint(s, longest + 1, (b,), generator=gen, device=device)
        rows = torch.randperm(b, generator=gen, device=device)
        lens[rows[:1]] = longest  # no row at all: B = 0
        if b > 1:
            lens[rows[1]] = s
    elif kind == "past_capacity":  # a device value past L: rows beyond L do not exist. Just past
        # L, or up to 600 rows past (beyond the longest decode tile, 512 rows at head_dim 16 on the
        # GPU), so that the tile holding row L-1 looks full to a kernel that does not clamp to L
        far = bool(torch.randint(0, 2, (), generator=gen, device=device))
        lens = cap + torch.randint(1, 600 if far else 5, (b,), generator=gen, device=device)
    else:
        lens = torch.full((b,), longest, device=device)
    return lens.to(torch.int32)


def _qk(params: dict, gen: torch.Generator, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``q [B, S, Hq, D]`` and ``k [B, L, Hkv, D]`` giving scores of the requested kind."""
    b, s, hkv, g, d = params["b"], params["s"], params["kv_heads"], params["group"], params["head_dim"]
    cap = capacity(params)
    q = torch.randn((b, s, hkv * g, d), generator=gen, device=device)
    k = torch.randn((b, cap, hkv, d), generator=gen, device=device)
    kind = choice(params, "scores", SCORES)
    if kind == "large":  # scaled scores ~ +-100s: exp overflows fp32 without the max subtracted
        q, k = 8 * q, 8 * k
    elif kind == "very_negative":  # q along u, every key along -u: all scores ~ -64 sqrt(D)
        u = torch.randn((b, 1, hkv, 1, d), generator=gen, device=device)
        u = u / u.norm(dim=-1, keepdim=True) * math.sqrt(d)
        q = (q.view(b, s, hkv, g, d) + 8 * u).view(b, s, hkv * g, d)
        k = k - 8 * u[:, :, :, 0]
    elif kind == "ties":  # every cache row the same key: equal scores, a uniform softmax
        k = k[:, :1].expand_as(k).contiguous()
    return q, k


def attention_build(params: dict, device: torch.device) -> Case:
    gen = generator(params, device)
    b, s, hkv, g, d = params["b"], params["s"], params["kv_heads"], params["group"], params["head_dim"]
    hq, cap, off, dtype = hkv * g, capacity(params), params["q_offset"], dtype_of(params)
    seq_lens = _seq_lens(params, gen, device)
    q, k = _qk(params, gen, device)
    v = torch.randn((b, cap, hkv, d), generator=gen, device=device)
    # Rows past each seq_len hold large random values, as a reused cache would.
    stale = torch.arange(cap, device=device)[None, :] >= seq_lens[:, None].long()
    k[stale] = GARBAGE * torch.randn((int(stale.sum()), hkv, d), generator=gen, device=device)
    v[stale] = GARBAGE * torch.randn((int(stale.sum()), hkv, d), generator=gen, device=device)
    qkv = values((b, s, off + hq + 2 * hkv, d), dtype, "normal", gen, device)
    qkv[:, :, off : off + hq] = q.to(dtype)
    q_view = qkv[:, :, off : off + hq]
    scale = SCALES[choice(params, "scale", tuple(SCALES), "1/sqrt(D)")](d)
    args = (q_view, k.to(dtype), v.to(dtype), seq_lens, scale)
    return Case(params, args, labels=_labels(params, seq_lens))


def _labels(params: dict, seq_lens: torch.Tensor) -> tuple[str, ...]:
    s, past, g = params["s"], params["past"], params["group"]
    out = labels_for(params, S=s, L=capacity(params), B=params["b"])
    out += [f"GQA group {g}", f"head_dim {params['head_dim']}", f"scores {params['scores']}"]
    out.append(f"scale {params.get('scale', '1/sqrt(D)')}")
    out.append("decode path" if uses_decode_path(s, g) else "prefill path")
    if past:
        out.append("decode (S = 1) after a prefix" if s == 1 else "chunked prefill (seq_len > S)")
    elif s == 1 and params["lens"] != "past_capacity":
        out.append("seq_len = 1")
    if params["lens"] == "past_capacity":
        out.append("seq_len past capacity")
    if seq_lens.numel() and bool((seq_lens != seq_lens[0]).any()):  # the drawn lengths, not the kind
        out.append("seq_lens ragged")
        if bool(seq_lens[0] < seq_lens.max()):
            out.append("longest row not the first")
    if bool((seq_lens < capacity(params)).any()):  # garbage rows a kernel must not read
        out.append("stale cache rows past seq_len")
    out.append("non-contiguous")
    return tuple(out)


def _example(
    name: str,
    b: int,
    kv_heads: int,
    group: int,
    head_dim: int,
    s: int,
    past: int,
    slack: int,
    **extra: object,
) -> dict:
    return {
        "name": name,
        "b": b,
        "kv_heads": kv_heads,
        "group": group,
        "head_dim": head_dim,
        "s": s,
        "past": past,
        "slack": slack,
        "lens": "same",
        "scores": "normal",
        "scale": "1/sqrt(D)",
        "q_offset": 0,
        "dtype": "bfloat16",
        "seed": 0,
        **extra,
    }


ATTENTION_EXAMPLES = (
    _example("typical: batch 2, 4/2 heads, 5 new after 11, ragged", 2, 2, 2, 32, 5, 11, 3,
             lens="ragged", q_offset=1, gpu=False),
    _example("prefill S=129 (block tail), head_dim 16", 1, 1, 1, 16, 129, 0, 0, gpu=False),
    _example("decode, 7-way GQA, head_dim 64, ragged", 2, 2, 7, 64, 1, 90, 6, lens="ragged", gpu=False),
    _example("decode, seq_lens past a capacity one short of a tile", 2, 1, 1, 16, 1, 14, 0,
             lens="past_capacity", gpu=False),
    _example("chunked prefill, large scores", 1, 1, 4, 32, 20, 10, 2, scores="large", gpu=False),
    _example("prefill, tied scores, 2-way GQA", 1, 2, 2, 16, 17, 0, 0, scores="ties", gpu=False),
    _example("2 new tokens after 30, 4-way GQA (decode kernels)", 1, 1, 4, 32, 2, 30, 3, gpu=False),
    _example("decode, a short ragged batch in a long cache (splits spread by length)", 2, 1, 4, 16, 1, 40,
             200, lens="ragged", gpu=False),
    _example("article prefill S=256", 1, 2, 4, 128, 256, 0, 0, q_offset=2),
    _example("article prefill S=1024", 1, 2, 4, 128, 1024, 0, 0, q_offset=2),
    _example("article prefill S=2048", 1, 2, 4, 128, 2048, 0, 0, q_offset=2),
    _example("article decode, cache 4096", 1, 2, 4, 128, 1, 4000, 95, q_offset=2),
    _example("article decode, cache 32768, batch 1", 1, 2, 4, 128, 1, 32700, 67, q_offset=2),
    _example("article decode, cache 32768 holding 1000 rows", 1, 2, 4, 128, 1, 999, 31768, q_offset=2),
    _example("article chunked prefill 256 after 768", 1, 2, 4, 128, 256, 768, 0, q_offset=2),
    _example("article 4 speculative tokens, batch 4 ragged", 4, 2, 4, 128, 4, 2000, 44, lens="ragged"),
    _example("qwen3-0.6b prefill 16/8, batch 2 ragged", 2, 8, 2, 128, 300, 200, 12, lens="ragged"),
    _example("qwen3-0.6b decode 16/8, batch 4 ragged", 4, 8, 2, 128, 1, 2047, 1, lens="ragged"),
    _example("qwen3-0.6b decode 16/8, 40960-row cache holding 3000, batch 2 ragged", 2, 8, 2, 128, 1,
             2999, 37960, lens="ragged"),
    _example("qwen2.5-0.5b prefill 14/2, head_dim 64", 1, 2, 7, 64, 333, 0, 5),
    _example("qwen2.5-0.5b decode 14/2, batch 3 ragged", 3, 2, 7, 64, 1, 3000, 17, lens="ragged"),
    _example("head_dim 256 prefill, large scores", 1, 1, 8, 256, 300, 100, 0, scores="large"),
    _example("decode, all scores very negative", 2, 2, 4, 128, 1, 1500, 3, scores="very_negative"),
    _example("prefill S=127 (one short of the block), 8-way GQA", 1, 2, 8, 128, 127, 0, 1),
    _example("first token (seq_len 1) of a batch of 3, 7-way GQA", 3, 2, 7, 64, 1, 0, 40, gpu=False),
    # on the interpreter decode shares a cache over 4 programs and combines 2 splits a chunk, so a
    # batch-1 cache of over 2 tiles takes the busy-only combine, with splits of several tiles
    _example("decode, batch 1, spread splits and the busy-only combine, head_dim 128", 1, 1, 4, 128, 1,
             150, 50, gpu=False),
    _example("decode, the busy-only combine, large scores", 1, 1, 4, 64, 1, 45, 10, scores="large",
             gpu=False),
    _example("chunked prefill scaled by 1, ragged", 3, 1, 2, 32, 9, 6, 2, lens="ragged", scale="1",
             gpu=False),
)  # fmt: skip
ATTENTION_DECODE_EXAMPLES = tuple(e for e in ATTENTION_EXAMPLES if e["s"] * e["group"] <= DECODE_MAX_ROWS)


def _too_many_tokens(args: dict) -> None:
    """``S = L + 1`` new tokens: more than the cache holds."""
    q, cap = args["q"], args["k_cache"].shape[1]
    args["q"] = q.new_zeros((q.shape[0], cap + 1, *q.shape[2:]))


def _caches(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict], None]:
    """An ``Invalid.mutate`` that edits both caches alike."""

    def mutate(args: dict) -> None:
        args["k_cache"], args["v_cache"] = fn(args["k_cache"]), fn(args["v_cache"])

    return mutate


ATTENTION_INVALID = (
    Invalid("q heads not a multiple of kv heads", "q", replace("q", lambda q: q[:, :, :-1])),
    Invalid("caches with 3 kv heads for 4 q heads", "q", _caches(lambda c: c[:, :, :1].repeat(1, 1, 3, 1))),
    Invalid("head_dim of q differs from the caches", "q", replace("q", lambda q: q[..., :-1])),
    Invalid("more new tokens than the cache holds", "q", _too_many_tokens),
    Invalid("q of rank 3", "q", replace("q", lambda q: q[:, 0])),
    Invalid(
        "transposed q (last-dim stride != 1)",
        "q",
        replace("q", lambda q: q.new_empty(q.shape[::-1]).permute(3, 2, 1, 0)),
    ),
    Invalid("v_cache of another shape", "v_cache", replace("v_cache", lambda c: c[:, :-1].contiguous())),
    Invalid("k_cache dtype differs from q", "k_cache", replace("k_cache", lambda c: c.float()), TypeError),
    Invalid(
        "non-contiguous k_cache",
        "k_cache",
        replace("k_cache", lambda c: c.transpose(1, 2).contiguous().transpose(1, 2)),
    ),
    Invalid("seq_lens as int64", "seq_lens", replace("seq_lens", lambda n: n.long()), TypeError),
    Invalid("seq_lens of the wrong length", "seq_lens", replace("seq_lens", lambda n: n[:-1])),
    Invalid("scale of zero", "scale", replace("scale", lambda s: 0.0)),
)
