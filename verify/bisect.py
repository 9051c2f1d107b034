"""``python -m verify.bisect --layer``: find the first layer, then the op, where the Triton model
leaves the reference.

Both models run the same input. Per layer, two errors side by side: free-running (each model
on its own activations: the drift accumulated so far) and teacher-forced (the Triton layer fed
the reference's input to that layer: the layer's own error). A layer's own error is judged
against a calibrated threshold: ``layer_error_factor`` (tolerances.toml) times the error of
plain bf16 torch running the same layer on the same input. The first layer over it is drilled
into: each of its ops is run on the reference's inputs for that op and judged with the op's
own tolerance, naming the op and writing a ready-to-run ``verify.op`` repro. Prefill and then
each decode step are checked (a KV cache bug may only show while decoding).
Exit 0: no divergence; 1: a divergence was found; 2: bad usage or input.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from model.decoder import MODEL_LAYER, Decoder, OpCall

EMBED, HEAD = "embed", "head"  # the model-level ops before the first and after the last layer


@dataclass
class Error:
    """How far one tensor is from another, in the measures the tables print."""

    max_abs: float
    mean_abs: float
    rel_l2: float
    cosine: float


def error(actual: torch.Tensor, expected: torch.Tensor) -> Error:
    a, e = actual.double().flatten(), expected.double().flatten()
    diff = a - e
    norm = float(e.norm()) or 1.0
    cos = float(torch.nn.functional.cosine_similarity(a, e, dim=0)) if a.numel() else 1.0
    return Error(float(diff.abs().max()), float(diff.abs().mean()), float(diff.norm()) / norm, cos)


@dataclass
class LayerResult:
    """One layer at one step: the free-running and teacher-forced errors against the reference,
    and plain bf16 torch's on the same input, whose multiple is the threshold."""

    step: int
    layer: str  # "embed", "0", "1", ..., "head"
    free: Error
    forced: Error
    lowp: Error  # plain bf16 torch on the same input: the yardstick
    threshold: float  # on the teacher-forced relative L2
    passed: bool


@dataclass
class OpResult:
    """One op of the drill-down, run on the reference's recorded inputs for that op."""

    point: str
    op: str
    shapes: str
    passed: bool
    max_abs: float
    detail: str
    repro: str = ""


@dataclass
class Report:
    """The whole run, as --json writes it: every layer's result, the first that diverged, its
    drill-down and the culprit op (if one op diverges on its own)."""

    model: str
    backend: str
    injected: list[dict]
    cache_len: int = 0  # the KV cache's rows
    prompt: list[int] = field(default_factory=list)  # the prefill's token ids (--prompt-ids takes them)
    ops: str = ""  # fused or unfused, as the header says
    verdict: str = "VERIFIED"  # or "DIVERGES"
    steps: list[str] = field(default_factory=list)
    layers: list[LayerResult] = field(default_factory=list)
    first: LayerResult | None = None
    drill: list[OpResult] = field(default_factory=list)
    culprit: OpResult | None = None
    raised: str | None = None  # an injected op raised: the run stopped there


# ---- recording the reference ---------------------------------------------------------------------


