"""The comparison core must catch wrong implementations and pass right ones."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import registry
from ops import backend, norm
from tests import buggy_kernels
from verify.compare import check, judge, judge_in_place, ulp
from verify.tolerances import Tolerance, lookup

DEVICE = backend.device()


def _case(name: str, **overrides):
    spec = registry.get(name)
    return spec, spec.build({**spec.typical, **overrides}, DEVICE)


def test_correct_kernel_passes() -> None:
    spec, case = _case("rms_norm")
    result = check(spec, case)
    assert result.passed, result.describe()


@pytest.mark.parametrize("bug", ["tail_dropped", "off_by_one", "wrong_eps"])
def test_buggy_rms_norm_is_caught(bug: str) -> None:
    # n=65: not a multiple of 16, so the dropped tail and the off-by-one mask both bite;
    # tiny values with eps=1e-5: eps dominates mean(x^2), so where it is added matters
    spec, case = _case("rms_norm", n=65, dist="tiny", eps=1e-5)
    result = check(spec, case, getattr(buggy_kernels, f"rms_norm_{bug}"))
    assert not result.passed


def test_failure_message_names_everything() -> None:
    spec, case = _case("rms_norm", n=65)
    text = check(spec, case, buggy_kernels.rms_norm_off_by_one).describe()
    for needle in (
        "rms_norm",
        "DIVERGES",
        "(3, 65)",
        "bfloat16",
        "strides=",
        "max abs diff",
        "mean abs diff",
        "worst at",
        "impl",
        "reference",
        "python -m verify.op rms_norm --case",
    ):
        assert needle in text, f"{needle!r} missing from:\n{text}"


def test_an_impl_drawing_random_numbers_draws_the_same_ones_whenever_its_case_runs() -> None:
    # so the repro command of a verdict that hangs on a draw replays it, named examples too
    spec, case = _case("rms_norm")

    def noisy(x, w, eps):
        draw = torch.rand((), device=x.device).item()  # the GPU's generator on the GPU
        return norm.rms_norm(x, w, eps) + (random.random() + np.random.rand() + draw)

    def states():
        gpu = torch.cuda.get_rng_state() if DEVICE.type == "cuda" else None
        return random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state(), gpu

    before = states()
    first, again = check(spec, case, noisy), check(spec, case, noisy)
    assert not first.passed and first.outputs[0].impl_value == again.outputs[0].impl_value
    after = states()  # and the caller's generators are left as they were
    assert after[0] == before[0] and (after[1] == before[1]).all() and torch.equal(after[2], before[2])
    assert DEVICE.type != "cuda" or torch.equal(after[3], before[3])


def test_wrong_dtype_fails_even_when_values_are_close() -> None:
    spec, case = _case("rms_norm")
    result = check(spec, case, lambda x, w, eps: norm.rms_norm(x, w, eps).float())
    assert not result.passed and "dtype" in result.outputs[0].reason


def test_second_output_of_a_pair_is_compared() -> None:
    spec, case = _case("add_rms_norm")

    def wrong_sum(x, r, w, eps):
        y, total = norm.add_rms_norm(x, r, w, eps)
        return y, total + 1

    result = check(spec, case, wrong_sum)
    assert not result.passed and [o.passed for o in result.outputs] == [True, False]


def test_stray_write_in_kv_cache_is_caught() -> None:
    spec, case = _case("kv_cache_store")

    def stray(k_cache, v_cache, k, v, start_pos):
        spec.impl(k_cache, v_cache, k, v, start_pos)
        k_cache[:, -1] = 0  # a row nobody asked to write

    assert not check(spec, case, stray).passed


def test_write_to_an_input_is_caught() -> None:
    spec, case = _case("rms_norm")

    def clobbers_input(x, w, eps):
        y = norm.rms_norm(x, w, eps)
        x.zero_()
        return y

    result = check(spec, case, clobbers_input)
    assert not result.passed
    (report,) = [o for o in result.outputs if "wrote to this input" in o.reason]
    x = case.args[0]  # the report describes the input written to
    expected = ("x", tuple(x.shape), x.stride(), "untouched")
    assert (report.name, report.shape, report.strides, report.rule) == expected


def test_an_impl_returning_none_is_told_so() -> None:
    spec, case = _case("rms_norm")
    result = check(spec, case, lambda x, w, eps: None)
    assert not result.passed and result.error == "implementation returned None, the reference a single output"
    spec, case = _case("rope_kv_store")  # the caches it updates are not counted as returned
    result = check(spec, case, lambda *args, **kwargs: None)
    assert not result.passed and result.error == "implementation returned None, the reference a single output"


def test_an_impl_returning_its_one_output_in_a_tuple_is_told_so() -> None:
    spec, case = _case("rms_norm")
    result = check(spec, case, lambda x, w, eps: (norm.rms_norm(x, w, eps),))
    assert not result.passed
    assert result.error == "implementation returned a tuple of 1 output, the reference a single output"


def test_an_output_that_is_not_new_memory_fails() -> None:
    # right values, but a view of an input, one output twice, or a view of a buffer passed by
    # keyword: each is overwritten under its caller
    spec, case = _case("splitk_reduce", s=1, dtype="float32")
    result = check(spec, case, lambda partials, out_dtype: partials[0].to(out_dtype))
    assert not result.passed and result.error.startswith("out shares memory with input partials")

    spec, case = _case("add_rms_norm")

    def one_output_twice(x, residual, w, eps):
        y, _ = norm.add_rms_norm(x, residual, w, eps)
        return y, y

    result = check(spec, case, one_output_twice)
    assert not result.passed and result.error.startswith("out[1] shares memory with out[0]")

    spec, case = _case("linear_splitk", split_k=1, dtype="float32", prealloc=True)
    assert "partials" in case.kwargs
    result = check(spec, case, lambda x, w, split_k, partials: torch.mm(x, w.t(), out=partials[0]))
    assert not result.passed and result.error.startswith("out shares memory with input partials")


def test_outputs_cut_from_one_new_allocation_pass() -> None:
    spec, case = _case("add_rms_norm")

    def halves_of_one_buffer(x, residual, w, eps):
        y, total = norm.add_rms_norm(x, residual, w, eps)
        both = torch.empty((2, *y.shape), dtype=y.dtype, device=y.device)
        both[0], both[1] = y, total
        return both[0], both[1]

    assert check(spec, case, halves_of_one_buffer).passed


def test_a_buffer_kept_between_calls_fails_within_a_run() -> None:
    from verify.memory import ReturnedMemory

    spec, case = _case("rms_norm")
    other_spec, other_case = _case("rms_norm", n=33)
    ring: list[torch.Tensor] = []
    calls = []

    def two_buffers_in_turn(x, w, eps):  # a ring of two, as a double-buffered kernel might keep
        y = norm.rms_norm(x, w, eps)
        if len(ring) < 2:
            ring.append(torch.empty_like(y))
        calls.append(None)
        return ring[(len(calls) - 1) % 2].copy_(y)

    earlier = ReturnedMemory()
    assert check(spec, case, two_buffers_in_turn, earlier=earlier).passed  # new memory both times
    assert check(spec, case, two_buffers_in_turn, earlier=earlier).passed
    assert check(other_spec, other_case, earlier=earlier).passed  # another op's call between
    result = check(spec, case, two_buffers_in_turn, earlier=earlier)
    assert not result.passed and "is memory an earlier call returned" in result.error
    for _ in range(3):  # the registered kernel allocates every time
        assert check(spec, case, earlier=earlier).passed


def test_an_impl_failing_deep_in_a_library_shows_its_own_line() -> None:
    import json

    spec, case = _case("rms_norm")

    def parses_nothing(x, w, eps):
        return json.loads("{")  # raises two frames down in the json package

    result = check(spec, case, parses_nothing)
    assert 'return json.loads("{")' in result.error and "JSONDecodeError" in result.error


def test_an_impl_failing_inside_a_torch_op_shows_its_own_line_last() -> None:
    """Under the check's poisoning dispatch mode a torch op raises from torch's dispatch code:
    the report ends at the implementation's call, not in torch/_ops.py."""
    spec, case = _case("rms_norm")

    def asks_for_a_negative_size(x, w, eps):
        return torch.empty(-1)

    result = check(spec, case, asks_for_a_negative_size)
    assert "return torch.empty(-1)" in result.error and "_ops.py" not in result.error


