"""``python -m verify.bench model``: prefill latency and decode speed of the whole decoder.

Random weights of the real size, one prompt, greedy decode, batch 1, in one run:
(a) the Triton model with CUDA Graphs (decode, and prefill captured for the prompt length),
(a') the same with the fused ops split into their parts (what fusion buys),
(b) the Triton model launched eagerly, (c) the reference model (fp32 math) eagerly,
(d) the reference model computing in bf16 (plain torch), eagerly, (e) that plain-torch model
compiled by ``torch.compile`` and replayed as a CUDA Graph, the gpt-fast style peer, (f) HF transformers
``generate``, (g) the launch floor: as many empty dependent kernels as a decode step launches,
in one graph (what the launches alone cost), and (h) the roofline: weight + KV bytes per token
over measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

import torch

from model import reference, triton_model
from model import weights as model_weights
from model.config import PRESETS, ModelConfig, to_hf_dict
from model.decoder import Decoder
from model.graph import DecodeRunner
from ops import gemm_config
from references.precision import computing_in
from verify import cli
from verify.bench import timing
from verify.cli import UsageError, add_cache_argument
from verify.impl_loader import exception_text
from verify.models import cache_rows
from verify.strategies.gemm import config_projections

SKIPPABLE = ("unfused", "eager", "reference", "compile", "hf")  # rows besides the graph decode
GRAPH_ROW, PEER_ROW = "triton + CUDA graph", "plain torch bf16 + torch.compile + CUDA graph"
DECODE_TARGET_MS, PREFILL_TARGET_MS, TARGET_PROMPT = 0.45, 2.0, 256  # the model issue's, article preset


def targets(rows: list[dict], prompt_len: int) -> list[dict]:
    """The model issue's targets that this run measured (they are stated for the article preset)."""
    by_name = {r["name"]: r for r in rows}
    ours = by_name[GRAPH_ROW]
    found = [
        {
            "target": f"graph decode <= {DECODE_TARGET_MS} ms/token",
            "value": f"{ours['decode_ms']:.3f} ms/token",
            "met": ours["decode_ms"] <= DECODE_TARGET_MS,
        }
    ]
    if PEER_ROW in by_name:
        speedup = by_name[PEER_ROW]["decode_ms"] / ours["decode_ms"]
        found.append(
            {
                "target": "graph decode faster than the torch.compile peer",
                "value": f"{speedup:.2f}x",
                "met": speedup > 1,
            }
        )
    if prompt_len == TARGET_PROMPT:
        prefill = ours["prefill_ms"]
        found.append(
            {
                "target": f"prefill of {TARGET_PROMPT} tokens <= {PREFILL_TARGET_MS} ms",
                "value": f"{prefill:.2f} ms",
                "met": prefill <= PREFILL_TARGET_MS,
            }
        )
    return found


def _seconds(fn: Callable[[], object], repeats: int = 5) -> float:
    """Median wall time of ``fn`` over ``repeats`` synchronized runs (after one warm-up)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode_loop(
    step: Callable[[torch.Tensor, int], torch.Tensor], first: torch.Tensor, start: int, steps: int
) -> float:
    """Seconds per token of ``steps`` greedy decode steps, each fed the previous step's token."""
    token = step(first, start)  # warm-up, capture
    torch.cuda.synchronize()
    began = time.perf_counter()
    for i in range(steps):
        token = step(token, start + 1 + i)
    torch.cuda.synchronize()
    return (time.perf_counter() - began) / steps


def compiled_decode(ref: Decoder, first: torch.Tensor, length: int, steps: int) -> float:
    """Seconds per token of the plain-bf16 reference compiled by inductor and replayed as one CUDA
    Graph per step (what ``mode="reduce-overhead"`` does, done by hand: the KV cache is state
    the model mutates, which makes inductor's own cudagraph wrapper decline)."""
    device = first.device
    ids = first.view(1, 1).clone()
    start = torch.full((1,), length, dtype=torch.int32, device=device)
    compiled = torch.compile(ref.forward)
    with computing_in(torch.bfloat16):
        for _ in range(3):  # compile, then run the compiled code outside capture once more
            compiled(ids, start)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = compiled(ids, start)

    def step(token: torch.Tensor, position: int) -> torch.Tensor:
        ids.copy_(token.view(1, 1))
        start.fill_(position)
        graph.replay()
        return torch.argmax(logits, dim=-1)

    return decode_loop(step, first, length, steps)


