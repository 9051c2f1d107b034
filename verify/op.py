"""``python -m verify.op NAME``: property-check one op (or an outside implementation of it).

Exit 0: verified. 1: a divergence (the shrunk case and a repro command are printed).
2: bad usage (unknown op, an implementation that fails to load or has the wrong signature, a
``--case`` or ``--inputs`` that is not a valid call of the op).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import sys
import time

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
    p.add_argument("name", nargs="?", help="the op to check (see --list)")
    p.add_argument(
        "--impl", metavar="MODULE:FN|FILE.py:FN", help="an outside implementation: MODULE:FN or FILE.py:FN"
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


def main(argv: list[str] | None = None) -> int:
    from verify.cli import parse_args

    args = parse_args("verify.op", _parser, argv)
    if args is None:
        return 2
    from hypothesis import settings

    import registry
    from ops import backend
    from verify import cli, impl_loader, profiles, property
    from verify.compare import check
    from verify.watchdog import Watchdog

    try:
        profile = profiles.load(backend.name())
    except ValueError as exc:
        print(f"verify.op: {exc}", file=sys.stderr)
        return 2
    if args.list:
        try:
            if args.name:
                raise cli.UsageError(f"--list lists every op; it takes no op name (got {args.name!r})")
            _check_list_options(args)
            cli.check_output_file("--json", args.json)
        except cli.UsageError as exc:
            print(f"verify.op: {exc}", file=sys.stderr)
            return 2
        return _list_ops(args.json)
    if not args.name:
        print("verify.op: an op name is required (see --list)", file=sys.stderr)
        return 2
    try:
        spec = registry.get(args.name)
        cli.check_output_file("--json", args.json)
    except KeyError as exc:
        print(f"verify.op: {exc.args[0]}", file=sys.stderr)
        return 2
    except cli.UsageError as exc:
        print(f"verify.op: {exc}", file=sys.stderr)
        return 2
    impl = None
    if args.impl is not None:  # "" too: refused by the loader, not taken for no --impl
        try:
            impl = impl_loader.load(args.impl)
            impl_loader.check_signature(impl, spec.reference, spec.name)
        except impl_loader.ImplError as exc:
            print(f"verify.op: {exc}", file=sys.stderr)
            return 2
    case = None
    if args.case or args.inputs:
        source = f"--inputs {args.inputs}" if args.inputs else "--case"
        try:
            if args.examples is not None or args.seed is not None:
                raise cli.UsageError(f"{source} runs one case: --examples and --seed do not apply")
            case = _recorded_case(spec, args.inputs) if args.inputs else _given_case(spec, args.case)
            broken = spec.precondition(*case.args, **case.kwargs) if spec.precondition else None
            if broken:
                raise cli.UsageError(f"{source}: not a valid {spec.name} call: {broken}")
        except cli.UsageError as exc:
            print(f"verify.op: {exc}", file=sys.stderr)
            return 2
    label = args.impl or f"registered {spec.name} kernel"
    print(f"verify.op {spec.name}: {label} vs reference, backend {backend.name()}, profile {profile}")
    watchdog = Watchdog(args.timeout, _hang_report(spec, label, args.impl, args.json))

    if case is not None:
        with watchdog.watching(case):
            result = check(spec, case, impl, args.impl)
        refusal = _refusal(spec, result, checking_registered=impl is None)
        if refusal:
            print(f"verify.op: {source}: not a valid {spec.name} call: {refusal}", file=sys.stderr)
            return 2
        if result.device_lost:
            print(f"  {DEVICE_LOST}:")
        print(result.describe())
        cli.write_json(
            args.json,
            {"op": spec.name, "impl": label, "backend": backend.name(), **result.as_json(), "hung": False},
        )
        return 0 if result.passed else 1

    started = time.monotonic()
    examples = args.examples if args.examples is not None else settings.default.max_examples
    outcome = property.run(
        spec,
        impl,
        args.impl,
        examples,
        args.seed,
        progress=lambda msg: print(f"  ... {msg}", file=sys.stderr, flush=True),
        watchdog=watchdog,
    )
    elapsed = time.monotonic() - started
    verdict = "VERIFIED" if outcome.passed else "DIVERGES"
    print(
        f"{verdict}: {cli.counted(outcome.examples, 'named example')} and "
        f"{cli.counted(outcome.cases, 'generated case')} in {elapsed:.1f}s"
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
    cli.write_json(
        args.json,
        {
            "op": spec.name,
            "impl": label,
            "backend": backend.name(),
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
        },
    )
    return 0 if outcome.passed else 1


def _hang_report(spec, label: str, impl_label: str | None, json_path: str | None):
    """What the watchdog prints (and writes to ``--json``) when a case runs past its limit: the
    case as a failure with its repro; no shrinking, since a smaller case could hang as long."""
    from ops import backend
    from verify import cli
    from verify.compare import CheckResult, repro_command
    from verify.watchdog import HANG

    def report(case, seconds: float) -> None:
        limit = f"{seconds:g} s"
        result = CheckResult(
            spec.name,
            case,
            False,
            error=f"did not finish within {limit} (--timeout): {HANG}",
            repro=f"{repro_command(spec.name, case, impl_label)} --timeout {seconds:g}",
        )
        print(f"DIVERGES: a case ran past the {limit} limit; the run stops there")
        print("  " + result.describe().replace("\n", "\n  "), flush=True)
        cli.write_report_json(
            "verify.op",
            json_path,
            {
                "op": spec.name,
                "impl": label,
                "backend": backend.name(),
                "passed": False,
                "hung": True,
                "timeout_s": seconds,
                "failure": result.as_json(),
            },
        )

    return report


def _refusal(spec, result, checking_registered: bool) -> str | None:
    """Why a given or recorded case is bad input (exit 2) rather than a divergence: the reference
    raised on it, or the registered kernel refused one of its arguments by name, as its checks do
    (an outside implementation that raises is judged, not believed)."""
    from verify.compare import arg_names

    exc = result.raised
    if result.raised_by == "reference":
        return f"the reference raised {type(exc).__name__}: {exc}"
    argument_error = isinstance(exc, (ValueError, TypeError))
    if checking_registered and result.raised_by == "implementation" and argument_error:
        names = [*arg_names(spec.reference), *result.case.kwargs]
        if re.match(rf"({'|'.join(map(re.escape, names))})\b", str(exc)):
            return f"the registered kernel refuses it: {exc}"
    return None


def _known_fields(spec) -> dict[str, list]:
    """The fields a case of ``spec`` may have, each with the values seen for it: the smallest
    case its strategy draws and its examples."""
    from hypothesis import find, settings

    from registry import example_params
    from verify import limits

    drawn = find(spec.params(limits.current()), lambda _: True, settings=settings(database=None))
    fields: dict[str, list] = {k: [v] for k, v in drawn.items()}
    for example in spec.examples:
        for k, v in example_params(example).items():
            fields.setdefault(k, []).append(v)
    return fields


def _same_kind(value: object, like: object) -> bool:
    """JSON types alike: a number for a number (an int where a float is drawn is fine), a string
    for a string, a list for a list; None matches anything (an optional field)."""
    if value is None or like is None:
        return True
    if isinstance(like, bool) or isinstance(value, bool):
        return isinstance(value, bool) == isinstance(like, bool)
    if isinstance(like, int | float):
        return isinstance(value, int | float) and (isinstance(like, float) or isinstance(value, int))
    return isinstance(value, type(like))


def _out_of_domain(value: object, known: list) -> str | None:
    """What a field's value must be that its kind alone does not say: every count, size, offset
    and seed a strategy draws is a whole number >= 0 (a negative one would build another case
    than the one printed), and a list (of dims) holds such numbers, at least one."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float) and all(isinstance(k, int) and not isinstance(k, bool) for k in known):
        return None if value >= 0 else "a whole number >= 0"
    if isinstance(value, list) and all(isinstance(k, list) and k for k in known):
        ok = value and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
        return None if ok else "a non-empty list of whole numbers >= 0"
    return None


