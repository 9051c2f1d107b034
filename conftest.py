"""Backend selection, Hypothesis profiles, the ``gpu`` marker and a seeded torch for the whole test
suite."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Checkpoints built on first use (the embedded default, preset files) land in the repo's
# ignored cache, shared by all xdist workers of a run and by later runs.
os.environ.setdefault("TRITONCHECK_CACHE", os.path.join(os.path.dirname(__file__), ".cache", "tritoncheck"))


@pytest.fixture(autouse=True)
def _torch_seeded():
    """torch's global generator from one seed before every test: an unseeded ``torch.randn`` then
    draws the same values whichever xdist worker runs the test, and after whatever else."""
    import torch

    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _release_cached_gpu_memory():
    """Hand the GPU memory a test freed back to the device after it. Each xdist worker's CUDA
    caching allocator keeps freed blocks for its own next allocation, so a worker done with a
    large test held gigabytes the others could not get: the thorough profile's 16 workers ran
    the H200 out of memory (2026-12-02)."""
    yield
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--backend",
        choices=("auto", "cuda", "interpreter"),
        default=None,
        help="where kernels run (default: $TRITONCHECK_BACKEND, else cuda if available, else interpreter)",
    )


def pytest_configure(config: pytest.Config) -> None:
    chosen = config.getoption("--backend")
    if chosen:
        os.environ["TRITONCHECK_BACKEND"] = chosen
    from ops import backend  # only now: the backend must be fixed before any kernel is defined
    from verify import profiles

    profiles.load(backend.name())


def pytest_report_header(config: pytest.Config) -> str:
    from hypothesis import settings

    from ops import backend

    return f"tritoncheck backend: {backend.name()}, hypothesis profile: {settings._current_profile}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from ops import backend

    if backend.name() == "cuda":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (compiled Triton); this run uses the interpreter")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