class Recorder:
    """An interceptor that keeps every op call's inputs (as they were before the call) and outputs."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []  # (OpCall, args snapshot, result snapshot)

    def __call__(self, call: OpCall, run: Callable[[], Any]) -> Any:
        from verify.compare import clone_value

        args = clone_value(call.args)
        result = run()
        self.calls.append((call, args, clone_value(result)))
        return result

    def find(self, layer: int, point: str) -> tuple[Any, Any]:
        return next(
            (args, result) for call, args, result in self.calls if (call.layer, call.point) == (layer, point)
        )


def _stream(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return x.float() + residual.float()


@dataclass
class StepTrace:
    """The reference's pass over one step: every layer's input and output pair, every op call."""

    ids: torch.Tensor
    start_pos: torch.Tensor
    layer_io: list[tuple]  # per layer: ((x_in, residual_in), (x_out, residual_out))
    logits: torch.Tensor
    recorder: Recorder


def trace_reference(model: Decoder, ids: torch.Tensor, start_pos: torch.Tensor) -> StepTrace:
    from verify.compare import clone_value

    recorder = Recorder()
    outputs: list[tuple] = []
    model.interceptor = recorder
    try:
        logits = model.forward(ids, start_pos, layer_hook=lambda n, x, r: outputs.append(clone_value((x, r))))
    finally:
        model.interceptor = None
    embedded = recorder.find(MODEL_LAYER, "embedding")[1]
    inputs = [(embedded, torch.zeros_like(embedded)), *outputs[:-1]]  # layer 0: a zero residual
    return StepTrace(ids, start_pos, list(zip(inputs, outputs, strict=True)), logits, recorder)


def _layer_args(model: Decoder, trace: StepTrace) -> tuple:
    cos, sin = trace.recorder.find(MODEL_LAYER, "rope")[1]
    return cos, sin, trace.start_pos, model.positions_and_lengths(trace.start_pos, trace.ids.shape[1])[1]


# ---- judging layers and ops ----------------------------------------------------------------------


def _passed(output) -> str:
    """Why a passing output passed: its rule's own words, or how close it came to the bound."""
    if output.reason:
        return output.reason
    if output.used is None:
        return "exact match"
    return f"within allclose, worst element at {output.used:.0%} of its bound"


def check_recorded_ops(
    trace: StepTrace, layer: int, triton: Decoder, save_dir: Path, step: int, impl_specs: dict
) -> list[OpResult]:
    """Run each Triton op of ``layer`` on the reference's inputs to that op; judge with the op's tolerance."""
    import registry
    from verify import cases
    from verify.compare import check, clone_value, describe_inputs

    results = []
    for call, args, _ in trace.recorder.calls:
        if call.layer != layer:
            continue
        spec = registry.get(call.op)
        impl = triton.overrides.get((call.op, layer), triton.impls[call.op])
        place = "model" if layer == MODEL_LAYER else f"layer{layer}"
        file = save_dir / f"step{step}-{place}-{call.point}-{call.op}.pt"
        case = cases.recorded(str(file), args)
        result = check(spec, case, impl, impl_specs.get((call.op, layer)))
        shapes = describe_inputs(case)
        if not result.passed:
            on_cpu = clone_value(args, "cpu")  # arguments sharing a buffer share its copy in the file
            file.parent.mkdir(parents=True, exist_ok=True)  # the directory is made when first needed
            torch.save({"op": call.op, "args": on_cpu}, file)
        worst = next((o for o in result.outputs if not o.passed), None)
        where = f"; failing elements: {worst.failing_at}" if worst and worst.failing_at else ""
        detail = result.error or (worst.reason + where if worst else "; ".join(map(_passed, result.outputs)))
        results.append(
            OpResult(
                call.point,
                call.op,
                shapes,
                result.passed,
                result.max_abs,
                detail.strip(),
                result.repro if not result.passed else "",
            )
        )
    return results