def roofline_seconds(config: ModelConfig, context: int, bandwidth: float) -> tuple[float, int]:
    """Bytes one decode step must read (every weight once, the KV cache so far) over bandwidth.

    The lm_head is read whole; the embedding only one row a token, so an untied embedding is
    left out (a tied one is the lm_head).
    """
    embedding = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    weight_bytes = 2 * (config.num_parameters() - embedding)
    kv_bytes = 2 * 2 * config.num_layers * context * config.num_kv_heads * config.head_dim
    total = weight_bytes + kv_bytes
    return total / bandwidth, total


def parse_overrides(
    text: str, shapes: set[tuple[int, int]]
) -> dict[tuple[int, int, int], gemm_config.GemmConfig]:
    """``"9728x1024=gemv n8 k1024 w4 s1;1024x4864=..."``: decode (M=1) GEMM configs by ``N x K``,
    each one of ``shapes`` (the model's projections): another would time the table's configs."""
    overrides = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        shape, sep, config = part.partition("=")
        n, x, k = shape.strip().partition("x")
        if not sep or not x or not n.isdigit() or not k.isdigit():
            raise ValueError(
                f"--try-config {part!r}: expected NxK=CONFIG, e.g. 9728x1024=gemv n8 k1024 w4 s1"
            )
        key = (1, int(n), int(k))
        if key[1:] not in shapes:
            known = ", ".join(f"{n}x{k}" for n, k in sorted(shapes))
            raise ValueError(f"--try-config {part!r}: {n}x{k} is no projection of the model (N x K: {known})")
        if key in overrides:
            raise ValueError(f"--try-config {text!r}: {n}x{k} is given twice")
        overrides[key] = gemm_config.GemmConfig.parse(config)
    if not overrides:
        raise ValueError(f"--try-config {text!r}: no NxK=CONFIG in it")
    return overrides


@contextlib.contextmanager
def gemm_overrides(overrides: dict[tuple[int, int, int], gemm_config.GemmConfig]) -> Iterator[None]:
    """The GEMM config table with ``overrides`` in it, restored after (a graph captured inside
    keeps the configs it was captured with)."""
    saved = dict(gemm_config.CONFIGS)
    gemm_config.CONFIGS.update(overrides)
    try:
        yield
    finally:
        gemm_config.CONFIGS.clear()
        gemm_config.CONFIGS.update(saved)


def busy_shares(intervals: list[tuple[float, float]]) -> list[float]:
    """Each ``(start, end)`` interval's share of their union, in the given order: the time by which
    it extends the busy period past every interval that started before it. In a chain of kernels
    that each wait for the one before, that is the time from its predecessor's end to its own: its
    cost on the critical path. The shares sum to the union's length (time with a kernel running)."""
    shares = [0.0] * len(intervals)
    reach = float("-inf")
    for i in sorted(range(len(intervals)), key=lambda i: intervals[i]):
        start, end = intervals[i]
        if end > reach:
            shares[i] = end - max(start, reach)
            reach = end
    return shares


