"""The one case ``verify.op --case JSON`` or ``--inputs FILE.pt`` names, checked as input: a
field no strategy draws, a value of the wrong kind, a file that is not a recording of this op are
a :class:`~verify.cli.UsageError` (exit 2), never a case built from values other than those given."""

from __future__ import annotations

import inspect
import json
from typing import TYPE_CHECKING

from verify.cases import Case

if TYPE_CHECKING:
    from registry import OpSpec


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


def from_json(spec: OpSpec, text: str) -> Case:
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


def from_recording(spec: OpSpec, path: str) -> Case:
    """A case from the inputs ``verify.bisect`` saved for one op call, moved to the backend's device."""
    import torch

    from ops import backend
    from verify.cases import recorded
    from verify.cli import UsageError
    from verify.compare import clone_value

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
        moved = clone_value(saved["args"], device)  # arguments sharing memory when recorded still do
    except Exception as exc:  # a tensor of some other kind torch cannot copy with its layout
        raise UsageError(
            f"--inputs {path}: not inputs saved by verify.bisect ({type(exc).__name__}: {exc})"
        ) from None
    return recorded(path, moved)
