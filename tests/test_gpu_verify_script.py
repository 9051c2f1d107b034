"""``scripts/gpu_verify.sh`` refuses a bad stage list before any stage starts: device time is
scarce, and a typo in a call's last stage must not cost the stages before it."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from tests.subprocess_env import user_env

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_verify.sh"


def run_in_bare_copy(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """The script run from a copy in an empty tree (no ``ab_*/`` copies, no package to run),
    its logs directed to ``tmp_path/out``."""
    (tmp_path / "scripts").mkdir()
    script = shutil.copy(SCRIPT, tmp_path / "scripts")
    env = {**user_env(), "OUT": str(tmp_path / "out")}
    return subprocess.run(["bash", script, *args], capture_output=True, text=True, env=env, timeout=60)


def test_an_unknown_stage_after_good_ones_is_refused_before_any_runs(tmp_path: Path) -> None:
    done = run_in_bare_copy(tmp_path, "gemm", "e2e", "bench", "e2ee")
    assert done.returncode == 2
    assert "(unknown: e2ee)" in done.stderr
    assert not (tmp_path / "out").exists(), "a stage ran before the stage list was checked"


def test_ab_without_copies_to_time_is_refused_before_any_stage_runs(tmp_path: Path) -> None:
    done = run_in_bare_copy(tmp_path, "gemm", "ab")
    assert done.returncode == 2
    assert "no ab_*/ copies" in done.stderr
    assert not (tmp_path / "out").exists()


def test_config_without_a_config_to_time_is_refused_before_any_stage_runs(tmp_path: Path) -> None:
    done = run_in_bare_copy(tmp_path, "gemm", "config")
    assert done.returncode == 2
    assert "config: BENCH_CONFIG must name" in done.stderr
    assert not (tmp_path / "out").exists()


def test_help_lists_the_stages_that_have_a_rule_and_runs_none(tmp_path: Path) -> None:
    done = run_in_bare_copy(tmp_path, "--help")
    assert done.returncode == 0
    listed = done.stdout.split("stages:", 1)[1].split()
    ruled = re.findall(r"^ {8}([a-z][a-z0-9-]*)\)", SCRIPT.read_text(), flags=re.MULTILINE)
    assert sorted(listed) == sorted(ruled) and len(ruled) > 5
    assert not (tmp_path / "out").exists()