def step_events(runner: DecodeRunner, first: torch.Tensor, start: int, steps: int) -> list:
    """The profiler's GPU events (kernels, copies) of ``steps`` decode steps, each fed the last token."""
    from torch.profiler import ProfilerActivity, profile

    token = runner.step(first, start)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            token = runner.step(token, start + 1 + i)
        torch.cuda.synchronize()
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def kernel_profile(runner: DecodeRunner, first: torch.Tensor, start: int, steps: int) -> str:
    """GPU time per decode token by kernel name, from the profiler's trace of graph replays.

    With programmatic dependent launch (``ops.pdl``) kernels overlap and a kernel's span
    includes the time it waits for the one before it, so spans add up to more than the step.
    The table gives both: the spans, and each kernel's share of the busy time (see
    :func:`busy_shares`), which adds up to the step and says where it goes.
    """
    events = step_events(runner, first, start, steps)
    shares = busy_shares([(e.time_range.start, e.time_range.end) for e in events])
    spans: dict[str, list[float]] = {}
    critical: dict[str, float] = {}
    for event, share in zip(events, shares, strict=True):
        spans.setdefault(event.name, []).append(event.time_range.elapsed_us())
        critical[event.name] = critical.get(event.name, 0.0) + share
    rows = sorted(spans, key=lambda name: -critical[name])
    table = [
        [
            name[:60],
            f"{len(spans[name]) / steps:.0f}",
            f"{statistics.mean(spans[name]):.2f}",
            f"{sum(spans[name]) / steps:.1f}",
            f"{critical[name] / steps:.1f}",
        ]
        for name in rows[:20]
    ]
    count = len(events) / steps
    total = sum(sum(t) for t in spans.values()) / steps
    head = (
        f"\nper decode token: {sum(shares) / steps:.1f} us with a kernel running, "
        f"{total:.1f} us of kernel spans (overlapping under PDL) over {count:.0f} kernels"
    )
    columns = ["kernel", "per token", "mean span us", "span us per token", "busy us per token"]
    return head + "\n" + timing.table(columns, table) + "\n" + step_order(events, shares, steps)


