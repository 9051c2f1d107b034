"""``python -m verify.op``: verdicts, exit codes, outside implementations, bad usage."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.subprocess_env import user_env

ROOT = Path(__file__).resolve().parent.parent


def verify_op(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "verify.op", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=user_env(),
    )  # fmt: skip


def test_list_shows_every_op_with_article_numbers(tmp_path: Path) -> None:
    import registry

    report = tmp_path / "ops.json"
    run = verify_op("--list", "--json", str(report))
    assert run.returncode == 0
    for spec in registry.all():
        assert spec.name in run.stdout
    assert "1, 12, 20, qk-norm" in run.stdout
    listed = {row["op"]: row for row in json.loads(report.read_text())}
    assert set(listed) == set(registry.names())
    assert listed["kv_cache_store"] == {
        "op": "kv_cache_store", "article_ops": [18], "rule": "exact", "mutates": ["k_cache", "v_cache"],
    }  # fmt: skip


def test_registered_kernel_verifies(tmp_path: Path) -> None:
    report = tmp_path / "out.json"
    run = verify_op("rms_norm", "--examples", "10", "--seed", "3", "--json", str(report))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "VERIFIED" in run.stdout and "edge classes covered" in run.stdout
    data = json.loads(report.read_text())
    assert data["passed"] and data["cases"] == 10 and data["coverage"]


def test_reference_as_outside_impl_verifies() -> None:
    run = verify_op("add_rms_norm", "--impl", "references.norm:add_rms_norm", "--examples", "10")
    assert run.returncode == 0, run.stdout + run.stderr


def test_outside_impl_of_the_contract_signature_is_not_handed_the_kernels_buffer(tmp_path: Path) -> None:
    """linear_splitk's contract is ``(x, weight, split_k)``; cases with a preallocated ``partials=``
    (the registered kernel's graph path) must not fail an implementation without that keyword."""
    impl = tmp_path / "splitk.py"
    impl.write_text(
        "import torch\n\n\ndef linear_splitk(x, weight, split_k):\n"
        "    return (x.float() @ weight.float().t()).to(x.dtype)\n"
    )
    import registry

    case = {**registry.get("linear_splitk").typical, "prealloc": True}
    run = verify_op("linear_splitk", "--case", json.dumps(case), "--impl", f"{impl}:linear_splitk")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "linear_splitk: verified" in run.stdout


def test_an_impl_taking_the_contracts_arguments_in_another_order_exits_2(tmp_path: Path) -> None:
    """Renamed arguments are the implementation's business; a contract name at another position
    is a swapped order, which would otherwise be reported as a divergence of the kernel."""
    impl = tmp_path / "swapped.py"
    impl.write_text("def linear(weight, x, bias=None):\n    return x @ weight.t()\n")
    run = verify_op("linear", "--impl", f"{impl}:linear")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "takes 'weight' at position 0; the linear signature (x, weight, bias) has it at 1" in run.stderr
    impl.write_text(
        "def linear(a, b, c=None):\n"
        "    y = a.float() @ b.float().t()\n"
        "    return (y if c is None else y + c.float()).to(a.dtype)\n"
    )
    assert verify_op("linear", "--impl", f"{impl}:linear", "--examples", "2").returncode == 0


def test_broken_kernel_from_a_file_diverges_with_a_small_repro(tmp_path: Path) -> None:
    report = tmp_path / "out.json"
    run = verify_op(
        "rms_norm", "--impl", "tests/buggy_kernels.py:rms_norm_tail_dropped", "--examples", "30",
        "--json", str(report),
    )  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    failure = json.loads(report.read_text())["failure"]  # the numbers, not only the text
    (out,) = failure["outputs"]
    assert not out["passed"] and out["max_abs"] > out["bound"] and failure["repro"].startswith("python -m")
    assert "DIVERGES" in run.stdout and "smallest failing case after shrinking" in run.stdout
    repro = next(line for line in run.stdout.splitlines() if "repro:" in line)
    case = json.loads(repro.split("--case ", 1)[1].split(" --impl")[0].strip("'"))
    assert case["n"] < 16 and len(case["lead"]) == 1  # shrunk toward the smallest shape that still fails
    # the repro command reproduces the failure on its own
    rerun = verify_op(
        "rms_norm", "--case", json.dumps(case), "--impl", "tests/buggy_kernels.py:rms_norm_tail_dropped"
    )
    assert rerun.returncode == 1 and "DIVERGES" in rerun.stdout


def test_a_failing_named_example_is_reported_as_such_not_as_shrunk(tmp_path: Path) -> None:
    impl = tmp_path / "wrong_on_the_example.py"
    impl.write_text(
        "from references.norm import rms_norm as reference\n"
        "def rms_norm(x, weight, eps):\n"
        "    y = reference(x, weight, eps)\n"
        "    return 2 * y if tuple(x.shape) == (3, 65) and not x.is_contiguous() else y\n"
    )
    report = tmp_path / "out.json"
    run = verify_op("rms_norm", "--impl", f"{impl}:rms_norm", "--examples", "5", "--json", str(report))
    assert run.returncode == 1, run.stdout + run.stderr
    assert "failing named example 'typical: 3 rows of 65, strided' (no drawn case failed" in run.stdout
    assert "after shrinking" not in run.stdout
    assert json.loads(report.read_text())["failing_example"] == "typical: 3 rows of 65, strided"


def test_a_case_that_hangs_ends_the_run_with_its_repro(tmp_path: Path) -> None:
    """A kernel whose programs wait for a flag no program sets never returns; the watchdog names
    the case and exits 1, rather than leaving the run to hang, and its repro hangs up the same way."""
    report = tmp_path / "out.json"
    impl = "tests/buggy_kernels.py:rms_norm_waits_for_next_row"
    run = verify_op("rms_norm", "--impl", impl, "--timeout", "3", "--json", str(report))
    assert run.returncode == 1, run.stdout + run.stderr
    assert "DIVERGES: a case ran past the 3 s limit; the run stops there" in run.stdout
    assert "did not finish within 3 s (--timeout)" in run.stdout
    data = json.loads(report.read_text())
    assert data["hung"] and not data["passed"] and data["timeout_s"] == 3
    repro = data["failure"]["repro"]
    assert repro.endswith(f"--impl {impl} --timeout 3") and repro in run.stdout
    case = data["failure"]["case"]
    rerun = verify_op("rms_norm", "--case", json.dumps(case), "--impl", impl, "--timeout", "2")
    assert rerun.returncode == 1 and "did not finish within 2 s" in rerun.stdout


def test_a_timeout_of_zero_is_no_limit() -> None:
    from verify.cli import seconds_or_none

    assert seconds_or_none("0") is None and seconds_or_none("2.5") == 2.5


def test_a_timeout_the_watchdogs_timer_cannot_take_is_refused() -> None:
    """Past ``threading.TIMEOUT_MAX`` the timer's thread dies at once, leaving no watchdog."""
    import argparse
    import threading

    from verify.cli import seconds_or_none

    assert seconds_or_none(str(threading.TIMEOUT_MAX)) == threading.TIMEOUT_MAX
    with pytest.raises(argparse.ArgumentTypeError, match="expected at most 9223372036 seconds"):
        seconds_or_none("1e10")


def test_a_json_report_that_cannot_be_written_exits_2() -> None:
    """A write that fails at the end (a full disk) is an output problem, exit 2, not a traceback."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    run = verify_op("--list", "--json", "/dev/full")
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr == "verify.op: --json /dev/full: No space left on device\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("no_such_op",), "unknown op"),
        ((), "op name is required"),
        (("rms_norm", "--impl", "no_such_module:fn"), "importing no_such_module failed"),
        (("rms_norm", "--impl", "tests/missing.py:fn"), "no file"),
        (("rms_norm", "--impl", "references.norm:nope"), "no callable"),
        (("rms_norm", "--impl", "references.elementwise:add"), "does not match the rms_norm signature"),
        (("rms_norm", "--impl", "just_a_name"), "importing just_a_name failed: ModuleNotFoundError"),
        (("rms_norm", "--case", "{not json"), "--case: not JSON"),
        (("rms_norm", "--case", "[1, 2]"), "--case: expected a JSON object of rms_norm fields"),
        (("rms_norm", "--case", "{}"), "--case: no field 'lead'; rms_norm cases have the fields"),
        (("rms_norm", "--list"), "--list lists every op; it takes no op name (got 'rms_norm')"),
        (("rms_norm", "--case", '{"n": "7"}'), "--case: field 'n' is '7'; expected int"),
        (("silu_mul", "--case", '{"fused": 1}'), "--case: field 'fused' is 1; expected bool"),
        (("rms_norm", "--case", '{"lead": 3}'), "--case: field 'lead' is 3; expected list"),
        (("rms_norm", "--case", '{"lead": [2], "n": 8, "dtype": "int8"}'), "dtype 'int8': expected one of"),
        (("rms_norm", "--case", "{}", "--inputs", "x.pt"), "not allowed with argument --case"),
        (("rms_norm", "--examples", "0"), "--examples: expected at least 1"),
        (("rms_norm", "--json", "/no/such/dir/out.json"), "--json /no/such/dir/out.json: no directory"),
        (("rms_norm", "--inputs", "/no/such/inputs.pt"), "--inputs /no/such/inputs.pt"),
        (("rms_norm", "--json", "/proc/out.json"), "--json /proc/out.json: cannot be written"),
        (("rms_norm", "--examples", "abc"), "--examples: expected a whole number, got 'abc'"),
        (("rms_norm", "--json", "tests"), "--json tests: is a directory, expected a file path"),
        (("rms_norm", "--timeout", "-1"), "--timeout: expected seconds >= 0 (0: no limit), got -1"),
        (("rms_norm", "--timeout", "nan"), "--timeout: expected seconds >= 0 (0: no limit), got nan"),
        (("rms_norm", "--timeout", "inf"), "--timeout: expected seconds >= 0 (0: no limit), got inf"),
        (("rms_norm", "--timeout", "5m"), "--timeout: expected a number of seconds, got '5m'"),
        (("rms_norm", "--json", ""), "--json: the path is empty, expected a file path"),
        (("--list", "--impl", "x:f", "--examples", "3"), "--list takes no option but --json (got --impl,"),
        (("rms_norm", "--impl", ""), "--impl: '' is not MODULE[:FN] or FILE.py[:FN]"),  # not the registered
        (("--all", "rms_norm"), "--all checks every op; it takes no op name (got 'rms_norm')"),
        (("add", "add"), "op 'add' is named twice"),
        (("add", "silu_mul", "--case", "{}"), "--case is one call of one op; got 2 ops"),
        (("--all", "--inputs", "x.pt"), "--inputs is one call of one op, not of --all"),
        (("--list", "--all"), "--list takes no option but --json (got --all)"),
        (("add", "silu_mul", "--impl", "references.elementwise:add"), "names one function; for several ops"),
        (("add", "rms_norm", "--impl", "references.elementwise"), "elementwise has no callable 'rms_norm'"),
        (("--all", "--impl", "json"), "json has a function named after none of the ops (embedding, rms"),
        (("add", "rms_norm", "--impl", "tests/buggy_ops.py"), "tests/buggy_ops.py has no callable 'add'"),
        (("RMS_norm",), "unknown op 'RMS_norm'; did you mean 'rms_norm'? registered: add,"),
        (  # the fp32 angle's own rounding there is past the max_error_ratio cap: no yardstick
            (
                "rope_cos_sin",
                "--case",
                '{"b": 2, "base": 1000000.0, "dtype": "float32", "pos_dtype": "int64", '
                '"positions": "consecutive", "rotary_dim": 34, "s": 5, "seed": 0, "start": 16777216}',
            ),
            "not a valid rope_cos_sin call: positions: 16777220 is past 262144 (2**18)",
        ),
    ],
)
def test_bad_usage_exits_2(args: tuple[str, ...], message: str) -> None:
    run = verify_op(*args)
    assert run.returncode == 2, run.stdout + run.stderr
    assert message in run.stderr


def test_a_bare_module_gives_the_op_its_function_of_that_name() -> None:
    run = verify_op("rms_norm", "--impl", "references.norm", "--examples", "3")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "verify.op rms_norm: references.norm:rms_norm vs reference" in run.stdout


def test_several_ops_are_each_reported_then_summed_up(tmp_path: Path) -> None:
    report = tmp_path / "ops.json"
    impl = ("--impl", "references.elementwise")
    run = verify_op("add", "silu_mul", *impl, "--examples", "5", "--json", str(report))
    assert run.returncode == 0, run.stdout + run.stderr
    for op in ("add", "silu_mul"):
        assert f"verify.op {op}: references.elementwise:{op} vs reference" in run.stdout
    summary = run.stdout[run.stdout.index("summary: 2 ops, references.elementwise") :].splitlines()
    assert summary[1].split() == ["op", "verdict", "named", "cases", "closest", "to", "failing", "seconds"]
    assert summary[2].split()[:5] == ["add", "VERIFIED", "3", "5", "exact"]  # an exact-rule op
    assert summary[3].split()[:4] == ["silu_mul", "VERIFIED", "3", "5"] and "% of tolerance" in summary[3]
    assert summary[-1] == "VERIFIED: all 2 ops"
    data = json.loads(report.read_text())
    assert data["passed"] and data["not_run"] == [] and data["not_in_impl"] == []
    first = data["ops"][0]  # how the cases were searched, as the header prints it
    assert (first["examples_requested"], first["seed"], first["profile"]) == (5, None, data["profile"])
    assert f"profile {data['profile']}" in run.stdout
    assert [(r["op"], r["impl"], r["cases"]) for r in data["ops"]] == [
        ("add", "references.elementwise:add", 5), ("silu_mul", "references.elementwise:silu_mul", 5),
    ]  # fmt: skip


def test_all_checks_the_ops_a_library_has_and_names_the_rest(tmp_path: Path) -> None:
    """``--all --impl MODULE``: each op the module has a function of that name for, the others
    listed as not checked (not counted as verified); one wrong op fails the run, with a repro that
    names its function."""
    report = tmp_path / "ops.json"
    run = verify_op("--all", "--impl", "tests/buggy_library.py", "--examples", "5", "--json", str(report))
    assert run.returncode == 1, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    top = lines.index("summary: 3 ops, tests/buggy_library.py, backend interpreter, profile ci")
    rows = [line.split()[:2] for line in lines[top + 2 : top + 5]]  # in the registry's order
    assert rows == [["add", "VERIFIED"], ["silu_mul", "DIVERGES"], ["kv_cache_store", "DIVERGES"]]
    assert lines[top + 5].startswith(
        "not checked (tests/buggy_library.py has no function of their name): embedding, rms_norm,"
    )
    assert lines[-1] == "DIVERGES: 2 of 3 ops (silu_mul, kv_cache_store)"
    data = json.loads(report.read_text())
    assert not data["passed"] and "rows" not in data["not_in_impl"] and "linear" in data["not_in_impl"]
    failure = next(r for r in data["ops"] if r["op"] == "silu_mul")["failure"]
    repro = shlex.split(failure["repro"])
    assert repro[-2:] == ["--impl", "tests/buggy_library.py:silu_mul"]
    rerun = verify_op(*repro[3:])
    assert rerun.returncode == 1 and "DIVERGES" in rerun.stdout, rerun.stdout + rerun.stderr


def test_a_hang_in_a_run_of_several_ops_ends_it_with_the_summary(tmp_path: Path) -> None:
    library = tmp_path / "library.py"
    library.write_text(
        "from references.elementwise import add\n"
        "from tests.buggy_kernels import rms_norm_waits_for_next_row as rms_norm\n"
    )
    report = tmp_path / "ops.json"
    run = verify_op("rms_norm", "add", "--impl", str(library), "--timeout", "3", "--json", str(report))
    assert run.returncode == 1, run.stdout + run.stderr
    assert "DIVERGES: a case ran past the 3 s limit; the run stops there" in run.stdout
    summary = run.stdout[run.stdout.index("summary: 2 ops") :].splitlines()
    assert [line.split()[:2] for line in summary[2:4]] == [["rms_norm", "HANGS"], ["add", "not"]]
    verdict = "DIVERGES: 1 of 2 ops (rms_norm); 1 of 2 ops not run"
    assert summary[-2:] == ["the run stopped when rms_norm hung", verdict]
    data = json.loads(report.read_text())
    assert data["not_run"] == ["add"] and data["ops"][0]["hung"] and not data["passed"]


def test_ops_a_lost_gpu_kept_from_running_fail_the_summary() -> None:
    from verify.op_summary import Summary

    summary = Summary(["embedding", "add"], [], "lib.py", "cuda", "gpu", stopped_by="the GPU was lost")
    lost = {"op": "embedding", "passed": False, "hung": False, "device_lost": True}
    summary.reports.append({**lost, "examples": 2, "cases": 1, "worst_tolerance_used": None, "seconds": 0.5})
    assert not summary.passed and summary.not_run == ["add"]
    assert summary.text().splitlines()[-2:] == [
        "the run stopped when the GPU was lost", "DIVERGES: 1 of 2 ops (embedding); 1 of 2 ops not run",
    ]  # fmt: skip


def test_inputs_that_are_not_a_recording_for_this_op_exit_2(tmp_path: Path) -> None:
    """verify.bisect saves ``{"op", "args"}``: another op's recording, or any other file, is a usage
    error (exit 2), not a divergence of the registered kernel."""
    import torch

    junk = tmp_path / "junk.pt"
    junk.write_text("not a tensor file")
    other = tmp_path / "other.pt"
    torch.save({"op": "kv_cache_store", "args": (torch.zeros(2),)}, other)
    arity = tmp_path / "arity.pt"
    torch.save({"op": "rms_norm", "args": (torch.zeros(2),)}, arity)
    extra = tmp_path / "extra.pt"  # a valid call, but the file holds more than a recording does
    torch.save({"op": "rms_norm", "args": (torch.zeros(2, 8), torch.ones(8), 1e-6), "note": 1}, extra)
    for path, message in (
        (junk, "not inputs saved by verify.bisect"),
        (other, "recorded for kv_cache_store, not rms_norm"),
        (arity, "the arguments do not fit rms_norm"),
        (extra, "not inputs saved by verify.bisect (expected op and args)"),
    ):
        run = verify_op("rms_norm", "--inputs", str(path))
        assert run.returncode == 2, run.stdout + run.stderr
        assert message in run.stderr


def test_inputs_are_judged_at_their_recorded_dtype(tmp_path: Path) -> None:
    """A recording's tolerance is its first float argument's dtype: fp32 inputs computed in bf16
    diverge (judged as bf16 they had passed); a recording without float inputs (rope_cos_sin's
    positions) is judged at fp32 and verifies."""
    import torch

    fp32 = tmp_path / "fp32.pt"
    gen = torch.Generator().manual_seed(0)
    args = (torch.randn(4, 64, generator=gen), torch.randn(64, generator=gen), 1e-6)
    torch.save({"op": "rms_norm", "args": args}, fp32)
    run = verify_op("rms_norm", "--inputs", str(fp32), "--impl", "tests/buggy_ops.py:rms_norm_in_bf16")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "DIVERGES" in run.stdout and "float32" in run.stdout
    assert verify_op("rms_norm", "--inputs", str(fp32)).returncode == 0

    positions = tmp_path / "positions.pt"
    ids = torch.arange(6, dtype=torch.int32)[None]
    torch.save({"op": "rope_cos_sin", "args": (ids, 32, 10000.0)}, positions)
    run = verify_op("rope_cos_sin", "--inputs", str(positions))
    assert run.returncode == 0, run.stdout + run.stderr


def test_a_case_that_is_no_valid_call_exits_2() -> None:
    """A ``--case`` with a field the op's cases do not have, values its builder cannot use, or
    arguments the registered kernel refuses by name is bad input, not a divergence."""
    import registry

    typical = registry.get("rms_norm").typical
    splitk = registry.get("linear_splitk").typical
    for op, case, extra, message in (
        (
            "rms_norm",
            {**typical, "extra": 1},
            (),
            "--case: unknown field 'extra'; rms_norm cases have the fields",
        ),
        (
            "rms_norm",
            {**typical, "eps": -1},
            (),
            "not a valid rms_norm call: the registered kernel refuses it: eps:",
        ),
        ("linear_splitk", {**splitk, "split_k": 0}, (), "--case is not a valid linear_splitk case"),
        (
            "rms_norm",
            typical,
            ("--examples", "3"),
            "--case runs one case: --examples and --seed do not apply",
        ),
        ("rms_norm", typical, ("--seed", "1"), "--case runs one case: --examples and --seed do not apply"),
    ):
        run = verify_op(op, "--case", json.dumps(case), *extra)
        assert run.returncode == 2, run.stdout + run.stderr
        assert message in run.stderr
        assert "Traceback" not in run.stderr


def test_a_call_the_registered_kernel_refuses_is_bad_input_for_an_outside_impl(tmp_path: Path) -> None:
    """An outside implementation is checked only on calls within the contract: one the registered
    kernel refuses by name (a negative eps, a float64 weight) exits 2 even where the outside
    implementation takes it (here the reference itself, which agrees with itself on anything)."""
    import torch

    import registry

    negative_eps = {**registry.get("rms_norm").typical, "eps": -1}
    run = verify_op("rms_norm", "--case", json.dumps(negative_eps), "--impl", "references.norm:rms_norm")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "not a valid rms_norm call: the registered kernel refuses it: eps:" in run.stderr

    float64 = tmp_path / "float64.pt"
    weight64 = torch.ones(8, dtype=torch.float64)
    torch.save({"op": "rms_norm", "args": (torch.ones(2, 8), weight64, 1e-6)}, float64)
    run = verify_op("rms_norm", "--inputs", str(float64), "--impl", "references.norm:rms_norm")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "the registered kernel refuses it: weight:" in run.stderr

    valid = tmp_path / "valid.pt"
    torch.save({"op": "rms_norm", "args": (torch.ones(2, 8), torch.ones(8), 1e-6)}, valid)
    run = verify_op("rms_norm", "--inputs", str(valid), "--impl", "references.norm:rms_norm")
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize(
    ("op", "field", "bogus"),
    [
        ("linear", "w_layout", "transposd"),
        ("attention", "lens", "raggd"),
        ("rms_norm", "weight", "one"),
        ("kv_cache_store", "layout", "k_contiguos"),  # a field with a default: absent from typical
    ],
)
def test_a_case_with_an_unknown_choice_exits_2(op: str, field: str, bogus: object) -> None:
    """An unknown value of a choice field (a typo) is refused naming the field and its options, not
    built as the builder's default branch and verified."""
    import registry

    run = verify_op(op, "--case", json.dumps({**registry.get(op).typical, field: bogus}))
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"--case is not a valid {op} case: ValueError: {field} {bogus!r}: expected one of" in run.stderr
    assert "Traceback" not in run.stderr


def test_every_choice_field_of_every_op_is_strict() -> None:
    """Each op's typical case (with the fields only its strategy draws added) builds, and the same
    case with any string or flag field set to a value no option has is refused naming the field."""
    import torch
    from hypothesis import find, settings

    import registry
    from verify import limits

    for spec in registry.all():
        drawn = find(spec.params(limits.current()), lambda _: True, settings=settings(database=None))
        params = {**drawn, **spec.typical}
        spec.build(params, torch.device("cpu"))
        choices = [k for k, v in params.items() if isinstance(v, str | bool)]
        assert choices, spec.name
        for field in choices:
            bogus = 1 if isinstance(params[field], bool) else "bogus"
            with pytest.raises(ValueError, match=rf"^{field} {bogus!r}: expected one of"):
                spec.build({**params, field: bogus}, torch.device("cpu"))


def test_recorded_inputs_the_reference_cannot_take_exit_2(tmp_path: Path) -> None:
    """A table with no rows: the registered kernel refuses it by name before an outside
    implementation runs, and where a check gets that far, the reference raising makes the case
    bad input too, not a divergence of the implementation (and no traceback)."""
    import torch

    import registry
    from verify import op
    from verify.cases import recorded
    from verify.compare import check

    args = (torch.tensor([[0]], dtype=torch.int32), torch.zeros(0, 8))
    path = tmp_path / "empty_table.pt"
    torch.save({"op": "embedding", "args": args}, path)
    run = verify_op("embedding", "--inputs", str(path), "--impl", "references.embedding:embedding")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "not a valid embedding call: the registered kernel refuses it: table:" in run.stderr
    assert "Traceback" not in run.stderr

    spec = registry.get("embedding")
    result = check(spec, recorded(str(path), args), lambda ids, table: torch.zeros(1, 1, 8))
    assert result.raised_by == "reference"
    refusal = op._refusal(spec, result, checking_registered=False)
    assert refusal is not None and refusal.startswith("the reference raised IndexError")


def test_a_recorded_call_breaking_a_rule_no_kernel_can_check_exits_2(tmp_path: Path) -> None:
    """``seq_len < S`` lives on the device, where a kernel in a CUDA Graph cannot check it: such a
    recording is bad input whoever is tested, not a divergence of the registered kernel."""
    import torch

    q, cache = torch.randn(1, 2, 1, 16).to(torch.bfloat16), torch.randn(1, 4, 1, 16).to(torch.bfloat16)
    path = tmp_path / "short.pt"
    torch.save(
        {"op": "attention", "args": (q, cache, cache.clone(), torch.tensor([1], dtype=torch.int32), 0.25)},
        path,
    )
    for impl in ((), ("--impl", "references.attention:attention")):
        run = verify_op("attention", "--inputs", str(path), *impl)
        assert run.returncode == 2, run.stdout + run.stderr
        assert "not a valid attention call: seq_lens: row 0 is 1, fewer than its 2 new tokens" in run.stderr


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("head_gap", -2, "expected a whole number >= 0"),
        ("lead", [], "expected a non-empty list of whole numbers >= 0"),
        ("lead", [3.5], "expected a non-empty list of whole numbers >= 0"),
        ("lead", [-3], "expected a non-empty list of whole numbers >= 0"),
    ],
)
def test_a_case_field_outside_what_strategies_draw_exits_2(field: str, value: object, expected: str) -> None:
    """A negative size would build another case than the one printed (a negative gap, no gap):
    refused naming the field, before anything is built."""
    case = {"dist": "normal", "dtype": "bfloat16", "eps": 1e-6, "head_gap": 0, "lead": [3], "n": 8,
            "pad": 0, "seed": 0, "weight": "normal", field: value}  # fmt: skip
    run = verify_op("rms_norm", "--case", json.dumps(case))
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"--case: field {field!r} is {value!r}; {expected}" in run.stderr