def compare_step(
    step: int,
    trace: StepTrace,
    free_streams: list[torch.Tensor],
    free_logits: torch.Tensor,
    triton: Decoder,
    lowp: Decoder,
    factor: float,
    save_dir: Path,
    impl_specs: dict,
) -> list[LayerResult]:
    from references.precision import computing_in

    cos, sin, start, seq_lens = _layer_args(triton, trace)
    results = []
    embed_ops = check_recorded_ops(trace, MODEL_LAYER, triton, save_dir, step, impl_specs)
    embed_ops = [r for r in embed_ops if r.op in ("embedding", "rope_cos_sin")]
    ref_embed = trace.layer_io[0][0][0]
    tri_embed = triton.op(MODEL_LAYER, "embedding", "embedding", trace.ids, triton.weights.embed)
    e = error(tri_embed, ref_embed)
    results.append(LayerResult(step, EMBED, e, e, Error(0, 0, 0, 1), 0.0, all(r.passed for r in embed_ops)))
    for n, ((x_in, r_in), (x_out, r_out)) in enumerate(trace.layer_io):
        expected = _stream(x_out, r_out)
        forced = _stream(*triton.layer(n, x_in, r_in, cos, sin, start, seq_lens))
        with computing_in(lowp.weights.dtype):
            low = _stream(*lowp.layer(n, x_in, r_in, cos, sin, start, seq_lens))
        lowp_err, forced_err = error(low, expected), error(forced, expected)
        threshold = factor * lowp_err.rel_l2 + 1e-6
        results.append(
            LayerResult(
                step,
                str(n),
                error(free_streams[n], expected),
                forced_err,
                lowp_err,
                threshold,
                forced_err.rel_l2 <= threshold,
            )
        )
    x_last, r_last = trace.layer_io[-1][1]
    forced_logits = triton.head(x_last, r_last)
    with computing_in(lowp.weights.dtype):
        low_logits = lowp.head(x_last, r_last)
    lowp_err, forced_err = error(low_logits, trace.logits), error(forced_logits, trace.logits)
    threshold = factor * lowp_err.rel_l2 + 1e-6
    results.append(
        LayerResult(
            step,
            HEAD,
            error(free_logits, trace.logits),
            forced_err,
            lowp_err,
            threshold,
            forced_err.rel_l2 <= threshold,
        )
    )
    return results


def free_run(
    model: Decoder, ids: torch.Tensor, start_pos: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor]:
    streams: list[torch.Tensor] = []
    logits = model.forward(ids, start_pos, layer_hook=lambda n, x, r: streams.append(_stream(x, r)))
    return streams, logits


# ---- the command line ----------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    from verify.cli import EPILOG

    p = argparse.ArgumentParser(
        prog="python -m verify.bisect", description=" ".join(__doc__.split("\n\n")[0].split()), epilog=EPILOG
    )
    p.add_argument(
        "--layer",
        action="store_true",
        help="compare layer by layer, then op by op in the first layer that diverges "
        "(what bisect always does; the flag is accepted as ARCHITECTURE.md spells the command)",
    )
    from verify.cli import add_cache_argument, add_model_arguments, positive_int

    add_model_arguments(p)
    add_cache_argument(p)
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument(
        "--prompt-len",
        type=positive_int,
        metavar="N",
        default=12,
        help="prompt tokens for the prefill pass (default 12): the embedded model's default prompt "
        "repeated, else random ids (seed 0, as verify.e2e draws them)",
    )
    prompt.add_argument(
        "--prompt-ids", metavar="IDS", help="the prompt's token ids, comma separated (as verify.e2e takes)"
    )
    p.add_argument(
        "--decode-steps",
        type=int,
        default=3,
        metavar="K",
        help="decode steps checked after prefill (default 3)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    p.add_argument(
        "--plot",
        metavar="FILE",
        help="per-layer error plot: .png (added to a bare name), .pdf or .svg; needs matplotlib",
    )
    p.add_argument(
        "--repro-dir", metavar="DIR", help="where failing op inputs are saved (default: a temp dir)"
    )
    return p


