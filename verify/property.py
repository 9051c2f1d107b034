"""Property-check one op: named examples, then Hypothesis-drawn cases, shrinking any failure."""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

from hypothesis import event, given, seed, settings
from hypothesis.errors import FlakyFailure

import registry
from ops import backend
from verify import limits
from verify.cases import Case
from verify.compare import CheckResult, check
from verify.memory import ReturnedMemory
from verify.watchdog import NO_LIMIT, Watchdog


@dataclass
class Outcome:
    """One op's property run: how many cases, which edge classes they covered, the worst
    passing case, and the (shrunk) failure if there was one."""

    op: str
    passed: bool
    cases: int = 0
    examples: int = 0
    coverage: collections.Counter = field(default_factory=collections.Counter)
    worst: CheckResult | None = None  # the passing case closest to its tolerance
    failure: CheckResult | None = None  # after shrinking: the smallest failing case
    failing_example: str | None = None  # the named example the failure is, when no drawn case failed
    nondeterministic: bool = False  # the failure did not repeat when its case ran again
    device_lost: bool = False  # the failure faulted the GPU: the run stopped there, not shrunk


class _DeviceLost(BaseException):
    """Ends a run at the case that faulted the GPU. A BaseException, so it passes through
    Hypothesis, which would otherwise shrink by rerunning cases, each failing on the dead device."""

    def __init__(self, result: CheckResult) -> None:
        super().__init__(result.describe())
        self.result = result


def _closeness(result: CheckResult) -> tuple[float, float]:
    """How near a passing case came to failing: its share of the tolerance, then its abs error
    (exact-rule ops have no share: every passing case is exact)."""
    return (result.used or 0.0, result.max_abs)


def runnable_examples(spec: registry.OpSpec) -> list[dict]:
    """The op's named examples this backend can run (full model shapes only on the GPU)."""
    on_gpu = backend.name() == "cuda"
    return [e for e in spec.examples if on_gpu or e.get("gpu", True) is False]


def run(
    spec: registry.OpSpec,
    impl: Callable | None = None,
    impl_label: str | None = None,
    max_examples: int = 100,
    random_seed: int | None = None,
    progress: Callable[[str], None] | None = None,
    watchdog: Watchdog = NO_LIMIT,
) -> Outcome:
    """The named examples first, then ``max_examples`` Hypothesis cases under the active
    profile; a failure is shrunk to its smallest repro before it is reported. ``watchdog`` bounds
    each case's time (a hung implementation ends the run from there)."""
    outcome = Outcome(spec.name, True)
    earlier = ReturnedMemory()  # this run's recent outputs: one returned again is a kept buffer

    def judge(case: Case) -> CheckResult:
        with watchdog.watching(case):
            result = check(spec, case, impl, impl_label, earlier)
        if result.device_lost:
            raise _DeviceLost(result)
        if result.passed and (outcome.worst is None or _closeness(result) > _closeness(outcome.worst)):
            outcome.worst = result
        return result

    try:
        _search(spec, outcome, judge, max_examples, random_seed, progress)
    except _DeviceLost as lost:
        outcome.passed, outcome.failure, outcome.device_lost = False, lost.result, True
        return outcome
    if outcome.failure is not None and not outcome.nondeterministic:
        # once more: a failure that Hypothesis's own replay happened to repeat may still not be the
        # case's (a kernel wrong on some calls only)
        with watchdog.watching(outcome.failure.case):
            outcome.nondeterministic = check(spec, outcome.failure.case, impl, impl_label).passed
    return outcome


def _search(
    spec: registry.OpSpec,
    outcome: Outcome,
    judge: Callable[[Case], CheckResult],
    max_examples: int,
    random_seed: int | None,
    progress: Callable[[str], None] | None,
) -> None:
    """The named examples, then the drawn cases; the outcome records the search and its failure."""
    device = backend.device()
    for example in runnable_examples(spec):
        outcome.examples += 1
        result = judge(spec.build(registry.example_params(example), device))
        if progress:
            progress(f"example {example['name']}: {'ok' if result.passed else 'DIVERGES'}")
        if not result.passed and outcome.failure is None:
            # keep searching: the drawn cases shrink to a smaller repro than a named shape
            outcome.passed, outcome.failure, outcome.failing_example = False, result, example["name"]

    failing_seen = False

    @settings(max_examples=max_examples, derandomize=settings.default.derandomize and random_seed is None)
    @given(spec.params(limits.current()))
    def property_holds(params: dict) -> None:
        nonlocal failing_seen
        case = spec.build(params, device)
        for label in case.labels:
            event(label)
        searching = not failing_seen  # count the search, not the shrinking that follows a failure
        if searching:
            outcome.cases += 1
            outcome.coverage.update(case.labels)
        result = judge(case)
        if searching and progress and outcome.cases % 10 == 0:
            progress(f"{outcome.cases} cases")
        if not result.passed:
            failing_seen = True
            outcome.failure, outcome.failing_example = result, None
            raise AssertionError(result.describe())

    test = property_holds if random_seed is None else seed(random_seed)(property_holds)
    try:
        test()
    except FlakyFailure:  # Hypothesis replayed the failing case and it passed: not shrunk, may not repeat
        outcome.passed, outcome.nondeterministic = False, True
    except AssertionError:
        outcome.passed = False