def test_an_implementation_calling_sys_exit_gets_no_pass(tmp_path: Path) -> None:
    """``sys.exit(0)`` in the implementation under test must not end the check with exit 0: it is
    what the implementation raised (exit 1); at import it is a load failure (exit 2)."""
    impl = tmp_path / "exits.py"
    impl.write_text("import sys\n\n\ndef rms_norm(x, weight, eps):\n    sys.exit(0)\n")
    run = verify_op("rms_norm", "--impl", f"{impl}:rms_norm", "--examples", "2")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "implementation raised SystemExit" in run.stdout
    at_import = tmp_path / "exits_at_import.py"
    at_import.write_text("import sys\n\nsys.exit(0)\n")
    run = verify_op("rms_norm", "--impl", f"{at_import}:rms_norm")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "failed: SystemExit" in run.stderr


IMPLS_THAT_MISBEHAVE = """
import os, torch

def exits(x, weight, eps):
    os._exit(0)

class Odd(BaseException):
    pass

def raises_base(x, weight, eps):
    raise Odd("not an Exception")

class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("str broke")

def raises_unprintable(x, weight, eps):
    raise Unprintable()

def sparse(x, weight, eps):
    return torch.zeros_like(x).to_sparse()

def meta(x, weight, eps):
    return torch.empty_like(x, device="meta")

def holds_the_gil(x, weight, eps):
    return 7 ** (10**9)  # one C call: the watchdog's timer thread never gets to run
"""


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        ("exits", "implementation raised ProcessExitCalled: it called os._exit(0)"),
        ("raises_base", "implementation raised Odd: not an Exception"),
        (
            "raises_unprintable",
            "implementation raised Unprintable: <its message could not be made: RuntimeError>",
        ),
        ("sparse", "layout torch.sparse_coo, expected a dense (strided) tensor"),
        ("meta", "device meta, expected"),
    ],
)
def test_an_implementation_that_misbehaves_is_a_divergence_not_a_crash(
    tmp_path: Path, fn: str, message: str
) -> None:
    """Whatever it does, the verdict is exit 1 with what it did: os._exit(0) was exit 0 (read as
    verified), a BaseException or a message that cannot be printed a traceback, a sparse output a
    crash in the memory check, a meta output 'memory an earlier call returned'."""
    impl = tmp_path / "misbehaving.py"
    impl.write_text(IMPLS_THAT_MISBEHAVE)
    run = verify_op("rms_norm", "--impl", f"{impl}:{fn}", "--examples", "2")
    assert run.returncode == 1, run.stdout + run.stderr
    assert message in run.stdout and "Traceback" not in run.stderr, run.stdout + run.stderr


