"""Kernels that fault or hang on a real GPU: ``verify.op`` must report the case, not crash or hang.

Each runs in its own process: a CUDA fault is sticky (every later call in the process fails), and
a hung kernel is only ended by ending its process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.test_verify_op import verify_op

pytestmark = pytest.mark.gpu


def test_an_illegal_address_is_reported_against_its_case(tmp_path: Path) -> None:
    """An embedding kernel without the id check, given an id 2^40 rows past the table: the fault
    is raised inside the implementation's call, so the reference is not run (it would fail on the
    dead device, and the case would be called bad input) and the run ends at this case, exit 1."""
    inputs, report = tmp_path / "far_id.pt", tmp_path / "out.json"
    ids = torch.tensor([[3, 2**40, 5]])
    torch.save({"op": "embedding", "args": (ids, torch.randn(100, 64, dtype=torch.bfloat16))}, inputs)
    impl = "tests/buggy_kernels.py:embedding_unchecked_ids"
    run = verify_op("embedding", "--inputs", str(inputs), "--impl", impl, "--json", str(report))
    assert run.returncode == 1, run.stdout + run.stderr
    assert "faulted the GPU on this case" in run.stdout
    assert "implementation raised" in run.stdout and "illegal memory access" in run.stdout
    data = json.loads(report.read_text())
    assert data["device_lost"] and not data["passed"]
    in_table = {"b": 2, "s": 5, "vocab": 100, "hidden": 33, "ids": "random", "id_dtype": "int64", "offset": 1,
                "dtype": "bfloat16", "dist": "normal", "seed": 0}  # fmt: skip
    run = verify_op("embedding", "--impl", impl, "--case", json.dumps(in_table))
    assert run.returncode == 0, run.stdout + run.stderr  # right wherever ids are in the table
    drawn = verify_op("embedding", "--impl", impl, "--examples", "20")  # the strategy's "outside" ids
    assert drawn.returncode == 1 and '"ids":"outside"' in drawn.stdout, drawn.stdout + drawn.stderr


def test_a_kernel_that_never_returns_is_stopped_by_the_watchdog() -> None:
    """Programs spinning on a flag no program sets: the timer thread reports the case while the
    main thread waits on the GPU, then ends the process."""
    impl = "tests/buggy_kernels.py:rms_norm_waits_for_next_row"
    run = verify_op("rms_norm", "--impl", impl, "--timeout", "30")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "DIVERGES: a case ran past the 30 s limit; the run stops there" in run.stdout
    assert "repro: python -m verify.op rms_norm --case" in run.stdout
