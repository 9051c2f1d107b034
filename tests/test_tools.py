"""``verify.bisect`` and ``verify.e2e`` on the embedded default model: clean runs pass, injected
bugs are found at the layer and op where they were planted, bad usage exits 2."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ops import backend
from tests.subprocess_env import user_env

ROOT = Path(__file__).resolve().parent.parent


def cli(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT, capture_output=True, text=True, timeout=900, env=user_env(),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("args", "status"),
    [(("rms_norm", "--examples", "1"), 0), (("rms_norm", "--impl", "torch:add", "--examples", "1"), 1)],
)
def test_a_reader_of_stdout_leaving_early_keeps_the_status(args: tuple[str, ...], status: int) -> None:
    """``verify.op ... | grep -q VERIFIED`` under pipefail: the verdict's status, not a traceback and 1."""
    run = subprocess.Popen(
        [sys.executable, "-m", "verify.op", *args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=user_env(),
    )  # fmt: skip
    run.stdout.close()  # gone before the first line: every write meets a closed pipe
    _, err = run.communicate(timeout=900)
    assert run.returncode == status, err
    assert "Traceback" not in err and "BrokenPipeError" not in err


def bisect(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    report = tmp_path / "bisect.json"
    run = cli(
        "verify.bisect",
        "--layer",
        "--prompt-len",
        "8",
        "--decode-steps",
        "2",
        "--json",
        str(report),
        "--repro-dir",
        str(tmp_path / "repros"),
        *args,
    )
    return run, json.loads(report.read_text()) if report.exists() else {}


def test_bisect_clean_model_verifies(tmp_path: Path) -> None:
    run, report = bisect(tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert report["first"] is None
    from model import embedded

    assert report["prompt"] == (list(embedded.default_prompt()) * 2)[:8]  # --prompt-ids takes it back
    # decode steps sit after the 8-token prompt, one position each
    assert report["steps"] == ["prefill", "decode step 1 (position 8)", "decode step 2 (position 9)"]
    assert report["ops"].startswith("fused ops (") and report["ops"] in run.stdout  # as the header says
    assert not (tmp_path / "repros").exists()  # nothing failed: no repro directory made


@pytest.mark.parametrize(
    ("inject", "layer", "op"),
    [
        ("add_rms_norm=tests/buggy_ops.py:add_rms_norm_wrong_eps@2", "2", "add_rms_norm"),
        ("apply_rope=tests/buggy_ops.py:apply_rope_no_offset@2", "2", "apply_rope"),
        ("kv_cache_store=tests/buggy_library.py@1", "1", "kv_cache_store"),  # its function of the op's name
        ("attention=tests/buggy_ops.py:attention_gqa_tiled@3", "3", "attention"),
        (
            "add_rms_norm_linear_silu_mul=tests/buggy_ops.py:add_rms_norm_linear_silu_mul_swapped_halves@1",
            "1",
            "add_rms_norm_linear_silu_mul",
        ),
    ],
    ids=[
        "wrong eps",
        "rope offset ignored",
        "kv row off by one",
        "gqa head mapping",
        "fused op: gate/up swapped",
    ],
)
def test_bisect_names_the_injected_layer_and_op(tmp_path: Path, inject: str, layer: str, op: str) -> None:
    run, report = bisect(tmp_path, "--inject", inject)
    assert run.returncode == 1, run.stdout + run.stderr
    assert report["first"]["layer"] == layer
    assert report["culprit"]["op"] == op
    # the repro command runs on its own and reproduces the divergence
    repro = report["culprit"]["repro"].split()
    assert repro[:4] == ["python", "-m", "verify.op", op]
    rerun = cli("verify.op", *repro[3:])
    assert rerun.returncode == 1 and "DIVERGES" in rerun.stdout, rerun.stdout + rerun.stderr


def test_bisect_reports_the_first_layer_and_the_first_op_and_drills_into_every_op(tmp_path: Path) -> None:
    """The same bug in layers 1 and 2 (in both norms of each): the first layer, its first
    diverging op, and a drill-down row for every op the layer calls (the embedded model is
    Qwen3-style and an injected part runs the decoder unfused)."""
    inject = "add_rms_norm=tests/buggy_ops.py:add_rms_norm_wrong_eps@1,2"
    run, report = bisect(tmp_path, "--inject", inject, "--decode-steps", "0")
    assert run.returncode == 1, run.stdout + run.stderr
    assert report["first"]["layer"] == "1"
    assert (report["culprit"]["op"], report["culprit"]["point"]) == ("add_rms_norm", "attn_norm")
    unfused_qwen3_layer = [
        "add_rms_norm", "linear", "rms_norm", "rms_norm", "apply_rope", "apply_rope", "kv_cache_store",
        "attention", "linear", "add_rms_norm", "linear", "silu_mul", "linear",
    ]  # fmt: skip
    assert [r["op"] for r in report["drill"]] == unfused_qwen3_layer


@pytest.mark.parametrize(("op", "row"), [("linear", "head"), ("embedding", "embed")])
def test_bisect_names_a_diverging_model_level_op(
    op: str, row: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The embedding and the lm_head run outside the layers, where --inject cannot reach: their
    own rows of the report must catch them (the Triton decoders are built with the op off)."""
    from model import triton_model
    from model.decoder import MODEL_LAYER
    from verify import bisect as bisect_cli

    real_build = triton_model.build

    def build(*args, **kwargs):
        model = real_build(*args, **kwargs)
        model.overrides[(op, MODEL_LAYER)] = lambda *a: model.impls[op](*a) * 1.5
        return model

    monkeypatch.setattr(triton_model, "build", build)
    report = tmp_path / "bisect.json"
    model = str(tiny_checkpoint(tmp_path / "ckpt"))  # 2 small layers: the rows, not the model, are tested
    argv = ["--model", model, "--prompt-len", "4", "--decode-steps", "0", "--json", str(report)]
    assert bisect_cli.main([*argv, "--repro-dir", str(tmp_path / "repros")]) == 1
    data = json.loads(report.read_text())
    assert data["first"]["layer"] == row
    assert data["culprit"]["op"] == op
    assert Path(data["culprit"]["repro"].split()[5]).name.startswith("step0-model-")  # not "layer-1"
    place = {"embed": "the embedding (before layer 0)", "head": "the head (after the last layer)"}[row]
    verdict = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("DIVERGES"))
    if row == "embed":  # an exact op: named, not measured against a bf16 threshold of 0
        assert verdict == f"DIVERGES: first at prefill, in {place}: embedding outside its tolerance"
    else:
        assert verdict.startswith(f"DIVERGES: first at prefill, in {place}: teacher-forced rel L2")


def test_e2e_clean_model_has_token_parity(tmp_path: Path) -> None:
    report = tmp_path / "e2e.json"
    run = cli("verify.e2e", "--new-tokens", "4", "--json", str(report))
    assert run.returncode == 0, run.stdout + run.stderr
    data = json.loads(report.read_text())
    assert data["verdicts"] == {"triton": "parity", "hf": "parity"}
    calibration = data["calibration"]
    assert calibration["bf16_logits_noise"] > 0  # the tolerances are measured, not 0
    assert calibration["near_tie_tolerance"] < calibration["drift_tolerance"]
    assert all(
        s["against"]["triton"]["max_abs_diff"] <= calibration["drift_tolerance"] for s in data["steps"]
    )
    assert data["injected"] == []
    assert data["ops"].startswith("fused ops (") and data["ops"] in run.stdout


def test_e2e_over_a_mostly_empty_cache_has_token_parity(tmp_path: Path) -> None:
    """``--cache-len``: a cache far longer than the run, as a server allocates it, sends decode
    attention through its split and combine kernels (a cache sized to the run is one split)."""
    report = tmp_path / "e2e.json"
    run = cli("verify.e2e", "--new-tokens", "2", "--against", "reference", "--cache-len", "512",
              "--json", str(report))  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "KV cache 512 rows" in run.stdout
    data = json.loads(report.read_text())
    assert data["verdicts"] == {"triton": "parity"} and data["cache_len"] == 512


def test_e2e_exits_1_when_hf_disagrees(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """HF is an independent oracle: its divergence fails the run as the Triton model's would."""
    from verify import e2e

    real_step = e2e.HFModel.step
    monkeypatch.setattr(e2e.HFModel, "step", lambda self, ids: -real_step(self, ids))
    report = tmp_path / "e2e.json"
    assert e2e.main(["--new-tokens", "2", "--json", str(report)]) == 1
    assert json.loads(report.read_text())["verdicts"] == {"triton": "parity", "hf": "DIVERGES"}


def test_e2e_exits_1_on_an_injected_bug_before_any_token_flips(tmp_path: Path) -> None:
    """The GQA bug in layer 1 flips no token in its first steps (the logits move by 2-3, the
    margins are ~7), but the logits drift past 8x the noise (~1); the report records the injection.
    (In every layer the bug moves them by ~7 and flips the first token on some builds of the
    embedded checkpoint: they differ slightly from one CPU to another.)"""
    report = tmp_path / "e2e.json"
    bug = "tests/buggy_ops.py:attention_gqa_tiled"
    run = cli(
        "verify.e2e", "--new-tokens", "2", "--against", "reference", "--inject", f"attention={bug}@1",
        "--cache-len", "64", "--json", str(report),
    )  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    assert "triton: DRIFTS from step 0" in run.stdout
    # the bisect run it suggests carries the injection and the cache, and finds the bug
    hint = f"python -m verify.bisect --layer --inject attention={bug}@1 --cache-len 64 --prompt-len 12 "
    assert f"`{hint}--decode-steps 0` finds where" in run.stdout
    bisected = cli("verify.bisect", *hint.split()[3:], "--decode-steps", "0")
    assert bisected.returncode == 1, bisected.stdout + bisected.stderr
    assert "culprit: attention at attention of layer 1" in bisected.stdout
    data = json.loads(report.read_text())
    assert data["verdicts"] == {"triton": "DRIFTS"}
    assert data["injected"] == [{"op": "attention", "impl": bug, "layers": [1]}]
    assert [s["against"]["triton"]["token"] for s in data["steps"]] == [s["ref_token"] for s in data["steps"]]


@pytest.mark.parametrize(
    ("module", "args", "message"),
    [
        ("verify.bisect", ("--inject", "no_such_op=tests/buggy_ops.py:x@1"), "unknown op 'no_such_op'"),
        (
            "verify.bisect",
            ("--inject", "rms_norm=tests/buggy_ops.py:rms_norm_wrong_eps@9"),
            "layer 9 is out of range",
        ),
        (
            "verify.bisect",
            ("--inject", "rms_norm=tests/missing.py:f@1"),
            "--inject rms_norm=tests/missing.py:f: no file",
        ),
        ("verify.e2e", ("--inject", "embedding=references.embedding:embedding@1"), "runs outside the layers"),
        ("verify.e2e", ("--json", "/no/such/dir/e2e.json"), "--json /no/such/dir/e2e.json: no directory"),
        ("verify.bisect", ("--json", "README.md/x.json"), "no directory README.md"),
        ("verify.bisect", ("--plot", "errors.txt"), "--plot errors.txt: expected a file ending"),
        ("verify.bisect", ("--repro-dir", "README.md/repros"), "README.md exists and is not a directory"),
        ("verify.bisect", ("--inject", "rms_norm@1"), "expected OP=IMPL@LAYERS"),
        ("verify.bisect", ("--model", "/no/such/dir"), "no such directory"),
        ("verify.e2e", ("--model", "/no/such/dir"), "no such directory"),
        ("verify.bisect", ("--model", ""), "--model: the name is empty, expected a checkpoint directory"),
        (
            "verify.bench",
            ("attention", "--sweep", "--sweep-models", "qwen3,"),
            "--sweep-models: unknown ''; expected",
        ),
        (
            "verify.e2e",
            ("--prompt-ids", "1,2,99999"),
            "--prompt-ids: token id 99999 is outside the vocabulary",
        ),
        (
            "verify.e2e",
            ("--prompt-ids", "99999999999999999999"),
            "--prompt-ids: token id 99999999999999999999 is outside the vocabulary [0, 1000)",
        ),
        ("verify.e2e", ("--prompt-ids", ""), "--prompt-ids: the prompt is empty"),
        ("verify.bisect", ("--prompt-ids", "1,1000"), "--prompt-ids: token id 1000 is outside the vocab"),
        ("verify.bisect", ("--prompt-ids", "1,2", "--prompt-len", "2"), "not allowed with argument"),
        (
            "verify.bisect",
            ("--prompt-ids", ",".join(["1"] * 600)),
            "--prompt-ids' 600 tokens + --decode-steps 3 need 603 positions, more than the model's",
        ),
        (
            "verify.bisect",
            ("--prompt-len", "600"),
            "--prompt-len 600 + --decode-steps 3 need 603 positions, more than the model's "
            "max_position_embeddings 512",
        ),
        # refused before a KV cache of that many positions is allocated (it was an out-of-memory crash)
        ("verify.bisect", ("--prompt-len", "10" * 6), "more than the model's max_position_embeddings 512"),
        (
            "verify.e2e",
            ("--new-tokens", "10" * 6),
            "the prompt's 12 tokens + 101010101010 new tokens need 101010101021 positions, more than the "
            "model's max_position_embeddings 512",
        ),
        ("verify.e2e", ("--prompt", "hello"), "needs a tokenizer"),
        ("verify.e2e", ("--against", "reference,vllm"), "--against"),
        ("verify.bench", ("model", "--try-config", "9728=gemv n8 k512 w4 s4"), "expected NxK=CONFIG"),
        ("verify.bench", ("model", "--repeat", "0"), "--repeat"),
        ("verify.bench", ("model", "--json", "/no/such/dir/m.json"), "--json /no/such/dir/m.json: no dir"),
        ("verify.bench", ("gemm", "--json", "README.md/g.json"), "no directory README.md"),
        ("verify.bench", ("attention", "--json", "/no/such/dir/a.json"), "no directory /no/such/dir"),
        ("verify.bench", ("model", "--skip", "hf,vllm"), "--skip: unknown row 'vllm'"),
        ("verify.bench", ("model", "--prompt-len", "0"), "--prompt-len: expected at least 1"),
        ("verify.bench", ("model", "--cache-len", "300"), "--cache-len 300: --prompt-len 256 + --new-tokens"),
        (
            "verify.bench",
            ("model", "--prompt-len", "32000", "--new-tokens", "1000"),
            "--prompt-len 32000 + --new-tokens 1000 + 1 (the warm-up step writes one row past them) need "
            "33001 positions, more than the model's max_position_embeddings 32768",
        ),
        ("verify.bench", ("model", "--cache-len", "40000"), "--cache-len 40000: exceeds the model's max_pos"),
        (
            "verify.bench",
            ("attention", "--sweep", "--sweep-models", "gpt2"),
            "--sweep-models: unknown 'gpt2'",
        ),
        ("verify.bench", ("attention", "--sweep-models", "article,qwen3"), "--sweep-models: only with"),
        ("verify.e2e", ("--cache-len", "13"), "--cache-len 13: the prompt's 12 tokens + 8 new tokens need"),
        ("verify.bisect", ("--cache-len", "600"), "--cache-len 600: exceeds the model's max_position"),
        ("verify.bench", (), "usage: python -m verify.bench {gemm,attention,model}"),
        ("verify.bench", ("roofline",), "unknown suite 'roofline'; expected one of gemm, attention, model"),
        ("verify.e2e", ("--new-tokens", "0"), "--new-tokens: expected at least 1"),
        ("verify.bisect", ("--prompt-len", "x"), "--prompt-len: expected a whole number, got 'x'"),
        ("verify.bisect", ("--decode-steps", "-1"), "--decode-steps -1: expected at least 0"),
        ("verify.bench", ("gemm", "--replays", "-1"), "--replays: expected at least 1"),
        ("verify.bench", ("model", "--config", "/no/such"), "--config: /no/such: no config.json found"),
        ("verify.bench", ("gemm", "--config", "README.md"), "--config: README.md: not valid JSON"),
        ("verify.bench", ("attention", "--config", "/no/such"), "--config: /no/such: no config.json found"),
        ("verify.bench", ("attention", "--config", "x", "--sweep"), "--config: not with --sweep"),
        (
            "verify.bench",
            ("gemm", "--preset", "article", "--config", "x"),
            "argument --config: not allowed with argument --preset",
        ),
        ("verify.e2e", ("--json", "/proc/e2e.json"), "--json /proc/e2e.json: cannot be written"),
        ("verify.bisect", ("--repro-dir", "/proc/repros"), "cannot make a directory in /proc"),
        (
            "verify.e2e",
            ("--inject", "rms_norm=torch:add@1", "--inject", "rms_norm=torch:mul@0,1"),
            "layer 1's rms_norm is already injected (torch:add)",
        ),
        ("verify.e2e", ("--against", "hf"), "--against 'hf': expected 'reference' and optionally 'hf'"),
        ("verify.e2e", ("--model", "README.md"), "--model README.md: expected a checkpoint directory"),
        ("verify.e2e", ("--prompt-ids", "1,x"), "--prompt-ids '1,x': expected comma-separated integers"),
        ("verify.e2e", ("--prompt-ids", "1,,2"), "--prompt-ids '1,,2': expected comma-separated integers"),
        ("verify.bisect", ("--inject", "rms_norm=torch:add@x"), "layers must be a number, a comma list"),
        ("verify.bisect", ("--inject", "rms_norm=torch:add@\uff11"), "layers must be a number, a comma list"),
        ("verify.bisect", ("--inject", "rms_norm=torch:add@1_0"), "layers must be a number, a comma list"),
        ("verify.e2e", ("--prompt-ids", "\uff11,\uff12"), "expected comma-separated integers"),  # full-width
        ("verify.e2e", ("--prompt-ids", "1_0"), "--prompt-ids '1_0': expected comma-separated integers"),
        ("verify.bisect", ("--inject", "rms_norm=torch:add@-1"), "layer -1 is out of range"),  # not the last
        (
            "verify.bisect",
            ("--inject", "linear=torch:add@0", "--inject", "add_rms_norm_linear=torch:add@0"),
            "add_rms_norm_linear is a fused op and linear one of the ops fused ops stand for",
        ),
    ],
)
def test_bad_usage_exits_2(module: str, args: tuple[str, ...], message: str) -> None:
    run = cli(module, *args)
    assert run.returncode == 2, run.stdout + run.stderr
    assert message in run.stderr


@pytest.mark.parametrize(
    ("module", "args", "message"),
    [
        ("verify.e2e", ("--prompt-ids", "99999999"), "token id 99999999 is outside the vocabulary"),
        ("verify.e2e", ("--new-tokens", "40000"), "more than the model's max_position_embeddings 32768"),
        ("verify.bisect", ("--cache-len", "40000"), "--cache-len 40000: exceeds the model's max_position"),
    ],
)
def test_a_presets_bad_request_is_refused_before_its_checkpoint_is_built(
    module: str, args: tuple[str, ...], message: str
) -> None:
    """The preset's config is known without its 0.65B-parameter random checkpoint: no note that one
    is about to be built and run, no minutes of writing it, just the refusal."""
    run = cli(module, "--model", "article", *args)
    assert run.returncode == 2, run.stdout + run.stderr
    assert message in run.stderr and "parameters" not in run.stderr


@pytest.mark.parametrize(
    ("module", "args"),
    [("verify.op", ("rms_norm",)), ("verify.op", ("--list",)), ("verify.e2e", ()), ("verify.bisect", ()),
     ("verify.bench", ("gemm",))],
)  # fmt: skip
def test_a_bad_backend_setting_is_bad_usage(module: str, args: tuple[str, ...], monkeypatch) -> None:
    """Exit 2 with the setting named, not a traceback and exit 1 (which means a divergence)."""
    monkeypatch.setenv("TRITONCHECK_BACKEND", "gpu")
    run = cli(module, *args)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "TRITONCHECK_BACKEND='gpu': expected one of auto, cuda, interpreter" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("command", ["verify.op", "verify.e2e", "verify.bisect", "verify.bench model"])
def test_help_answers_whatever_the_backend_setting(command: str, monkeypatch) -> None:
    """The setting is checked after the arguments are parsed: --help needs no working backend."""
    monkeypatch.setenv("TRITONCHECK_BACKEND", "gpu")
    run = cli(*command.split(), "--help")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith(f"usage: python -m {command}") and not run.stderr


def test_a_checkpoint_that_decides_no_token_is_named_untestable() -> None:
    """Every logit tying (noise 0, so no drift check, and every margin 0): any token would pass,
    so the run is refused rather than reported as parity. A drift check, or one decided step,
    makes the run a test again."""
    from verify.e2e import Step, untestable

    ties = [Step(i, 16 + i, 0, 0.0) for i in range(3)]
    flat = {"near_tie_tolerance": 0.0, "drift_tolerance": None}
    assert "the checkpoint decides no token" in untestable(ties, flat)
    assert untestable(ties, {**flat, "drift_tolerance": 0.5}) is None
    assert untestable([*ties, Step(3, 19, 0, 0.25)], flat) is None


def test_a_layer_listed_twice_in_one_injection_is_named_so() -> None:
    """Not "layer 0's rms_norm is already injected", which suggests another --inject did it."""
    from verify.cli import UsageError
    from verify.models import parse_injection

    with pytest.raises(UsageError, match=r"^--inject 'rms_norm=f.py:g@0,1,0': layer 0 is listed twice$"):
        parse_injection("rms_norm=f.py:g@0,1,0")


def test_injections_start_python_and_numpy_random_from_one_seed(tmp_path: Path) -> None:
    """So an injected op that draws from them draws the same numbers every run (torch's global
    generator starts from a fixed seed in every process)."""
    import random

    import numpy as np

    from model import triton_model
    from model import weights as model_weights
    from model.config import ModelConfig
    from verify.models import apply_injections, parse_injection

    impl = tmp_path / "noisy.py"
    impl.write_text("import random\n\n\ndef rms_norm(x, weight, eps):\n    return x * random.random()\n")
    cfg = ModelConfig("qwen3", 120, 64, 72, 2, 4, 2, 16, qk_norm=True)
    weights, injection = model_weights.random_weights(cfg, "cpu"), parse_injection(f"rms_norm={impl}@1")
    draws = []
    for _ in range(2):
        random.random(), np.random.rand()  # whatever ran before
        apply_injections(triton_model.build(weights, 1, 8, fused=False), [injection])
        draws.append((random.random(), np.random.rand()))
    assert draws[0] == draws[1]


# These commands force the interpreter, which import order concerns alone and a CUDA run of the
# suite does not use (on the H200, 7 CLI tests failed, as many as these; the log was lost).
interpreter_runs = pytest.mark.skipif(
    not backend.is_interpreter(), reason="forces the interpreter; this run uses the CUDA backend"
)


def python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=user_env() | env,
    )  # fmt: skip


IMPORTED_BEFORE_OPS = (
    "model.decoder", "model.reference", "verify.op", "verify.e2e", "verify.bisect",
    "verify.bench.model", "verify.bench.gemm",
)  # fmt: skip


@interpreter_runs
@pytest.mark.parametrize("module", IMPORTED_BEFORE_OPS)
def test_importing_the_model_or_a_cli_leaves_the_interpreter_choosable(module: str) -> None:
    """The interpreter must be chosen before triton's first import (``ops.backend``), and each
    CLI chooses it only after its environment checks: so none of these may import triton before
    ``ops`` (torch.compile's decorators import it; one at the decoder's import broke every CPU
    bisect run)."""
    run = python(f"import {module}, ops", TRITONCHECK_BACKEND="interpreter")
    assert run.returncode == 0, run.stdout + run.stderr


@interpreter_runs
def test_triton_imported_before_the_interpreter_is_chosen_is_a_clear_error() -> None:
    """Not the interpreter's "Cannot call @triton.jit'd outside of the scope of a kernel" from
    the first kernel using ``tl.sum``: a CLI says what happened and exits 2."""
    run = python(
        "import sys, triton; from verify import op; sys.exit(op.main(['rms_norm']))",
        TRITONCHECK_BACKEND="interpreter",
    )
    assert run.returncode == 2, run.stdout + run.stderr
    assert "triton was imported before the interpreter backend was chosen" in run.stderr
    assert "Traceback" not in run.stderr
    run = python("import triton, ops", TRITONCHECK_BACKEND="interpreter", TRITON_INTERPRET="1")
    assert run.returncode == 0, run.stdout + run.stderr  # imported in interpreter mode: fine


def test_an_unknown_hypothesis_profile_is_bad_usage(monkeypatch) -> None:
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "fast")
    run = cli("verify.op", "rms_norm")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "HYPOTHESIS_PROFILE='fast': expected one of ci, gpu, thorough" in run.stderr


def test_a_full_size_preset_on_the_interpreter_is_announced_as_slow(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    from model import presets
    from verify.models import resolve_checkpoint

    monkeypatch.setattr(presets, "checkpoint", lambda name: tmp_path)  # no 1.3 GB build here
    assert resolve_checkpoint("article") == tmp_path
    announced = "--model article has 0.65B parameters" in capsys.readouterr().err
    assert announced == backend.is_interpreter()


def test_json_reports_are_strict_json(tmp_path: Path) -> None:
    """A wrong implementation's NaN or Inf lands in the reports as a string: bare NaN is no JSON."""
    from verify.cli import write_json

    path = tmp_path / "report.json"
    write_json(str(path), {"a": [float("nan"), float("inf"), 1.5], "b": (float("-inf"),)})
    strict = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))
    assert strict == {"a": ["nan", "inf", 1.5], "b": ["-inf"]}


def test_bench_help_lists_the_suites() -> None:
    run = cli("verify.bench", "--help")
    assert run.returncode == 0, run.stdout + run.stderr
    for suite in ("gemm", "attention", "model"):
        assert f"\n  {suite} " in run.stdout


def test_bisect_plot_without_matplotlib_exits_2_before_the_run(monkeypatch, capsys) -> None:
    from verify import bisect as bisect_cli

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a)
    )
    assert bisect_cli.main(["--plot", "errors.png"]) == 2
    assert "--plot errors.png: needs matplotlib, which is not installed" in capsys.readouterr().err


