"""Projections with the ops around them fused into the weight stream (decode's kernel count).

At decode the model is a chain of small kernels, each costing ~1-2 us even inside a CUDA
Graph, so the op before a GEMM runs in its prologue and, where a program holds what it needs,
the op after it in its epilogue. Three fused ops:

* ``add_rms_norm_linear``: residual add + RMSNorm + projection (the QKV GEMM of models with
  qk-norm, whose ``rope_kv_store`` needs whole heads and so runs after it).
  Every gemv program recomputes the row's rms from ``x + residual`` (K <= a few thousand: a
  few KB read from L2) and normalizes each chunk as it loads it; the programs of the first
  output block also write ``x + residual``, the next residual stream.
* ``add_rms_norm_linear_silu_mul``: the same norm prologue on the gate/up projection, and the
  SwiGLU gate in its epilogue: each program streams the gate and up rows of its outputs and
  stores ``silu(gate) * up``, so the down projection after it reads half the width and no
  program of it recomputes the activation.
* ``add_rms_norm_linear_rope_kv_store``: the same norm prologue on the QKV gemv, and RoPE plus
  the KV cache write in its epilogue (``rope_kv_store`` without qk-norm): each program streams
  the two weight rows of each rotation pair (d and d + D/2 of a head), so it holds both values
  it rotates, and stores q into the output and k and v into the caches.

Each fused value is rounded to the input dtype exactly where the unfused op would round its
output, so the result is the unfused composition's, up to fp32 summation order. Past the
gemv sizes (M > 4: prefill, compute bound), and for RoPE over part of the head, the ops run as
that composition through cached scratch: the norm kernel, ``linear``, then ``silu_mul`` or
``rope_kv_store``.
"""

from __future__ import annotations

import torch

from ops import elementwise, gemm, gemm_config, norm, rope_kv_store, scratch, validate


def _intermediate(
    shape: tuple[int, int], like: torch.Tensor, name: str = "fused intermediate"
) -> torch.Tensor:
    """The composed path's normalized rows, gate/up sums or QKV rows (see ``ops.scratch``)."""
    return scratch.cached(
        name,
        (like.device, shape, like.dtype),
        lambda: torch.empty(shape, dtype=like.dtype, device=like.device),
    )


def _fused_config(m: int, n: int, k: int) -> gemm_config.GemmConfig | None:
    """The gemv config ``linear`` uses for this shape, or None where the op runs composed."""
    if m == 0 or n == 0 or k == 0:
        return None
    config = gemm_config.table_config(m, n, k)
    return config if config.kernel == "gemv" else None


def _project(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: gemm_config.GemmConfig,
    y: torch.Tensor,
    prologue: gemm.Prologue,
    epilogue: str | gemm.RopeArgs = "none",
) -> None:
    m, n = x.shape[0], weight.shape[0]
    partials = gemm.workspace(config.split_k, m, n, x.device) if config.split_k > 1 else None
    gemm.run(x, weight, bias, config, y, partials, prologue, epilogue)


def _check_norm_operands(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, k: int
) -> float:
    """Check the norm's operands; return ``eps`` as a Python float."""
    validate.tensor("residual", residual, ndim=2)
    validate.shape("residual", residual, x.shape, "the shape of x")
    validate.same_dtype("residual", residual, "x", x)
    validate.tensor("norm_weight", norm_weight, ndim=1)
    validate.shape("norm_weight", norm_weight, (k,), "K, the last dim of x")
    validate.same_dtype("norm_weight", norm_weight, "x", x)
    return validate.positive("eps", eps, fp32=True)


def _norm_outputs(
    out: tuple[torch.Tensor, torch.Tensor] | None, x: torch.Tensor, y_shape: tuple[int, ...], inputs: dict
) -> tuple[torch.Tensor, torch.Tensor]:
    """The projection ``y_shape`` and the residual sum ``[M, K]``: the caller's ``out`` or new.
    Every program reads all of x and residual, so neither output may share their memory (nor
    the weights', nor each other's): not even in place."""
    y_out, total_out = validate.pair("out", out)
    y = validate.output(y_out, y_shape, x.dtype, x, "out[0]", reads=inputs)
    return y, validate.output(total_out, tuple(x.shape), x.dtype, x, "out[1]", reads=inputs | {"out[0]": y})