def test_an_integer_output_reports_integer_values() -> None:
    spec, case = _case("argmax")
    result = check(spec, case, lambda logits: logits.argmin(-1))
    (report,) = result.outputs
    assert not report.passed and isinstance(report.impl_value, int) and isinstance(report.ref_value, int)


def test_write_outside_a_view_is_caught() -> None:
    spec, case = _case("rms_norm", pad=3)

    def writes_padding(x, w, eps):
        y = norm.rms_norm(x, w, eps)
        x.as_strided((x.shape[0],), (x.stride(0),), x.storage_offset() + x.shape[1]).zero_()
        return y

    assert not check(spec, case, writes_padding).passed


def test_unwritten_output_is_caught() -> None:
    spec, case = _case("rms_norm")
    assert not check(
        spec, case, lambda x, w, eps: torch.empty(x.shape, dtype=x.dtype, device=x.device)
    ).passed
    assert not check(spec, case, buggy_kernels.rms_norm_half_written).passed


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("op", ["add", "silu_mul", "rms_norm"])  # exact, allclose, max_error_ratio
def test_a_non_finite_element_where_the_reference_is_finite_is_caught(op: str, bad: float) -> None:
    spec, case = _case(op)

    def one_bad(*args):
        out = spec.impl(*args)
        out.view(-1)[5] = bad
        return out

    result = check(spec, case, one_bad)
    assert not result.passed and "NaN/Inf" in result.outputs[0].reason
    text = result.describe()  # no "max abs diff 0" next to a NaN: the diffs are the finite elements'
    assert "first at" in text and "among the finite elements: max abs diff" in text and "worst at" not in text


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's inf * 0
@pytest.mark.parametrize("op", ["silu_mul", "rms_norm"])  # allclose, max_error_ratio
def test_a_finite_element_where_the_reference_is_not_is_caught(op: str) -> None:
    """Where the reference is inf or NaN the output must be the same: under allclose and
    max_error_ratio that rule alone stands between a kernel clamping an overflow and a pass."""
    spec, case = _case(op)
    case.args[0][(0,) * (case.args[0].dim() - 1) + (5,)] = float("inf")  # silu_mul: inf; rms_norm: a NaN row
    assert check(spec, case).passed  # the kernel matches the non-finite reference

    def clamped(*args):
        return torch.nan_to_num(spec.impl(*args), nan=0.0, posinf=1.0, neginf=-1.0)

    result = check(spec, case, clamped)
    assert not result.passed and result.outputs[0].reason.startswith("NaN/Inf not matched")