def test_bisect_plot_comes_after_the_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bare name gets .png, and the JSON is on disk before the plot is drawn (a plot that
    fails must not lose the report)."""
    from verify import bisect as bisect_cli

    real_plot, drawn = bisect_cli.plot, []

    def plot(report, path: str) -> str:
        drawn.append((path, json.loads((tmp_path / "bisect.json").read_text())["verdict"]))
        return real_plot(report, path)

    monkeypatch.setattr(bisect_cli, "plot", plot)
    model = str(tiny_checkpoint(tmp_path / "ckpt"))
    argv = ["--model", model, "--prompt-len", "4", "--decode-steps", "0", "--plot", str(tmp_path / "errors")]
    assert bisect_cli.main([*argv, "--json", str(tmp_path / "bisect.json")]) == 0
    assert drawn == [(str(tmp_path / "errors.png"), "VERIFIED")]
    assert (tmp_path / "errors.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_e2e_suggests_a_bisect_run_of_its_own_request() -> None:
    from verify import e2e

    given = ["--model", "my ckpt", "--prompt-ids", "5,6,7", "--inject", "attention=x.py:f@1"]
    args = e2e._parser().parse_args([*given, "--timeout", "0", "--cache-len", "64"])
    assert e2e.bisect_command(args, [5, 6, 7], 2) == (
        "python -m verify.bisect --layer --model 'my ckpt' --inject attention=x.py:f@1 --timeout 0 "
        "--cache-len 64 --prompt-ids 5,6,7 --decode-steps 2"
    )
    default = e2e._parser().parse_args([])  # bisect draws the default prompt as e2e does: its length says it
    assert e2e.bisect_command(default, [1, 2, 3], 0) == (
        "python -m verify.bisect --layer --prompt-len 3 --decode-steps 0"
    )


def test_bisect_plot_takes_a_bare_name_as_png_and_refuses_other_suffixes() -> None:
    from verify import bisect as bisect_cli
    from verify.models import UsageError

    assert bisect_cli.plot_path("out/errors") == "out/errors.png"
    assert [bisect_cli.plot_path(f"e.{s}") for s in ("png", "PDF", "svg")] == ["e.png", "e.PDF", "e.svg"]
    with pytest.raises(UsageError, match=r"--plot e\.jpeg: expected a file ending in \.png, \.pdf or \.svg"):
        bisect_cli.plot_path("e.jpeg")


@pytest.mark.parametrize("module", ["verify.e2e", "verify.bisect"])
def test_an_injected_implementation_that_raises_is_a_divergence(module: str, tmp_path: Path) -> None:
    """It fails as the implementation under test (exit 1, as verify.op), named, without a traceback,
    and --json still records the verdict."""
    report = tmp_path / "report.json"
    inject = ("--inject", "rms_norm=torch:add@1", "--json", str(report))
    if module == "verify.bisect":
        run = cli(module, *inject, "--prompt-len", "4", "--decode-steps", "0")
    else:
        run = cli(module, *inject, "--new-tokens", "1", "--against", "reference")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "DIVERGES: the injected rms_norm (torch:add) raised TypeError" in run.stdout
    assert "Traceback" not in run.stderr
    assert "raised TypeError" in json.loads(report.read_text())["raised"]


@pytest.mark.parametrize("module", ["verify.e2e", "verify.bisect"])
def test_an_injected_implementation_that_hangs_is_a_divergence(module: str, tmp_path: Path) -> None:
    """A kernel whose programs wait for a flag no program sets: the watchdog names the injection,
    exits 1 and still writes the --json verdict, instead of leaving the run to hang."""
    report = tmp_path / "report.json"
    impl = "tests/buggy_kernels.py:rms_norm_waits_for_next_row"
    inject = ("--inject", f"rms_norm={impl}@1", "--timeout", "5", "--json", str(report))
    if module == "verify.bisect":
        run = cli(module, *inject, "--prompt-len", "4", "--decode-steps", "0")
    else:
        run = cli(module, *inject, "--new-tokens", "1", "--against", "reference")
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"DIVERGES: the injected rms_norm ({impl}) did not return within 5 s (--timeout)" in run.stdout
    assert "did not return within 5 s" in json.loads(report.read_text())["raised"]


@pytest.mark.parametrize("module", ["verify.e2e", "verify.bisect"])
def test_an_injected_kernel_reading_far_outside_x_is_a_divergence(module: str, tmp_path: Path) -> None:
    """Loads 2^40 elements past x. Under the interpreter the memcheck raises before the access; on
    the GPU the launch faults and the device is lost: the wait inside the injected call charges the
    fault to the injection, and the run stops there. Exit 1 and the --json verdict either way."""
    report = tmp_path / "report.json"
    impl = "tests/buggy_kernels.py:rms_norm_reads_far_outside_x"
    inject = ("--inject", f"rms_norm={impl}@1", "--json", str(report))
    if module == "verify.bisect":
        run = cli(module, *inject, "--prompt-len", "4", "--decode-steps", "0")
    else:
        run = cli(module, *inject, "--new-tokens", "1", "--against", "reference")
    assert run.returncode == 1, run.stdout + run.stderr
    if backend.is_interpreter():
        expected = "raised InterpreterError: OutOfBounds('_rms_norm_kernel, program (0, 0, 0): a load of"
    else:
        expected = "faulted the GPU: CUDA error: an illegal memory access"
    assert f"DIVERGES: the injected rms_norm ({impl}) {expected}" in run.stdout
    assert expected in json.loads(report.read_text())["raised"]


def test_an_injected_implementation_that_raises_shows_the_failing_line(tmp_path: Path, capsys) -> None:
    from verify import e2e

    impl = tmp_path / "broken.py"
    impl.write_text("def rms_norm(x, weight, eps):\n    raise ValueError('boom: ' + str(x.shape[-1]))\n")
    assert (
        e2e.main(["--inject", f"rms_norm={impl}:rms_norm@1", "--new-tokens", "1", "--against", "reference"])
        == 1
    )
    out = capsys.readouterr().out
    assert f'File "{impl}", line 2, in rms_norm' in out and "raise ValueError('boom: '" in out


def test_an_injected_implementation_calling_sys_exit_is_a_divergence(tmp_path: Path) -> None:
    """``sys.exit(0)`` inside it must not end the run with exit 0 and no verdict."""
    impl = tmp_path / "exits.py"
    impl.write_text("import sys\n\n\ndef rms_norm(x, weight, eps):\n    sys.exit(0)\n")
    run = cli(
        "verify.e2e", "--inject", f"rms_norm={impl}:rms_norm@1", "--new-tokens", "1", "--against", "reference"
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "raised SystemExit" in run.stdout


def tiny_checkpoint(directory: Path, overflowing: bool = False) -> Path:
    """A 2-layer random qwen3 checkpoint; ``overflowing``: finite weights whose forward is not (a
    constant embedding times gate/up weights of 3e38 sums past the fp32 range)."""
    from model import weights as model_weights
    from model.config import ModelConfig

    cfg = ModelConfig("qwen3", 120, 64, 72, 2, 4, 2, 16, rope_theta=10000.0, qk_norm=True)
    weights = model_weights.random_weights(cfg, "cpu")
    if overflowing:
        weights.embed.fill_(1.0)
        weights.layers[0].gate_up.fill_(3e38)
    model_weights.save(weights, directory)
    return directory


@pytest.mark.parametrize("module", ["verify.e2e", "verify.bisect"])
def test_a_reference_with_non_finite_logits_is_bad_input(tmp_path: Path, module: str) -> None:
    """The yardstick itself is broken by the checkpoint: exit 2 naming that, not every layer OVER."""
    model = str(tiny_checkpoint(tmp_path / "ckpt", overflowing=True))
    if module == "verify.bisect":
        run = cli(module, "--model", model, "--prompt-len", "4", "--decode-steps", "0")
        where = "at prefill"
    else:
        run = cli(module, "--model", model, "--new-tokens", "1", "--against", "reference")
        where = "at step 0"
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"the reference model's logits {where} are not finite" in run.stderr
    assert "Traceback" not in run.stderr


def test_bisect_non_finite_triton_side_is_still_a_divergence(tmp_path: Path) -> None:
    model = str(tiny_checkpoint(tmp_path / "ckpt"))
    impl = tmp_path / "nan_linear.py"
    impl.write_text(
        "import torch\n\n\ndef linear(x, weight, bias=None):\n"
        "    return torch.full((x.shape[0], weight.shape[0]), float('nan'), dtype=x.dtype, device=x.device)\n"
    )
    run = cli(
        "verify.bisect", "--model", model, "--prompt-len", "4", "--decode-steps", "0",
        "--repro-dir", str(tmp_path / "repros"), "--inject", f"linear={impl}:linear@1",
    )  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    assert "DIVERGES: first at prefill, in layer 1" in run.stdout


def test_a_checkpoint_the_loaders_refuse_exits_2(tmp_path: Path, capsys) -> None:
    from verify import bisect, e2e

    model = tiny_checkpoint(tmp_path / "ckpt")
    (model / "model.safetensors").unlink()
    assert e2e.main(["--model", str(model), "--new-tokens", "1"]) == 2
    assert "verify.e2e: --model: " in capsys.readouterr().err
    (model / "config.json").write_text('{"model_type": "gpt2"}')
    assert bisect.main(["--model", str(model)]) == 2
    assert "model_type 'gpt2' is not supported" in capsys.readouterr().err


def test_e2e_exits_2_when_transformers_cannot_load_the_oracle(tmp_path: Path, monkeypatch, capsys) -> None:
    """Only the oracle's load is bad input (say a quantization backend missing): exit 2 with a
    message, before the run, not a traceback."""
    import transformers

    from verify import e2e

    def refuse(*args, **kwargs):
        raise ImportError("this checkpoint needs the optimum package")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    model = str(tiny_checkpoint(tmp_path / "ckpt"))
    assert e2e.main(["--model", model, "--new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert f"--against hf: transformers cannot load {model} (ImportError: this checkpoint needs" in err


def test_without_transformers_the_embedded_model_and_the_oracle_are_bad_usage(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """transformers is a test extra: without it the embedded default cannot be trained (exit 2,
    pointing at --model) and --against hf cannot run (exit 2); a checkpoint runs against the
    reference alone."""
    from verify import e2e

    model = str(tiny_checkpoint(tmp_path / "ckpt"))
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers: ImportError
    monkeypatch.setenv("TRITONCHECK_CACHE", str(tmp_path / "cache"))  # nothing built yet
    assert e2e.main(["--new-tokens", "1"]) == 2
    assert (
        "embedded default model is trained with transformers, which is not installed"
        in capsys.readouterr().err
    )
    assert e2e.main(["--model", model, "--new-tokens", "1"]) == 2
    assert "--against hf: transformers cannot load" in capsys.readouterr().err
    assert e2e.main(["--model", model, "--new-tokens", "1", "--against", "reference"]) == 0


def test_e2e_verdicts_ok_near_tie_drifts_diverges_and_non_finite() -> None:
    import torch

    from verify.e2e import compare

    ref = torch.tensor([0.0, 5.0, 4.95, 1.0])
    assert compare(ref.clone(), ref, 1, 0.1).verdict == "ok"
    assert compare(torch.tensor([0.0, 4.9, 5.0, 1.0]), ref, 1, 0.1).verdict == "near-tie"
    assert compare(torch.tensor([0.0, 1.0, 1.0, 5.0]), ref, 1, 0.1).verdict == "DIVERGES"
    # the same token (or a near-tie) with a logit off by more than the drift tolerance: a drift
    drifted = torch.tensor([0.0, 5.0, 4.95, 1.8])
    assert compare(drifted, ref, 1, 0.1, drift_tolerance=1.0).verdict == "ok"
    assert compare(drifted, ref, 1, 0.1, drift_tolerance=0.5).verdict == "DRIFTS"
    assert compare(torch.tensor([0.0, 4.9, 5.0, 1.8]), ref, 1, 0.1, drift_tolerance=0.5).verdict == "DRIFTS"
    # a flip past the near-tie tolerance is a divergence, drifted or not
    assert compare(torch.tensor([0.0, 1.0, 1.0, 5.0]), ref, 1, 0.1, drift_tolerance=0.5).verdict == "DIVERGES"
    # NaN logits whose argmax happens to land on the reference's token are still a divergence
    nan = torch.tensor([0.0, float("nan"), 0.0, 0.0])
    assert int(torch.argmax(nan)) == 1 and compare(nan, ref, 1, 0.1).verdict == "DIVERGES"


def test_roofline_reads_the_lm_head_once_and_one_embedding_row() -> None:
    """A decode step reads every layer weight and the lm_head whole; an untied embedding only one
    row (nothing counted twice), and the KV cache so far."""
    from model.config import PRESETS
    from verify.bench.model import roofline_seconds

    tied = PRESETS["article"]
    untied = tied.replace(tie_word_embeddings=False)
    vh = tied.vocab_size * tied.hidden_size
    _, tied_bytes = roofline_seconds(tied, 0, 1.0)
    _, untied_bytes = roofline_seconds(untied, 0, 1.0)
    assert tied_bytes == untied_bytes == 2 * tied.num_parameters()
    assert untied.num_parameters() == tied.num_parameters() + vh
    _, with_cache = roofline_seconds(tied, 100, 1.0)
    kv_row = 2 * tied.num_kv_heads * tied.head_dim * 2  # k and v, bf16
    assert with_cache - tied_bytes == 100 * tied.num_layers * kv_row


def test_model_bench_reports_the_model_issues_targets_it_measured() -> None:
    """Decode against 0.45 ms/token always; the peer only when its row ran; prefill only at the
    targets' prompt of 256 tokens (another length's prefill is not the stated target)."""
    from verify.bench.model import GRAPH_ROW, PEER_ROW, targets

    ours = {"name": GRAPH_ROW, "prefill_ms": 1.74, "decode_ms": 0.624}
    peer = {"name": PEER_ROW, "prefill_ms": None, "decode_ms": 1.663}
    found = targets([ours, peer], 256)
    assert [t["met"] for t in found] == [False, True, True]
    assert found[0]["value"] == "0.624 ms/token" and found[1]["value"] == "2.67x"
    assert [t["met"] for t in targets([{**ours, "decode_ms": 0.45, "prefill_ms": 2.1}], 256)] == [True, False]
    assert len(targets([ours], 128)) == 1


def test_profile_shares_split_the_union_of_kernel_spans() -> None:
    """Under programmatic dependent launch kernel spans overlap: each kernel is credited with the
    time it extends the busy period, so nothing is counted twice and the shares sum to the union."""
    from verify.bench.model import busy_shares

    assert busy_shares([]) == []
    assert busy_shares([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == [2.0, 1.0, 1.0]
    assert busy_shares([(0.0, 10.0), (2.0, 3.0), (4.0, 5.0)]) == [10.0, 0.0, 0.0]
    assert busy_shares([(3.0, 4.0), (0.0, 1.0)]) == [1.0, 1.0]
    # a PDL chain: each kernel starts early and waits; its share is the time after its predecessor
    assert busy_shares([(0.0, 4.0), (1.0, 5.5), (2.0, 9.0)]) == [4.0, 1.5, 3.5]


def test_profile_step_order_gives_each_position_its_median_share() -> None:
    from types import SimpleNamespace

    from verify.bench.model import step_order

    def event(name: str, start: float) -> SimpleNamespace:
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start))

    # two steps of (embed, gemv, attn), listed out of order; shares per position 1/3, 2/4, 5/9
    events = [
        event("gemv", 1),
        event("embed", 0),
        event("attn", 2),
        event("embed", 10),
        event("gemv", 11),
        event("attn", 12),
    ]
    shares = [2.0, 1.0, 5.0, 3.0, 4.0, 9.0]
    text = step_order(events, shares, steps=2)
    lines = [line.split() for line in text.splitlines() if line[:1].isdigit()]
    assert lines == [["0", "embed", "2.00"], ["1", "gemv", "3.00"], ["2", "attn", "7.00"]]
    assert "last" not in text  # every position is already among the first
    text = step_order(events, shares, steps=2, first=1, last=1)
    lines = [line.split() for line in text.splitlines() if line[:1].isdigit()]
    assert lines == [["0", "embed", "2.00"], ["2", "attn", "7.00"]]
    assert "and its last 1" in text
    assert "differs" in step_order(events[:5], shares[:5], steps=2)


def test_try_config_overrides_decode_configs_and_restores_the_table() -> None:
    from ops import gemm_config
    from verify.bench.model import gemm_overrides, parse_overrides

    shapes = {(9728, 1024), (1024, 4864), (1536, 1024)}
    overrides = parse_overrides("9728x1024=gemv n8 k1024 w4 s1; 1024x4864=gemv n2 k512 splitK2 w4 s4", shapes)
    assert overrides == {
        (1, 9728, 1024): gemm_config.GemmConfig("gemv", 1, 8, 1024, 1, 4, 1),
        (1, 1024, 4864): gemm_config.GemmConfig("gemv", 1, 2, 512, 2, 4, 4),
    }
    for bad, message in (
        ("9728x1024=gemv n8", "expected e.g."),
        ("9728=gemv n8 k512 w4 s4", "NxK=CONFIG"),
        ("1x1=gemv n8 k1024 w4 s1", r"1x1 is no projection of the model \(N x K: 1024x4864, 1536x1024, 9728"),
        ("9728x1024=gemv n8 k1024 w4 s1;9728x1024=gemv n4 k1024 w4 s1", "9728x1024 is given twice"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_overrides(bad, shapes)
    before = dict(gemm_config.CONFIGS)
    with gemm_overrides(overrides):
        assert gemm_config.table_config(1, 9728, 1024) == overrides[(1, 9728, 1024)]
    assert before == gemm_config.CONFIGS


def test_benchmarks_time_the_shape_a_config_names(tmp_path: Path) -> None:
    """``--config``: a model the presets do not cover (Qwen2.5-1.5B's shape), its projections
    timed on random weights, the ones the config table lacks on default_config's guesses, and
    attention on its head layout."""
    import argparse
    import dataclasses

    from model.config import PRESETS, to_hf_dict
    from verify.bench.gemm import _models
    from verify.strategies.gemm import MODEL_PROJECTIONS

    wider = dataclasses.replace(
        PRESETS["qwen2.5-0.5b"], hidden_size=1536, num_heads=12, head_dim=128, intermediate_size=8960
    )
    for name, cfg in (("wider", wider), ("article", PRESETS["article"])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(to_hf_dict(cfg)))
    parser = argparse.ArgumentParser()
    article = str(tmp_path / "article" / "config.json")  # a file or its directory
    assert _models(parser, argparse.Namespace(config=article)) == {article: MODEL_PROJECTIONS["article"]}
    models = _models(parser, argparse.Namespace(config=str(tmp_path / "wider")))
    assert [(p.name, p.n, p.k, p.bias) for p in models[str(tmp_path / "wider")]] == [
        ("qkv_proj", 2048, 1536, True), ("o_proj", 1536, 1536, False), ("gate_up_proj", 17920, 1536, False),
        ("down_proj", 1536, 8960, False), ("lm_head", 151936, 1536, False),
    ]  # fmt: skip
    from verify.bench.attention import SWEEP_MODELS, layout_of

    assert layout_of(wider) == {"b": 1, "kv_heads": 2, "group": 6, "head_dim": 128}
    assert SWEEP_MODELS["qwen2.5"] == {"b": 1, "kv_heads": 2, "group": 7, "head_dim": 64}  # 14/2 heads
    # the model benchmark's --try-config is checked against the config's shapes, not a preset's
    run = cli(
        "verify.bench",
        "model",
        "--config",
        str(tmp_path / "wider"),
        "--try-config",
        "9728x1024=gemv n8 k1024 w4 s1",
    )
    assert (
        run.returncode == 2
        and "(N x K: 1536x1536, 1536x8960, 2048x1536, 17920x1536, 151936x1536)" in run.stderr
    )


def test_sweep_writes_table_entries_as_the_table_does() -> None:
    from ops.gemm_config import GemmConfig
    from verify.bench.gemm import _config_source, candidates_for

    assert not any(c.kernel == "gemv" for c in candidates_for(256, 1024, 1024))  # prefill: tiled only
    # a long K also in one step, masked or in whole pieces (down_proj's 4864 = 4096 + 512 + 256)
    described = {c.describe() for c in candidates_for(1, 1024, 4864)}
    assert {"gemv n2 k8192 w4 s1", "gemv n2 k4096 w4 s1"} <= described, described
    assert "gemv n2 k4096 w8 s1" in {c.describe() for c in candidates_for(1, 1024, 3072)}
    assert _config_source(GemmConfig.parse("gemv n8 k1024 w4 s1")) == "gemv_config(8, 1024, 1, 4, 1)"
    assert (
        _config_source(GemmConfig.parse("tiled 64x64 k64 splitK4 w4 s4"))
        == "tiled_config(64, 64, 64, 4, 4, 4)"
    )


def test_decode_targets_state_the_ceiling_an_empty_launch_sets() -> None:
    from verify.bench.gemm import Roofline, Row, targets

    roof = Roofline(copy_bw=4e12, bf16_peak=8e14, launch_s=1e-6)

    def pick(n: int, k: int, seconds: float) -> Row:  # targets reads every third row: the table's pick
        row = Row("article", f"{n}x{k}", 1, n, k, "ours *", "gemv", seconds, True, 0.0)
        row.pct_roofline, row.vs_cublas = 100 * 2 * n * k / roof.copy_bw / seconds, 2.0
        return row

    small, large = pick(1024, 1024, 2e-6), pick(9728, 1024, 7e-6)  # 2 MB read in 0.52 us; 20 MB
    lines = targets([small, small, small, large, large, large], roof)
    assert lines[0].startswith("MISS") and "at most 52% here" in lines[0]
    assert lines[1].startswith("MISS") and "at most" not in lines[1]


def test_attention_decode_target_states_the_launch_ceiling() -> None:
    from verify.bench.attention import _targets

    rows = [
        {"kind": "prefill", "shape": "S=2048", "speed_vs_sdpa": 1.5, "passed": True, "graphed": True},
        {"kind": "decode", "shape": "cache=4096", "speed_vs_sdpa": 2.0, "pct_bandwidth": 14.0,
         "kv_bytes": 4e6, "launches": 2, "passed": True, "graphed": True},
    ]  # fmt: skip
    prefill, decode_bandwidth, decode_speed = _targets(rows, bandwidth=4e12, launch_s=1e-6)
    assert prefill["met"] and decode_speed["met"] and not decode_bandwidth["met"]
    assert decode_bandwidth["value"] == "14% (at most 50% with 2 launches of 1.00 us or more)"
    # a fast wrong answer, or a time with host launches in it, meets nothing
    rows[0]["passed"], rows[1]["graphed"] = False, False
    prefill, _, decode_speed = _targets(rows, bandwidth=4e12, launch_s=1e-6)
    assert not prefill["met"] and prefill["value"] == "150% (its check failed)"
    assert not decode_speed["met"] and decode_speed["value"] == "2.00x (not timed in a CUDA Graph)"


def test_an_output_path_that_is_one_of_the_runs_inputs_is_refused_untouched(tmp_path: Path) -> None:
    """``--json`` naming the checkpoint's config, the implementation file, a hard link to it, or
    the ``--plot`` file would clobber what the run reads or writes: refused before anything is
    emptied. A new file in the checkpoint directory, or a path ending in a slash, is no clash
    but the slash is no file path either."""
    import os

    from verify import cli

    model = tmp_path / "ckpt"
    model.mkdir()
    (model / "config.json").write_text("{}")
    impl = tmp_path / "impl.py"
    impl.write_text("def f(x):\n    return x\n")
    os.link(impl, tmp_path / "linked.py")
    reads = [("--model", str(model)), ("--inject", cli.impl_file(f"linear={impl}:f@all"))]
    refused = {
        str(model / "config.json"): f"is a file of --model {model}, which this run reads",
        str(impl): f"is the same file as --inject {impl}",
        str(tmp_path / "linked.py"): f"is the same file as --inject {impl}",
        f"{tmp_path}/new.json/": "ends with '/', expected a file path",
    }
    for path, message in refused.items():
        with pytest.raises(cli.UsageError, match=re.escape(f"--json {path}: {message}")):
            cli.check_output_file("--json", path, reads)
    assert (model / "config.json").read_text() == "{}" and impl.read_text().startswith("def f")
    assert not (tmp_path / "new.json").exists()
    with pytest.raises(cli.UsageError, match="is the same file as --json"):
        cli.check_output_file("--plot", str(tmp_path / "out"), [("--json", str(tmp_path / "out"))])
    cli.check_output_file("--json", str(model / "report.json"), reads)  # a new file there is no clash


@pytest.mark.parametrize(
    ("module", "option", "name"),
    [("verify.e2e", "--json", "config.json"), ("verify.bisect", "--json", "model.safetensors")],
)
def test_the_clis_refuse_to_write_over_the_checkpoint(
    tmp_path: Path, module: str, option: str, name: str
) -> None:
    model = tiny_checkpoint(tmp_path / "ckpt")
    before = (model / name).read_bytes()
    run = cli(module, "--model", str(model), option, str(model / name))
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"{option} {model / name}: is a file of --model {model}, which this run reads" in run.stderr
    assert (model / name).read_bytes() == before


def test_bisect_plot_with_a_trailing_slash_is_refused_before_the_run(tmp_path: Path, capsys) -> None:
    from verify import bisect

    for plot in (f"{tmp_path}/plot.png/", f"{tmp_path}/plot/"):
        assert bisect.main(["--plot", plot]) == 2
        assert f"--plot {plot}: ends with '/', expected a file path" in capsys.readouterr().err


def test_e2e_runs_hf_on_a_config_asking_for_tuples(tmp_path: Path, capsys) -> None:
    """``"return_dict": false`` in config.json: the oracle still reads its logits by name."""
    from verify import e2e

    model = tiny_checkpoint(tmp_path / "ckpt")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "return_dict": False}))
    assert e2e.main(["--model", str(model), "--new-tokens", "2"]) == 0, capsys.readouterr().err


def test_e2e_exits_2_when_the_oracles_forward_raises(tmp_path: Path, monkeypatch, capsys) -> None:
    from verify import e2e

    def refuse(*args, **kwargs):
        raise RuntimeError("this attention implementation needs a GPU")

    monkeypatch.setattr(e2e, "hf_forward", refuse)
    model = str(tiny_checkpoint(tmp_path / "ckpt"))
    assert e2e.main(["--model", model, "--new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert f"--against hf: transformers' forward of {model} raised (RuntimeError: this attention" in err


@pytest.mark.parametrize(
    ("module", "args", "asked"),
    [
        ("verify.e2e", ("--cache-len", str(10**11)), f"--cache-len {10**11}"),
        ("verify.e2e", ("--new-tokens", str(10**11)), "+ 100000000000 new tokens: a KV cache of"),
        ("verify.bisect", ("--prompt-len", str(10**11)), f"--prompt-len {10**11} + --decode-steps"),
    ],
)
def test_a_kv_cache_past_the_free_memory_is_refused_by_name(
    tmp_path: Path, capsys, module: str, args: tuple[str, ...], asked: str
) -> None:
    """A checkpoint allowing 1e13 positions: a cache of 1e11 rows (23 TiB here) is bad usage
    named before any allocation, not the allocator's traceback."""
    from verify import bisect, e2e

    model = tiny_checkpoint(tmp_path / "ckpt")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 10**13}))
    main = e2e.main if module == "verify.e2e" else bisect.main
    assert main(["--model", str(model), *args]) == 2
    err = capsys.readouterr().err
    assert asked in err and "GiB, more than the" in err and "GiB free on " in err, err


