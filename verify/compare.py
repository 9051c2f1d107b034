"""The comparison core: run an implementation and the reference on identical copies of a case
and judge every output under the op's tolerance.

What it catches, whatever the op: wrong dtype, shape, device or layout of an output; values
out of tolerance; NaN/Inf where the reference is finite; a missing or extra output; writes to
inputs the op must not touch (compared bitwise, whole underlying buffer); in-place buffers
compared whole (pre-filled with random data by the case builders), so stray writes show;
output left unwritten (every tensor the implementation allocates starts as NaN, whatever the
allocator's recycled memory held: on CPU that was often the right answer from the last run).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import random
import shlex
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ops import backend, scratch
from references.precision import computing_in, oracle, ulp
from verify.cases import Case, dtype_of
from verify.cli import counted
from verify.impl_loader import exception_text, failure_site
from verify.memory import ReturnedMemory, not_new
from verify.tolerances import Tolerance, dtype_key, lookup
from verify.watchdog import device_lost, wait_for_device

RATIO_CAP = 1 / 32  # max_error_ratio: k x a yardstick's error past this share of max|oracle| is no bound
POISON_BYTE = 0xFF  # 0xFFFF.. is NaN in bf16, fp16 and fp32, and -1 as an integer


@dataclass
class OutputReport:
    """The verdict on one output tensor."""

    name: str
    passed: bool
    reason: str = ""
    shape: tuple[int, ...] = ()
    dtype: str = ""
    strides: tuple[int, ...] = ()
    rule: str = ""
    max_abs: float = 0.0
    mean_abs: float = 0.0
    worst_index: tuple[int, ...] | None = None
    nonfinite: bool = False  # NaN/Inf where they should not be: the diffs are over finite elements
    impl_value: float | None = None
    ref_value: float | None = None
    bound: float | None = None
    used: float | None = None  # error over bound at the worst element (1 = at the limit); None: exact
    failing_at: str = ""  # which indices of each dim hold the failing elements, where not all do


def failing_extent(bad: torch.Tensor) -> str:
    """Where along each dim the failing elements lie, when that narrows them down ("dim 1 at 48-64
    of 65": a tail; "dim 2 at 1, 3, 5, 7 of 8": every other head), else "": the pattern often
    names the bug before the numbers do."""
    if bad.ndim == 0 or not bad.any():
        return ""
    parts, narrowed = [], False
    for d, size in enumerate(bad.shape):
        hit = bad.movedim(d, 0).reshape(size, -1).any(dim=1).nonzero().flatten().tolist()
        if len(hit) == size:
            parts.append(f"dim {d} all {size}")
            continue
        narrowed = True
        runs: list[list[int]] = []
        for i in hit:
            if runs and i == runs[-1][1] + 1:
                runs[-1][1] = i
            else:
                runs.append([i, i])
        shown = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:6]]
        parts.append(f"dim {d} at {', '.join(shown)}{', ...' if len(runs) > 6 else ''} of {size}")
    return "; ".join(parts) if narrowed else ""


def _share(error: torch.Tensor | float, bound: torch.Tensor | float) -> float:
    """The largest ``error / bound``: 0 where both are 0, inf where only the bound is."""
    error, bound = torch.as_tensor(error, dtype=torch.float64), torch.as_tensor(bound, dtype=torch.float64)
    share = torch.where(bound > 0, error / bound.clamp_min(torch.finfo(torch.float64).tiny), error * math.inf)
    return float(torch.nan_to_num(share, nan=0.0).max()) if share.numel() else 0.0


@dataclass
class CheckResult:
    """The verdict on one case: every output's report, what raised (if anything) and the
    command that reruns exactly this case."""

    op: str
    case: Case
    passed: bool
    outputs: list[OutputReport] = field(default_factory=list)
    error: str | None = None
    repro: str = ""
    raised_by: str | None = None  # "implementation" or "reference" when one raised
    raised: BaseException | None = field(default=None, repr=False, compare=False)
    device_lost: bool = False  # what it raised was a GPU fault, which leaves no usable device

    @property
    def max_abs(self) -> float:
        return max((o.max_abs for o in self.outputs), default=0.0)

    @property
    def used(self) -> float | None:
        """The largest share of its tolerance any output used (None: every output exact-rule)."""
        return max((o.used for o in self.outputs if o.used is not None), default=None)

    def as_json(self) -> dict:
        """The case, the verdict with each output's numbers, the error and the repro command, as
        the --json reports record them."""
        return {
            "case": self.case.params,
            "passed": self.passed,
            "outputs": [asdict(o) for o in self.outputs],
            "error": self.error,
            "repro": self.repro,
            "device_lost": self.device_lost,
            "description": self.describe(),
        }

    def describe(self) -> str:
        """A failure message a person can act on: what, where, how far off, how to reproduce."""
        lines = [f"{self.op}: {'verified' if self.passed else 'DIVERGES'}"]
        lines.append(f"  case: {self.case.params_json()}")
        if self.case.labels:  # e.g. "seq_len past capacity": a rule the case holds the op to
            lines.append(f"  edge classes: {', '.join(self.case.labels)}")
        lines.append(f"  inputs: {describe_inputs(self.case)}")
        if self.error:
            lines.append(f"  error: {self.error}")
        for o in self.outputs:
            status = "ok" if o.passed else "FAIL"
            lines.append(
                f"  {o.name} [{status}] shape={o.shape} dtype={o.dtype} strides={o.strides} rule={o.rule}"
            )
            if o.reason:
                lines.append(f"    {o.reason}")
            if o.failing_at:
                lines.append(f"    failing elements: {o.failing_at}")
            if o.worst_index is not None:
                bound = f" (bound {o.bound:.3g})" if o.bound is not None else ""
                diffs = f"max abs diff {o.max_abs:.4g}{bound}, mean abs diff {o.mean_abs:.4g}"
                if o.nonfinite:  # the reason names the first NaN/Inf
                    lines.append(f"    among the finite elements: {diffs}")
                else:
                    worst = f"impl {o.impl_value!r} vs reference {o.ref_value!r}"
                    lines.append(f"    {diffs}; worst at {o.worst_index}: {worst}")
        if not self.passed:
            lines.append(f"  repro: {self.repro}")
        return "\n".join(lines)


# ---- copies, poisoning, outputs ----------------------------------------------------------------


def clone_preserving_layout(
    t: torch.Tensor, device: torch.device | str | None = None, copies: dict | None = None
) -> torch.Tensor:
    """A copy of ``t`` (on ``device``) with the same sizes, strides and offset into a copy of its
    whole buffer: a view of a fused buffer stays a view, and the bytes around it come along.
    ``copies`` holds the buffers one call's arguments copied so far: tensors sharing a buffer
    share its copy, so a call whose arguments overlap (a cache and a view of it) stays that call."""
    device = t.device if device is None else torch.device(device)
    key = (t.device, t.untyped_storage().data_ptr())
    raw = None if copies is None else copies.get(key)
    if raw is None:
        raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        raw = raw.to(device, copy=True)
        if copies is not None:
            copies[key] = raw
    return torch.empty(0, dtype=t.dtype, device=device).set_(
        raw.untyped_storage(), t.storage_offset(), t.shape, t.stride()
    )


def clone_value(value: Any, device: torch.device | str | None = None, copies: dict | None = None) -> Any:
    """Tensors (nested in tuples/lists too) copied with their layout, those sharing a buffer into
    one copy of it (``copies``: see :func:`clone_preserving_layout`); anything else as is."""
    copies = {} if copies is None else copies
    if isinstance(value, torch.Tensor):
        return clone_preserving_layout(value, device, copies)
    if isinstance(value, (tuple, list)):
        return type(value)(clone_value(v, device, copies) for v in value)
    return value


def clone_args(case: Case) -> tuple[tuple, dict[str, Any]]:
    """The case's arguments copied for one call, sharing buffers where the case's do."""
    copies: dict = {}
    args = clone_value(case.args, copies=copies)
    return args, {k: clone_value(v, copies=copies) for k, v in case.kwargs.items()}


def _buffer_bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


class PoisonNewTensors(TorchDispatchMode):
    """Every tensor allocated inside comes filled with 0xFF bytes (NaN in bf16/fp16/fp32, -1 as
    an integer), so an output element the implementation never writes shows up as NaN instead
    of whatever the allocator's reused memory held (often the right answer from the last run)."""

    ALLOCATORS = frozenset(
        {
            torch.ops.aten.empty.memory_format,
            torch.ops.aten.empty_like.default,
            torch.ops.aten.empty_strided.default,
            torch.ops.aten.new_empty.default,
            torch.ops.aten.new_empty_strided.default,
            torch.ops.aten.empty_permuted.default,
        }
    )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.ALLOCATORS and out.numel():
            _buffer_bytes(out).fill_(POISON_BYTE)
        return out


@contextlib.contextmanager
def seeded_rngs(case: Case) -> Iterator[None]:
    """Python's, numpy's and torch's global generators seeded from the case, their states put
    back after: an implementation that draws from them (stochastic rounding, a random split, a
    bug) then draws the same numbers whenever the case runs, so its repro command replays the
    verdict. Hypothesis seeds the first two per drawn case already, but not the named examples,
    a ``--case`` or ``--inputs`` run, or torch."""
    seed = zlib.crc32(case.params_json().encode())
    python_state, numpy_state = random.getstate(), np.random.get_state()
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        random.seed(seed)
        np.random.seed(seed)
        torch.random.default_generator.manual_seed(seed)
        if devices:  # the device fork_rng puts back (torch.manual_seed would seed every GPU)
            torch.cuda.manual_seed(seed)
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def poison_scratch() -> None:
    """Fill every buffer ``ops.scratch`` holds (split-K partials, decode partials, fused
    intermediates) with the poison bytes: kept from call to call, they would otherwise hand a
    kernel that reads scratch it did not write this call the last call's values."""
    for buffer in scratch.held():
        for t in buffer if isinstance(buffer, tuple) else (buffer,):
            if isinstance(t, torch.Tensor) and t.numel():
                _buffer_bytes(t).fill_(POISON_BYTE)


def named_outputs(result: Any) -> list[tuple[str, Any]]:
    """An op's return value as ``(name, value)`` pairs: none, ``out``, or ``out[i]``."""
    if result is None:
        return []
    if isinstance(result, (tuple, list)):
        return [(f"out[{i}]", r) for i, r in enumerate(result)]
    return [("out", result)]


def arg_names(fn: Callable) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind != p.KEYWORD_ONLY]