def test_a_hang_holding_the_gil_is_ended_by_the_backstop(tmp_path: Path) -> None:
    from verify.watchdog import BACKSTOP_S

    """Past the timeout a call that never releases the GIL starves the watchdog's timer, so no
    report is written; the earlier run's report at ``--json`` is gone too, not read as this one's."""
    impl = tmp_path / "misbehaving.py"
    impl.write_text(IMPLS_THAT_MISBEHAVE)
    report = tmp_path / "report.json"
    report.write_text('{"passed": true}')
    args = ("--examples", "1", "--timeout", "1", "--json", str(report))
    run = verify_op("rms_norm", "--impl", f"{impl}:holds_the_gil", *args)
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"Timeout (0:00:{1 + BACKSTOP_S:02.0f})!" in run.stderr and "holds_the_gil" in run.stderr
    assert report.read_text() == ""


def test_the_longest_timeout_arms_the_backstop_too() -> None:
    """The backstop fires BACKSTOP_S past the timeout: at the longest timeout the timer takes,
    that sum overflows faulthandler's clock unless it is held to the same bound."""
    import threading

    from verify.watchdog import Watchdog

    with Watchdog(threading.TIMEOUT_MAX, lambda subject, seconds: None).watching("a call"):
        pass


def test_os_exit_at_import_is_a_load_failure(tmp_path: Path) -> None:
    impl = tmp_path / "exits_at_import.py"
    impl.write_text("import os\n\nos._exit(5)\n")
    run = verify_op("rms_norm", "--impl", f"{impl}:rms_norm")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "failed: ProcessExitCalled: it called os._exit(5)" in run.stderr


