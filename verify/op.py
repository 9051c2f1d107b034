"""``python -m verify.op NAME [NAME ...] | --all``: property-check ops (or outside implementations of them).

Exit 0: verified. 1: a divergence (the shrunk case and a repro command are printed).
2: bad usage (unknown op, an implementation that fails to load or has the wrong signature, a
``--case`` or ``--inputs`` that is not a valid call of the op).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from registry import OpSpec
    from verify.op_summary import Summary

os.environ.setdefault("HF_HUB_OFFLINE", "1")


DEVICE_LOST = (
    "the implementation faulted the GPU on this case, which leaves the device unusable for the\n"
    "  rest of the process: the run stopped there"
)


def _parser() -> argparse.ArgumentParser:
    from verify.cli import EPILOG, add_timeout_argument, positive_int
    from verify.profiles import NAMES

    profiles = (
        f" HYPOTHESIS_PROFILE={'|'.join(NAMES)} sets how many cases are drawn (default: ci, gpu on cuda)."
    )
    p = argparse.ArgumentParser(
        prog="python -m verify.op",
        description=" ".join(__doc__.split("\n\n")[0].split()),
        epilog=EPILOG + profiles,
    )
    p.add_argument("names", nargs="*", metavar="NAME", help="the ops to check (see --list)")
    p.add_argument(
        "--all",
        action="store_true",
        help="check every registered op (with --impl MODULE: each op it has a function of that name for)",
    )
    p.add_argument(
        "--impl",
        metavar="MODULE[:FN]|FILE.py[:FN]",
        help="an outside implementation: MODULE:FN or FILE.py:FN; a bare MODULE or FILE.py gives each "
        "op its function of the op's name",
    )
    p.add_argument(
        "--examples",
        type=positive_int,
        default=None,
        metavar="N",
        help="Hypothesis cases to draw (default: profile's)",
    )
    p.add_argument(
        "--seed", type=int, default=None, metavar="S", help="Hypothesis seed, for a reproducible search"
    )
    one = p.add_mutually_exclusive_group()
    one.add_argument(
        "--case", metavar="JSON", help="run exactly this case (the JSON a repro command carries)"
    )
    one.add_argument("--inputs", metavar="FILE.pt", help="run on recorded inputs (written by verify.bisect)")
    add_timeout_argument(p, "a case")
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    p.add_argument("--list", action="store_true", help="list the registered ops and exit")
    return p


def _list_ops(json_path: str | None) -> int:
    import registry
    from verify import cli
    from verify.tolerances import rule

    listed = [
        {
            "op": s.name,
            "article_ops": sorted(s.article_ops, key=lambda n: (isinstance(n, str), n)),  # 2, 11, qk-norm
            "rule": rule(s.tolerance),
            "mutates": list(s.mutates),
        }
        for s in registry.all()
    ]
    rows = [
        (r["op"], ", ".join(map(str, r["article_ops"])), r["rule"], ", ".join(r["mutates"]) or "-")
        for r in listed
    ]
    widths = [max(len(r[i]) for r in [("op", "article ops", "rule", "mutates"), *rows]) for i in range(3)]
    for name, ops, kind, mutates in [("op", "article ops", "rule", "mutates"), *rows]:
        print(f"{name:<{widths[0]}}  {ops:<{widths[1]}}  {kind:<{widths[2]}}  {mutates}")
    cli.write_json(json_path, listed)
    return 0


def _check_list_options(args: argparse.Namespace) -> None:
    """``--list`` uses ``--json`` alone: any other option would be ignored, so it is refused."""
    from verify.cli import DEFAULT_S, UsageError

    given = [
        option
        for option, value in (
            ("--all", args.all or None),
            ("--impl", args.impl),
            ("--examples", args.examples),
            ("--seed", args.seed),
            ("--case", args.case),
            ("--inputs", args.inputs),
        )
        if value is not None
    ] + (["--timeout"] if args.timeout != DEFAULT_S else [])
    if given:
        raise UsageError(f"--list takes no option but --json (got {', '.join(given)})")


def _coverage_lines(coverage) -> list[str]:
    return [
        f"    {label:<28} {count}"
        for label, count in sorted(coverage.items(), key=lambda kv: (-kv[1], kv[0]))
    ]


@dataclass(frozen=True)
class Chosen:
    """An op to check and what implements it: the registered kernel (``impl`` None) or an outside
    function, named as ``--impl`` would name it alone (``MODULE:FN``), for repro commands."""

    spec: OpSpec
    impl: Callable | None = None
    impl_label: str | None = None

    @property
    def label(self) -> str:
        return self.impl_label or f"registered {self.spec.name} kernel"


def _chosen_ops(args: argparse.Namespace) -> list[OpSpec]:
    import registry
    from verify.cli import UsageError

    one_case = "--case" if args.case is not None else "--inputs" if args.inputs is not None else None
    if args.all:
        if args.names:
            raise UsageError(f"--all checks every op; it takes no op name (got {args.names[0]!r})")
        if one_case:
            raise UsageError(f"{one_case} is one call of one op, not of --all")
        return registry.all()
    if not args.names:
        raise UsageError("an op name is required (see --list), or --all")
    twice = next((n for i, n in enumerate(args.names) if n in args.names[:i]), None)
    if twice:
        raise UsageError(f"op {twice!r} is named twice")
    specs = [registry.get(name) for name in args.names]
    if one_case and len(specs) > 1:
        raise UsageError(f"{one_case} is one call of one op; got {len(specs)} ops")
    return specs


def _chosen_impls(args: argparse.Namespace, specs: list[OpSpec]) -> tuple[list[Chosen], list[str]]:
    """Each op with its implementation, and the ops ``--all --impl MODULE`` leaves unchecked (the
    module has no function of their name). Every signature is checked before anything runs."""
    from verify import impl_loader
    from verify.impl_loader import ImplError

    if args.impl is None:
        return [Chosen(spec) for spec in specs], []
    if len(specs) == 1 and not args.all:
        spec = specs[0]
        fn = impl_loader.load(args.impl, default_fn=spec.name, timeout=args.timeout)
        impl_loader.check_signature(fn, spec.reference, spec.name)
        label = args.impl if ":" in args.impl else f"{args.impl}:{spec.name}"
        return [Chosen(spec, fn, label)], []
    if ":" in args.impl:
        raise ImplError(
            f"--impl: {args.impl!r} names one function; for several ops give MODULE or FILE.py, "
            "whose function of each op's name is checked"
        )
    module = impl_loader.load_module(args.impl, timeout=args.timeout)
    chosen, missing = [], []
    for spec in specs:
        fn = getattr(module, spec.name, None)
        if not callable(fn):
            if not args.all:
                raise ImplError(f"--impl: {args.impl} has no callable {spec.name!r}")
            missing.append(spec.name)
            continue
        impl_loader.check_signature(fn, spec.reference, spec.name)
        chosen.append(Chosen(spec, fn, f"{args.impl}:{spec.name}"))
    if not chosen:
        raise ImplError(
            f"--impl: {args.impl} has a function named after none of the ops ({', '.join(missing)})"
        )
    return chosen, missing


def main(argv: list[str] | None = None) -> int:
    from verify.cli import parse_args

    args = parse_args("verify.op", _parser, argv)
    if args is None:
        return 2
    from ops import backend
    from verify import cli, impl_loader, profiles
    from verify.op_summary import Summary

    try:
        profile = profiles.load(backend.name())
    except ValueError as exc:
        print(f"verify.op: {exc}", file=sys.stderr)
        return 2
    if args.list:
        try:
            if args.names:
                raise cli.UsageError(f"--list lists every op; it takes no op name (got {args.names[0]!r})")
            _check_list_options(args)
            cli.check_output_file("--json", args.json)
        except cli.UsageError as exc:
            print(f"verify.op: {exc}", file=sys.stderr)
            return 2
        return _list_ops(args.json)
    try:
        specs = _chosen_ops(args)
        reads = [("--impl", cli.impl_file(args.impl)), ("--inputs", args.inputs)]
        cli.check_output_file("--json", args.json, reads)
        chosen, missing = _chosen_impls(args, specs)
    except KeyError as exc:
        print(f"verify.op: {exc.args[0]}", file=sys.stderr)
        return 2
    except (cli.UsageError, impl_loader.ImplError) as exc:
        print(f"verify.op: {exc}", file=sys.stderr)
        return 2
    if args.case is not None or args.inputs is not None:
        return _one_case(args, chosen[0], profile)

    several = args.all or len(chosen) > 1
    summary = Summary([c.spec.name for c in chosen], missing, args.impl, backend.name(), profile)
    for c in chosen:
        if several and summary.reports:
            print()
        report = _property_run(args, c, profile, summary if several else None)
        summary.reports.append(report)
        if report["device_lost"]:
            summary.stopped_by = "the GPU was lost"
            break
    if not several:
        cli.write_json(args.json, summary.reports[0])
        return 0 if summary.passed else 1
    print()
    print(summary.text())
    cli.write_json(args.json, summary.as_json())
    return 0 if summary.passed else 1


def _one_case(args: argparse.Namespace, chosen: Chosen, profile: str) -> int:
    """``--case`` or ``--inputs``: run one given call of the op; exit 2 where it is no valid call."""
    from ops import backend
    from verify import cli, given_case
    from verify.compare import check
    from verify.watchdog import Watchdog

    spec = chosen.spec
    source = f"--inputs {args.inputs}" if args.inputs is not None else "--case"
    try:
        if args.examples is not None or args.seed is not None:
            raise cli.UsageError(f"{source} runs one case: --examples and --seed do not apply")
        if args.inputs is not None:
            case = given_case.from_recording(spec, args.inputs)
        else:
            case = given_case.from_json(spec, args.case)
        broken = spec.precondition(*case.args, **case.kwargs) if spec.precondition else None
        if broken:
            raise cli.UsageError(f"{source}: not a valid {spec.name} call: {broken}")
    except cli.UsageError as exc:
        print(f"verify.op: {exc}", file=sys.stderr)
        return 2
    print(f"verify.op {spec.name}: {chosen.label} vs reference, backend {backend.name()}, profile {profile}")
    watchdog = Watchdog(args.timeout, _hang_report(chosen, args.json, None))
    with watchdog.watching(case):
        refusal = _registered_refusal(spec, case) if chosen.impl is not None else None
        result = None if refusal else check(spec, case, chosen.impl, chosen.impl_label)
    refusal = refusal or _refusal(spec, result, checking_registered=chosen.impl is None)
    if refusal:
        print(f"verify.op: {source}: not a valid {spec.name} call: {refusal}", file=sys.stderr)
        return 2
    if result.device_lost:
        print(f"  {DEVICE_LOST}:")
    print(result.describe())
    cli.write_json(
        args.json,
        {
            "op": spec.name,
            "impl": chosen.label,
            "backend": backend.name(),
            "profile": profile,
            **result.as_json(),
            "hung": False,
        },
    )
    return 0 if result.passed else 1


def _property_run(args: argparse.Namespace, chosen: Chosen, profile: str, summary: Summary | None) -> dict:
    """One op's named examples and drawn cases, reported as ``verify.op NAME`` reports them; its
    JSON report returned. ``summary``: the run of several ops this is one of (a hang reports it)."""
    from hypothesis import settings

    from ops import backend
    from verify import property
    from verify.cli import counted
    from verify.watchdog import Watchdog

    spec = chosen.spec
    print(f"verify.op {spec.name}: {chosen.label} vs reference, backend {backend.name()}, profile {profile}")
    watchdog = Watchdog(args.timeout, _hang_report(chosen, args.json, summary))
    started = time.monotonic()
    examples = args.examples if args.examples is not None else settings.default.max_examples
    outcome = property.run(
        spec,
        chosen.impl,
        chosen.impl_label,
        examples,
        args.seed,
        progress=lambda msg: print(f"  ... {msg}", file=sys.stderr, flush=True),
        watchdog=watchdog,
    )
    elapsed = time.monotonic() - started
    verdict = "VERIFIED" if outcome.passed else "DIVERGES"
    print(
        f"{verdict}: {counted(outcome.examples, 'named example')} and "
        f"{counted(outcome.cases, 'generated case')} in {elapsed:.1f}s"
    )
    print("  edge classes covered (cases):")
    print("\n".join(_coverage_lines(outcome.coverage)) or "    (none)")
    if outcome.worst is not None:
        w = outcome.worst
        used = "" if w.used is None else f"{w.used:.0%} of its tolerance, "
        diff = f"max abs diff from the reference {w.max_abs:.3g}"
        print(f"  closest to failing: {used}{diff}, on {w.case.params_json()}")
        for o in w.outputs:
            if o.reason:
                print(f"    {o.name}: {o.reason}")
    if outcome.failure is not None:
        if outcome.device_lost:
            print(f"  {DEVICE_LOST}, not shrunk:")
        elif outcome.nondeterministic:
            print(
                "  the failure did not repeat when its case ran again: the implementation is not\n"
                "  deterministic (a race, memory read before it is written, state kept between calls);\n"
                "  a case that failed once, not shrunk (its repro may pass):"
            )
        elif outcome.failing_example is not None:
            name = outcome.failing_example
            print(f"  failing named example {name!r} (no drawn case failed: nothing to shrink):")
        else:
            print("  smallest failing case after shrinking:")
        print("  " + outcome.failure.describe().replace("\n", "\n  "))
    return {
        "op": spec.name,
        "impl": chosen.label,
        "backend": backend.name(),
        "profile": profile,  # how the cases were searched: the profile, --seed and --examples given
        "seed": args.seed,
        "examples_requested": args.examples,
        "passed": outcome.passed,
        "examples": outcome.examples,
        "cases": outcome.cases,
        "coverage": dict(outcome.coverage),
        "worst_max_abs": outcome.worst.max_abs if outcome.worst else None,
        "worst_tolerance_used": outcome.worst.used if outcome.worst else None,
        "worst": outcome.worst.as_json() if outcome.worst else None,  # the closest to failing
        "failure": outcome.failure.as_json() if outcome.failure else None,
        "failing_example": outcome.failing_example,  # the failure's named example, not shrunk
        "nondeterministic": outcome.nondeterministic,
        "device_lost": outcome.device_lost,
        "hung": False,
        "seconds": round(elapsed, 3),
    }


def _hang_report(chosen: Chosen, json_path: str | None, summary: Summary | None):
    """What the watchdog prints (and writes to ``--json``) when a case runs past its limit: the
    case as a failure with its repro; no shrinking, since a smaller case could hang as long. In a
    run of several ops (``summary``) the summary follows, the ops not reached marked so."""
    from ops import backend
    from verify import cli
    from verify.compare import CheckResult, repro_command
    from verify.watchdog import HANG

    def report(case, seconds: float) -> None:
        limit = f"{seconds:g} s"
        result = CheckResult(
            chosen.spec.name,
            case,
            False,
            error=f"did not finish within {limit} (--timeout): {HANG}",
            repro=f"{repro_command(chosen.spec.name, case, chosen.impl_label)} --timeout {seconds:g}",
        )
        print(f"DIVERGES: a case ran past the {limit} limit; the run stops there")
        print("  " + result.describe().replace("\n", "\n  "), flush=True)
        hung = {
            "op": chosen.spec.name,
            "impl": chosen.label,
            "backend": backend.name(),
            "passed": False,
            "hung": True,
            "timeout_s": seconds,
            "failure": result.as_json(),
        }
        if summary is None:
            cli.write_report_json("verify.op", json_path, hung)
            return
        summary.reports.append(hung)
        summary.stopped_by = f"{chosen.spec.name} hung"
        print("\n" + summary.text(), flush=True)
        cli.write_report_json("verify.op", json_path, summary.as_json())

    return report


def _refusal(spec, result, checking_registered: bool) -> str | None:
    """Why a given or recorded case is bad input (exit 2) rather than a divergence: the reference
    raised on it, or the registered kernel refused one of its arguments by name, as its checks do
    (an outside implementation that raises is judged, not believed)."""
    exc = result.raised
    if result.raised_by == "reference":
        return f"the reference raised {type(exc).__name__}: {exc}"
    refused = result.raised_by == "implementation" and _names_an_argument(spec, result.case, exc)
    if checking_registered and refused:
        return f"the registered kernel refuses it: {exc}"
    return None


def _registered_refusal(spec, case) -> str | None:
    """Whether the registered kernel refuses a given or recorded case by name, asked before an
    outside implementation is judged on it: a call out of contract is bad input whoever is
    checked, and an implementation that rightly refuses it must not read as diverging. Anything
    else the kernel does (it runs, or fails otherwise) leaves the verdict to the check."""
    from verify.compare import clone_args

    args, kwargs = clone_args(case)
    try:
        spec.impl(*args, **kwargs)
    except Exception as exc:  # only a refusal by name counts; the check judges the rest
        if _names_an_argument(spec, case, exc):
            return f"the registered kernel refuses it: {exc}"
    return None


def _names_an_argument(spec, case, exc: BaseException) -> bool:
    """Whether ``exc`` is an argument check's error: a ValueError or TypeError whose message
    starts with the name of one of the op's arguments, as ``ops.validate`` writes them."""
    from verify.compare import arg_names

    if not isinstance(exc, (ValueError, TypeError)):
        return False
    names = [*arg_names(spec.reference), *case.kwargs]
    return re.match(rf"({'|'.join(map(re.escape, names))})\b", str(exc)) is not None


if __name__ == "__main__":
    from verify import cli

    cli.exit_with(main)
