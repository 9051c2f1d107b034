"""The Triton model against the reference model, and the decode runner's buffer discipline."""

from __future__ import annotations

import dataclasses
import re
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model import config as model_config
from model import reference, triton_model
from model import weights as model_weights
from model.config import ModelConfig
from model.generate import check_prompt, generate, prefill
from model.graph import DecodeRunner
from ops import backend, pdl
from references.precision import computing_in
from verify import tolerances

DEVICE = backend.device()
CONFIGS = {
    "qwen3": ModelConfig("qwen3", 120, 64, 72, 3, 4, 2, 16, rope_theta=10000.0, qk_norm=True),
    "qwen2": ModelConfig("qwen2", 120, 64, 72, 2, 4, 1, 32, rope_theta=10000.0, qkv_bias=True),
}


def _models(family: str = "qwen3", max_seq: int = 24, batch: int = 1):
    weights = model_weights.random_weights(CONFIGS[family], DEVICE, seed=3)
    return reference.build(weights, batch, max_seq), triton_model.build(weights, batch, max_seq)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_triton_prefill_logits_match_reference(family: str) -> None:
    ref, tri = _models(family, batch=2)
    ids = torch.randint(0, 120, (2, 11), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    expected, got = prefill(ref, ids).float(), prefill(tri, ids).float()
    with computing_in(torch.bfloat16):  # plain bf16 torch: the yardstick of the tolerances
        plain = prefill(ref, ids).float()

    def rel(x: torch.Tensor) -> float:
        return float((x - expected).norm() / expected.norm())

    # no worse than plain bf16 torch, as bisect requires of every layer ([bisect] in tolerances.toml)
    factor = tolerances.setting("bisect", "layer_error_factor")
    assert rel(got) <= factor * rel(plain), f"relative L2 {rel(got):.3g}, plain bf16 torch {rel(plain):.3g}"


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_runner_decode_equals_eager_decode_bitwise(family: str) -> None:
    """The static-buffer step (a CUDA Graph on GPU) computes exactly what the eager step computes
    (qwen2: the QKV projection with RoPE and the cache write in its epilogue)."""
    _, tri = _models(family)
    ids = torch.randint(0, 120, (1, 6), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    eager = generate(tri, ids, 6)
    position = torch.full((1,), 10, dtype=torch.int32, device=DEVICE)
    eager_logits = tri.forward(eager[:, -2:-1], position).clone()
    runner = DecodeRunner(tri, 1)
    graphed = generate(tri, ids, 6, runner=runner)
    assert torch.equal(eager, graphed)
    runner.step(graphed[0, -2:-1], 10)
    assert torch.equal(runner.logits, eager_logits)


def _embedded_reference(batch: int):
    """The embedded checkpoint's reference model: trained, so its greedy tokens follow the
    context and the positions (a random model repeats one token whatever it is fed)."""
    from model import embedded

    directory = embedded.ensure()
    weights = model_weights.load(directory, model_config.load(directory), DEVICE)
    return reference.build(weights, batch, 32)


def test_generate_feeds_each_token_at_the_next_position() -> None:
    """generate against a loop written out here: prefill, then token i fed at position L + i."""
    ref = _embedded_reference(1)
    ids = torch.randint(0, ref.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(2))
    ids = ids.to(DEVICE)
    tokens = generate(ref, ids, 6)
    fresh = _embedded_reference(1)
    expected = [fresh.impls["argmax"](prefill(fresh, ids))]
    for i in range(5):
        start = torch.full((1,), 5 + i, dtype=torch.int32, device=DEVICE)
        expected.append(fresh.impls["argmax"](fresh.forward(expected[-1][:, None], start)))
    assert torch.equal(tokens, torch.stack(expected, dim=1))
    assert all(torch.equal(a, b) for a, b in zip(ref.k_cache, fresh.k_cache, strict=True))


def _with_eos(row: torch.Tensor, eos: int) -> torch.Tensor:
    """A row as generate returns it: everything after the first EOS is EOS."""
    row = row.clone()
    hits = (row == eos).nonzero()
    if len(hits):
        row[int(hits[0]) + 1 :] = eos
    return row


def _prompts_that_change_token(ref, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two random prompts whose greedy continuations each change token at least once, with those
    continuations. The embedded model repeats a prompt's pattern, and which prompts it continues
    with one token over and over depends on the machine it was trained on (per-machine builds)."""
    for seed in range(100):
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, ref.config.vocab_size, (2, 6), generator=gen).to(DEVICE)
        free = generate(ref, ids, new_tokens)
        if bool((free[:, 1:] != free[:, :-1]).any(dim=1).all()):
            return ids, free
    raise AssertionError("no two prompts in 100 whose continuations change token")


def test_generate_pads_finished_rows_with_eos_and_stops_when_all_are_done() -> None:
    ref = _embedded_reference(2)
    ids, free = _prompts_that_change_token(ref, 8)
    change = int((free[0, 1:] != free[0, :-1]).nonzero()[0])
    eos = int(free[0, change])  # row 0 finishes by this step, and without EOS goes on differently
    assert int(free[0, change + 1]) != eos
    got = generate(_embedded_reference(2), ids, 8, eos_token_ids=[eos])
    expected = torch.stack([_with_eos(free[0], eos), _with_eos(free[1], eos)])
    done = [int((r == eos).nonzero()[0]) for r in expected if (r == eos).any()]
    steps = max(done) + 1 if len(done) == 2 else 8
    assert torch.equal(got, expected[:, :steps])
    # both rows alike: both finish at row 0's first EOS, and generate stops there
    twins = ids[:1].expand(2, -1).contiguous()
    got = generate(_embedded_reference(2), twins, 8, eos_token_ids=[eos])
    first = int((free[0] == eos).nonzero()[0])
    assert torch.equal(got, free[:1, : first + 1].expand(2, -1))


@pytest.mark.parametrize(("new_tokens", "position"), [(1, 24), (1, 100), (1, -3), (4, 21)])
def test_runner_refuses_a_host_position_outside_the_cache(new_tokens: int, position: int) -> None:
    """The kernels keep such a step safe but wrong (finite logits from a cache row never
    written): a host int position is checked; a device one is not (that would be a host sync)."""
    _, tri = _models()  # cache capacity 24
    runner = DecodeRunner(tri, 1, new_tokens=new_tokens)
    tokens = torch.zeros(1, new_tokens, dtype=torch.int64, device=DEVICE)
    last = 24 - new_tokens
    with pytest.raises(ValueError, match=rf"position: {position} .*capacity 24; expected 0\.\.{last}"):
        runner.step(tokens, position)
    assert runner.next_token is None  # refused before anything ran


class _Recorder(TorchDispatchMode):
    """Records every aten op of the step, and every output that is not a view of a known buffer."""

    def __init__(self, known: set[int]) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.fresh: list[str] = []
        self.known = known

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _inside_interpreter_launch():
            return out  # the interpreter's own host-side emulation of a kernel launch
        self.ops.append(str(func))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.known:
                self.fresh.append(str(func))
        return out


def _inside_interpreter_launch() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.endswith(("triton/runtime/interpreter.py", "triton/runtime/jit.py")):
            return True
        frame = frame.f_back
    return False


HOST_SYNCS = ("aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.equal")


@pytest.mark.parametrize("max_seq", [24, 200], ids=["cache 24", "cache 200"])
def test_decode_step_is_capture_safe(max_seq: int) -> None:
    """What capture needs: after warm-up, a step allocates nothing, never syncs with the host, and
    dispatches the same ops at any position (no data-dependent Python branch); also over a cache
    whose attention splits hold several tiles, shared out by the device length."""
    _, tri = _models(max_seq=max_seq)
    ids = torch.randint(0, 120, (1, 5), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    prefill(tri, ids)
    runner = DecodeRunner(tri, 1)
    runner.step(ids[:, -1], 5)  # warm-up: allocates the static buffers
    known = {t.untyped_storage().data_ptr() for t in _all_tensors(tri, runner)}
    traces = []
    for position in (6, 13):
        runner.ids.fill_(7)
        runner.start_pos.fill_(position)
        with _Recorder(known) as rec:
            runner._step()
        assert not rec.fresh, f"the step allocated: {rec.fresh}"
        assert not [op for op in rec.ops if op.startswith(HOST_SYNCS)], rec.ops
        traces.append(rec.ops)
    assert traces[0] == traces[1]


def _all_tensors(tri, runner) -> list[torch.Tensor]:
    out = [runner.ids, runner.start_pos, *tri.k_cache, *tri.v_cache]
    for value in tri.buffers.values():
        out += list(value) if isinstance(value, tuple) else [value]
    w = tri.weights
    out += [w.embed, w.lm_head, w.final_norm]
    for layer in w.layers:
        out += [t for t in vars(layer).values() if isinstance(t, torch.Tensor)]
    from ops import rope, scratch

    out += list(rope._inv_freq_cache.values())
    for buffer in scratch.held():  # made in the warm-up step, reused after
        out += list(buffer) if isinstance(buffer, tuple) else [buffer]
    return out


@pytest.mark.parametrize(
    ("ids", "new", "message"),
    [
        ([[]], 1, "empty"),
        ([[1, 500]], 1, "token id 500 is outside the vocabulary"),
        ([[1, -1]], 1, "token id -1"),
        ([[1] * 20], 6, "20 tokens \\+ 6 new tokens needs 25 positions: more than the KV cache capacity 24"),
    ],
)
def test_bad_prompts_are_refused(ids, new: int, message: str) -> None:
    _, tri = _models()
    with pytest.raises(ValueError, match=message):
        check_prompt(torch.tensor(ids, dtype=torch.int64).reshape(1, -1), tri, new)


def test_a_generation_may_fill_the_cache_to_its_last_row() -> None:
    """The last new token is returned, never fed back: a prompt of 20 and 5 new tokens fit 24 rows."""
    ref, _ = _models()
    roomy, _ = _models(max_seq=32)
    ids = torch.randint(0, 120, (1, 20), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    assert torch.equal(generate(ref, ids, 5), generate(roomy, ids, 5))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda ref, ids: generate(ref, ids.tolist(), 2), "prompt ids: expected a torch.Tensor"),
        (lambda ref, ids: generate(ref, ids, 2.0), "max_new_tokens: expected an int >= 0, got 2.0"),
        (lambda ref, ids: generate(ref, ids, 2, eos_token_ids=3), "eos_token_ids: expected a sequence"),
        (
            lambda ref, ids: generate(ref, ids, 2, eos_token_ids=[120]),
            r"eos_token_ids: expected token ids in \[0, 120\)",
        ),
        (lambda ref, ids: generate(ref, ids.expand(2, -1), 2), "batch 2 differs from the model's cache"),
        (lambda ref, ids: DecodeRunner(ref, 2), "batch: 2 differs from the model's cache batch 1"),
        (
            lambda ref, ids: ref.forward(ids, torch.zeros(1, dtype=torch.int64, device=DEVICE)),
            r"start_pos: expected int32 \[1\] \(a position per row\), got torch.int64 \(1,\)",
        ),
        (
            lambda ref, ids: ref.forward(ids.expand(2, -1), torch.zeros(2, dtype=torch.int32, device=DEVICE)),
            "ids: batch 2 differs from the KV cache's batch 1",
        ),
        (
            lambda ref, ids: reference.build(ref.weights, 1, -1),
            r"max_seq: expected a positive int \(the KV cache's size\), got -1",
        ),
    ],
)
def test_bad_generation_requests_are_refused(call, message: str) -> None:
    ref, _ = _models()
    ids = torch.ones(1, 3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=message):
        call(ref, ids)


def test_a_runner_over_another_model_is_refused() -> None:
    """Prefill would fill this model's cache and decode would read the other's."""
    _, tri = _models()
    _, other = _models()
    with pytest.raises(ValueError, match="runner: a DecodeRunner over another model"):
        generate(tri, torch.ones(1, 3, dtype=torch.int64), 2, runner=DecodeRunner(other, 1))


def test_positions_past_the_configs_max_position_embeddings_are_refused(monkeypatch) -> None:
    _, tri = _models()
    monkeypatch.setattr(tri, "config", dataclasses.replace(tri.config, max_position_embeddings=16))
    ids = torch.ones(1, 10, dtype=torch.int64)
    check_prompt(ids, tri, 7)  # the 7th new token is returned, never fed: 16 positions
    with pytest.raises(ValueError, match="needs 17 positions: more than the model's max_position_embeddings"):
        check_prompt(ids, tri, 8)


@pytest.mark.gpu
def test_graph_replay_equals_uncaptured_decode_at_many_lengths() -> None:
    _, tri = _models(max_seq=200)
    ids = torch.randint(0, 120, (1, 3), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    prefill(tri, ids)
    runner = DecodeRunner(tri, 1)
    token = ids[:, -1]
    for position in range(3, 190, 7):
        runner.step(token, position)
        assert runner.graph is not None  # on CUDA the first step captures it: replays, not eager runs
        graphed = runner.logits.clone()
        eager = tri.forward(token[:, None], torch.full((1,), position, dtype=torch.int32, device=DEVICE))
        assert torch.equal(graphed, eager), f"position {position}"


@pytest.mark.gpu
def test_dependent_launches_compute_what_plain_launches_compute(monkeypatch) -> None:
    """With programmatic dependent launch a kernel starts while the one before it finishes; one
    that read its input before ``pdl.wait`` would race. Greedy graph decode with and without PDL
    must give the same logits bit for bit at every step."""
    if not pdl.enabled():
        pytest.skip("programmatic dependent launch needs a Hopper or later GPU")

    def decode_logits() -> list[torch.Tensor]:
        _, tri = _models(max_seq=120)
        ids = torch.randint(0, 120, (1, 5), generator=torch.Generator().manual_seed(6)).to(DEVICE)
        prefill(tri, ids)
        runner = DecodeRunner(tri, 1)
        token, steps = ids[:, -1], []
        for position in range(5, 100):
            token = runner.step(token, position).clone()
            steps.append(runner.logits.clone())
        return steps

    with_pdl = decode_logits()
    monkeypatch.setattr(pdl, "enabled", lambda: False)
    for step, (got, expected) in enumerate(zip(with_pdl, decode_logits(), strict=True)):
        assert torch.equal(got, expected), f"decode step {step}"


def test_dependent_launch_is_off_on_the_interpreter() -> None:
    if backend.is_interpreter():
        assert pdl.launch_options() == {"PDL": False}
    else:
        assert pdl.launch_options()["PDL"] == pdl.enabled()


def test_layers_call_the_fused_qkv_op_their_config_allows() -> None:
    """Without qk-norm, every layer (layer 0 too: its residual is zero) runs norm + QKV + RoPE +
    cache write as one op; an injection of an op no layer calls is refused, not silently never run."""
    _, qwen2 = _models("qwen2")
    _, qwen3 = _models("qwen3")
    assert qwen2.layer_ops()[0] == "add_rms_norm_linear_rope_kv_store"
    assert qwen3.layer_ops()[:2] == ("add_rms_norm_linear", "rope_kv_store")
    with pytest.raises(ValueError, match="rope_kv_store is not called in the layers"):
        qwen2.inject("rope_kv_store", lambda *args: None, [0, 1])
    qwen3.inject("rope_kv_store", lambda *args: None, [0, 1])


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static buffers"])
def test_positions_and_lengths_per_row(static: bool) -> None:
    """One add gives every row its own positions and length; the positions are a strided view,
    which rope_cos_sin reads as it reads a contiguous copy."""
    from ops.rope import rope_cos_sin

    _, tri = _models(batch=3)
    tri.static = static
    start = torch.tensor([0, 5, 9], dtype=torch.int32, device=DEVICE)
    positions, seq_lens = tri.positions_and_lengths(start, 4)
    expected = start[:, None].long() + torch.arange(4, device=DEVICE)
    assert positions.dtype == seq_lens.dtype == torch.int32
    assert torch.equal(positions.long(), expected)
    assert torch.equal(seq_lens.long(), start.long() + 4)
    strided, contiguous = (
        rope_cos_sin(positions, 16, 10000.0),
        rope_cos_sin(positions.contiguous(), 16, 10000.0),
    )
    assert all(torch.equal(a, b) for a, b in zip(strided, contiguous, strict=True))


def test_loaded_weights_reach_linear_as_static_and_other_impls_never_see_the_keyword() -> None:
    """o_proj, down_proj and lm_head are called with ``static_weight=True`` where the
    implementation takes it (``ops.gemm.linear`` may then read the weight early); the reference
    and ``--inject``-style implementations without the keyword are called as before."""
    ref_model, tri = _models("qwen2")
    seen: list[tuple[int, bool]] = []
    linear = tri.impls["linear"]

    def recording(x, weight, bias=None, *, out=None, static_weight=False):
        seen.append((weight.shape[0], static_weight))
        return linear(x, weight, bias, out=out, static_weight=static_weight)

    tri.impls["linear"] = recording
    ids = torch.tensor([[1, 2, 3]], device=DEVICE)
    start = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    tri.forward(ids, start)
    c = tri.config
    layers = c.num_layers
    assert seen == [(c.hidden_size, True), (c.hidden_size, True)] * layers + [(c.vocab_size, True)]
    ref_model.forward(ids, start)  # the reference linear takes no static_weight: it must not be passed


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"qk_norm": False}, "qk_norm: family qwen3 implies True, got False"),
        ({"qkv_bias": True}, "qkv_bias: family qwen3 implies False, got True"),
        ({"rope_theta": -5.0}, "rope_theta: expected a positive finite number, got -5.0"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps: expected a positive finite number, got nan"),
        ({"head_dim": 24}, "head_dim 24 is not supported by the attention kernels"),
        ({"tie_word_embeddings": "no"}, "tie_word_embeddings: expected a bool, got 'no'"),
        ({"eos_token_ids": (500,)}, "eos_token_ids: expected token ids in [0, 120), got (500,)"),
        ({"max_position_embeddings": 0}, "max_position_embeddings: expected a positive int, got 0"),
    ],
)
def test_a_config_built_in_code_is_checked_as_a_file_is(changes: dict, message: str) -> None:
    """A config the loader would refuse, or whose checkpoint HF would read as another model
    (qwen3 without its q/k norms), is refused when built, not at the first forward."""
    good = ModelConfig("qwen3", 120, 64, 72, 2, 4, 2, 16, rope_theta=1e4, qk_norm=True)
    with pytest.raises(model_config.ConfigError, match=re.escape(message)):
        good.replace(**changes)


def test_weights_keep_their_dtype_and_refuse_others(tmp_path) -> None:
    """config.json states the dtype the tensors are stored in; an int dtype is refused, not
    loaded truncated to fail at the first forward."""
    import json

    cfg = ModelConfig("qwen3", 120, 64, 72, 2, 4, 2, 16, rope_theta=1e4, qk_norm=True)
    model_weights.save(model_weights.random_weights(cfg, "cpu", dtype=torch.float32), tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "float32"
    for call in (
        lambda: model_weights.load(tmp_path, cfg, "cpu", dtype=torch.int32),
        lambda: model_weights.random_weights(cfg, "cpu", dtype=torch.float64),
    ):
        with pytest.raises(
            ValueError, match=r"dtype: expected torch.bfloat16, torch.float16 or torch.float32"
        ):
            call()


def test_a_decode_runner_refuses_tokens_it_cannot_take_and_generate_a_prefill_runner() -> None:
    _, tri = _models()
    prefill(tri, torch.tensor([[5, 6, 7, 8]], device=DEVICE))
    runner = DecodeRunner(tri, 1)
    for tokens in (torch.tensor([3.9], device=DEVICE), torch.tensor([1, 2], device=DEVICE), [3]):
        with pytest.raises(ValueError, match=r"^tokens: expected 1 int32 or int64 token ids"):
            runner.step(tokens, 4)
    with pytest.raises(ValueError, match=r"^runner: a DecodeRunner of 3 tokens a step; decode takes one"):
        generate(
            tri, torch.tensor([[5, 6, 7, 8]], device=DEVICE), 2, runner=DecodeRunner(tri, 1, new_tokens=3)
        )
    with pytest.raises(ValueError, match=r"^new_tokens: 2 must be in"):
        DecodeRunner(tri, 1, new_tokens="2")