def _mutated(names: list[str], mutates: tuple[str, ...], args: tuple) -> list[tuple[str, Any]]:
    return [(n, args[names.index(n)]) for n in mutates]


def describe_inputs(case: Case) -> str:
    parts = []
    for i, a in enumerate(case.args):
        if isinstance(a, torch.Tensor):
            parts.append(f"#{i} {tuple(a.shape)} {dtype_key(a.dtype)} strides={a.stride()}")
        else:
            parts.append(f"#{i} {a!r}")
    return "; ".join(parts)


# ---- judging one output ------------------------------------------------------------------------


def _nonfinite_problem(impl: torch.Tensor, ref: torch.Tensor) -> tuple[str, torch.Tensor] | None:
    ref_bad = ~torch.isfinite(ref)
    same = (torch.isnan(impl) & torch.isnan(ref)) | (impl == ref)
    wrong = (~torch.isfinite(impl) & ~ref_bad) | (ref_bad & ~same)
    if not wrong.any():
        return None
    where = wrong & ~ref_bad
    text = "NaN/Inf in the output where the reference is finite" if where.any() else "NaN/Inf not matched"
    return f"{text} ({int(wrong.sum())} elements)", wrong


_SAME_SIZE_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits_differ(impl: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Elementwise "not the same bits" (the exact rule): -0.0 is not +0.0, and any NaN matches any
    NaN (a copy may quiet a NaN's payload)."""
    if not impl.dtype.is_floating_point:
        return impl != ref
    as_int = _SAME_SIZE_INT[impl.element_size()]
    both_nan = torch.isnan(impl) & torch.isnan(ref)
    return (impl.view(as_int) != ref.view(as_int)) & ~both_nan


def judge(
    name: str,
    impl: Any,
    ref: torch.Tensor,
    tol: Tolerance,
    oracle_out: torch.Tensor | None = None,
    lowp_out: torch.Tensor | None = None,
    terms_out: torch.Tensor | None = None,
    extra_floor: float = 0.0,
) -> OutputReport:
    """Judge one output. For ``max_error_ratio``, ``terms_out`` (ops that sum products) is the
    oracle on |inputs|, the size of the sums: an fp32 sum in another order may differ by an ulp
    of that, however small the output it cancels down to. ``extra_floor``: the op's own
    addition to the floor (``OpSpec.error_floor``)."""
    if not isinstance(impl, torch.Tensor):
        return OutputReport(name, False, f"expected a tensor, got {type(impl).__name__}")
    if impl.layout != torch.strided:
        return OutputReport(name, False, f"layout {impl.layout}, expected a dense (strided) tensor")
    report = OutputReport(
        name, True, shape=tuple(impl.shape), dtype=dtype_key(impl.dtype), strides=impl.stride(), rule=tol.rule
    )
    for problem, bad in (
        (f"dtype {impl.dtype}, expected {ref.dtype}", impl.dtype != ref.dtype),
        (f"shape {tuple(impl.shape)}, expected {tuple(ref.shape)}", impl.shape != ref.shape),
        (f"device {impl.device}, expected {ref.device}", impl.device != ref.device),
    ):
        if bad:
            report.passed, report.reason = False, problem
            return report
    if impl.numel() == 0:
        return report
    a, r = impl.double(), ref.double()
    diff = (a - r).abs()
    finite = torch.isfinite(a) & torch.isfinite(r)
    diff = torch.where(finite, diff, torch.zeros_like(diff))
    flat = int(diff.argmax())
    report.worst_index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), impl.shape))
    report.max_abs, report.mean_abs = float(diff.max()), float(diff[finite].mean()) if finite.any() else 0.0
    # the values as the tensors hold them: an index stays an int in the report
    report.impl_value, report.ref_value = impl.flatten()[flat].item(), ref.flatten()[flat].item()

    nonfinite = _nonfinite_problem(a, r)
    if nonfinite is not None:
        reason, mask = nonfinite
        first = tuple(
            int(i) for i in torch.unravel_index(torch.tensor(int(mask.flatten().int().argmax())), a.shape)
        )
        report.passed, report.nonfinite = False, True
        report.reason = (
            f"{reason}; first at {first}: impl {a[first].item()!r} vs reference {r[first].item()!r}"
        )
        report.worst_index, report.impl_value, report.ref_value = first, a[first].item(), r[first].item()
        report.failing_at = failing_extent(mask)
        return report

    if tol.rule == "exact" or not impl.dtype.is_floating_point:
        wrong = _bits_differ(impl, ref)
        if wrong.any():
            report.passed, report.reason = (
                False,
                f"{int(wrong.sum())} of {a.numel()} elements differ (exact rule)",
            )
            report.failing_at = failing_extent(wrong)
        return report

    if tol.rule == "allclose":
        bound = tol.atol + tol.rtol * r.abs()
        report.used = _share(diff, bound)
        over = diff > bound
        if over.any():
            excess = diff - bound
            flat = int(excess.argmax())
            idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), impl.shape))
            report.passed = False
            report.worst_index, report.impl_value, report.ref_value = idx, a[idx].item(), r[idx].item()
            report.reason = (
                f"{int(over.sum())} of {a.numel()} elements exceed "
                f"atol={tol.atol:g} + rtol={tol.rtol:g} * |ref|"
            )
            report.bound = float(bound[idx])
            report.failing_at = failing_extent(over)
        return report

    # max_error_ratio: judge the implementation's distance to the fp64 oracle against plain torch's
    assert oracle_out is not None and lowp_out is not None
    o = oracle_out.double()
    # Where the exact value lies past the dtype's largest finite number, the correctly rounded
    # output is that infinity (fp16 sums near 65504): there an output must equal it, and the
    # distance is measured elsewhere.
    o_rounded = oracle_out.to(impl.dtype).double()
    overflow = torch.isfinite(o) & ~torch.isfinite(o_rounded)
    fin = torch.isfinite(o) & ~overflow

    def max_error(x: torch.Tensor) -> float:
        """Largest distance to the oracle; NaN where the oracle is finite counts as infinite
        (a NaN would otherwise slip through max() and every comparison)."""
        if (overflow & (x != o_rounded)).any():
            return float("inf")
        errors = torch.where(fin, (x - o).abs(), torch.zeros_like(o))
        return torch.nan_to_num(errors, nan=float("inf")).max().item()

    err_impl, err_lowp = max_error(a), max_error(lowp_out.double())
    magnitude = torch.where(fin, o.abs(), torch.zeros_like(o)).max().item()
    floor = tol.ulps * ulp(impl.dtype, magnitude) + extra_floor
    if terms_out is not None:
        terms = terms_out.double()
        floor += ulp(torch.float32, torch.where(torch.isfinite(terms), terms.abs(), 0).max().item())
    # Where plain torch in this dtype breaks down (fp16 squares overflowing: k x its error past
    # 1/32 of the output's magnitude), its error says nothing about what is acceptable: the
    # yardstick there is the reference's, fp32 math rounded once, what an fp32 kernel reaches
    # (and never more than that 1/32, should the reference break down too).
    who, err_base, note = f"plain {report.dtype} torch", err_lowp, ""
    allowed = tol.max_error_ratio * err_lowp
    if allowed > magnitude * RATIO_CAP:
        who, err_base = "the fp32 reference", max_error(r)
        note = f" (plain {report.dtype} torch broke down: {err_lowp:.3g})"
        allowed = min(tol.max_error_ratio * err_base, magnitude * RATIO_CAP)
    report.bound = allowed + floor + tol.atol
    report.used = _share(err_impl, report.bound)
    if not err_impl <= report.bound:
        report.passed = False
        report.reason = (
            f"error vs fp64 oracle {err_impl:.4g} > {tol.max_error_ratio:g} x {who} error {err_base:.4g}"
            f"{note} + floor {floor:.3g}"
        )
        off = torch.where(fin, (a - o).abs(), torch.zeros_like(o)).nan_to_num(nan=float("inf"))
        report.failing_at = failing_extent((off > report.bound) | (overflow & (a != o_rounded)))
    else:
        report.reason = f"error vs fp64 oracle {err_impl:.3g}; {who} {err_base:.3g}{note}"
    return report