def test_an_output_of_a_broadcastable_wrong_shape_is_caught() -> None:
    spec, case = _case("rms_norm")
    result = check(spec, case, lambda x, w, eps: norm.rms_norm(x, w, eps)[None])
    assert not result.passed and "shape" in result.outputs[0].reason


def test_tensors_the_implementation_allocates_start_as_nan_or_minus_one() -> None:
    """Memory an implementation allocates is poisoned, so an element it never writes cannot pass
    on whatever the allocator hands back (often the right answer from an earlier run)."""
    spec, case = _case("add")
    seen = []

    def allocates(x, y):
        seen.append((torch.empty(16, device=x.device).clone(), torch.empty(4, dtype=torch.int32).clone()))
        return spec.impl(x, y)

    assert check(spec, case, allocates).passed
    floats, ints = seen[0]
    assert torch.isnan(floats).all() and (ints == -1).all()


def test_non_contiguous_output_is_caught() -> None:
    spec, case = _case("add")
    result = check(spec, case, lambda x, y: spec.impl(x, y).t().contiguous().t())
    assert not result.passed and "contiguous" in result.outputs[0].reason


def test_missing_output_is_caught() -> None:
    spec, case = _case("add_rms_norm")
    assert not check(spec, case, lambda x, r, w, eps: norm.add_rms_norm(x, r, w, eps)[0]).passed


def test_exception_in_impl_is_a_failure_with_the_error() -> None:
    spec, case = _case("add")

    def boom(x, y):
        raise RuntimeError("kernel exploded")

    result = check(spec, case, boom)
    assert not result.passed and "kernel exploded" in result.error


def test_max_error_ratio_floor_keeps_an_exact_baseline_satisfiable() -> None:
    # In fp32, plain torch *is* the reference computation: its error against fp64 can be
    # ~0, and without the one-ulp floor the kernel would have to be exact.
    spec, case = _case("rms_norm", dtype="float32")
    assert check(spec, case).passed


