"""Attention checks the registry-driven tests cannot express: the two kernel paths agree and
``path="auto"`` picks the right one, the drill-down steps compose to the reference, the decode
path runs on preallocated buffers only, splits past ``seq_len`` are neutral, device lengths
outside the contract are safe, and (GPU) one captured decode graph replays at every length."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import registry
from ops import attention as ops_attention
from ops import backend
from references import attention as ref
from tests import buggy_kernels
from tests.subprocess_env import user_env
from verify.cases import Case
from verify.compare import check, clone_args, ulp

DEVICE = backend.device()
ROOT = Path(__file__).resolve().parent.parent
TYPICAL = registry.get("attention").typical


def _case(**overrides: object) -> Case:
    return registry.get("attention").build({**TYPICAL, **overrides}, DEVICE)


# Shapes on both sides of the auto switch, with a prefix, ragged lengths and stale rows.
SHAPES = [
    {},
    {"s": 1, "past": 40, "slack": 9, "group": 4, "kv_heads": 2, "head_dim": 64},
    {"s": 3, "past": 20, "b": 3, "group": 7, "kv_heads": 1, "lens": "ragged", "scores": "large"},
    {"s": 16, "past": 5, "group": 4, "kv_heads": 1, "head_dim": 128, "scores": "very_negative"},
    {"s": 17, "past": 0, "group": 4, "kv_heads": 1, "head_dim": 16, "scores": "ties"},
    {"s": 33, "past": 0, "group": 1, "kv_heads": 2, "b": 1, "head_dim": 32, "dtype": "float32"},
]


@pytest.mark.parametrize(
    "overrides", SHAPES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "typical"
)
def test_prefill_and_decode_paths_agree(overrides: dict) -> None:
    case = _case(**overrides)
    q, k_cache = case.args[:2]
    group = q.shape[2] // k_cache.shape[2]
    outputs = {}
    for name in ("attention_prefill", "attention_decode"):
        if name == "attention_decode" and q.shape[1] * group > ops_attention.DECODE_MAX_ROWS:
            continue
        result = check(registry.get(name), case)
        assert result.passed, result.describe()
        outputs[name] = registry.get(name).impl(*clone_args(case)[0])
    auto = ops_attention.attention(*clone_args(case)[0])
    expected = (
        "attention_decode" if ops_attention.uses_decode_path(q.shape[1], group) else "attention_prefill"
    )
    assert torch.equal(auto, outputs[expected]), f"path='auto' did not run the {expected} kernel"
    if len(outputs) == 2:  # both within one output ulp of the fp64 oracle, so within two of each other
        a, b = (o.double() for o in outputs.values())
        assert (a - b).abs().max() <= 2 * ulp(q.dtype, float(a.abs().max()))


@pytest.mark.parametrize("empty", [{"s": 0}, {"b": 0}, {"group": 0}])
def test_an_empty_call_is_checked_not_crashed(empty: dict) -> None:
    """No queries (S, B or Hq of 0) is a valid call with an empty answer; the tolerance's score
    floor, a max over the visible scores, has nothing to take a max of and is zero."""
    case = _case(**{"past": 0, **empty})
    assert ref.score_rounding_floor(*case.args) == 0.0
    result = check(registry.get("attention"), case)
    assert result.passed, result.describe()


def test_seq_len_below_s_is_named_as_outside_the_contract() -> None:
    case = _case(s=3, past=0, b=2, lens="same")
    q, k_cache, v_cache, seq_lens, scale = case.args
    assert ref.seq_lens_below_s(*case.args) is None
    short = seq_lens.clone()
    short[1] = 2
    assert ref.seq_lens_below_s(q, k_cache, v_cache, short, scale).startswith(
        "seq_lens: row 1 is 2, fewer than its 3 new tokens"
    )


def test_auto_switch_is_at_decode_max_rows() -> None:
    assert ops_attention.uses_decode_path(1, 8) and ops_attention.uses_decode_path(16, 4)
    assert not ops_attention.uses_decode_path(17, 4) and not ops_attention.uses_decode_path(65, 1)


def test_drill_down_steps_compose_to_the_reference() -> None:
    q, k_cache, v_cache, seq_lens, scale = _case().args
    batch, seq, q_heads, _ = q.shape
    capacity = k_cache.shape[1]
    scores = ref.qk_score(q, k_cache, scale)
    assert scores.shape == (batch, q_heads, seq, capacity) and scores.dtype == torch.float32
    probs = ref.causal_mask_softmax(scores, seq_lens, seq)
    torch.testing.assert_close(probs.sum(-1), torch.ones(batch, q_heads, seq, device=DEVICE))
    for b in range(batch):
        for i in range(seq):  # query i sees rows 0 .. seq_len - S + i and nothing after
            pos = int(seq_lens[b]) - seq + i
            assert (probs[b, :, i, pos + 1 :] == 0).all() and (probs[b, :, i, : pos + 1] > 0).all()
    combined = ref.pv_matmul(probs, v_cache)
    assert combined.shape == q.shape and combined.dtype == torch.float32
    assert torch.equal(combined.to(q.dtype), ref.attention(q, k_cache, v_cache, seq_lens, scale))


@pytest.mark.parametrize("path", ["prefill", "decode"])
def test_non_finite_rows_past_seq_len_reach_no_output(path: str) -> None:
    """No query sees a cache row at or past its batch row's ``seq_len``: NaN and inf there leave
    the reference finite (a zero probability times NaN would not) and the kernels with it."""
    gen = torch.Generator().manual_seed(3)
    seq = 1 if path == "decode" else 3
    q = torch.randn(2, seq, 4, 16, generator=gen).to(DEVICE, torch.bfloat16)
    k_cache, v_cache = (torch.randn(2, 24, 2, 16, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(2))
    seq_lens = torch.tensor([5, 20], dtype=torch.int32, device=DEVICE)
    k_cache[0, 5:], v_cache[0, 5:] = float("inf"), float("nan")
    v_cache[1, 20:] = float("-inf")
    expected = ref.attention(q, k_cache, v_cache, seq_lens, 0.25)
    assert torch.isfinite(expected).all()
    got = ops_attention.attention(q, k_cache, v_cache, seq_lens, 0.25, path=path)
    torch.testing.assert_close(got, expected, rtol=0.02, atol=0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_taken_a_head_at_a_time_computes_what_it_computes_whole(monkeypatch, dtype) -> None:
    """Past ``SCORES_AT_ONCE`` scores (only the GPU's largest drawn cases) the reference and its
    rounding floor work one batch row and query head at a time: the same numbers as whole."""
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(2, 5, 6, 32, generator=gen).to(dtype)
    k_cache, v_cache = (torch.randn(2, 40, 3, 32, generator=gen).to(dtype) for _ in range(2))
    seq_lens = torch.tensor([40, 9], dtype=torch.int32)
    whole = ref.attention(q, k_cache, v_cache, seq_lens, 0.3)
    floor = ref.score_rounding_floor(q, k_cache, v_cache, seq_lens, 0.3)
    monkeypatch.setattr(ref, "SCORES_AT_ONCE", 1)
    torch.testing.assert_close(ref.attention(q, k_cache, v_cache, seq_lens, 0.3), whole, rtol=1e-6, atol=1e-6)
    assert ref.score_rounding_floor(q, k_cache, v_cache, seq_lens, 0.3) == floor


def test_qk_score_reads_kv_head_h_over_group() -> None:
    q, k_cache, _, _, scale = _case().args
    group = q.shape[2] // k_cache.shape[2]
    scores = ref.qk_score(q, k_cache, scale)
    for h in range(q.shape[2]):
        direct = torch.einsum("bid,bjd->bij", q[:, :, h].float(), k_cache[:, :, h // group].float()) * scale
        torch.testing.assert_close(scores[:, h], direct)


class _NoAllocTorch:
    """Stands in for ``torch`` in the wrapper modules: any allocation raises."""

    def __getattr__(self, name: str) -> object:
        if name in ("empty", "zeros", "full", "ones", "empty_like", "zeros_like", "full_like"):
            raise AssertionError(f"torch.{name} called with preallocated buffers")
        return getattr(torch, name)


def test_decode_runs_on_preallocated_buffers_only(monkeypatch: pytest.MonkeyPatch) -> None:
    past = 60 if DEVICE.type == "cpu" else 2000  # GPU tiles hold 64+ rows: several splits need a long cache
    case = _case(s=1, past=past, slack=0, lens="ragged", b=2, kv_heads=1)
    q, k_cache, v_cache, seq_lens, scale = case.args
    seq_lens.copy_(torch.tensor([past + 1, 3], dtype=torch.int32))  # row 1: most splits lie past seq_len
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=DEVICE)
    scratch = ops_attention.decode_scratch(q, k_cache)
    splits = scratch.max.shape[-1]
    assert splits > 1, "the case must span several splits"
    for t in scratch:
        t.fill_(float("nan"))
    monkeypatch.setattr(ops_attention, "torch", _NoAllocTorch())
    monkeypatch.setattr(ops_attention.validate, "torch", _NoAllocTorch())
    got = ops_attention.attention_decode(q, k_cache, v_cache, seq_lens, scale, out=out, scratch=scratch)
    monkeypatch.undo()
    ops_attention.attention_decode(q, k_cache, v_cache, seq_lens, scale, out=out)  # caches a scratch
    monkeypatch.setattr(ops_attention, "torch", _NoAllocTorch())
    monkeypatch.setattr(ops_attention.validate, "torch", _NoAllocTorch())
    ops_attention.attention_decode(q, k_cache, v_cache, seq_lens, scale, out=out)  # and reuses it
    monkeypatch.undo()
    assert got is out
    assert not any(t.isnan().any() for t in scratch), "a partial was left unwritten"
    empty = torch.arange(splits, device=DEVICE) > 0  # row 1's 3 rows fill part of one tile: split 0
    assert (scratch.max[1][..., empty] == float("-inf")).all()
    assert (scratch.sum[1][..., empty] == 0).all() and (scratch.acc[1][..., empty, :] == 0).all()
    result = check(registry.get("attention"), case, lambda *args: out.clone())
    assert result.passed, result.describe()


@pytest.mark.parametrize("programs,splits,tiles", [(28, 7, 1), (16, 4, 2)])
@pytest.mark.parametrize("scores", ["normal", "large", "very_negative"])
def test_combine_rescales_across_chunks_of_splits(
    monkeypatch: pytest.MonkeyPatch, scores: str, programs: int, splits: int, tiles: int
) -> None:
    """The combine kernel's running max over several chunks of splits, the last one partial, and
    rows whose later splits lie past seq_len (neutral partials, not read); with splits of two
    tiles each, a shorter row's tiles spread over the splits."""
    config = ops_attention.DecodeConfig(
        block_n=16, num_warps=4, num_stages=1, target_programs=programs, combine_chunk=2
    )  # the interpreter's chunk, on the GPU too
    monkeypatch.setattr(ops_attention, "decode_config", lambda head_dim, dtype, capacity: config)
    case = _case(s=1, past=100, slack=0, b=2, kv_heads=2, lens="ragged", scores=scores)
    k_cache = case.args[1]
    assert ops_attention.decode_splits(2, 2, k_cache.shape[1], config) == (splits, tiles * 16)
    result = check(registry.get("attention_decode"), case)
    assert result.passed, result.describe()


def test_unspecialized_sizes_are_kernel_parameters() -> None:
    """``do_not_specialize`` ignores a name the kernel does not take: a typo would silently bring
    back a compile per size."""
    for kernel, names in (
        (ops_attention._prefill_kernel, ops_attention.SIZES),
        (ops_attention._decode_split_kernel, (*ops_attention.SIZES, "SPLITS", "SPLIT_SIZE")),
        (ops_attention._decode_combine_kernel, ("SPLITS",)),
        (ops_attention._decode_combine_busy_kernel, ("SPLITS", "ROWS_PER_BATCH", "L")),
    ):
        params = inspect.signature(kernel.fn).parameters
        assert set(names) <= set(params), f"{kernel.fn.__name__}: {set(names) - set(params)}"


@pytest.mark.parametrize("compiled", [False, True], ids=["interpreter", "compiled"])
def test_decode_split_count_depends_on_shapes_only(monkeypatch: pytest.MonkeyPatch, compiled: bool) -> None:
    """Every capacity is covered by splits that each can hold a row, at most MAX_SPLITS of them;
    the compiled configs (checked here on the CPU, as the H200's 132 SMs would get them) keep K
    and V tiles within 32 KiB each, across the tile-size boundaries of ``decode_config``."""
    if compiled:
        monkeypatch.setattr(ops_attention.backend, "is_interpreter", lambda: False)
        monkeypatch.setattr(ops_attention, "_sm_count", lambda: 132)
    shapes = ((64, torch.bfloat16), (128, torch.bfloat16), (128, torch.float32), (256, torch.float16))
    for head_dim, dtype in shapes:
        for capacity in (1, 17, 512, 513, 2048, 2049, 4096, 8192, 8193, 32768):
            config = ops_attention.decode_config(head_dim, dtype, capacity)
            tile_bytes = config.block_n * head_dim * dtype.itemsize
            assert config.block_n >= 16 and tile_bytes <= 32 * 1024, (head_dim, dtype, capacity, config)
            splits, size = ops_attention.decode_splits(1, 2, capacity, config)
            assert 1 <= splits <= ops_attention.MAX_SPLITS and splits * size >= capacity
            assert (splits - 1) * size < capacity, "a split that can never hold a row"


def test_a_short_sequence_in_a_long_cache_spreads_over_the_splits() -> None:
    """The split count follows the capacity (one graph replays at every length), the rows per
    split the length: a sequence of as many tiles as half the splits goes to that many splits of
    a tile each, not to the first few splits of several tiles (the capacity's split size)."""
    capacity, head_dim = (256, 16) if DEVICE.type == "cpu" else (32768, 128)
    config = ops_attention.decode_config(head_dim, torch.bfloat16, capacity)
    splits, split_size = ops_attention.decode_splits(1, 1, capacity, config)
    assert split_size >= 2 * config.block_n and splits >= 4, "the capacity's splits must hold several tiles"
    tiles = splits // 2
    valid = tiles * config.block_n
    case = _case(s=1, past=valid - 1, slack=capacity - valid, b=1, kv_heads=1, group=4, head_dim=head_dim)
    q, k_cache, v_cache, seq_lens, scale = case.args
    scratch = ops_attention.decode_scratch(q, k_cache)
    out = ops_attention.attention_decode(q, k_cache, v_cache, seq_lens, scale, scratch=scratch)
    busy = (scratch.max[0, 0] > float("-inf")).all(0)  # per split: every q head saw a row
    assert busy[:tiles].all() and not busy[tiles:].any(), busy
    result = check(registry.get("attention_decode"), case, lambda *args: out.clone())
    assert result.passed, result.describe()


def test_one_scratch_serves_every_length() -> None:
    """What a replayed decode graph does: same buffers, new device lengths each step."""
    case = _case(s=1, past=50, slack=7, b=1)
    q, k_cache, v_cache, seq_lens, scale = case.args
    out = torch.empty(q.shape, dtype=q.dtype, device=DEVICE)
    scratch = ops_attention.decode_scratch(q, k_cache)
    for n in (1, 2, 16, 17, 33, 58):
        seq_lens.fill_(n)
        ops_attention.attention_decode(q, k_cache, v_cache, seq_lens, scale, out=out, scratch=scratch)
        result = check(registry.get("attention_decode"), case, lambda *args: out.clone())
        assert result.passed, f"seq_len {n}: {result.describe()}"


@pytest.mark.parametrize("path", ["prefill", "decode"])
def test_queries_that_see_no_row_get_zeros(path: str) -> None:
    """seq_len < S breaks the contract but is a device value: no NaN, no stray read."""
    q, k_cache, v_cache, seq_lens, scale = _case(s=4, past=0, slack=4, b=1).args
    seq_lens.fill_(2)  # queries 0, 1 sit at positions -2, -1
    got = ops_attention.attention(q, k_cache, v_cache, seq_lens, scale, path=path)
    assert (got[:, :2] == 0).all()
    want = ref.attention(q, k_cache, v_cache, seq_lens, scale)  # NaN in the rows that see nothing
    # the rest within one bf16 ulp at their magnitude (|out| < 4, ulp 2^-6); measured 2^-7
    torch.testing.assert_close(got[:, 2:].float(), want[:, 2:].float(), atol=2**-6, rtol=0)


def test_bad_path_and_scratch_are_refused() -> None:
    q, k_cache, v_cache, seq_lens, scale = _case().args
    with pytest.raises(ValueError, match="path"):
        ops_attention.attention(q, k_cache, v_cache, seq_lens, scale, path="sideways")
    scratch = ops_attention.decode_scratch(q, k_cache)
    bad = scratch._replace(sum=scratch.sum[:1] if scratch.sum.shape[0] > 1 else scratch.sum[..., :-1])
    with pytest.raises(ValueError, match=r"scratch\.sum"):
        ops_attention.attention_decode(q, k_cache, v_cache, seq_lens, scale, scratch=bad)
    padded = torch.empty((*scratch.sum.shape[:-1], scratch.sum.shape[-1] + 1), device=DEVICE)
    with pytest.raises(ValueError, match=r"scratch\.sum: expected a contiguous tensor"):
        strided = scratch._replace(sum=padded[..., :-1])  # the right shape, rows a gap apart
        ops_attention.attention_decode(q, k_cache, v_cache, seq_lens, scale, scratch=strided)
    wide = _case(s=20, past=0, group=4, kv_heads=1).args  # 80 query rows per kv head
    with pytest.raises(ValueError, match="q: the decode path"):
        ops_attention.attention_decode(*wide)
    with pytest.raises(ValueError, match="q: head_dim 48"):
        ops_attention.attention(q.new_zeros(*q.shape[:3], 48), k_cache.new_zeros(*k_cache.shape[:3], 48),
                                v_cache.new_zeros(*v_cache.shape[:3], 48), seq_lens, scale)  # fmt: skip


PREFILL_BLOCK_N = ops_attention.prefill_config(16, torch.bfloat16).block_n


@pytest.mark.parametrize("past", range(2 * PREFILL_BLOCK_N + 1))
def test_prefill_causal_edge_at_every_offset_in_a_key_block(past: int) -> None:
    """Two queries after ``past`` rows: the first query's last visible row walks every offset of a
    key block, so a block loop that skips the causal mask one tile too far (or one row short) is
    caught at some ``past``, not only where a drawn case happens to land on it."""
    spec = registry.get("attention_prefill")
    params = {**TYPICAL, "b": 1, "kv_heads": 1, "group": 2, "head_dim": 16, "s": 2, "past": past}
    case = spec.build({**params, "slack": 0, "lens": "same", "q_offset": 0}, DEVICE)
    result = check(spec, case)
    assert result.passed, result.describe()


@pytest.mark.parametrize("bug", ["causal_off_by_one", "gqa_modulo", "no_rescale"])
def test_buggy_attention_is_caught(bug: str) -> None:
    # prefill from an empty cache (query 0 sees one row), 2 kv heads, 20 queries > one 16-row block
    case = _case(s=20, past=0, slack=0, lens="same")
    assert not check(registry.get("attention"), case, getattr(buggy_kernels, f"attention_{bug}")).passed


def test_verify_op_shrinks_a_causal_off_by_one_to_two_tokens() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "verify.op", "attention", "--examples", "30",
         "--impl", "tests/buggy_kernels.py:attention_causal_off_by_one"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=user_env(),
    )  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    repro = next(line for line in run.stdout.splitlines() if "repro:" in line)
    case = json.loads(repro.split("--case ", 1)[1].split(" --impl")[0].strip("'"))
    # the fewest tokens that show it: S=2 (query 0 sees row 1), or S=1 when the cache has a stale
    # row past seq_len for the query to see (the H200 run of 2026-11-29 shrank to that one)
    assert case["s"] <= 2 and case["b"] == 1


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("batch", "capacity", "lengths"),
    [
        (2, 4096, ([1, 1], [4096, 17], [2048, 4001], [63, 64])),
        # 64 splits of four tiles: rows shared out by length, the combine reading the busy splits
        (1, 32768, ([1], [1000], [32768], [4097], [129])),
    ],
    ids=["cache 4096", "cache 32768"],
)
def test_captured_decode_graph_replays_at_every_length(
    batch: int, capacity: int, lengths: tuple[list[int], ...]
) -> None:
    params = {
        **TYPICAL,
        "b": batch,
        "s": 1,
        "past": capacity - 96,
        "slack": 95,
        "group": 4,
        "kv_heads": 2,
        "head_dim": 128,
    }
    case = registry.get("attention").build(params, DEVICE)
    q, k_cache, v_cache, seq_lens, scale = case.args
    out = torch.empty(q.shape, dtype=q.dtype, device=DEVICE)
    scratch = ops_attention.decode_scratch(q, k_cache)

    def step() -> None:
        ops_attention.attention(q, k_cache, v_cache, seq_lens, scale, out=out, scratch=scratch)

    step()  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lens in lengths:
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        result = check(registry.get("attention"), case, lambda *args: out.clone())
        assert result.passed, f"seq_lens {lens}: {result.describe()}"


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["prefill", "decode"])
def test_a_cache_past_two_to_the_31_elements_a_batch_row_is_addressed_in_int64(path: str) -> None:
    """Rows past 2**31 / (Hkv * D) sit past int32 offsets (here rows >= 524288 of 32 x 128): their
    offsets are 64-bit, so the one nonzero value row, the last, is read where it is. K is zero,
    so every score ties and the last query's output is V's mean over the L rows: 1 / L."""
    if torch.cuda.mem_get_info()[0] < 12 * 2**30:
        pytest.skip("needs 12 GiB of free GPU memory (two 4.3 GB caches)")
    capacity, kv_heads, dim = 2**19 + 64, 32, 128
    k_cache = torch.zeros(1, capacity, kv_heads, dim, device=DEVICE, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    v_cache[0, -1] = 1.0
    seq = 16 if path == "prefill" else 1
    q = torch.randn(1, seq, kv_heads, dim, device=DEVICE, dtype=torch.bfloat16)
    seq_lens = torch.full((1,), capacity, device=DEVICE, dtype=torch.int32)
    out = ops_attention.attention(q, k_cache, v_cache, seq_lens, dim**-0.5, path=path)
    torch.testing.assert_close(
        out[0, -1].float(), torch.full_like(out[0, -1], 1 / capacity).float(), rtol=0.01, atol=0
    )


@pytest.mark.parametrize("seed", range(8))
def test_a_ragged_draw_has_lengths_that_differ_and_only_then_the_label(seed: int) -> None:
    """ "ragged" with one row of prefix used to draw equal lengths half the time, labelled ragged
    all the same: a kernel using seq_lens[0] for every row passed every drawn case."""
    ragged = _case(b=2, s=1, past=1, lens="ragged", seed=seed)
    lengths = ragged.args[3].tolist()
    assert lengths[0] != lengths[1] and "seq_lens ragged" in ragged.labels
    assert "seq_lens ragged" not in _case(b=2, lens="same", seed=seed).labels