def _given_case(spec, text: str):
    """The case a ``--case`` JSON object describes (a repro command's), built on the backend's device."""
    from ops import backend
    from verify.cli import UsageError

    try:
        params = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"--case: not JSON ({exc})") from None
    known = _known_fields(spec)
    fields = ", ".join(sorted(known))
    listing = f"{spec.name} cases have the fields {fields}"
    if not isinstance(params, dict):
        raise UsageError(f"--case: expected a JSON object of {spec.name} fields ({fields}), got {params!r}")
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise UsageError(f"--case: unknown field {unknown[0]!r}; {listing}")
    for name, value in params.items():
        if not any(_same_kind(value, like) for like in known[name]):
            like = known[name][0]
            raise UsageError(
                f"--case: field {name!r} is {value!r}; expected {type(like).__name__}, e.g. {like!r}"
            )
        problem = _out_of_domain(value, known[name])
        if problem:
            raise UsageError(f"--case: field {name!r} is {value!r}; expected {problem}")
    try:
        return spec.build(params, backend.device())
    except KeyError as exc:
        raise UsageError(f"--case: no field {exc.args[0]!r}; {listing}") from None
    except Exception as exc:  # whatever a builder makes of values of the wrong kind
        raise UsageError(f"--case is not a valid {spec.name} case: {type(exc).__name__}: {exc}") from None


def _recorded_case(spec, path: str):
    """A case from the inputs ``verify.bisect`` saved for one op call, moved to the backend's device."""
    import torch

    from ops import backend
    from verify.cases import recorded
    from verify.cli import UsageError
    from verify.compare import clone_preserving_layout

    try:
        saved = torch.load(path, weights_only=True)
    except OSError as exc:
        raise UsageError(f"--inputs {path}: {exc.strerror or exc}") from None
    except Exception as exc:  # whatever the unpickler makes of a file that is not ours
        raise UsageError(
            f"--inputs {path}: not inputs saved by verify.bisect ({type(exc).__name__})"
        ) from None
    if not isinstance(saved, dict) or set(saved) != {"op", "args"} or not isinstance(saved["args"], tuple):
        raise UsageError(f"--inputs {path}: not inputs saved by verify.bisect (expected op and args)")
    if saved["op"] != spec.name:
        raise UsageError(f"--inputs {path}: recorded for {saved['op']}, not {spec.name}")
    try:
        inspect.signature(spec.reference).bind(*saved["args"])
    except TypeError as exc:
        raise UsageError(f"--inputs {path}: the arguments do not fit {spec.name}: {exc}") from None
    for i, arg in enumerate(saved["args"]):
        if isinstance(arg, torch.Tensor) and (arg.layout != torch.strided or arg.is_meta):
            kind = "a meta tensor (no data)" if arg.is_meta else f"a {arg.layout} tensor"
            raise UsageError(
                f"--inputs {path}: argument #{i} is {kind}; expected a dense strided tensor with data"
            )
    device = backend.device()
    try:
        moved = tuple(
            clone_preserving_layout(a, device) if isinstance(a, torch.Tensor) else a for a in saved["args"]
        )
    except Exception as exc:  # a tensor of some other kind torch cannot copy with its layout
        raise UsageError(
            f"--inputs {path}: not inputs saved by verify.bisect ({type(exc).__name__}: {exc})"
        ) from None
    return recorded(path, moved)


if __name__ == "__main__":
    from verify import cli

    cli.exit_with(main)
