"""The reference decoder: the shared forward (model/decoder.py) run on ``references/`` only.

Plain eager torch, every op in fp32 math with one rounding per op output: the yardstick
the Triton model is compared with, layer by layer and token by token. Its own faithfulness
to HF's modeling code is checked against transformers in tests/test_hf_oracle.py.
"""

from __future__ import annotations

import torch

import registry
from model.decoder import OPS, Decoder
from model.weights import Weights


def build(weights: Weights, max_batch: int, max_seq: int, fused: bool = True) -> Decoder:
    """The decoder on the registered references (eager torch, fresh tensors each call): the
    yardstick. ``fused`` picks the fused ops' references, so its hook points match the Triton
    model's one for one."""
    impls = {name: registry.get(name).reference for name in OPS}
    return Decoder(weights, impls, max_batch, max_seq, static=False, name="reference", fused=fused)


class NonFiniteReference(ValueError):
    """The reference model itself produced NaN or inf logits: bad input, not a divergence."""


def check_finite(logits: torch.Tensor, where: str) -> None:
    """Refuse a reference whose logits (``where``: the step) hold NaN or inf: the yardstick is
    broken by its checkpoint, so comparing the Triton model with it would blame the kernels."""
    if not bool(torch.isfinite(logits).all()):
        raise NonFiniteReference(
            f"the reference model's logits {where} are not finite: the checkpoint does not make a "
            "usable model (its weights or config), so there is nothing to compare against"
        )