def test_ulp_is_the_rounding_step() -> None:
    assert ulp(torch.bfloat16, 1.0) == 2**-7
    assert ulp(torch.bfloat16, 3.0) == 2**-6
    assert ulp(torch.float32, 1.0) == 2**-23


def test_tolerance_lookup_falls_back_to_default_and_refuses_unknown_dtypes(tmp_path) -> None:
    table = tmp_path / "tolerances.toml"  # no op of the real table falls back since splitk_reduce's rule
    table.write_text('[default]\nbfloat16 = { atol = 1e-6, rtol = 0.008 }\n[op]\nrule = "allclose"\n')
    assert lookup("op", torch.bfloat16, table) == Tolerance("allclose", atol=1e-6, rtol=0.008)
    assert lookup("embedding", torch.bfloat16).rule == "exact"
    with pytest.raises(KeyError, match="float64"):
        lookup("op", torch.float64, table)


def test_tolerance_lookup_names_a_missing_ratio(tmp_path) -> None:
    table = tmp_path / "tolerances.toml"
    table.write_text('[default]\nbfloat16 = { atol = 0.0, rtol = 0.008 }\n[op]\nrule = "max_error_ratio"\n')
    with pytest.raises(KeyError, match=r"\[op\] uses max_error_ratio but gives no ratio for bfloat16"):
        lookup("op", torch.bfloat16, table)


def test_a_backend_table_replaces_the_dtype_entry_on_that_backend_only(tmp_path) -> None:
    table = tmp_path / "tolerances.toml"
    table.write_text(
        '[default]\nbfloat16 = { atol = 0.0, rtol = 0.008 }\n[op]\nrule = "max_error_ratio"\n'
        "float32 = { max_error_ratio = 16.0, ulps = 16 }\n"
        "[op.interpreter]\nfloat32 = { max_error_ratio = 2.0 }\n"
    )
    exact_math = Tolerance("max_error_ratio", max_error_ratio=2.0, ulps=1.0)  # the entry whole, not merged
    assert lookup("op", torch.float32, table, backend="interpreter") == exact_math
    gpu_math = Tolerance("max_error_ratio", max_error_ratio=16.0, ulps=16.0)
    assert lookup("op", torch.float32, table, backend="cuda") == gpu_math
    assert lookup("op", torch.float32, table) == gpu_math
    with pytest.raises(KeyError, match="max_error_ratio but gives no ratio for bfloat16"):  # [default]'s
        lookup("op", torch.bfloat16, table, backend="interpreter")


def test_a_misspelt_backend_table_is_refused(tmp_path) -> None:
    table = tmp_path / "tolerances.toml"
    table.write_text('[op]\nrule = "allclose"\nfloat32 = { atol = 0.0, rtol = 1e-5 }\n[op.interpeter]\n')
    with pytest.raises(ValueError, match=r"\[op.interpeter\] is neither a dtype nor a backend"):
        lookup("op", torch.float32, table, backend="interpreter")


def test_max_error_ratio_takes_a_floor_in_ulps(tmp_path) -> None:
    table = tmp_path / "tolerances.toml"
    table.write_text('[op]\nrule = "max_error_ratio"\nfloat32 = { max_error_ratio = 2.0, ulps = 16 }\n')
    tol = lookup("op", torch.float32, table)
    assert tol.ulps == 16 and lookup("linear", torch.float32).ulps == 1
    oracle = torch.tensor([1.0], dtype=torch.float64)
    exact = oracle.float()
    for ulps, verdict in ((15, True), (17, False)):  # floor: 16 ulps, plain torch exact
        off = torch.tensor([1.0 + ulps * 2**-23], dtype=torch.float32)
        assert judge("out", off, exact, tol, oracle, exact).passed is verdict


def _attention_inputs(seq_len: int) -> tuple:
    """One query (2, 0), keys (3, 0) and (-8, 4), values (1, -5) and (0, 9), scale 0.5: the
    score terms are 3 and 8, and max|v| 5 and 9, for the first row and the second."""
    q = torch.tensor([2.0, 0.0]).view(1, 1, 1, 2)
    k = torch.tensor([[3.0, 0.0], [-8.0, 4.0]]).view(1, 2, 1, 2)
    v = torch.tensor([[1.0, -5.0], [0.0, 9.0]]).view(1, 2, 1, 2)
    return q, k, v, torch.tensor([seq_len], dtype=torch.int32), 0.5


