"""Cases for ``embedding``: ids as a column slice of a longer token buffer, ids at the table's edges."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from verify.cases import AWKWARD, MODEL_DIMS, Case, choice, dtype_of, generator, size, strided_view
from verify.limits import Limits
from verify.strategies.common import INDEX_DTYPES, Invalid, common, labels_for, padding, replace

# token ids anywhere, at the table's first and last rows, all one, and some outside the table
# (-1, V, and the dtype's extremes: the contract gives those a NaN row, never another row)
IDS = ("random", "edges", "repeated", "outside")


def embedding_params(limits: Limits) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries(
        {
            "b": size(limits.batch, AWKWARD),
            "s": size(limits.seq, AWKWARD),
            "vocab": size(limits.vocab, AWKWARD + MODEL_DIMS),
            # 1025: one column past a program's 1024 (ops/embedding.py's BLOCK_H)
            "hidden": size(limits.width, AWKWARD + MODEL_DIMS[:-1] + (1025,)),
            "ids": st.sampled_from(IDS),
            "id_dtype": st.sampled_from(INDEX_DTYPES),
            "offset": st.integers(0, 5),  # ids start this many columns into a longer buffer
            "id_step": st.sampled_from([1, 2]),  # 2: every other column (ids' last-dim stride 2)
            "table_pad": padding(),  # table rows inside wider rows (row stride H + pad)
            **common(dists=("normal", "large", "tiny", "constant_rows")),
        }
    )


def embedding_build(params: dict, device: torch.device) -> Case:
    gen = generator(params, device)
    b, s, vocab, offset = params["b"], params["s"], params["vocab"], params["offset"]
    ids_kind, id_dtype = choice(params, "ids", IDS), choice(params, "id_dtype", INDEX_DTYPES)
    table_pad = params.get("table_pad", 0)
    table = strided_view((vocab, params["hidden"]), dtype_of(params), params["dist"], gen, device, table_pad)
    step = choice(params, "id_step", (1, 2), 1)
    buffer = torch.randint(0, vocab, (b, step * s + offset + 3), generator=gen, device=device)
    if ids_kind == "edges":  # the first and last rows of the table
        buffer = torch.where(buffer % 2 == 0, 0, vocab - 1)
    elif ids_kind == "repeated":
        buffer = buffer[:, :1].expand_as(buffer).contiguous()
    elif ids_kind == "outside":
        info = torch.iinfo(getattr(torch, id_dtype))
        bad = torch.tensor([-1, vocab, info.max, info.min], device=device)
        buffer = torch.where(buffer % 3 == 0, bad[buffer % 4], buffer)
        buffer[:, offset] = bad[buffer[:, offset + 1] % 4]  # at least one in every row
    ids = buffer.to(getattr(torch, id_dtype))[:, offset : offset + step * s : step]
    labels = labels_for(params, S=s, H=params["hidden"], V=vocab)
    labels += [f"ids {params['ids']}", f"ids {params['id_dtype']}"]
    if offset or b > 1 or step > 1 or table_pad:
        labels.append("non-contiguous")
    return Case(params, (ids, table), labels=tuple(labels))


def _example(name: str, b: int, s: int, vocab: int, hidden: int, **extra: object) -> dict:
    return {
        "name": name,
        "b": b,
        "s": s,
        "vocab": vocab,
        "hidden": hidden,
        "ids": "random",
        "id_dtype": "int64",
        "offset": 1,
        "dtype": "bfloat16",
        "dist": "normal",
        "seed": 0,
        **extra,
    }


EMBEDDING_EXAMPLES = (
    _example("typical: 2 x 5 ids into 100 x 33", 2, 5, 100, 33, gpu=False),
    _example(
        "every other id of the buffer, table rows padded", 2, 3, 40, 17, id_step=2, table_pad=3, gpu=False
    ),
    _example("a row past one 1024-column program", 1, 2, 10, 1100, gpu=False),
    _example("article decode token", 1, 1, 151936, 1024, ids="edges"),
    _example("article prefill 256 tokens", 1, 256, 151936, 1024),
    _example("qwen2.5 batch 4 prefill", 4, 33, 151936, 896, id_dtype="int32"),
)
EMBEDDING_INVALID = (
    Invalid("1-d ids", "ids", replace("ids", lambda i: i[0])),
    Invalid("3-d table", "table", replace("table", lambda t: t[None])),
)
