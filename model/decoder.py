"""The decoder forward, written once over named ops, run with either set of implementations.

The reference model runs it on ``references/``, the Triton model on ``ops/``: the same
layers, the same op calls in the same order, so ``verify.bisect`` can line the two up op by
op and ``--inject`` can swap one op in one layer. Whether the shared structure itself is
right (residual wiring, the order of norm, RoPE and attention) is checked independently
against HF transformers (tests/test_hf_oracle.py).

Per layer, as in HF's Llama/Qwen2/Qwen3 decoder layers::

    h, residual = add_rms_norm(x, residual, input_norm)     # layer 0: x = embedding, residual = 0
    q, k, v     = split(linear(h, W_qkv, b_qkv))            # one fused GEMM, views
    q, k        = rms_norm(q, q_norm), rms_norm(k, k_norm)  # qwen3 only
    q, k        = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    kv_cache_store(k_cache, v_cache, k, v, start_pos)
    a           = attention(q, k_cache, v_cache, start_pos + S, 1/sqrt(D))
    x           = linear(a, W_o)
    h, residual = add_rms_norm(x, residual, post_norm)
    x           = linear(silu_mul(split(linear(h, W_gate_up))), W_down)

and after the last layer ``logits = linear(add_rms_norm(x, residual, final_norm), lm_head)``.

With ``fused=True`` (the default; decode's kernel count decides its speed) consecutive ops
run as one fused op each, registered and verified like any other (see ``FUSIONS``):
``add_rms_norm_linear_rope_kv_store`` for norm + QKV + RoPE + cache write (not with qk-norm,
which needs whole heads the QKV gemv's programs do not hold: there ``add_rms_norm_linear`` then
``rope_kv_store``), and
``add_rms_norm_linear_silu_mul`` for norm + gate/up + SwiGLU (``layer_ops`` lists a layer's).
``fused=False`` calls the parts, one op per step of the listing above,
which is what an ``--inject`` of one part needs.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from model.weights import Weights

OPS = (
    "embedding",
    "rms_norm",
    "add_rms_norm",
    "linear",
    "rope_cos_sin",
    "apply_rope",
    "kv_cache_store",
    "attention",
    "silu_mul",
    "argmax",
    "add_rms_norm_linear",
    "rope_kv_store",
    "add_rms_norm_linear_silu_mul",
    "add_rms_norm_linear_rope_kv_store",
)
# fused op -> the ops it stands for (its reference is their composition)
FUSIONS = {
    "add_rms_norm_linear": ("add_rms_norm", "linear"),
    "rope_kv_store": ("rms_norm", "apply_rope", "kv_cache_store"),
    "add_rms_norm_linear_silu_mul": ("add_rms_norm", "linear", "silu_mul"),
    "add_rms_norm_linear_rope_kv_store": ("add_rms_norm", "linear", "apply_rope", "kv_cache_store"),
}
FUSED_PARTS = frozenset(part for parts in FUSIONS.values() for part in parts)
MODEL_LAYER = -1  # ops outside the layers: embedding, rope table, final norm, lm_head
# Hook points whose op is told ``static_weight=True`` (where it takes the keyword): plain
# ``linear`` calls on loaded weights, which no kernel of the step writes, so ``ops.gemm.linear``
# may request them before its PDL wait. Chosen by measurement (o_proj gains; gate_up's early
# weight lost), so not every loaded weight is listed. The request applies to one-step gemvs only:
# lm_head's table configs loop, so for the presets it changes nothing there.
STATIC_WEIGHT_POINTS = frozenset({"o_proj", "down_proj", "lm_head"})


@dataclass
class OpCall:
    """One op invocation, as an interceptor sees it: where, which op, with what."""

    layer: int
    point: str  # the hook point, e.g. "q_rope" or "down_proj"
    op: str
    args: tuple


Interceptor = Callable[[OpCall, Callable[[], Any]], Any]


def _keywords(fn: Callable) -> frozenset[str]:
    """Which of the keywords the decoder may pass (``out``, ``static_weight``) ``fn`` takes."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(k for k in ("out", "static_weight") if k in parameters)


