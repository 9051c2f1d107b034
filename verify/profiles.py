"""Hypothesis profiles: ``ci`` (fast, deterministic, CPU), ``gpu`` and ``thorough``.

``gpu`` and ``thorough`` keep their example database in the repo's ignored ``.cache/hypothesis``,
so a failure found on one run is replayed first on the next; ``ci`` is derandomized (the same
cases every run) and keeps none.
"""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase

DATABASE = Path(__file__).resolve().parent.parent / ".cache" / "hypothesis"
NAMES = ("ci", "gpu", "thorough")
_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
# Hypothesis's explain phase reruns a shrunk failure under a tracer to list the lines only
# failing runs reach: minutes on interpreted kernels, for lines our report already names.
_PHASES = [phase for phase in Phase if phase != Phase.explain]


def register() -> None:
    db = DirectoryBasedExampleDatabase(str(DATABASE))
    common = {"deadline": None, "suppress_health_check": _SLOW_OK, "print_blob": True, "phases": _PHASES}
    settings.register_profile("ci", max_examples=50, derandomize=True, database=None, **common)
    settings.register_profile("gpu", max_examples=50, database=db, **common)
    settings.register_profile("thorough", max_examples=500, database=db, **common)


def load(backend_name: str) -> str:
    """Load ``HYPOTHESIS_PROFILE`` if set, else ``gpu`` on CUDA and ``ci`` on the interpreter."""
    register()
    name = os.environ.get("HYPOTHESIS_PROFILE") or ("gpu" if backend_name == "cuda" else "ci")
    if name not in NAMES:
        raise ValueError(f"HYPOTHESIS_PROFILE={name!r}: expected one of {', '.join(NAMES)}")
    settings.load_profile(name)
    return name