def test_an_import_that_hangs_is_a_load_failure_after_the_timeout(tmp_path: Path) -> None:
    impl = tmp_path / "hangs_at_import.py"
    impl.write_text("import time\n\ntime.sleep(600)\n")
    run = verify_op("rms_norm", "--impl", f"{impl}:rms_norm", "--timeout", "1")
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"verify.op: --impl: importing {impl} did not finish in 1 s (--timeout)" in run.stderr


def test_recorded_tensors_without_data_or_a_strided_layout_exit_2(tmp_path: Path, capsys) -> None:
    """A meta tensor (no data) or a sparse one cannot be copied with its layout: bad input, named."""
    import torch

    from verify import op

    for name, x in (("meta", torch.empty(2, 8, device="meta")), ("sparse", torch.ones(2, 8).to_sparse())):
        path = tmp_path / f"{name}.pt"
        torch.save({"op": "rms_norm", "args": (x, torch.ones(8), 1e-6)}, path)
        assert op.main(["rms_norm", "--inputs", str(path)]) == 2
        err = capsys.readouterr().err
        assert f"--inputs {path}: argument #0 is a " in err, err
        assert "expected a dense strided tensor with data" in err and "Traceback" not in err


def test_an_impl_requiring_a_keyword_the_op_never_passes_is_refused() -> None:
    """Every call would raise TypeError, judged a divergence: refused as bad usage instead."""
    from references.norm import rms_norm
    from verify.impl_loader import ImplError, check_signature

    def kwonly(x, weight, eps, *, mode):
        return x

    def with_default(x, weight, eps, *, mode="fast", out=None):
        return x

    with pytest.raises(ImplError, match=r"requires the keyword-only argument 'mode'.*give it a default"):
        check_signature(kwonly, rms_norm, "rms_norm")
    check_signature(with_default, rms_norm, "rms_norm")


