"""Per-op case strategies: what parameters to draw, and how to build tensors from them.

Each op module exposes, per op, ``params(limits)`` (a Hypothesis strategy of JSON-able dicts),
``build(params, device)`` (the deterministic tensors), ``EXAMPLES`` (named shapes of the
real models, most of them GPU-sized) and ``INVALID`` (bad inputs the wrapper must refuse).
"""