def judge_in_place(
    name: str,
    impl: torch.Tensor,
    ref: torch.Tensor,
    before: torch.Tensor,
    tol: Tolerance,
    oracle_out: torch.Tensor,
    lowp_out: torch.Tensor,
    terms_out: torch.Tensor | None = None,
    extra_floor: float = 0.0,
) -> OutputReport:
    """Judge a buffer the op updates in place (a KV cache) under ``max_error_ratio``: rows (last
    dim) the oracle leaves as they were must keep their bits, and the rows it writes are judged
    among themselves. One bound over the whole buffer would take its scale from both: a stray
    write could hide below the old rows' magnitude, a wrong new row below theirs. ``terms_out``
    and ``extra_floor``: as for ``judge``, where the new rows are sums of products (a fused
    projection's k and v) or the op has a floor of its own."""
    layout = (ref.shape, ref.dtype, ref.device)
    if not isinstance(impl, torch.Tensor) or (impl.shape, impl.dtype, impl.device) != layout:
        return judge(name, impl, ref, tol, oracle_out, lowp_out)  # reports what is wrong with it
    written = (oracle_out.double() != before.double()).any(dim=-1)
    kept = ~written
    touched = _bits_differ(impl[kept], before[kept]).any(dim=-1)
    if touched.any():
        first = tuple(int(i) for i in kept.nonzero()[int(touched.int().argmax())])
        return OutputReport(
            name, False, f"{int(touched.sum())} of {int(kept.sum())} rows the op must leave as they "
            f"were are changed; first at {first}", tuple(impl.shape), dtype_key(impl.dtype), impl.stride(),
            tol.rule, worst_index=first,
        )  # fmt: skip
    terms = terms_out[written] if terms_out is not None else None
    report = judge(
        name, impl[written], ref[written], tol, oracle_out[written], lowp_out[written], terms, extra_floor
    )
    report.shape, report.strides = tuple(impl.shape), impl.stride()
    if report.worst_index is not None and written.any():  # back from the written rows to the buffer
        row, *rest = report.worst_index
        report.worst_index = (*(int(i) for i in written.nonzero()[row]), *rest)
    report.reason = f"written rows: {report.reason}"
    return report


