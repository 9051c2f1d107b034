"""Cases for ``argmax``: vocabularies up to 151936, ties, NaN, all -inf or all negative rows, strided rows."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from verify.cases import AWKWARD, MODEL_DIMS, Case, choice, dtype_of, generator, size, values
from verify.limits import Limits
from verify.strategies.common import Invalid, common, labels_for, padding, replace

PATTERNS = ("random", "ties", "nan", "neg_inf", "negative", "constant", "nan_last", "max_last")


def argmax_params(limits: Limits) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries(
        {
            "b": size(limits.batch, AWKWARD),
            "vocab": size(limits.vocab, AWKWARD + MODEL_DIMS),
            "pattern": st.sampled_from(PATTERNS),
            "pad": padding(),
            **common(dists=("normal", "large", "tiny")),
        }
    )


def argmax_build(params: dict, device: torch.device) -> Case:
    gen = generator(params, device)
    b, vocab, pattern = params["b"], params["vocab"], choice(params, "pattern", PATTERNS)
    logits = values((b, vocab + params["pad"]), torch.float32, params["dist"], gen, device)
    where = torch.randint(0, vocab, (b, 3), generator=gen, device=device)
    rows = torch.arange(b, device=device)[:, None].expand(b, 3)
    if pattern == "ties":  # the maximum at three places: the lowest index must win
        logits[rows, where] = logits.max() + 1
    elif pattern == "nan":  # NaN counts as the maximum, the first NaN wins
        logits[rows, where] = float("nan")
    elif pattern == "neg_inf":
        logits[:, :] = float("-inf")
    elif pattern == "negative":  # every logit below 0: a masked lane read as 0 would win
        logits = logits - logits.max() - 1
    elif pattern == "constant":
        logits[:, :] = 1.5
    elif pattern == "nan_last":  # the only NaN at the row's last index
        logits[:, vocab - 1] = float("nan")
    elif pattern == "max_last":  # the maximum at the last index: in a chunked scan, the tail chunk's
        logits[:, vocab - 1] = logits.max() + 1
    logits = logits.to(dtype_of(params))[:, :vocab]
    labels = [*labels_for(params, V=vocab, B=b), f"pattern {pattern}"]
    if params["pad"]:
        labels.append("non-contiguous")
    return Case(params, (logits,), labels=tuple(labels))


def _example(name: str, b: int, vocab: int, pattern: str, **extra: object) -> dict:
    return {
        "name": name,
        "b": b,
        "vocab": vocab,
        "pattern": pattern,
        "pad": 0,
        "dtype": "bfloat16",
        "dist": "normal",
        "seed": 0,
        **extra,
    }


ARGMAX_EXAMPLES = (
    _example("typical: 3 rows of 129 with ties", 3, 129, "ties", gpu=False),
    _example("NaN in short rows", 2, 77, "nan", gpu=False),
    _example("the only NaN at the last index", 2, 300, "nan_last", gpu=False),  # 20 draws may miss both
    # the maximum in a last, partial chunk: 4100 = 2 x 2048 + 4 on the GPU, 16 x 256 + 4 on CPU
    _example("the maximum at the last index, in a 4-wide tail chunk", 1, 4100, "max_last", gpu=False),
    _example("article logits, the maximum in the last chunk", 1, 151936, "max_last", gpu=False),
    _example("article decode logits", 1, 151936, "random", gpu=False),
    # 600 = 2 x 256 + 88 on CPU: masked lanes of the tail chunk must lose to every real logit
    _example("all -inf rows, a tail chunk", 2, 600, "neg_inf", gpu=False),
    _example("all logits negative, a tail chunk", 2, 600, "negative", gpu=False),
    _example("batch 4 with ties at 151936", 4, 151936, "ties", dtype="float32"),
    _example("NaN in the logits", 2, 151936, "nan"),
)
ARGMAX_INVALID = (
    Invalid("1-d logits", "logits", replace("logits", lambda x: x[0])),
    Invalid("empty vocabulary", "logits", replace("logits", lambda x: x[:, :0])),
)