def test_an_output_in_the_checkpoint_cache_is_refused_for_the_embedded_model(
    tmp_path: Path, monkeypatch, capsys
):
    """No --model: the embedded checkpoint is read from the cache, whose files an output path
    must not empty (a broken cached checkpoint fails every later run)."""
    from verify import bisect, e2e

    cache = tmp_path / "cache"
    model = cache / "embedded-qwen3-0123456789ab"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    monkeypatch.setenv("TRITONCHECK_CACHE", str(cache))
    for main, option in ((e2e.main, "--json"), (bisect.main, "--json")):
        assert main([option, str(model / "config.json")]) == 2
        err = capsys.readouterr().err
        assert f"is a file of the checkpoint cache {cache}, which this run reads" in err, err
    assert (model / "config.json").read_text() == "{}"


def test_e2e_prompt_the_tokenizer_cannot_encode_is_bad_usage(tmp_path: Path, monkeypatch, capsys) -> None:
    from verify import e2e

    class Refusing:
        def __call__(self, text):
            raise Exception("WordLevel error: Missing [UNK] token from the vocabulary")

    model = str(tiny_checkpoint(tmp_path / "ckpt"))
    monkeypatch.setattr(e2e, "_tokenizer", lambda directory: Refusing())
    assert e2e.main(["--model", model, "--prompt", "zzz", "--new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert f"--prompt: the tokenizer in {model} cannot encode it (Exception: WordLevel error" in err, err
