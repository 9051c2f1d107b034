"""``python -m verify.e2e``: greedy token parity of the Triton model (CUDA Graph decode on GPU,
the same static-buffer runner on CPU) against the reference model and HF transformers.

Every model is fed the reference's token at every step (teacher forcing), so one difference
does not cascade. A differing token that the reference scores within the calibrated logits
noise of its best is a near-tie (reported, not a failure); any other is a divergence. Logits
that drift far past that noise fail too, even while the tokens still agree (a broken kernel
may take many steps to flip a token).
Exit 0: parity; 1: a divergence or a drift; 2: bad usage or input.
"""

from __future__ import annotations

import argparse
import inspect
import os
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from verify.cli import EPILOG, UsageError, checked_ids, parse_ids, positive_int
from verify.impl_loader import exception_text

if TYPE_CHECKING:
    from verify.models import Models

TOP_K = 50


@dataclass
class Comparison:
    """One implementation's logits at one step, against the reference's."""

    token: int
    max_abs_diff: float
    top_k_overlap: int
    verdict: str  # "ok", "near-tie", "DRIFTS" or "DIVERGES"


@dataclass
class Step:
    """One generated position: the reference's token and its top-1 margin, and each compared
    model's verdict there."""

    step: int
    position: int
    ref_token: int
    ref_margin: float
    against: dict[str, Comparison] = field(default_factory=dict)


class HFOracleError(Exception):
    """transformers cannot load or run the checkpoint: the oracle is unusable, which is bad input,
    not a divergence."""

    def __init__(self, what: str, exc: Exception) -> None:
        super().__init__(
            f"--against hf: {what} ({type(exc).__name__}: {exception_text(exc)}); "
            "--against reference runs without it"
        )


def margin(logits: torch.Tensor) -> float:
    """Top-1 minus top-2 logit: how far a token is from flipping."""
    top2 = logits.float().topk(2).values
    return float(top2[0] - top2[1])


def compare(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    ref_token: int,
    tie_tolerance: float,
    drift_tolerance: float | None = None,
) -> Comparison:
    """Same token: ok. Another token the reference scores within ``tie_tolerance`` of its best: a
    near-tie (the noise can flip it). Another token, or a NaN or inf logit: a divergence. Either of
    the first two with a logit off by more than ``drift_tolerance`` (None: no drift check): a drift."""
    ref = ref_logits.float()
    token = int(torch.argmax(logits))
    k = min(TOP_K, ref.numel())
    overlap = len(set(logits.float().topk(k).indices.tolist()) & set(ref.topk(k).indices.tolist()))
    diff = float((logits.float() - ref).abs().max())
    flipped = token != ref_token and float(ref[ref_token] - ref[token]) > tie_tolerance
    if flipped or not bool(torch.isfinite(logits).all()):
        verdict = "DIVERGES"
    elif drift_tolerance is not None and diff > drift_tolerance:
        verdict = "DRIFTS"
    else:
        verdict = "ok" if token == ref_token else "near-tie"
    return Comparison(token, diff, overlap, verdict)


# ---- the three implementations, stepped in lockstep -------------------------------------------