def test_attention_floor_is_one_ulp_per_visible_score_through_the_softmax() -> None:
    from references.attention import score_rounding_floor

    eps = torch.finfo(torch.float32).eps
    assert score_rounding_floor(*_attention_inputs(2)) == 2 * (8 * eps) * 9
    assert score_rounding_floor(*_attention_inputs(1)) == 2 * (2 * eps) * 5  # row 1 not visible
    assert score_rounding_floor(*_attention_inputs(0)) == 0.0


def test_attention_floor_bounds_what_an_ulp_on_every_score_does() -> None:
    """The floor's derivation, checked: every score moved by one ulp of the largest terms, each
    in the direction that pushes an output element furthest (scores spread enough that several
    rows share the softmax), moves the output by no more than the floor (at most ~0.4 of it here)."""
    from references.attention import score_rounding_floor

    gen = torch.Generator().manual_seed(0)
    for length in range(2, 22):
        q = torch.randn(1, 1, 1, 16, generator=gen, dtype=torch.float64) * 2
        k = torch.randn(1, length, 1, 16, generator=gen, dtype=torch.float64) * 2
        v = torch.randn(1, length, 1, 16, generator=gen, dtype=torch.float64)
        floor = score_rounding_floor(q, k, v, torch.tensor([length]), 0.125)
        keys, values = k[0, :, 0], v[0, :, 0]
        scores = keys @ q[0, 0, 0] * 0.125
        step = (
            torch.finfo(torch.float32).eps
            * 2.0 ** (keys.abs() @ q[0, 0, 0].abs() * 0.125).max().log2().floor()
        )
        out = torch.softmax(scores, 0) @ values
        d = (values - out).abs().amax(0).argmax()  # the element with the most to move
        moved = torch.softmax(scores + torch.sign(values[:, d] - out[d]) * step, 0) @ values
        assert 0 < (moved - out).abs().max() <= floor


def test_attention_checks_take_the_score_rounding_floor() -> None:
    """The floor, times the backend's ``floor_ulps``, reaches the verdict: on fp32 scores in the
    hundreds it dwarfs 2x plain torch's error, so an output off by 90% of it passes and one off
    by three times it fails."""
    from references.attention import score_rounding_floor

    spec, case = _case("attention", dtype="float32", scores="large")
    ulps = lookup("attention", torch.float32, backend=backend.name()).floor_ulps
    floor = ulps * score_rounding_floor(*case.args)

    def nudged(by: float):
        def impl(*args):
            result = spec.reference(*args).contiguous()
            result.view(-1)[0] += by
            return result

        return impl

    assert check(spec, case, nudged(0.9 * floor)).passed
    assert not check(spec, case, nudged(3 * floor)).passed


def test_overflow_to_inf_is_judged_against_the_rounded_oracle() -> None:
    """An fp16 output whose exact value is past 65504 rounds to inf: inf there is right, a
    finite value there (or an inf where the exact value fits) is not."""
    tol = Tolerance("max_error_ratio", max_error_ratio=2.0)
    oracle = torch.tensor([70000.0, -70000.0, 1.0], dtype=torch.float64)
    right = torch.tensor([float("inf"), float("-inf"), 1.0], dtype=torch.float16)
    assert judge("out", right, right, tol, oracle, right).passed
    saturated = torch.tensor([65504.0, float("-inf"), 1.0], dtype=torch.float16)
    assert not judge("out", saturated, right, tol, oracle, right).passed
    fits = torch.tensor([60000.0, -70000.0, 1.0], dtype=torch.float64)
    assert not judge("out", right, right, tol, fits, right).passed


def test_max_error_ratio_takes_an_absolute_floor() -> None:
    tol = Tolerance("max_error_ratio", max_error_ratio=2.0, atol=1e-26)
    assert lookup("linear", torch.bfloat16).atol == 0.0
    oracle = torch.tensor([1e-30], dtype=torch.float64)
    zero = torch.zeros(1, dtype=torch.bfloat16)
    assert judge("out", zero, zero, tol, oracle, zero).passed
    assert not judge("out", zero, zero, lookup("linear", torch.bfloat16), oracle, zero).passed