# ---- one whole check ---------------------------------------------------------------------------


def _to_oracle(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype.is_floating_point:
        return value.to(torch.float64)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_oracle(v) for v in value)
    return value


def _abs(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype.is_floating_point:
        return value.abs()
    return value


def _run_reference(spec: Any, case: Case, mode: str) -> list[tuple[str, Any]]:
    """The reference's outputs: ``"reference"`` as written, ``"lowp"`` computing in the case's
    dtype, ``"oracle"`` in fp64, ``"terms"`` the oracle on the absolute values of the inputs."""
    args, kwargs = clone_args(case)
    names = arg_names(spec.reference)
    if mode == "terms":
        args, kwargs = [_abs(a) for a in args], {k: _abs(v) for k, v in kwargs.items()}
        mode = "oracle"
    if mode == "oracle":
        args, kwargs = _to_oracle(args), {k: _to_oracle(v) for k, v in kwargs.items()}
        with oracle(storage=dtype_of(case.params)):
            result = spec.reference(*args, **kwargs)
    elif mode == "lowp":
        with computing_in(dtype_of(case.params)):
            result = spec.reference(*args, **kwargs)
    else:
        result = spec.reference(*args, **kwargs)
    return named_outputs(result) + _mutated(names, spec.mutates, args)


def repro_command(op: str, case: Case, impl_label: str | None = None) -> str:
    if "inputs" in case.params:  # a case recorded inside the model (verify.bisect), saved to a file
        cmd = f"python -m verify.op {op} --inputs {shlex.quote(case.params['inputs'])}"
    else:
        cmd = f"python -m verify.op {op} --case {shlex.quote(case.params_json())}"
    return cmd + (f" --impl {shlex.quote(impl_label)}" if impl_label else "")


def _raised(result: CheckResult, who: str, exc: BaseException, error: str | None = None) -> CheckResult:
    """``who`` raised ``exc``: the verdict, with ``error`` or else the exception and where it rose."""
    result.passed, result.raised_by, result.raised = False, who, exc
    text = f"{who} raised {type(exc).__name__}: {exception_text(exc)}\n"
    result.error = error or (text + failure_site(exc)).rstrip()
    return result


def _accepted(fn: Callable, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword extras ``fn`` takes: the contract's arguments are positional, so an outside
    implementation is not required to accept the registered kernel's buffers."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return kwargs  # no signature to read: let the call decide
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def _form(named: list[tuple[str, Any]]) -> str:
    """What a call returned, from its named outputs: None, a single output, or a tuple of n."""
    outs = [n for n, _ in named if n.startswith("out")]
    if not outs:
        return "None"
    if outs == ["out"]:
        return "a single output"
    return f"a tuple of {counted(len(outs), 'output')}"


def check(
    spec: Any,
    case: Case,
    impl: Callable | None = None,
    impl_label: str | None = None,
    earlier: ReturnedMemory | None = None,
) -> CheckResult:
    """Run ``impl`` (default: the registered kernel), then the reference, and judge every output.
    ``earlier``: the run's recent outputs, so one returned again (a kept buffer) fails."""
    impl = impl or spec.impl
    names = arg_names(spec.reference)
    result = CheckResult(spec.name, case, True, repro=repro_command(spec.name, case, impl_label))

    args, kwargs = clone_args(case)
    untouched = {
        n: _buffer_bytes(a).clone()
        for n, a in zip(names, args, strict=False)
        if isinstance(a, torch.Tensor) and n not in spec.mutates
    }
    passed = _accepted(impl, kwargs)
    poison_scratch()
    try:
        with seeded_rngs(case), PoisonNewTensors():  # the generators saved outside the mode
            returned = impl(*args, **passed)
        wait_for_device()  # a fault its launches cause is raised here, against this case
        impl_out = named_outputs(returned) + _mutated(names, spec.mutates, args)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # the verdict must say what it raised; sys.exit(0) is none
        if device_lost():  # the reference cannot run, and no other case can
            result.device_lost = True
            text = exception_text(exc)
            fault = text.splitlines()[0] if text else ""
            return _raised(  # raised by the wait after the call: its traceback shows the wait, not the kernel
                result,
                "implementation",
                exc,
                f"implementation raised {type(exc).__name__}: {fault} (in one of its launches, which "
                "CUDA_LAUNCH_BLOCKING=1 on the repro names)",
            )
        try:  # inputs the reference cannot take either are the case's fault (a given or recorded one)
            _run_reference(spec, case, "reference")
        except Exception as ref_exc:
            return _raised(result, "reference", ref_exc)
        return _raised(result, "implementation", exc)

    for n, a in zip(names, args, strict=False):
        if n in untouched and not torch.equal(_buffer_bytes(a), untouched[n]):
            result.outputs.append(
                OutputReport(
                    n,
                    False,
                    "the op wrote to this input (or the buffer around it), which it must not",
                    shape=tuple(a.shape),
                    dtype=dtype_key(a.dtype),
                    strides=a.stride(),
                    rule="untouched",
                )
            )

    try:
        ref_out = _run_reference(spec, case, "reference")
    except Exception as exc:  # inputs the reference cannot take (a given or recorded case)
        return _raised(result, "reference", exc)
    if [n for n, _ in impl_out] != [n for n, _ in ref_out]:  # a count, or a 1-tuple for a tensor
        result.passed = False
        result.error = f"implementation returned {_form(impl_out)}, the reference {_form(ref_out)}"
        return result
    inputs = [*zip(names, args, strict=False), *((k, v) for k, v in passed.items() if k != "out")]
    shared = not_new([(n, v) for n, v in impl_out if n not in spec.mutates], inputs, earlier)
    if shared:
        result.passed, result.error = False, shared
        return result
    tol = lookup(spec.tolerance, dtype_of(case.params), backend=backend.name())
    oracle_out = lowp_out = terms_out = None
    extra_floor = 0.0
    if tol.rule == "max_error_ratio":
        oracle_out = _run_reference(spec, case, "oracle")
        lowp_out = _run_reference(spec, case, "lowp")
        if spec.sums_products:
            terms_out = _run_reference(spec, case, "terms")
        if spec.error_floor is not None:
            extra_floor = tol.floor_ulps * spec.error_floor(*case.args, **case.kwargs)
    for i, ((name, got), (_, want)) in enumerate(zip(impl_out, ref_out, strict=True)):
        if name in spec.mutates and oracle_out and lowp_out:
            before = case.args[names.index(name)]
            terms = terms_out[i][1] if terms_out else None
            report = judge_in_place(
                name, got, want, before, tol, oracle_out[i][1], lowp_out[i][1], terms, extra_floor
            )
        else:
            report = judge(
                name,
                got,
                want,
                tol,
                oracle_out[i][1] if oracle_out else None,
                lowp_out[i][1] if lowp_out else None,
                terms_out[i][1] if terms_out and i == 0 else None,  # the product, not a side output
                extra_floor,
            )
        if report.passed and name.startswith("out") and not got.is_contiguous():
            report.passed, report.reason = False, f"output is not contiguous (strides {got.stride()})"
        result.outputs.append(report)
    result.passed = all(o.passed for o in result.outputs)
    return result