def test_an_impl_without_a_name_is_refused_by_what_it_is() -> None:
    """A functools.partial or a callable object has no ``__name__``: the refusal names its type."""
    import functools

    from references.norm import rms_norm
    from verify.impl_loader import ImplError, check_signature

    def two(x, weight):
        return x

    class Scaler:
        def __call__(self, x):
            return x

    with pytest.raises(ImplError, match=r"a partial object\(x, weight\) does not match"):
        check_signature(functools.partial(two), rms_norm, "rms_norm")
    with pytest.raises(ImplError, match=r"a Scaler object\(x\) does not match"):
        check_signature(Scaler(), rms_norm, "rms_norm")


def _two_impls_with_helpers(root: Path) -> list:
    """Two implementation files in folders of their own, each beside a ``helpers_of_one_impl``
    of its own scale (2 and 3), loaded in turn."""
    from verify import impl_loader

    fns = []
    for scale in (2, 3):
        folder = root / f"impl{scale}"
        folder.mkdir()
        (folder / "helpers_of_one_impl.py").write_text(f"SCALE = {scale}\n")
        body = "import helpers_of_one_impl\n\ndef f(x):\n    return x * helpers_of_one_impl.SCALE\n"
        (folder / "impl.py").write_text(body)
        fns.append(impl_loader.load(f"{folder / 'impl.py'}:f"))
    sys.modules.pop("helpers_of_one_impl", None)
    return fns