def _bf16(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.bfloat16)


def _ratio_verdict(impl: list[float], ref: list[float], oracle: list[float], lowp: list[float]) -> bool:
    tol = Tolerance("max_error_ratio", max_error_ratio=2.0)
    return judge("out", _bf16(impl), _bf16(ref), tol, _bf16(oracle).double(), _bf16(lowp)).passed


def test_a_nan_in_an_error_measure_does_not_pass_everything() -> None:
    # plain torch NaN where the oracle is finite: its error is no yardstick, not an unbounded one
    assert not _ratio_verdict([100, -50, 7], [1, 2, 3], [1, 2, 3], [1, float("nan"), 3])
    # the reference NaN where the oracle is finite, matched by a NaN of the implementation, which is
    # right everywhere else: that NaN is an unbounded error, not one to leave out
    assert not _ratio_verdict([1, float("nan"), 3], [1, float("nan"), 3], [1, 2, 3], [1, 2, 3])
    assert _ratio_verdict([1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2.01, 3])


def test_where_plain_torch_breaks_down_the_fp32_reference_is_the_yardstick() -> None:
    """A baseline far off the oracle must not license any error: past 1/32 of max|oracle| the
    reference's error (fp32 math rounded once) takes its place, never beyond that 1/32."""
    broken = [1, 2, 400]
    step = 2**-5  # a bf16 ulp at 4
    assert _ratio_verdict([1, 2, 4 + step], [1, 2, 4], [1, 2, 4], broken)  # the 1-ulp floor
    assert not _ratio_verdict([1, 2, 4 + 2 * step], [1, 2, 4], [1, 2, 4], broken)  # 1.6% off
    assert _ratio_verdict([1, 2, 4 + 3 * step], [1, 2, 4 + step], [1, 2, 4], broken)  # 2 x 1 ulp + 1
    assert not _ratio_verdict([1, 2, 4 + 4 * step], [1, 2, 4 + step], [1, 2, 4], broken)
    # the reference broken too: the 1/32 cap (0.125) and the floor
    assert _ratio_verdict([1, 2, 4 + 4 * step], broken, [1, 2, 4], broken)
    assert not _ratio_verdict([1, 2, 4.5], broken, [1, 2, 4], broken)


def test_a_report_names_the_yardstick_it_judged_by() -> None:
    tol = Tolerance("max_error_ratio", max_error_ratio=2.0)
    oracle = _bf16([1, 2, 4]).double()
    report = judge("out", _bf16([1, 2, 4.5]), _bf16([1, 2, 4]), tol, oracle, _bf16([1, 2, 400]))
    assert "2 x the fp32 reference error 0 (plain bfloat16 torch broke down: 396)" in report.reason
    report = judge("out", _bf16([1, 2, 4.5]), _bf16([1, 2, 4]), tol, oracle, _bf16([1, 2, 4.03125]))
    assert "2 x plain bfloat16 torch error 0.03125 + floor" in report.reason


def test_the_oracle_is_fp64_and_rounds_only_what_the_definition_rounds() -> None:
    from references.precision import computing_in, oracle, rounded
    from verify.compare import _run_reference

    for op in ("rms_norm", "splitk_reduce"):  # output dtype from the input's, and an out_dtype argument
        spec, case = _case(op)
        (_, out), *_ = _run_reference(spec, case, "oracle")
        assert out.dtype == torch.float64
        assert not torch.equal(out, out.to(torch.bfloat16).double())  # not rounded to the op's dtype
    x = torch.tensor([1 + 2**-10], dtype=torch.float64)
    with oracle(storage=torch.bfloat16):
        # an intermediate the op's definition rounds is rounded to the inputs' storage dtype
        assert rounded(x, torch.float32).dtype == torch.float64
        assert rounded(x, torch.float32).item() == 1.0
    with computing_in(torch.float32):
        assert rounded(x.float(), torch.bfloat16).item() == 1.0


def _impl_wrong_on_calls(spec, wrong):
    """The registered kernel, its output scaled on the calls (counted from 1) where ``wrong``."""
    calls = []

    def impl(*args):
        out = spec.impl(*args)
        calls.append(None)
        return out * 1.5 if wrong(len(calls)) else out

    return impl