def step_order(events: list, shares: list[float], steps: int, first: int = 16, last: int = 6) -> str:
    """The step's first and last kernels in launch order with their median busy share over the
    steps: which op of a layer the time goes to (every layer launches the same sequence), and
    the head's (final norm, lm_head, argmax)."""
    order = sorted(range(len(events)), key=lambda i: events[i].time_range.start)
    per_step = len(order) // steps
    if per_step * steps != len(order):
        return "(kernel count differs between steps: no per-position breakdown)"

    def rows(positions: range) -> list[list[str]]:
        out = []
        for position in positions:
            picks = [order[step * per_step + position] for step in range(steps)]
            busy = statistics.median(shares[i] for i in picks)
            out.append([str(position), events[picks[0]].name[:60], f"{busy:.2f}"])
        return out

    head = rows(range(min(first, per_step)))
    tail = rows(range(max(len(head), per_step - last), per_step))
    text = f"\nthe step's first {len(head)} kernels in launch order (median busy us over {steps} steps)"
    text += "\n" + timing.table(["#", "kernel", "busy us"], head)
    if tail:
        text += f"\nand its last {len(tail)}\n" + timing.table(["#", "kernel", "busy us"], tail)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m verify.bench model",
        description=" ".join(__doc__.split("\n\n")[0].split()),
        epilog="Exit status: 0 timed (token parity is verify.e2e's job), 2 bad usage or no CUDA GPU.",
    )
    cli.add_shape_arguments(p, sorted(PRESETS), "article")
    p.add_argument("--prompt-len", type=cli.positive_int, default=256, help="prefill tokens (default 256)")
    p.add_argument("--new-tokens", type=cli.positive_int, default=128, help="decode tokens (default 128)")
    add_cache_argument(p)  # the reference-based rows (eager, compile) attend over all of it
    p.add_argument("--skip", default="", help=f"rows to skip, comma list: {','.join(SKIPPABLE)}")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.add_argument(
        "--profile", action="store_true", help="also print where a graph decode step spends its time"
    )
    p.add_argument(
        "--try-config",
        action="append",
        default=[],
        metavar="NxK=CONFIG[;NxK=CONFIG]",
        help="also time graph decode with these decode GEMM configs (one row per flag), e.g. "
        "'9728x1024=gemv n8 k1024 w4 s1': a kernel's best config alone is not always its best in the step",
    )
    p.add_argument(
        "--repeat",
        type=cli.positive_int,
        default=1,
        help="time the graph decode rows this many times, interleaved (median; default 1)",
    )
    args = p.parse_args(argv)
    cfg = PRESETS[args.preset] if args.config is None else cli.shape_config(p, args.config)
    shape = f"preset {args.preset}" if args.config is None else f"config {args.config}"
    shapes = {(proj.n, proj.k) for proj in config_projections(cfg)}
    try:
        variants = [(text, parse_overrides(text, shapes)) for text in args.try_config]
    except ValueError as error:
        p.error(str(error))
    skip = set(filter(None, args.skip.split(",")))
    if skip - set(SKIPPABLE):
        p.error(f"--skip: unknown row {sorted(skip - set(SKIPPABLE))[0]!r}; rows: {', '.join(SKIPPABLE)}")
    cli.require_output_file(p, "--json", args.json)
    length, new = args.prompt_len, args.new_tokens
    what = f"--prompt-len {length} + --new-tokens {new} + 1 (the warm-up step writes one row past them)"
    try:
        where = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # no GPU: refused below
        max_seq = cache_rows(args.cache_len, length + new + 1, what, cfg, where)
    except UsageError as error:
        p.error(str(error))
    if timing.cuda_missing("verify.bench model"):
        return 2
    device = torch.device("cuda")
    weights = model_weights.random_weights(cfg, device, seed=0)
    prompt = torch.randint(
        0, cfg.vocab_size, (1, length), device=device, generator=torch.Generator(device).manual_seed(0)
    )
    first = prompt[:, -1]
    bandwidth = timing.copy_bandwidth()
    rows: list[dict] = []

    def record(name: str, prefill_s: float | None, decode_s: float | None, note: str = "") -> None:
        rows.append(
            {
                "name": name,
                "prefill_ms": None if prefill_s is None else prefill_s * 1e3,
                "decode_ms": None if decode_s is None else decode_s * 1e3,
                "note": note,
            }
        )
        prefill = "-" if prefill_s is None else f"{prefill_s * 1e3:.2f} ms"
        decode = "-" if decode_s is None else f"{decode_s * 1e3:.3f} ms/token"
        print(f"  {name}: prefill {prefill}, decode {decode}", flush=True)  # progress; the table follows

    tri = triton_model.build(weights, 1, max_seq)
    prefill_runner = DecodeRunner(tri, 1, new_tokens=length)
    decode_runner = DecodeRunner(tri, 1)
    prefill_s = _seconds(lambda: prefill_runner.step(prompt, 0))
    graph_rows = [(None, {}, decode_runner)] + [(text, o, DecodeRunner(tri, 1)) for text, o in variants]
    decode_s: list[list[float]] = [[] for _ in graph_rows]
    for _ in range(args.repeat):  # interleaved, so a slow stretch of the GPU hits every row
        for times, (text, overrides, runner) in zip(decode_s, graph_rows, strict=True):
            try:
                with gemm_overrides(overrides):  # the first step captures the graph with them
                    times.append(decode_loop(runner.step, first, length, new))
            except Exception as exc:  # Triton's OutOfResources, CompilationError, ...
                if text is None or times:
                    raise
                why = f"{type(exc).__name__}: {exception_text(exc)}"
                p.error(f"--try-config {text!r}: does not run on this GPU ({why})")
    record(
        GRAPH_ROW,
        prefill_s,
        statistics.median(decode_s[0]),
        "prefill captured for this prompt length",
    )
    for (text, _, _), times in zip(graph_rows[1:], decode_s[1:], strict=True):
        record(f"triton + CUDA graph, {text}", None, statistics.median(times), "decode GEMM configs tried")
    if args.profile:
        print(kernel_profile(decode_runner, first, length, steps=8), flush=True)
    if "unfused" not in skip:  # what the fused ops buy: the same graph over one op per step
        unfused = triton_model.build(weights, 1, max_seq, fused=False)
        unfused_prefill = DecodeRunner(unfused, 1, new_tokens=length)
        unfused_decode = DecodeRunner(unfused, 1)
        record(
            "triton + CUDA graph, unfused ops",
            _seconds(lambda: unfused_prefill.step(prompt, 0)),
            decode_loop(unfused_decode.step, first, length, new),
            "norm, SwiGLU, RoPE and cache write as their own kernels",
        )
        del unfused, unfused_prefill, unfused_decode

    def eager_step(model, token, position):
        start = torch.full((1,), position, dtype=torch.int32, device=device)
        return torch.argmax(model.forward(token.view(1, 1), start), dim=-1)

    zero = torch.zeros(1, dtype=torch.int32, device=device)
    if "eager" not in skip:
        record(
            "triton, eager launches",
            _seconds(lambda: tri.forward(prompt, zero)),
            decode_loop(lambda t, pos: eager_step(tri, t, pos), first, length, min(new, 32)),
        )
    ref = reference.build(weights, 1, max_seq)
    if "reference" not in skip:
        record(
            "reference, fp32 math, eager",
            _seconds(lambda: ref.forward(prompt, zero), 2),
            decode_loop(lambda t, pos: eager_step(ref, t, pos), first, length, 8),
        )
        with computing_in(torch.bfloat16):
            record(
                "plain torch bf16 (reference in bf16), eager",
                _seconds(lambda: ref.forward(prompt, zero)),
                decode_loop(lambda t, pos: eager_step(ref, t, pos), first, length, 16),
            )
    if "compile" not in skip:
        record(
            PEER_ROW,
            None,
            compiled_decode(ref, first, length, new),
            "the gpt-fast style peer; decode only",
        )
    if "hf" not in skip:
        from transformers import AutoConfig, AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**to_hf_dict(cfg)), dtype=torch.bfloat16)
        hf.load_state_dict({k: v for k, v in model_weights.hf_tensors(weights).items()}, strict=False)
        hf = hf.to(device).eval()
        with torch.no_grad():
            prefill_s = _seconds(lambda: hf(input_ids=prompt))
            total = _seconds(
                lambda: hf.generate(
                    prompt,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    attention_mask=torch.ones_like(prompt),
                ),
                1,
            )
        # generate's prefill forward makes the first new token: new - 1 decode forwards follow
        record("HF transformers generate (bf16, eager)", prefill_s, (total - prefill_s) / max(new - 1, 1))
        del hf

    # What the step's launches cost before any byte moves: as many empty dependent kernels.
    launches = round(len(step_events(decode_runner, first, length, steps=4)) / 4)
    floor_s, plain_floor_s = timing.launch_floor(launches), timing.launch_floor(launches, dependent=False)
    record(
        f"launch floor: {launches} empty dependent kernels",
        None,
        floor_s,
        f"as many launches as a step, PDL as the model; plain launches {plain_floor_s * 1e3:.3f} ms",
    )
    avg_context = length + new // 2
    roof_s, roof_bytes = roofline_seconds(cfg, avg_context, bandwidth)
    record(
        "roofline (weights + KV bytes / copy bandwidth)",
        None,
        roof_s,
        f"{roof_bytes / 1e6:.0f} MB per token at context {avg_context}, {bandwidth / 1e12:.2f} TB/s measured",
    )
    base = rows[0]["decode_ms"]
    print(
        f"\nverify.bench model: {shape}, prompt {length}, {new} new tokens, KV cache of "
        f"{max_seq} rows, batch 1, {torch.cuda.get_device_name()}"
    )
    table = []
    for r in rows:
        decode = r["decode_ms"]
        table.append(
            [
                r["name"],
                "-" if r["prefill_ms"] is None else f"{r['prefill_ms']:.2f}",
                "-" if decode is None else f"{decode:.3f}",
                "-" if decode is None else f"{1e3 / decode:.0f}",
                "-" if decode is None else f"{decode / base:.2f}x",
                r["note"],
            ]
        )
    print(
        timing.table(
            ["implementation", "prefill ms", "decode ms/token", "tokens/s", "vs triton+graph", "note"], table
        )
    )
    payload = {"preset": None if args.config else args.preset, "config": args.config, "prompt_len": length,
               "new_tokens": new, "cache_len": max_seq, "bandwidth": bandwidth, "rows": rows}  # fmt: skip
    if shape == "preset article":  # reported, not enforced, as in the gemm and attention suites
        payload["targets"] = targets(rows, length)
        print("\ntargets")
        print(timing.targets_table(payload["targets"]))
    cli.write_json(args.json, payload)
    return 0