def add_rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(rms_norm(x + residual, norm_weight, eps), weight, bias), x + residual)``.

    ``x``, ``residual``: ``[M, K]`` (any row stride); ``weight``: ``[N, K]``.
    """
    m, n, k = gemm.check_operands(x, weight, last_dim_contiguous=True)
    eps = _check_norm_operands(x, residual, norm_weight, eps, k)
    gemm.check_bias(bias, n, x)
    inputs = {"x": x, "residual": residual, "norm_weight": norm_weight, "weight": weight, "bias": bias}
    y, total = _norm_outputs(out, x, (m, n), inputs)
    config = _fused_config(m, n, k)
    if config is None:
        h = _intermediate((m, k), x)
        norm.add_rms_norm(x, residual, norm_weight, eps, out=(h, total))
        gemm.linear(h, weight, bias, out=y)
        return y, total
    _project(x, weight, bias, config, y, gemm.Prologue("add_rms_norm", residual, norm_weight, eps, total))
    return y, total


def add_rms_norm_linear_silu_mul(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(silu_mul(gate, up), x + residual)`` for ``[gate | up] = linear(rms_norm(x + residual,
    norm_weight, eps), weight)``.

    ``x``, ``residual``: ``[M, K]`` (any row stride); ``weight``: ``[2N, K]``, the N gate rows
    then the N up rows (the model's fused gate/up weight); the first output is ``[M, N]``.
    """
    m, n2, k = gemm.check_operands(x, weight, last_dim_contiguous=True)
    if n2 % 2:
        raise ValueError(
            f"weight: expected an even number of rows (gate rows, then up rows), "
            f"got shape {tuple(weight.shape)}"
        )
    eps = _check_norm_operands(x, residual, norm_weight, eps, k)
    n = n2 // 2
    inputs = {"x": x, "residual": residual, "norm_weight": norm_weight, "weight": weight}
    y, total = _norm_outputs(out, x, (m, n), inputs)
    config = _fused_config(m, n2, k)
    if config is None:
        h = _intermediate((m, k), x)
        norm.add_rms_norm(x, residual, norm_weight, eps, out=(h, total))
        gate_up = _intermediate((m, n2), x, "fused gate/up")  # its own buffer: N2 may equal K
        gemm.linear(h, weight, None, out=gate_up)
        elementwise.silu_mul(gate_up[:, :n], gate_up[:, n:], out=y)
        return y, total
    prologue = gemm.Prologue("add_rms_norm", residual, norm_weight, eps, total)
    # the epilogue needs whole sums: no split-K
    _project(x, weight, None, config.replace(split_k=1), y, prologue, "silu_mul")
    return y, total


def add_rms_norm_linear_rope_kv_store(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start_pos: torch.Tensor,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rope_kv_store(q, k, v, cos, sin, k_cache, v_cache, start_pos), x + residual)`` for
    ``[q | k | v] = linear(rms_norm(x + residual, norm_weight, eps), weight, bias)``.

    ``x``, ``residual``: ``[B * S, K]`` (any row stride), the tokens of ``cos``/``sin``
    ``[B, S, rotary_dim / 2]``; ``weight``: ``[(Hq + 2 Hkv) * D, K]``, the q heads' rows, then
    k's, then v's (the model's fused QKV weight), D and Hkv those of the caches ``[B, L, Hkv, D]``.
    The caches are written in place (rows ``start_pos[b] + s`` inside ``0 .. L - 1``); the first
    output is q, rotated, ``[B, S, Hq, D]``.
    """
    m, n, k = gemm.check_operands(x, weight, last_dim_contiguous=True)
    eps = _check_norm_operands(x, residual, norm_weight, eps, k)
    gemm.check_bias(bias, n, x)
    validate.tensor("cos", cos, ndim=3, dtypes=(torch.float32,))
    validate.tensor("k_cache", k_cache, ndim=4)
    batch, seq = cos.shape[:2]
    if batch * seq != m:
        raise ValueError(
            f"cos: expected [B, S, rotary_dim / 2] with B * S = {m} (the rows of x), got {tuple(cos.shape)}"
        )
    kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
    q_heads = n // dim - 2 * kv_heads if dim else 0
    if dim == 0 or n % dim or q_heads < 1:
        raise ValueError(
            f"weight: expected (Hq + 2 * {kv_heads}) * {dim} rows (q, k and v heads of k_cache's "
            f"head_dim and kv heads, Hq >= 1), got shape {tuple(weight.shape)}"
        )
    rope_kv_store.check_cos_sin_caches(cos, sin, k_cache, v_cache, start_pos, batch, seq, dim, x, "x")
    inputs = {"x": x, "residual": residual, "norm_weight": norm_weight, "weight": weight, "bias": bias}
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        validate.disjoint(name, cache, inputs)
    inputs |= {"cos": cos, "sin": sin, "k_cache": k_cache, "v_cache": v_cache, "start_pos": start_pos}
    q, total = _norm_outputs(out, x, (batch, seq, q_heads, dim), inputs)
    config = _fused_config(m, n, k)
    if config is None or 2 * cos.shape[2] != dim:  # partial rotary: other rows pair up
        qkv = _intermediate((m, n), x, "fused qkv")
        add_rms_norm_linear(x, residual, norm_weight, eps, weight, bias, out=(qkv, total))
        heads = qkv.view(batch, seq, q_heads + 2 * kv_heads, dim)
        k, v = heads[:, :, q_heads : q_heads + kv_heads], heads[:, :, q_heads + kv_heads :]
        rope_kv_store.rope_kv_store(heads[:, :, :q_heads], k, v, cos, sin, k_cache, v_cache, start_pos, out=q)
        return q, total
    prologue = gemm.Prologue("add_rms_norm", residual, norm_weight, eps, total)
    rope = gemm.RopeArgs.of(cos, sin, k_cache, v_cache, start_pos, q_heads)
    _project(x, weight, bias, config.replace(split_k=1), q.view(m, q_heads * dim), prologue, rope)
    return q, total