def test_a_failure_in_either_stage_of_a_property_run_fails_it() -> None:
    """Named examples run first, drawn cases after: a kernel wrong only in one stage must fail."""
    from verify import property

    spec = registry.get("rms_norm")
    named = len(property.runnable_examples(spec))
    assert named >= 1
    drawn_only = property.run(spec, _impl_wrong_on_calls(spec, lambda n: n > named), max_examples=5)
    assert not drawn_only.passed and drawn_only.failure is not None
    named_only = property.run(spec, _impl_wrong_on_calls(spec, lambda n: n == 1), max_examples=5)
    assert not named_only.passed and named_only.failure is not None
    assert property.run(spec, _impl_wrong_on_calls(spec, lambda n: False), max_examples=5).passed
    assert not drawn_only.nondeterministic  # wrong on every drawn call: the failure repeats
    assert named_only.nondeterministic  # wrong on its first call only: rerun, the example passes


def test_a_failure_that_does_not_repeat_is_reported_as_nondeterministic() -> None:
    """Wrong on the first drawn case only: Hypothesis's replay of it passes, so the run fails and
    says the implementation is nondeterministic instead of calling the case a shrunk repro."""
    from verify import property

    spec = registry.get("rms_norm")
    first_drawn = len(property.runnable_examples(spec)) + 1
    outcome = property.run(spec, _impl_wrong_on_calls(spec, lambda n: n == first_drawn), max_examples=5)
    assert not outcome.passed and outcome.nondeterministic and outcome.failure is not None