def hf_forward(model: torch.nn.Module, ids: torch.Tensor, cache: object) -> tuple[torch.Tensor, object]:
    """One cached forward of an HF causal LM: ``(logits, cache)``. transformers renamed the
    argument and output ``past_key_values`` to ``cache`` (5.24 warns that the old name goes in
    5.40), so the name is taken from the installed version's ``forward``."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=ids, use_cache=True, **{name: cache})
    return out.logits, getattr(out, name)


class HFModel:
    """HF transformers on the same checkpoint: the independent third implementation."""

    def __init__(self, directory: Path, device: torch.device) -> None:
        try:
            from transformers import AutoModelForCausalLM
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # its loading bar would break into the step table
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
        except Exception as exc:  # transformers raises many kinds (OSError, ValueError, ImportError, ...)
            raise HFOracleError(f"transformers cannot load {directory}", exc) from None
        model.config.return_dict = True  # an output format, not the model: its inner layers read it too
        self.model = model.to(device).eval()
        self.directory = directory
        self.cache = None

    @torch.no_grad()
    def step(self, ids: torch.Tensor) -> torch.Tensor:
        try:
            logits, self.cache = hf_forward(self.model, ids, self.cache)
        except Exception as exc:  # a config transformers loads but cannot run
            raise HFOracleError(f"transformers' forward of {self.directory} raised", exc) from None
        return logits[:, -1]


def logits_noise(models: Models, prompt: torch.Tensor) -> float:
    """The logits noise of plain torch in the model's dtype: max |the reference computed in that
    dtype - in fp32| at prefill. The near-tie and drift tolerances are multiples of it."""
    from model.generate import prefill
    from references.precision import computing_in

    with computing_in(models.weights.dtype):
        lowp = prefill(models.reference, prompt)
    exact = prefill(models.reference, prompt)  # rewrites the cache rows the bf16 run wrote
    return float((lowp.float() - exact.float()).abs().max())


def run(
    models: Models,
    prompt: torch.Tensor,
    new_tokens: int,
    against: list[str],
    tie_factor: float,
    drift_factor: float,
    progress: Callable[[Step], object] = print,
) -> tuple[list[Step], dict]:
    """Greedy decoding of ``new_tokens`` after ``prompt``, teacher-forced on the reference's
    tokens (a flip at one step must not derail every later one), the Triton model decoding
    through its CUDA Graph runner; returns the steps and the calibration. Where the model's dtype
    is fp32 the noise is 0: near-ties are exact ties and there is no drift check."""
    from model.generate import prefill
    from model.graph import DecodeRunner
    from model.reference import check_finite

    hf = HFModel(models.directory, prompt.device) if "hf" in against else None  # first: it may fail
    noise = logits_noise(models, prompt)
    tie_tol = tie_factor * noise
    drift_tol = drift_factor * noise if noise > 0 else None
    length = prompt.shape[1]
    runner = DecodeRunner(models.triton, batch=1)
    ref_logits = prefill(models.reference, prompt)
    logits = {"triton": prefill(models.triton, prompt)}
    if hf is not None:
        logits["hf"] = hf.step(prompt)
    steps: list[Step] = []
    for step in range(new_tokens):
        ref_row = ref_logits[0]
        check_finite(ref_row, f"at step {step}")
        ref_token = int(torch.argmax(ref_row))
        record = Step(step, length + step, ref_token, margin(ref_row))
        for name, value in logits.items():
            record.against[name] = compare(value[0], ref_row, ref_token, tie_tol, drift_tol)
        steps.append(record)
        progress(record)
        if step + 1 == new_tokens:
            break
        token = torch.tensor([ref_token], device=prompt.device)
        position = length + step
        start = torch.full((1,), position, dtype=torch.int32, device=prompt.device)
        ref_logits = models.reference.forward(token[:, None], start)
        runner.step(token, position)
        logits = {"triton": runner.logits.clone()}
        if hf is not None:
            logits["hf"] = hf.step(token[:, None])
    calibration = {
        "bf16_logits_noise": noise,
        "near_tie_tolerance": tie_tol,
        "near_tie_factor": tie_factor,
        "drift_tolerance": drift_tol,
        "drift_factor": drift_factor,
        "decode": "cuda graph" if runner.graph is not None else "static buffers, uncaptured",
    }
    return steps, calibration


# ---- the command line ---------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m verify.e2e",
        description=" ".join(__doc__.split("\n\n")[0].split()),
        epilog=EPILOG + " Here 1 also means logits that drift past drift_factor x the measured noise "
        "(tolerances.toml [e2e]) while the tokens agree.",
    )
    from verify.cli import add_cache_argument, add_model_arguments

    add_model_arguments(p)
    add_cache_argument(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--prompt", metavar="TEXT", help="prompt text (needs a tokenizer in the model directory)"
    )
    src.add_argument("--prompt-ids", metavar="IDS", help="prompt token ids, comma separated")
    p.add_argument(
        "--new-tokens", type=positive_int, default=8, metavar="N", help="tokens to generate (default 8)"
    )
    p.add_argument(
        "--against",
        default="reference,hf",
        metavar="reference[,hf]",
        help="reference, or reference,hf (the default): HF is optional",
    )
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    return p


def _prompt(
    args: argparse.Namespace, directory, vocab: int, device: torch.device
) -> tuple[torch.Tensor, object]:
    """The prompt ``[1, tokens]`` and the tokenizer (``--prompt`` only)."""
    tokenizer = None
    if args.prompt is not None:
        tokenizer = _tokenizer(directory)
        try:
            encoded = tokenizer(args.prompt)["input_ids"]
        except Exception as exc:  # tokenizers raise their own kinds (a vocabulary without [UNK], ...)
            raise UsageError(
                f"--prompt: the tokenizer in {directory} cannot encode it ({type(exc).__name__}: {exc})"
            ) from None
        ids = checked_ids("--prompt", encoded, vocab)
    elif args.prompt_ids is not None:
        ids = checked_ids("--prompt-ids", parse_ids(args.prompt_ids), vocab)
    elif args.model is None:
        from model import embedded

        ids = list(embedded.default_prompt())
    else:
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (16,), generator=gen).tolist()
    return torch.tensor([ids], dtype=torch.int64, device=device), tokenizer


def _tokenizer(directory) -> object:
    from pathlib import Path

    files = ("tokenizer.json", "tokenizer.model", "vocab.json")
    if not any((Path(directory) / f).is_file() for f in files):
        raise UsageError(
            f"--prompt needs a tokenizer in {directory} (one of {', '.join(files)}); use --prompt-ids"
        )
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(directory)
    except Exception as exc:
        raise UsageError(f"--prompt needs a tokenizer in {directory}: {type(exc).__name__}: {exc}") from None


def _row(step: Step, names: list[str]) -> str:
    cells = [f"{step.step:>4}", f"{step.position:>5}", f"{step.ref_token:>9}", f"{step.ref_margin:>8.3f}"]
    for name in names:
        c = step.against[name]
        cells += [
            f"{c.token:>9}",
            f"{c.max_abs_diff:>10.4f}",
            f"{c.top_k_overlap:>4}/{TOP_K}",
            f"{c.verdict:<8}",
        ]
    return "  ".join(cells)


def _header(names: list[str]) -> str:
    cells = [f"{'step':>4}", f"{'pos':>5}", f"{'reference':>9}", f"{'margin':>8}"]
    for name in names:
        cells += [f"{name:>9}", f"{'max|dlog|':>10}", f"{'top' + str(TOP_K):>7}", f"{'verdict':<8}"]
    return "  ".join(cells)


def bisect_command(args: argparse.Namespace, prompt: list[int], step: int) -> str:
    """The bisect run that looks for where this run went wrong: the same checkpoint, injections,
    KV cache and prompt (bisect draws the default prompts as this does), as many decode steps
    as it took to get there."""
    from verify.cli import DEFAULT_S

    words = ["python", "-m", "verify.bisect", "--layer"]
    if args.model is not None:
        words += ["--model", args.model]
    for text in args.inject:
        words += ["--inject", text]
    if args.inject and args.timeout != DEFAULT_S:
        words += ["--timeout", "0" if args.timeout is None else f"{args.timeout:g}"]
    if args.cache_len is not None:
        words += ["--cache-len", str(args.cache_len)]
    if args.prompt is None and args.prompt_ids is None:
        words += ["--prompt-len", str(len(prompt))]
    else:
        words += ["--prompt-ids", ",".join(map(str, prompt))]
    words += ["--decode-steps", str(step)]
    return shlex.join(words)


def _verdict(name: str, steps: list[Step], drift_tolerance: float | None, hint: Callable[[Step], str]) -> str:
    """Print and return one model's verdict over the run: its first divergence, else its first
    drift, else parity (with the near-ties named). ``hint(step)`` follows the Triton model's."""
    at = {v: [s for s in steps if s.against[name].verdict == v] for v in ("DIVERGES", "DRIFTS", "near-tie")}
    ties = [s.step for s in at["near-tie"]]
    tie_text = f", near-ties at steps {ties}" if ties else ""
    if at["DIVERGES"]:
        s = at["DIVERGES"][0]
        c = s.against[name]
        print(
            f"{name}: DIVERGES at step {s.step} (position {s.position}): reference token {s.ref_token} "
            f"(margin {s.ref_margin:.3f}), {name} token {c.token}; max logits diff {c.max_abs_diff:.4f}"
            f"{hint(s) if name == 'triton' else ''}"
        )
        return "DIVERGES"
    if at["DRIFTS"]:
        s = at["DRIFTS"][0]
        worst = max(d.against[name].max_abs_diff for d in at["DRIFTS"])
        print(
            f"{name}: DRIFTS from step {s.step} (position {s.position}): logits off by up to {worst:.4f}, "
            f"past the drift tolerance {drift_tolerance:.4f}, with no token flipped past the near-tie "
            f"tolerance over {len(steps)} steps{tie_text}{hint(s) if name == 'triton' else ''}"
        )
        return "DRIFTS"
    print(f"{name}: token parity with the reference over {len(steps)} steps{tie_text}")
    return "near-ties" if ties else "parity"


