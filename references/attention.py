"""Causal attention over the KV cache, written as the article's three steps (ops 6, 7, 8).

Each step is a public function a reader or a test can run on its own (the Triton kernel fuses
all three and keeps no intermediates, so the bisect drill-down compares their composition):

1. ``qk_score``: scores ``q . k * scale`` for every query, head and cache row.
2. ``causal_mask_softmax``: hide cache rows a query may not see, softmax over the rest.
3. ``pv_matmul``: the probability-weighted sum of the value rows.

Positions: batch row ``b`` holds ``seq_lens[b]`` valid cache rows; the ``S`` new queries are the
last ``S`` of them, so query ``i`` sits at position ``seq_lens[b] - S + i`` and sees cache rows
``0 ..`` its own position (causal, bottom-right aligned). Query head ``h`` reads kv head
``h // (Hq / Hkv)`` (grouped-query attention).

A query that sees no row at all cannot happen under the contract (``S <= seq_len``): there
is always the query's own row. If it does (a device ``seq_len`` below ``S``), the softmax
of an all-masked row is NaN here; the kernel writes zeros there. A ``seq_len`` past the
capacity ``L`` simply finds no rows beyond ``L``.
"""

from __future__ import annotations

import torch

from references.precision import acc, compute_dtype, out, ulp


def _expand_kv(x: torch.Tensor, q_heads: int) -> torch.Tensor:
    """``[B, L, Hkv, D]`` -> ``[B, L, Hq, D]``: head ``h`` gets kv head ``h // (Hq / Hkv)``."""
    return x.repeat_interleave(q_heads // x.shape[2], dim=2)


def qk_score(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Article op 6: ``scores[b, h, i, j] = q[b, i, h] . k[b, j, h // group] * scale``, ``[B, Hq, S, L]``.

    In the compute dtype (fp32 for the reference), every cache row, masked or not.
    """
    keys = _expand_kv(acc(k), q.shape[2])
    return torch.einsum("bihd,bjhd->bhij", acc(q), keys) * scale


def visible(seq_lens: torch.Tensor, new_tokens: int, capacity: int) -> torch.Tensor:
    """``[B, 1, S, L]`` bool: may query ``i`` of batch row ``b`` see cache row ``j``?

    Row ``j`` is visible when ``j <= seq_lens[b] - S + i`` (its own position or earlier), which
    also keeps ``j < seq_lens[b]``.
    """
    rows = torch.arange(capacity, device=seq_lens.device)
    positions = seq_lens.long()[:, None] - new_tokens + torch.arange(new_tokens, device=seq_lens.device)
    return (rows[None, None, :] <= positions[:, :, None])[:, None]


def causal_mask_softmax(scores: torch.Tensor, seq_lens: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Article op 7: masked rows get ``-inf``, then softmax over the cache rows (compute dtype)."""
    mask = visible(seq_lens, new_tokens, scores.shape[-1])
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)


def pv_matmul(probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Article op 8: ``out[b, i, h] = sum_j probs[b, h, i, j] * v[b, j, h // group]``, ``[B, S, Hq, D]``."""
    values = _expand_kv(acc(v), probs.shape[1])
    return torch.einsum("bhij,bjhd->bihd", probs, values)


# Scores a reference computes at once. The model's runs (decode, the benchmark's prefill, the
# torch.compile peer) stay under it and compute whole; the largest drawn GPU cases
# ([4, 32, 2100, 2100]) with their masked, softmaxed and fp64 copies took tens of GB a process,
# and the thorough profile's 16 workers ran the H200 out of memory (2026-12-02).
SCORES_AT_ONCE = 1 << 24


def _chunks(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor):
    """``(rows, heads, q, k, v, seq_lens)``: the whole problem when its scores fit
    ``SCORES_AT_ONCE``, else one batch row and query head at a time (``k`` and ``v`` its kv head)."""
    batch, seq, q_heads, _ = q.shape
    if batch * q_heads * seq * k_cache.shape[1] <= SCORES_AT_ONCE:
        yield slice(None), slice(None), q, k_cache, v_cache, seq_lens
        return
    group = q_heads // k_cache.shape[2]
    for b in range(batch):
        for h in range(q_heads):
            rows, heads, kv = slice(b, b + 1), slice(h, h + 1), slice(h // group, h // group + 1)
            yield rows, heads, q[rows, :, heads], k_cache[rows, :, kv], v_cache[rows, :, kv], seq_lens[rows]


def attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``softmax(q k^T * scale, causal over the valid cache rows) v``, ``[B, S, Hq, D]`` in q's dtype
    (the three steps over ``_chunks``)."""
    result = torch.empty(q.shape, dtype=compute_dtype(), device=q.device)
    for rows, heads, q_c, k_c, v_c, lens in _chunks(q, k_cache, v_cache, seq_lens):
        probs = causal_mask_softmax(qk_score(q_c, k_c, scale), lens, q.shape[1])
        result[rows, :, heads] = pv_matmul(probs, _valid_rows(v_c, lens))
    return out(result, q.dtype)


def _valid_rows(v: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """``v`` with its rows at or past ``seq_lens`` zeroed: no query sees them, but a zero
    probability times a NaN or inf value there would still be NaN."""
    rows = torch.arange(v.shape[1], device=v.device)
    return v.where(rows[None, :, None, None] < seq_lens.long()[:, None, None, None], 0)


def seq_lens_below_s(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor, scale: float
) -> str | None:
    """The contract's ``S <= seq_len``, which the kernel cannot check (the lengths stay on the
    device inside a CUDA Graph): why a given call breaks it, or None."""
    short = (seq_lens < q.shape[1]).nonzero().flatten().tolist()
    if not short:
        return None
    row = short[0]
    return (
        f"seq_lens: row {row} is {int(seq_lens[row])}, fewer than its {q.shape[1]} new tokens; "
        "expected S <= seq_len (the queries are the last S of the valid rows)"
    )


def score_rounding_floor(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor, scale: float
) -> float:
    """How far the output may move when every visible score is off by one fp32 ulp of its terms.

    Any fp32 computation of a score ``scale * sum_d q_d k_d`` (another summation order, the
    scale folded into an exp2 argument) can be off by about an ulp of ``|scale| sum_d |q_d k_d|``,
    however lucky plain torch's rounding was; a running sum of same-signed terms by a few
    (``floor_ulps`` in tolerances.toml says how many a backend gets). Since ``d out / d score_j
    = p_j (v_j - out)``, an error of at most ``e`` on every score moves the output by at most
    ``2 e max|v|``: that is the floor, over the visible rows. Large scores (hundreds) make it
    the dominant fp32 error.
    """
    if q.numel() == 0 or k_cache.numel() == 0:  # no output, or no row to see: nothing can move
        return 0.0
    largest_terms, largest_values = [], []
    for _, _, q_c, k_c, v_c, lens in _chunks(q, k_cache, v_cache, seq_lens):
        mask = visible(lens, q.shape[1], k_cache.shape[1])  # [B, 1, S, L] of the chunk
        terms = qk_score(q_c.double().abs(), k_c.double().abs(), abs(scale)).masked_fill(~mask, 0.0)
        values = _expand_kv(v_c.double().abs(), q_c.shape[2]).amax(dim=-1)  # [B, L, Hq] of the chunk
        values = values.transpose(1, 2)[:, :, None, :]
        largest_terms.append(terms.amax())
        largest_values.append(values.masked_fill(~mask, 0.0).amax())
    largest_v = torch.stack(largest_values).amax().item()
    return 2.0 * ulp(torch.float32, torch.stack(largest_terms).amax().item()) * largest_v