def test_a_gpu_fault_ends_the_run_at_its_case(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a CUDA fault every call fails, so Hypothesis, shrinking by rerunning cases, would
    shrink to whatever case ran next. The run stops at the faulting case instead, with no reference
    run and no other case. Simulated: the implementation raises on the first drawn case, from
    which the device counts as lost (tests/test_gpu_faults.py faults a real GPU)."""
    from verify import compare, property

    spec = registry.get("rms_norm")
    named = len(property.runnable_examples(spec))
    calls = []

    def impl(*args):
        calls.append(None)
        if len(calls) == named + 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return spec.impl(*args)

    def reference(*args):
        assert len(calls) <= named, "the reference ran after the fault"
        return run_reference(*args)

    run_reference = compare._run_reference
    monkeypatch.setattr(compare, "_run_reference", reference)
    monkeypatch.setattr(compare, "device_lost", lambda: len(calls) > named)
    outcome = property.run(spec, impl, max_examples=20)
    assert not outcome.passed and outcome.device_lost and len(calls) == named + 1
    assert outcome.failure.device_lost and outcome.failure.raised_by == "implementation"
    assert (outcome.examples, outcome.cases) == (named, 1)


def test_a_report_says_how_much_of_its_tolerance_an_output_used() -> None:
    """``used``: error over bound at the worst element, so a run can show how near it came."""
    allclose = Tolerance("allclose", atol=0.0, rtol=0.01)
    ref = torch.tensor([1.0, 100.0])
    assert judge("out", torch.tensor([1.005, 100.0]), ref, allclose).used == pytest.approx(0.5)
    assert judge("out", torch.tensor([1.0, 102.0]), ref, allclose).used == pytest.approx(2.0)
    assert judge("out", ref.clone(), ref, Tolerance("exact")).used is None
    four = _bf16([1, 2, 4])
    tol = Tolerance("max_error_ratio", max_error_ratio=2.0)
    ratio = judge("out", _bf16([1, 2, 4.0625]), four, tol, four.double(), _bf16([1, 2, 400]))
    assert ratio.used == pytest.approx(0.0625 / ratio.bound)
    spec, case = _case("rms_norm")
    result = check(spec, case)
    assert result.passed and 0 < result.used <= 1


def test_exact_rule_compares_bits() -> None:
    exact = Tolerance("exact")
    copy = torch.tensor([1.0, float("nan"), -0.0], dtype=torch.bfloat16)
    assert judge("out", copy.clone(), copy, exact).passed  # a NaN copied is right
    assert not judge("out", torch.tensor([1.0, float("nan"), 0.0], dtype=torch.bfloat16), copy, exact).passed


def _rope_kv_store_then(change):
    """The registered rope_kv_store, then ``change(cache, written_rows_mask)`` on both caches."""
    spec = registry.get("rope_kv_store")

    def impl(q, k, v, cos, sin, k_cache, v_cache, start_pos, q_norm, k_norm, eps):
        before = k_cache.clone()
        out = spec.impl(q, k, v, cos, sin, k_cache, v_cache, start_pos, q_norm, k_norm, eps)
        written = (k_cache != before).any(dim=-1)
        for cache in (k_cache, v_cache):
            change(cache, written)
        return out

    return impl


@pytest.mark.parametrize(
    ("dist", "change"),
    [
        ("large", lambda cache, written: cache.masked_fill_(~written[..., None], 0.0)),  # stray writes
        ("tiny", lambda cache, written: cache.masked_fill_(written[..., None], 0.0)),  # new rows lost
    ],
    ids=["other rows zeroed, large values", "new rows zeroed, tiny values"],
)
def test_in_place_cache_rows_are_judged_apart_from_the_rest(dist: str, change) -> None:
    """One bound over a whole cache takes its scale from old and new rows alike: zeroing the old
    rows hid below large new ones, zeroing tiny new rows below the old ones."""
    spec, case = _case("rope_kv_store", dist=dist, qk_norm=False)
    assert check(spec, case).passed
    result = check(spec, case, _rope_kv_store_then(change))
    assert not result.passed
    assert {o.name for o in result.outputs if not o.passed} >= {"v_cache"}


def test_in_place_rows_of_products_get_the_terms_floor() -> None:
    """The H200 case (fp32, one written v row 2 ulps off where plain torch was exact): the sums'
    |terms| floor, as for any output that sums products, and no pass without it."""
    tol = Tolerance("max_error_ratio", max_error_ratio=16.0)
    before = torch.tensor([[0.5, -1.1], [0.5, -1.1]])
    ref = before.clone()
    ref[1] = torch.tensor([0.8968594, 0.25])
    impl = ref.clone()
    impl[1, 0] += 2**-23  # 2 ulps at 0.897
    oracle = ref.double()
    assert not judge_in_place("v_cache", impl, ref, before, tol, oracle, ref.clone()).passed
    assert judge_in_place("v_cache", impl, ref, before, tol, oracle, ref.clone(), oracle.abs()).passed


def test_scratch_is_poisoned_before_the_implementation_runs() -> None:
    """Scratch kept from an earlier call (often holding the right answer) reads as NaN."""
    from ops import scratch

    held = scratch.cached("test_compare", (DEVICE,), lambda: torch.ones(4, device=DEVICE))
    spec, case = _case("add")
    seen = []

    def reads_old_scratch(x, y):
        seen.append(held.clone())
        return spec.impl(x, y)

    assert check(spec, case, reads_old_scratch).passed
    assert torch.isnan(seen[0]).all()


def test_failing_elements_are_narrowed_down_per_dim() -> None:
    """A tail, every other head, one row: the pattern of the failing indices, where it narrows
    anything down; nothing where every index of every dim fails, or nothing does."""
    from verify.compare import failing_extent

    tail = torch.zeros(3, 65, dtype=torch.bool)
    tail[:, 48:] = True
    assert failing_extent(tail) == "dim 0 all 3; dim 1 at 48-64 of 65"
    heads = torch.zeros(1, 2, 8, 4, dtype=torch.bool)
    heads[:, :, 1::2] = True
    assert failing_extent(heads) == "dim 0 all 1; dim 1 all 2; dim 2 at 1, 3, 5, 7 of 8; dim 3 all 4"
    scattered = torch.zeros(20, dtype=torch.bool)
    scattered[::2] = True
    assert failing_extent(scattered) == "dim 0 at 0, 2, 4, 6, 8, 10, ... of 20"
    assert failing_extent(torch.ones(2, 3, dtype=torch.bool)) == ""
    assert failing_extent(torch.zeros(2, 3, dtype=torch.bool)) == ""


def test_floor_ulps_is_read_per_backend() -> None:
    """attention's fp32 floor: 4 score ulps on the GPU (its dot order), 1 on the interpreter."""
    assert lookup("attention", torch.float32, backend="cuda").floor_ulps == 4.0
    assert lookup("attention", torch.float32, backend="interpreter").floor_ulps == 1.0
    assert lookup("attention", torch.bfloat16, backend="cuda").floor_ulps == 1.0