class Decoder:
    """A Llama/Qwen2/Qwen3 decoder over a static KV cache, its ops looked up by name.

    ``impls`` maps op name -> implementation. With ``static=True`` every op writes into a
    buffer allocated on first use and reused after (the CUDA Graph discipline: after one
    warm-up step, a step allocates nothing).
    """

    def __init__(
        self,
        weights: Weights,
        impls: dict[str, Callable],
        max_batch: int,
        max_seq: int,
        static: bool = False,
        name: str = "decoder",
        fused: bool = True,
    ) -> None:
        for arg, value in (("max_batch", max_batch), ("max_seq", max_seq)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{arg}: expected a positive int (the KV cache's size), got {value!r}")
        c = weights.config
        self.config, self.weights, self.name, self.fused = c, weights, name, fused
        self.impls = dict(impls)
        self.overrides: dict[tuple[str, int], Callable] = {}
        # Asked on every op call, so looked up once per implementation here and in ``inject``:
        # inspect stays off the per-token path and out of what torch.compile traces (the
        # benchmark's compiled peer runs this decoder).
        self._takes = {fn: _keywords(fn) for fn in self.impls.values()}
        self.interceptor: Interceptor | None = None
        self.static = static
        self.buffers: dict[tuple, Any] = {}
        self._shape: tuple[int, int] = (0, 0)  # (B, S) of the forward in progress: keys static buffers
        self.max_batch, self.max_seq = max_batch, max_seq
        device, dtype = weights.embed.device, weights.dtype
        shape = (max_batch, max_seq, c.num_kv_heads, c.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(c.num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(c.num_layers)]
        self.scale = 1.0 / math.sqrt(c.head_dim)

    # ---- op dispatch: overrides, static outputs, recording ------------------------------------

    def inject(self, op: str, impl: Callable, layers: list[int]) -> None:
        """Use ``impl`` for ``op`` in these layers (``--inject`` of verify.bisect and verify.e2e)."""
        if op not in self.impls:
            raise KeyError(f"unknown op {op!r}; the decoder calls {', '.join(OPS)}")
        if op in FUSIONS and not self.fused:
            raise ValueError(f"{op} is a fused op: this decoder runs unfused (fused=False), never calling it")
        if self.fused and op in FUSED_PARTS:
            raise ValueError(
                f"{op} runs inside a fused op in this decoder (fused=True): build it with fused=False"
            )
        if op not in self.layer_ops():
            raise ValueError(
                f"{op} is not called in the layers of this decoder: {', '.join(self.layer_ops())}"
            )
        self._takes[impl] = _keywords(impl)
        for layer in layers:
            self.overrides[(op, layer)] = impl

    def layer_ops(self) -> tuple[str, ...]:
        """The ops every layer calls, in order (what an injection can swap)."""
        c = self.config
        if not self.fused:
            qk_norm = ("rms_norm", "rms_norm") if c.qk_norm else ()
            attn = (
                "add_rms_norm",
                "linear",
                *qk_norm,
                "apply_rope",
                "apply_rope",
                "kv_cache_store",
                "attention",
            )
            return (*attn, "linear", "add_rms_norm", "linear", "silu_mul", "linear")
        if c.qk_norm:
            qkv = ("add_rms_norm_linear", "rope_kv_store")
        else:
            qkv = ("add_rms_norm_linear_rope_kv_store",)
        return (*qkv, "attention", "linear", "add_rms_norm_linear_silu_mul", "linear")

    def op(self, layer: int, point: str, name: str, *args: Any, slot: int = 0) -> Any:
        """Call op ``name`` at hook ``point`` of ``layer``.

        Static mode: the first call's outputs become the buffers that later calls write into
        (``out=``); ``slot`` keeps apart buffers that are alive at the same time (the residual
        streams of consecutive ``add_rms_norm`` calls). At ``STATIC_WEIGHT_POINTS`` an
        implementation that takes ``static_weight`` (``ops.gemm.linear``) is told its weight is
        a loaded one; others never see the keyword. An ``interceptor``
        (the verification tools) sees every call with its arguments and decides when it runs.
        """
        fn = self.overrides.get((name, layer), self.impls[name])
        takes = self._takes.get(fn)
        if takes is None:  # an implementation set in ``impls`` after construction
            takes = self._takes[fn] = _keywords(fn)
        key = (point, name, slot, self._shape)
        buffers = self.buffers.get(key) if self.static else None
        static = point in STATIC_WEIGHT_POINTS and "static_weight" in takes
        options = {"static_weight": True} if static else {}

        def run() -> Any:
            if buffers is not None and "out" in takes:
                return fn(*args, out=buffers, **options)
            result = fn(*args, **options)
            if self.static and result is not None and buffers is None:
                self.buffers[key] = result if isinstance(result, torch.Tensor) else tuple(result)
            return result

        if self.interceptor is None:
            return run()
        return self.interceptor(OpCall(layer, point, name, args), run)

    # ---- the forward ---------------------------------------------------------------------------

    def positions_and_lengths(
        self, start_pos: torch.Tensor, new_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions, seq_lens)``: ``start_pos[b] + i`` for the new tokens ``[B, S]`` and
        ``start_pos[b] + S`` ``[B]``, int32, from one add (a launch fewer in the decode step):
        row ``i`` of ``[S + 1, B]`` is ``start_pos + i``, the positions are its first S rows
        transposed (a strided view), seq_lens its last row."""
        steps = self._const(
            ("steps", new_tokens),
            lambda: torch.arange(new_tokens + 1, dtype=torch.int32, device=start_pos.device)[:, None],
        )
        if self.static:
            out = self._const(
                ("positions", tuple(start_pos.shape), new_tokens),
                lambda: torch.empty(
                    new_tokens + 1, start_pos.shape[0], dtype=torch.int32, device=start_pos.device
                ),
            )
            table = torch.add(steps, start_pos[None, :], out=out)
        else:
            table = steps + start_pos[None, :]
        return table[:new_tokens].t(), table[new_tokens]

    def _const(self, key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        if key not in self.buffers:
            self.buffers[key] = make()
        return self.buffers[key]

    def layer(
        self,
        n: int,
        x: torch.Tensor,
        residual: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        start_pos: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer: ``(x, residual)`` in, ``(mlp output, residual)`` out; their sum is the stream."""
        c, w = self.config, self.weights.layers[n]
        batch, seq, hidden = x.shape
        eps = c.rms_norm_eps
        rows = batch * seq
        k_cache, v_cache = self.k_cache[n], self.v_cache[n]
        if "add_rms_norm_linear_rope_kv_store" in self.layer_ops():
            q, total = self.op(
                n, "qkv_proj", "add_rms_norm_linear_rope_kv_store", x.view(rows, hidden),
                residual.view(rows, hidden), w.input_norm, eps, w.qkv, w.qkv_bias, cos, sin, k_cache,
                v_cache, start_pos, slot=n % 2,
            )  # fmt: skip
            residual = total.view(batch, seq, hidden)
        else:
            qkv, residual = self._qkv(n, x, residual)
            q = self._rope_kv_store(n, qkv, cos, sin, start_pos)
        a = self.op(n, "attention", "attention", q, k_cache, v_cache, seq_lens, self.scale)
        o = self.op(n, "o_proj", "linear", a.reshape(rows, c.q_size), w.o_proj, None)
        inter = c.intermediate_size
        if self.fused:
            act, total = self.op(
                n, "gate_up_proj", "add_rms_norm_linear_silu_mul", o, residual.view(rows, hidden),
                w.post_norm, eps, w.gate_up, slot=2 + n % 2,
            )  # fmt: skip
            residual = total.view(batch, seq, hidden)
        else:
            h, residual = self.op(
                n, "mlp_norm", "add_rms_norm", o.view(batch, seq, hidden), residual, w.post_norm, eps,
                slot=2 + n % 2,
            )  # fmt: skip
            gate_up = self.op(n, "gate_up_proj", "linear", h.view(rows, hidden), w.gate_up, None)
            act = self.op(n, "silu_mul", "silu_mul", gate_up[:, :inter], gate_up[:, inter:])
        down = self.op(n, "down_proj", "linear", act, w.down, None)
        return down.view(batch, seq, hidden), residual

    def _qkv(self, n: int, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The input norm and the QKV projection: ``(qkv [B * S, (Hq + 2 Hkv) * D], residual)``."""
        c, w = self.config, self.weights.layers[n]
        batch, seq, hidden = x.shape
        rows, eps = batch * seq, c.rms_norm_eps
        if self.fused:
            qkv, total = self.op(
                n, "qkv_proj", "add_rms_norm_linear", x.view(rows, hidden), residual.view(rows, hidden),
                w.input_norm, eps, w.qkv, w.qkv_bias, slot=n % 2,
            )  # fmt: skip
            return qkv, total.view(batch, seq, hidden)
        h, residual = self.op(n, "attn_norm", "add_rms_norm", x, residual, w.input_norm, eps, slot=n % 2)
        return self.op(n, "qkv_proj", "linear", h.view(rows, hidden), w.qkv, w.qkv_bias), residual

    def _rope_kv_store(
        self, n: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start_pos: torch.Tensor
    ) -> torch.Tensor:
        """qk-norm (qwen3), RoPE and the cache write on the QKV output; returns the rotated q."""
        c, w = self.config, self.weights.layers[n]
        batch, seq = cos.shape[:2]
        eps = c.rms_norm_eps
        heads = qkv.view(batch, seq, c.num_heads + 2 * c.num_kv_heads, c.head_dim)
        q = heads[:, :, : c.num_heads]
        k = heads[:, :, c.num_heads : c.num_heads + c.num_kv_heads]
        v = heads[:, :, c.num_heads + c.num_kv_heads :]
        k_cache, v_cache = self.k_cache[n], self.v_cache[n]
        if self.fused:
            # qk-norm only: without it the QKV gemv's epilogue does RoPE and the cache write
            return self.op(
                n, "rope_kv_store", "rope_kv_store", q, k, v, cos, sin, k_cache, v_cache, start_pos,
                w.q_norm, w.k_norm, eps,
            )  # fmt: skip
        if c.qk_norm:
            q = self.op(n, "q_norm", "rms_norm", q, w.q_norm, eps)
            k = self.op(n, "k_norm", "rms_norm", k, w.k_norm, eps)
        q = self.op(n, "q_rope", "apply_rope", q, cos, sin)
        k = self.op(n, "k_rope", "apply_rope", k, cos, sin)
        self.op(n, "kv_store", "kv_cache_store", k_cache, v_cache, k, v, start_pos)
        return q

    def forward(
        self,
        ids: torch.Tensor,
        start_pos: torch.Tensor,
        all_logits: bool = False,
        layer_hook: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Run ``ids[B, S]`` whose first token sits at ``start_pos[b]`` (device int32 ``[B]``).

        Writes the new keys and values into the cache; returns the logits in the model dtype,
        ``[B, V]`` for the last token (or ``[B, S, V]`` with ``all_logits``).
        ``layer_hook(n, x, residual)`` sees each layer's output pair. B is the cache's batch.
        The values of ``start_pos`` are not checked (a host sync, and this is the captured step):
        ``start_pos[b] + S`` past the cache gives finite, wrong logits. ``generate`` and
        ``DecodeRunner.step`` check them where they are host ints.
        """
        c, w = self.config, self.weights
        self._check_forward_args(ids, start_pos)
        batch, seq = ids.shape
        self._shape = (batch, seq)
        x = self.op(MODEL_LAYER, "embedding", "embedding", ids, w.embed)
        positions, seq_lens = self.positions_and_lengths(start_pos, seq)
        cos, sin = self.op(MODEL_LAYER, "rope", "rope_cos_sin", positions, c.head_dim, c.rope_theta)
        # layer 0 adds nothing to the embedding: a zero residual, so every layer is the same
        zeros = functools.partial(torch.zeros_like, x)
        residual = self._const(("zeros", tuple(x.shape)), zeros) if self.static else zeros()
        for n in range(c.num_layers):
            x, residual = self.layer(n, x, residual, cos, sin, start_pos, seq_lens)
            if layer_hook is not None:
                layer_hook(n, x, residual)
        return self.head(x, residual, all_logits)

    def _check_forward_args(self, ids: torch.Tensor, start_pos: torch.Tensor) -> None:
        """Shapes, dtypes and devices only: both models refuse what the kernels would."""
        device = self.weights.embed.device
        for name, t in (("ids", ids), ("start_pos", start_pos)):
            if not isinstance(t, torch.Tensor) or t.device != device:
                where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name}: expected a tensor on the model's device {device}, got {where}")
        if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64) or ids.shape[1] == 0:
            raise ValueError(
                f"ids: expected int32 or int64 [B, S] with S >= 1, got {ids.dtype} {tuple(ids.shape)}"
            )
        if ids.shape[0] != self.max_batch:
            raise ValueError(
                f"ids: batch {ids.shape[0]} differs from the KV cache's batch {self.max_batch} "
                "(build the model with max_batch equal to the batch it runs)"
            )
        if start_pos.dtype != torch.int32 or tuple(start_pos.shape) != (self.max_batch,):
            raise ValueError(
                f"start_pos: expected int32 [{self.max_batch}] (a position per row), "
                f"got {start_pos.dtype} {tuple(start_pos.shape)}"
            )

    def head(self, x: torch.Tensor, residual: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """The final norm of the last layer's ``(x, residual)`` and the lm_head (see ``forward``)."""
        c, w = self.config, self.weights
        batch, seq, _ = x.shape
        h, _ = self.op(
            MODEL_LAYER, "final_norm", "add_rms_norm", x, residual, w.final_norm, c.rms_norm_eps, slot=4
        )
        rows = h.view(batch * seq, c.hidden_size) if all_logits else h[:, -1]
        logits = self.op(MODEL_LAYER, "lm_head", "linear", rows, w.lm_head, None)
        return logits.view(batch, seq, c.vocab_size) if all_logits else logits
