"""Greedy generation: prefill the prompt, then decode one token at a time until EOS or the limit."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from model.config import token_ids_in_vocab
from model.decoder import Decoder
from model.graph import DecodeRunner


def cache_rows_needed(prompt_len: int, max_new_tokens: int) -> int:
    """KV cache rows a generation writes: the prompt's, then every new token's but the last,
    which is returned and never fed back."""
    return prompt_len + max(max_new_tokens - 1, 0)


def check_prompt(
    ids: torch.Tensor, model: Decoder, max_new_tokens: int, eos_token_ids: Sequence[int] = ()
) -> None:
    """Refuse requests the model cannot run, before any kernel sees them."""
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"prompt ids: expected a torch.Tensor [batch, tokens], got {type(ids).__name__}")
    if ids.dim() != 2:
        raise ValueError(f"prompt ids: expected [batch, tokens], got shape {tuple(ids.shape)}")
    batch, length = ids.shape
    if length == 0 or batch == 0:
        raise ValueError("prompt ids: the prompt is empty")
    if batch != model.max_batch:
        raise ValueError(f"prompt ids: batch {batch} differs from the model's cache batch {model.max_batch}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"prompt ids: expected an integer tensor, got {ids.dtype}")
    vocab = model.config.vocab_size
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab:
        bad = low if low < 0 else high
        raise ValueError(f"prompt ids: token id {bad} is outside the vocabulary [0, {vocab})")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens: expected an int >= 0, got {max_new_tokens!r}")
    if isinstance(eos_token_ids, (str, bytes)) or not isinstance(eos_token_ids, Sequence):
        raise ValueError(f"eos_token_ids: expected a sequence of token ids, got {eos_token_ids!r}")
    if not token_ids_in_vocab(eos_token_ids, vocab):
        raise ValueError(f"eos_token_ids: expected token ids in [0, {vocab}), got {list(eos_token_ids)!r}")
    rows = cache_rows_needed(length, max_new_tokens)
    request = f"a prompt of {length} tokens + {max_new_tokens} new tokens needs {rows} positions"
    limit = model.config.max_position_embeddings
    if rows > limit:
        raise ValueError(
            f"{request}: more than the model's max_position_embeddings {limit} (the positions its "
            "config declares)"
        )
    if rows > model.max_seq:
        raise ValueError(f"{request}: more than the KV cache capacity {model.max_seq}")


def prefill(model: Decoder, ids: torch.Tensor) -> torch.Tensor:
    """Run the whole prompt from position 0; return the last token's logits ``[B, V]``."""
    start = torch.zeros(ids.shape[0], dtype=torch.int32, device=ids.device)
    return model.forward(ids, start)


def generate(
    model: Decoder,
    ids: torch.Tensor,
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
    runner: DecodeRunner | None = None,
) -> torch.Tensor:
    """Greedy tokens ``[B, n]`` (n <= max_new_tokens; rows that hit EOS early are padded with EOS).

    ``runner``: a ``DecodeRunner`` over ``model`` (CUDA Graph decode); without one, decode steps
    run eagerly, as the reference model does.
    """
    if runner is not None and runner.model is not model:  # it would decode over another cache
        raise ValueError("runner: a DecodeRunner over another model; build it over this one")
    if runner is not None and runner.new_tokens != 1:  # a prefill runner: one token a step is decode's
        raise ValueError(f"runner: a DecodeRunner of {runner.new_tokens} tokens a step; decode takes one")
    check_prompt(ids, model, max_new_tokens, eos_token_ids)
    ids = ids.to(model.weights.embed.device)
    batch, length = ids.shape
    tokens = torch.empty(batch, max_new_tokens, dtype=torch.int64, device=ids.device)
    if max_new_tokens == 0:
        return tokens
    argmax = model.impls["argmax"]
    token = argmax(prefill(model, ids))
    eos = torch.tensor(list(eos_token_ids), device=ids.device) if eos_token_ids else None
    finished = torch.zeros(batch, dtype=torch.bool, device=ids.device)
    for step in range(max_new_tokens):
        tokens[:, step] = torch.where(finished, tokens[:, step - 1], token) if step else token
        if eos is not None:
            finished |= torch.isin(tokens[:, step], eos)
            if bool(finished.all()):  # the one host sync per step, only when EOS can stop us
                return tokens[:, : step + 1]
        if step + 1 == max_new_tokens:
            break
        position = length + step
        if runner is not None:
            token = runner.step(tokens[:, step], position)
        else:
            start = torch.full((batch,), position, dtype=torch.int32, device=ids.device)
            token = argmax(model.forward(tokens[:, step : step + 1], start))
    return tokens
