"""The Triton decoder: the shared forward (model/decoder.py) run on the kernels in ``ops/``.

Prefill runs eagerly, or captured per prompt length (``DecodeRunner(new_tokens=S)``); decode
steps run through ``model.graph.DecodeRunner``, which switches the decoder to static buffers and
captures one step in a CUDA Graph.
"""

from __future__ import annotations

import registry
from model.decoder import OPS, Decoder
from model.weights import Weights


def build(weights: Weights, max_batch: int, max_seq: int, fused: bool = True) -> Decoder:
    """The same decoder on the registered Triton kernels, over the same weights (no copy)."""
    impls = {name: registry.get(name).impl for name in OPS}
    return Decoder(weights, impls, max_batch, max_seq, static=False, name="triton", fused=fused)