def _injected_failure(json_path: str | None, run_json: dict, message: str, where: str = "") -> int:
    """An injected op raised or hung: the Triton model diverges (exit 1), and ``--json`` says why."""
    from verify import cli

    print(f"triton: DIVERGES: {message}\n{where}", end="", flush=True)
    cli.write_report_json(
        "verify.e2e", json_path, {**run_json, "verdicts": {"triton": "DIVERGES"}, "raised": message}
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    from verify.cli import parse_args

    args = parse_args("verify.e2e", _parser, argv)
    if args is None:
        return 2
    from model.generate import cache_rows_needed
    from model.reference import NonFiniteReference
    from ops import backend
    from verify import cli
    from verify import models as model_loading
    from verify.tolerances import setting
    from verify.watchdog import Watchdog

    against = [a.strip() for a in args.against.split(",") if a.strip()]
    unknown = sorted(set(against) - {"reference", "hf"})
    try:
        if unknown or "reference" not in against:
            raise UsageError(f"--against {args.against!r}: expected 'reference' and optionally 'hf'")
        cli.check_output_file("--json", args.json, cli.model_reads(args))
        injections = [model_loading.parse_injection(text) for text in args.inject]
        device = backend.device()
        if args.prompt is None:  # no tokenizer: the request is checked before a checkpoint is built
            directory, config = None, model_loading.requested_config(args.model)
        else:
            directory, config = model_loading.checkpoint_config(args.model)
        prompt, tokenizer = _prompt(args, directory, config.vocab_size, device)
        needed = cache_rows_needed(prompt.shape[1], args.new_tokens)
        what = f"the prompt's {prompt.shape[1]} tokens + {args.new_tokens} new tokens"
        max_seq = model_loading.cache_rows(args.cache_len, needed, what, config, device)
        if directory is None:
            directory, config = model_loading.checkpoint_config(args.model)
        run_json = {
            "model": str(directory),
            "backend": backend.name(),
            "prompt": prompt[0].tolist(),
            "cache_len": max_seq,
            "injected": [i.as_json() for i in injections],
        }

        def hung(inj: model_loading.Injection, seconds: float) -> None:  # on the watchdog's thread
            _injected_failure(args.json, run_json, model_loading.hang_message(inj, seconds))

        watchdog = Watchdog(args.timeout, hung)
        models = model_loading.load(directory, config, device, 1, max_seq, injections, watchdog)
        run_json["ops"] = model_loading.describe_ops(models)  # fused or unfused, as the header says
    except UsageError as exc:
        print(f"verify.e2e: {exc}", file=sys.stderr)
        return 2

    names = ["triton"] + (["hf"] if "hf" in against else [])
    print(
        f"verify.e2e: {models.directory} ({models.config.family}, {models.config.num_layers} layers), "
        f"backend {backend.name()}, {model_loading.describe_ops(models)}, prompt {prompt.shape[1]} tokens, "
        f"{args.new_tokens} new, KV cache {max_seq} rows"
    )
    for inj in injections:
        print(f"  injected: {inj.op} = {inj.impl_spec} in layers {inj.layer_spec}")
    print(_header(names))
    started = time.monotonic()
    try:
        with torch.no_grad():
            steps, calibration = run(
                models,
                prompt,
                args.new_tokens,
                against,
                setting("e2e", "near_tie_factor"),
                setting("e2e", "drift_factor"),
                progress=lambda s: print(_row(s, names), flush=True),
            )
    except model_loading.InjectedOpError as exc:
        return _injected_failure(args.json, run_json, str(exc), exc.where)
    except (NonFiniteReference, HFOracleError) as exc:
        print(f"verify.e2e: {exc}", file=sys.stderr)
        return 2
    elapsed = time.monotonic() - started
    drift = calibration["drift_tolerance"]
    drift_text = (
        f"drift tolerance {drift:.4f} ({calibration['drift_factor']:g}x)"
        if drift is not None
        else "no drift check (the noise is 0)"
    )
    print(
        f"logits noise {calibration['bf16_logits_noise']:.4f}: near-tie tolerance "
        f"{calibration['near_tie_tolerance']:.4f} ({calibration['near_tie_factor']:g}x), {drift_text}; "
        f"decode: {calibration['decode']}; {elapsed:.1f}s"
    )

    def hint(step: Step) -> str:
        return f"; `{bisect_command(args, prompt[0].tolist(), step.step)}` finds where"

    verdicts = {name: _verdict(name, steps, drift, hint) for name in names}
    if tokenizer is not None:
        print("text:", tokenizer.decode([s.ref_token for s in steps]))
    undecided = untestable(steps, calibration)
    cli.write_json(
        args.json,
        {**run_json, "calibration": calibration, "verdicts": verdicts, "steps": [asdict(s) for s in steps],
         "untestable": undecided},
    )  # fmt: skip
    if undecided:
        print(f"verify.e2e: {undecided}", file=sys.stderr)
        return 2
    return 0 if set(verdicts.values()) <= {"parity", "near-ties"} else 1


def untestable(steps: list[Step], calibration: dict) -> str | None:
    """Why this checkpoint cannot fail the run, or None: with no drift check (a logits noise of 0)
    only tokens are judged, and where the reference's top token wins by no more than the near-tie
    tolerance at every step, any token passes (an embedding so large that every logit ties)."""
    tolerance = calibration["near_tie_tolerance"]
    if calibration["drift_tolerance"] is not None or any(s.ref_margin > tolerance for s in steps):
        return None
    return (
        f"the checkpoint decides no token: the reference's top-1 margin is at most {tolerance:.4g} "
        f"(the near-tie tolerance) at every step and the logits noise is 0 (no drift check), so any "
        f"token would pass; a checkpoint whose top tokens win by a margin is needed"
    )


if __name__ == "__main__":
    from verify import cli

    cli.exit_with(main)