def _prompt_ids(args: argparse.Namespace, vocab: int) -> list[int]:
    """``--prompt-ids``, else ``--prompt-len`` tokens: the embedded model's default prompt repeated,
    or random ids drawn as verify.e2e draws its default prompt (the same for its 16 tokens)."""
    if args.prompt_ids is not None:
        from verify.cli import checked_ids, parse_ids

        return checked_ids("--prompt-ids", parse_ids(args.prompt_ids), vocab)
    if args.model is None:
        from model import embedded

        base = list(embedded.default_prompt())
        return (base * (args.prompt_len // len(base) + 1))[: args.prompt_len]
    return torch.randint(0, vocab, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()


def _fmt(e: Error) -> str:
    return f"{e.max_abs:>9.3g} {e.rel_l2:>9.3g} {e.cosine:>9.6f}"


def print_step(results: list[LayerResult], label: str) -> None:
    print(f"\n{label}")
    print(
        f"{'layer':>5}  {'free-running: max abs':>21} {'rel L2':>9} {'cosine':>9}   "
        f"{'teacher-forced: max abs':>23} {'rel L2':>9} {'cosine':>9}   "
        f"{'bf16 rel L2':>11} {'threshold':>9}  verdict"
    )
    for r in results:
        verdict = "ok" if r.passed else "OVER"
        print(
            f"{r.layer:>5}  {'':>12}{_fmt(r.free)}   {'':>14}{_fmt(r.forced)}   {r.lowp.rel_l2:>11.3g} "
            f"{r.threshold:>9.3g}  {verdict}"
        )


def _clipped(text: str, width: int) -> str:
    """The text cut at a word boundary to fit the table, marked when cut."""
    if len(text) <= width:
        return text
    return text[: width - 4].rsplit(" ", 1)[0].rstrip(";,") + " ..."


def print_drill(ops: list[OpResult]) -> None:
    width = max(len("op"), *(len(r.op) for r in ops))  # fused ops' names run long
    print(f"\n{'point':<13} {'op':<{width}} {'verdict':<8} {'max abs':>9}  detail")
    for r in ops:
        print(
            f"{r.point:<13} {r.op:<{width}} {'ok' if r.passed else 'DIVERGES':<8} {r.max_abs:>9.3g}  "
            f"{_clipped(r.detail, 90)}"
        )
        if not r.passed:
            print(f"{'':<13} inputs: {r.shapes}")


PLOT_SUFFIXES = (".png", ".pdf", ".svg")


def plot_path(path: str | None) -> str | None:
    """The file ``--plot`` writes: ``.png`` added to a bare name; a suffix matplotlib would not
    take for a plot (or a typo) is refused before the run, not after it."""
    if not path or path.endswith(("/", os.sep)):  # no file path: check_output_file says so
        return path
    suffix = Path(path).suffix.lower()
    if not suffix:
        return path + ".png"
    if suffix not in PLOT_SUFFIXES:
        from verify.models import UsageError

        raise UsageError(f"--plot {path}: expected a file ending in .png, .pdf or .svg, got {suffix!r}")
    return path


def where(layer: str) -> str:
    """A report row's place in the model, as the verdict lines name it."""
    return {EMBED: "the embedding (before layer 0)", HEAD: "the head (after the last layer)"}.get(
        layer, f"layer {layer}"
    )


def plot(report: Report, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prefill = [r for r in report.layers if r.step == 0]
    embed = next(r for r in prefill if r.layer == EMBED)  # judged by its ops' checks: no threshold to draw
    rows = [r for r in prefill if r.layer != EMBED]
    xs = list(range(len(rows)))

    def errors(values: list[float]) -> list[float]:
        return [v if v > 0 else float("nan") for v in values]  # a zero error has no place on a log axis

    fig, ax = plt.subplots(figsize=(9, 4))
    ax.semilogy(xs, errors([r.free.rel_l2 for r in rows]), "o-", label="free-running")
    ax.semilogy(xs, errors([r.forced.rel_l2 for r in rows]), "s-", label="teacher-forced (own error)")
    ax.semilogy(xs, errors([r.threshold for r in rows]), "k--", label="threshold")
    ax.set_xticks(xs, [r.layer for r in rows], rotation=90)
    ax.set_xlabel("layer (a missing point: an error of 0)")
    ax.set_ylabel("relative L2 error vs reference")
    embedding = "embedding ops within tolerance" if embed.passed else "embedding ops DIVERGE"
    ax.set_title(f"verify.bisect, prefill ({embedding}): {report.model}", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot written to {path}"


def _walk(args, ids: torch.Tensor, models, free, lowp, factor: float, save_dir: Path, impl_specs, report):
    """Prefill ``ids``, then each decode step: compare every layer; at the first failing one, drill
    into its ops."""
    from model.reference import check_finite

    started = time.monotonic()
    start = torch.zeros(1, dtype=torch.int32, device=ids.device)
    for step in range(args.decode_steps + 1):
        label = "prefill" if step == 0 else f"decode step {step} (position {int(start)})"
        trace = trace_reference(models.reference, ids, start)
        check_finite(trace.logits, f"at {label}")  # a broken yardstick is bad input, not a divergence
        free_streams, free_logits = free_run(free, ids, start)
        results = compare_step(
            step, trace, free_streams, free_logits, models.triton, lowp, factor, save_dir, impl_specs
        )
        report.steps.append(label)
        report.layers += results
        print_step(results, f"{label} (done at {time.monotonic() - started:.1f}s)")
        failed = next((r for r in results if not r.passed), None)
        if failed is not None:
            report.first = failed
            layer = {EMBED: MODEL_LAYER, HEAD: MODEL_LAYER}.get(failed.layer)
            layer = int(failed.layer) if layer is None else layer
            ops = check_recorded_ops(trace, layer, models.triton, save_dir, step, impl_specs)
            if failed.layer == EMBED:
                ops = [r for r in ops if r.op in ("embedding", "rope_cos_sin")]
            elif failed.layer == HEAD:
                ops = [r for r in ops if r.point in ("final_norm", "lm_head")]
            report.drill = ops
            report.culprit = next((r for r in ops if not r.passed), None)
            break
        next_token = torch.argmax(trace.logits, dim=-1)
        start = start + ids.shape[1]
        ids = next_token[:, None]


def _injected_failure(json_path: str | None, report: Report, message: str, where: str = "") -> int:
    """An injected op raised or hung: the run stops there (exit 1), and ``--json`` says why."""
    from verify import cli

    print(f"\nDIVERGES: {message}\n{where}", end="", flush=True)
    report.raised, report.verdict = message, "DIVERGES"
    cli.write_report_json("verify.bisect", json_path, asdict(report))
    return 1


def main(argv: list[str] | None = None) -> int:
    from verify.cli import parse_args

    args = parse_args("verify.bisect", _parser, argv)
    if args is None:
        return 2
    from model import reference, triton_model
    from ops import backend
    from verify import cli
    from verify import models as model_loading
    from verify.tolerances import setting
    from verify.watchdog import Watchdog

    try:
        if args.decode_steps < 0:
            raise model_loading.UsageError(f"--decode-steps {args.decode_steps}: expected at least 0")
        cli.check_output_file("--json", args.json, cli.model_reads(args))
        args.plot = plot_path(args.plot)
        cli.check_output_file("--plot", args.plot, [*cli.model_reads(args), ("--json", args.json)])
        if args.plot and importlib.util.find_spec("matplotlib") is None:
            raise model_loading.UsageError(f"--plot {args.plot}: needs matplotlib, which is not installed")
        cli.check_output_dir("--repro-dir", args.repro_dir)
        injections = [model_loading.parse_injection(t) for t in args.inject]
        device = backend.device()
        config = model_loading.requested_config(args.model)  # checked before a checkpoint is built
        given = _prompt_ids(args, config.vocab_size) if args.prompt_ids is not None else None
        if given is not None:
            args.prompt_len = len(given)
            what = f"--prompt-ids' {args.prompt_len} tokens + --decode-steps {args.decode_steps}"
        else:
            what = f"--prompt-len {args.prompt_len} + --decode-steps {args.decode_steps}"
        needed = args.prompt_len + args.decode_steps
        max_seq = model_loading.cache_rows(args.cache_len, needed, what, config, device)  # before any cache
        ids = given or _prompt_ids(args, config.vocab_size)  # drawn once the length is known to fit
        directory, config = model_loading.checkpoint_config(args.model)
        report = Report(str(directory), backend.name(), [i.as_json() for i in injections], max_seq, ids)

        def hung(inj: model_loading.Injection, seconds: float) -> None:  # on the watchdog's thread
            _injected_failure(args.json, report, model_loading.hang_message(inj, seconds))

        watchdog = Watchdog(args.timeout, hung)
        models = model_loading.load(directory, config, device, 1, max_seq, injections, watchdog)
        report.ops = model_loading.describe_ops(models)
        free = triton_model.build(models.weights, 1, max_seq, models.triton.fused)
        model_loading.apply_injections(free, injections, watchdog)
    except model_loading.UsageError as exc:
        print(f"verify.bisect: {exc}", file=sys.stderr)
        return 2
    lowp = reference.build(models.weights, 1, max_seq, models.triton.fused)
    factor = setting("bisect", "layer_error_factor")
    impl_specs = {
        (inj.op, n): inj.impl_spec
        for inj in injections
        for n in (inj.layers if inj.layers is not None else range(models.config.num_layers))
    }
    # made when the first input is saved, so a run that finds nothing (or is ended by the
    # watchdog) leaves no empty directory behind
    save_dir = Path(args.repro_dir or Path(tempfile.gettempdir()) / f"bisect-{uuid.uuid4().hex[:8]}")
    print(
        f"verify.bisect: {models.directory} ({models.config.family}, {models.config.num_layers} layers), "
        f"backend {backend.name()}, {model_loading.describe_ops(models)}, prompt {args.prompt_len} tokens "
        f"+ {cli.counted(args.decode_steps, 'decode step')}, KV cache {max_seq} rows; a layer is judged by "
        f"its teacher-forced rel L2 against the threshold, {factor:g} x plain bf16 torch's on the same layer "
        "input (free-running drift is shown, not judged)"
    )
    for inj in injections:
        print(f"  injected: {inj.op} = {inj.impl_spec} in layers {inj.layer_spec}")
    try:
        with torch.no_grad():
            prompt = torch.tensor([ids], dtype=torch.int64, device=device)
            _walk(args, prompt, models, free, lowp, factor, save_dir, impl_specs, report)
    except model_loading.InjectedOpError as exc:
        return _injected_failure(args.json, report, str(exc), exc.where)
    except reference.NonFiniteReference as exc:
        print(f"verify.bisect: {exc}", file=sys.stderr)
        return 2
    print()
    if report.first is None:
        steps = cli.counted(args.decode_steps, "decode step")
        print(f"VERIFIED: every layer within its threshold at prefill and {steps}")
    else:
        report.verdict = "DIVERGES"
        f, place = report.first, where(report.first.layer)
        if f.layer == EMBED:  # judged by its ops' tolerances, not by a rel L2 threshold
            failing = ", ".join(r.op for r in report.drill if not r.passed)
            print(f"DIVERGES: first at {report.steps[-1]}, in {place}: {failing} outside its tolerance")
        else:
            print(
                f"DIVERGES: first at {report.steps[-1]}, in {place}: teacher-forced rel L2 "
                f"{f.forced.rel_l2:.3g} > threshold {f.threshold:.3g} "
                f"({factor:g} x bf16 torch {f.lowp.rel_l2:.3g})"
            )
        print(f"drill-down into {place}: each Triton op on the reference's inputs for that op")
        print_drill(report.drill)
        if report.culprit is not None:
            c = report.culprit
            print(f"\nculprit: {c.op} at {c.point} of {place}\nrepro: {c.repro}")
        else:
            print(
                "\nno single op diverges on the reference's inputs: the layer's error comes from how its ops "
                "compose (rounding accumulating across ops), not from one kernel"
            )
    cli.write_json(args.json, asdict(report))  # before the plot: a plot that fails loses no report
    if args.plot:
        print(plot(report, args.plot))
    return 0 if report.first is None else 1


if __name__ == "__main__":
    from verify import cli

    cli.exit_with(main)
