"""CUDA Graph decode: one decode step captured once, replayed at every position.

The rules (seed article): warm every kernel up before capture (no compilation inside it);
every buffer exists before capture (KV cache, activations, split-K partials, attention
scratch, logits, next token); the token and the position are device tensors written before
each replay; greedy argmax runs inside the graph; no allocation, host sync, data-dependent
Python branch or autotuning inside the captured step. On CPU the same runner executes the
step uncaptured on the same static buffers, so CI exercises the buffer discipline.
"""

from __future__ import annotations

import torch

from model.decoder import MODEL_LAYER, Decoder


class DecodeRunner:
    """Steps of ``model`` for a fixed batch size and token count, through static buffers (and a
    CUDA Graph on CUDA). ``new_tokens=1`` is decode; a prompt length captures a prefill bucket."""

    def __init__(
        self, model: Decoder, batch: int, use_graph: bool | None = None, new_tokens: int = 1
    ) -> None:
        if batch != model.max_batch:  # the decoder runs the whole cache batch
            raise ValueError(f"batch: {batch} differs from the model's cache batch {model.max_batch}")
        if (
            isinstance(new_tokens, bool)
            or not isinstance(new_tokens, int)
            or not 0 < new_tokens <= model.max_seq
        ):
            raise ValueError(f"new_tokens: {new_tokens} must be in 1..{model.max_seq} (the cache capacity)")
        self.model, self.batch, self.new_tokens = model, batch, new_tokens
        device = model.weights.embed.device
        self.use_graph = device.type == "cuda" if use_graph is None else use_graph
        self.ids = torch.zeros(batch, new_tokens, dtype=torch.int64, device=device)
        self.start_pos = torch.zeros(batch, dtype=torch.int32, device=device)
        self.logits: torch.Tensor | None = None
        self.next_token: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None

    def _step(self) -> None:
        """The captured step: forward ``new_tokens`` per row, then greedy argmax, all into static buffers."""
        model = self.model
        model.static = True
        try:
            self.logits = model.forward(self.ids, self.start_pos)
            self.next_token = model.op(MODEL_LAYER, "argmax", "argmax", self.logits)
        finally:
            model.static = False

    def prepare(self) -> None:
        """Warm up (compile every kernel, allocate every buffer), then capture on CUDA.

        Warm-up runs the step on the current ``ids``/``start_pos``: it writes that KV cache row.
        """
        if self.next_token is not None:
            return
        if not self.use_graph:
            self._step()
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # the first call allocates the static buffers, the second reuses them
                self._step()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._step()

    def _check_position(self, position: int) -> None:
        """The kernels keep an out-of-cache position safe, not right (they drop the rows they
        cannot write): the step would return finite, wrong logits, silently."""
        last = self.model.max_seq - self.new_tokens
        if not 0 <= position <= last:
            raise ValueError(
                f"position: {position} with {self.new_tokens} new tokens does not fit the KV cache "
                f"capacity {self.model.max_seq}; expected 0..{last}"
            )

    def step(self, tokens: torch.Tensor, position: int | torch.Tensor) -> torch.Tensor:
        """Feed ``tokens`` (``[B]`` or ``[B, new_tokens]``) from ``position`` (one int, or per row);
        return the static next-token buffer. The step's last-token logits stay readable in
        ``self.logits`` until the next step. A host-int position is checked against the cache;
        a tensor one is not (reading it back would be a host sync).
        """
        want = self.batch * self.new_tokens
        if (
            not isinstance(tokens, torch.Tensor)
            or tokens.dtype not in (torch.int32, torch.int64)
            or tokens.numel() != want
        ):
            got = (
                f"{tokens.dtype} {tuple(tokens.shape)}"
                if isinstance(tokens, torch.Tensor)
                else type(tokens).__name__
            )
            raise ValueError(
                f"tokens: expected {want} int32 or int64 token ids ([B] or [B, new_tokens]), got {got}"
            )
        self.ids.copy_(tokens.view(self.batch, self.new_tokens))
        if isinstance(position, torch.Tensor):
            self.start_pos.copy_(position)
        else:
            self._check_position(position)
            self.start_pos.fill_(position)
        # Warm-up runs this very step (same token, same cache row), so it is harmless to repeat.
        self.prepare()
        if self.graph is not None:
            self.graph.replay()
        else:
            self._step()
        return self.next_token