def test_two_impl_files_each_import_their_own_helpers(tmp_path: Path) -> None:
    """A module of the same name beside each file: the second file gets its own, not the first's
    from ``sys.modules`` (which the first keeps)."""
    assert [fn(1) for fn in _two_impls_with_helpers(tmp_path)] == [2, 3]


def test_modules_of_python_or_this_project_are_never_dropped(tmp_path: Path, monkeypatch) -> None:
    """One copy of those serves every implementation (an implementation file at the project's
    root must not take ``registry`` out of ``sys.modules``): here tmp_path stands for them."""
    from verify import impl_loader

    monkeypatch.setattr(impl_loader, "_SHARED", (tmp_path,))
    assert [fn(1) for fn in _two_impls_with_helpers(tmp_path)] == [2, 2]


def test_an_impl_file_imports_the_modules_beside_it(tmp_path: Path) -> None:
    """As ``python impl.py`` would; its directory is not left on ``sys.path`` afterwards."""
    from verify import impl_loader

    (tmp_path / "helpers_beside_impl.py").write_text("def norm(x, weight, eps):\n    return x\n")
    (tmp_path / "impl.py").write_text("from helpers_beside_impl import norm\n\nf = norm\n")
    path_before = list(sys.path)
    try:
        assert impl_loader.load(f"{tmp_path / 'impl.py'}:f").__name__ == "norm"
    finally:
        sys.modules.pop("helpers_beside_impl", None)
    assert sys.path == path_before


def test_a_recording_whose_arguments_share_memory_is_run_as_recorded(tmp_path: Path, capsys) -> None:
    """v_cache recorded as the very tensor k_cache is: loaded, the two still share one buffer, so
    the registered kernel refuses the call (exit 2) rather than a copy of each being verified."""
    import torch

    import registry
    from verify import op

    spec = registry.get("kv_cache_store")
    k_cache, _, k, v, start = spec.build(spec.typical, torch.device("cpu")).args
    path = tmp_path / "same_cache.pt"
    torch.save({"op": "kv_cache_store", "args": (k_cache, k_cache, k, v, start)}, path)
    assert op.main(["kv_cache_store", "--inputs", str(path)]) == 2
    assert "the registered kernel refuses it: v_cache: shares memory with k_cache" in capsys.readouterr().err
