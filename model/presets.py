"""Checkpoints of the named presets with random weights of the real size, in HF layout.

Built once into the cache (``$TRITONCHECK_CACHE`` or ``~/.cache/tritoncheck``), so every
tool, HF transformers included, reads the same files. No download: the weights are drawn
from a seeded generator.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from model import weights as model_weights
from model.config import PRESETS
from model.embedded import default_cache_dir


def checkpoint(name: str, seed: int = 0) -> Path:
    """The directory of preset ``name``'s random checkpoint, built on first use."""
    if name not in PRESETS:
        raise ValueError(f"name: {name!r} is not a preset; expected one of {', '.join(PRESETS)}")
    target = default_cache_dir() / f"preset-{name}-seed{seed}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    weights = model_weights.random_weights(PRESETS[name], device, seed=seed)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        model_weights.save(weights, staging)
        os.replace(staging, target)  # atomic: concurrent builders never see half a checkpoint
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
