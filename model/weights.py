"""Load a decoder's weights from HF safetensors, tensor by tensor, into the layout the kernels use.

q/k/v projections are fused into one ``[q + 2 kv, H]`` matrix and gate/up into one
``[2 I, H]`` matrix at load time (one GEMM each instead of three and two). Each fused matrix
is allocated once on the target device and filled slice by slice, so no step holds two
copies of the model. Every tensor name, shape and dtype is checked against the config, the
shapes from the file headers before anything is allocated, and every value is checked finite in
the dtype the model computes in (a float32 value can be finite and overflow bfloat16).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from model.config import ModelConfig, not_a_file

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
STORED_DTYPES = ("BF16", "F16", "F32")  # safetensors' names for bfloat16, float16, float32
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry


class WeightsError(ValueError):
    """A checkpoint that does not match its config: names the tensor and the file."""


@dataclass
class LayerWeights:
    """One layer's tensors, q/k/v and gate/up already fused into one matrix each (one gemv)."""

    input_norm: torch.Tensor
    qkv: torch.Tensor  # [q + 2 kv, H]: q rows, then k, then v
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # [D], qwen3
    k_norm: torch.Tensor | None
    o_proj: torch.Tensor  # [H, q]
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 I, H]: gate rows, then up
    down: torch.Tensor  # [H, I]


@dataclass
class Weights:
    """The whole model on one device, shared by the reference and the Triton decoder."""

    config: ModelConfig
    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor  # [V, H]; the embedding itself when tied
    dtype: torch.dtype = torch.bfloat16


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the config implies, with its shape."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (config.q_size, h),
            p + "self_attn.k_proj.weight": (config.kv_size, h),
            p + "self_attn.v_proj.weight": (config.kv_size, h),
            p + "self_attn.o_proj.weight": (h, config.q_size),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
        if config.qkv_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (config.q_size,),
                p + "self_attn.k_proj.bias": (config.kv_size,),
                p + "self_attn.v_proj.bias": (config.kv_size,),
            }
        if config.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    return shapes


def _weight_map(directory: Path) -> dict[str, Path]:
    """Tensor name -> file, from the shard index or the single file's header."""
    index = directory / INDEX_FILE
    single = directory / SINGLE_FILE
    if index.is_file() and single.is_file():  # transformers would read the single file: ambiguous
        raise WeightsError(
            f"{directory}: both {SINGLE_FILE} and {INDEX_FILE}; keep the one that is the checkpoint"
        )
    if index.is_file():
        try:
            mapping = json.loads(index.read_text())["weight_map"]
        except OSError as exc:
            raise WeightsError(f"{index}: cannot read it ({exc.strerror or exc})") from None
        except (ValueError, RecursionError, KeyError, TypeError) as exc:  # ValueError: bad JSON, bad UTF-8
            raise WeightsError(
                f"{index}: not a valid safetensors index ({type(exc).__name__}: {exc})"
            ) from None
        if not isinstance(mapping, dict) or not all(isinstance(f, str) for f in mapping.values()):
            raise WeightsError(f"{index}: weight_map must map tensor names to shard file names")
        files = {name: directory / file for name, file in mapping.items()}
        for file in set(files.values()):
            if file.parent != directory:
                raise WeightsError(f"{index}: shard {file} is not a file of the checkpoint directory")
            if not file.is_file():
                raise WeightsError(f"{index}: names shard {file.name}, which does not exist")
        _check_shards_match(files)
        return files
    problem = not_a_file(directory / INDEX_FILE) or not_a_file(single)
    if problem:
        raise WeightsError(problem)
    if not single.is_file():
        raise WeightsError(f"{directory}: no {SINGLE_FILE} or {INDEX_FILE}{_other_layout(directory)}")
    with _open(single) as f:
        return dict.fromkeys(f.keys(), single)


def _other_layout(directory: Path) -> str:
    """What a directory without this loader's files holds instead, said in its error."""
    if not directory.is_dir():
        return ""
    if any(directory.glob("pytorch_model*.bin")) or (directory / "pytorch_model.bin.index.json").is_file():
        return (
            " (it holds pytorch_model .bin weights: only safetensors checkpoints are read; "
            "re-save it with save_pretrained(safe_serialization=True))"
        )
    shards = sorted(f.name for f in directory.glob("*.safetensors"))
    if shards:
        return f" (it holds {len(shards)} other .safetensors files, e.g. {shards[0]}, but no shard index)"
    return ""


def _check_shards_match(files: dict[str, Path]) -> None:
    """Every tensor a shard holds is one the index maps to that shard: a tensor the index leaves
    out, or a second copy in another shard, would otherwise go unread and unnoticed."""
    for file in sorted(set(files.values())):
        with _open(file) as f:
            held = f.keys()
        stray = sorted(n for n in held if files.get(n) != file and not n.endswith(IGNORED_SUFFIXES))
        if stray:
            elsewhere = files.get(stray[0])
            where = f"maps it to {elsewhere.name}" if elsewhere else "does not list it"
            more = f", and {len(stray) - 1} more" if len(stray) > 1 else ""
            raise WeightsError(
                f"{file}: holds a tensor the shard index does not map here: {stray[0]} "
                f"(the index {where}){more}"
            )


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise WeightsError(f"{file}: cannot read safetensors (truncated or corrupt?): {exc}") from None


def _by_file(files: dict[str, Path], names: list[str]) -> dict[Path, list[str]]:
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    return by_file


def _check_headers(files: dict[str, Path], shapes: dict[str, tuple[int, ...]]) -> None:
    """Every tensor's stored shape against the config's, and its dtype, read from the safetensors
    headers (no data), before anything of the config's size is allocated: a config far larger
    than its checkpoint is a named error, not an out-of-memory crash."""
    for file, names in _by_file(files, sorted(shapes)).items():
        with _open(file) as f:
            held = set(f.keys())
            for name in names:
                if name not in held:  # a shard index that maps the tensor to the wrong file
                    raise WeightsError(f"{file}: holds no tensor {name}, though the shard index maps it here")
                header = f.get_slice(name)
                stored = tuple(header.get_shape())
                if stored != shapes[name]:
                    raise WeightsError(
                        f"{file}: tensor {name} has shape {stored}, the config implies {shapes[name]}"
                    )
                if header.get_dtype() not in STORED_DTYPES:
                    raise WeightsError(
                        f"{file}: tensor {name} has dtype {header.get_dtype()}, expected one of "
                        f"{', '.join(STORED_DTYPES)} (bfloat16, float16 or float32)"
                    )


def _tensors(files: dict[str, Path], names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the named tensors one at a time, opening each shard once."""
    for file, file_names in _by_file(files, names).items():
        with _open(file) as f:
            for name in file_names:
                try:
                    yield name, f.get_tensor(name)
                except (SafetensorError, OSError, ValueError) as exc:
                    raise WeightsError(
                        f"{file}: cannot read tensor {name} (truncated or corrupt?): {exc}"
                    ) from None


def _allocate(
    config: ModelConfig,
    dtype: torch.dtype,
    matrix: Callable[..., torch.Tensor],
    norm: Callable[[int], torch.Tensor],
) -> Weights:
    """Every tensor of the model, made by ``matrix(*shape)`` (projections, biases, embedding) and
    ``norm(n)`` (norm weights), with q/k/v and gate/up fused."""
    c = config
    layers = [
        LayerWeights(
            input_norm=norm(c.hidden_size),
            qkv=matrix(c.qkv_size, c.hidden_size),
            qkv_bias=matrix(c.qkv_size) if c.qkv_bias else None,
            q_norm=norm(c.head_dim) if c.qk_norm else None,
            k_norm=norm(c.head_dim) if c.qk_norm else None,
            o_proj=matrix(c.hidden_size, c.q_size),
            post_norm=norm(c.hidden_size),
            gate_up=matrix(2 * c.intermediate_size, c.hidden_size),
            down=matrix(c.hidden_size, c.intermediate_size),
        )
        for _ in range(c.num_layers)
    ]
    embed = matrix(c.vocab_size, c.hidden_size)
    lm_head = embed if c.tie_word_embeddings else matrix(c.vocab_size, c.hidden_size)
    return Weights(c, embed, layers, norm(c.hidden_size), lm_head, dtype)


def _not_finite(file: Path, name: str, stored: torch.Tensor, dtype: torch.dtype) -> str:
    """Why a tensor is not finite once converted to ``dtype``: NaN or inf stored, or finite values
    past ``dtype``'s range (worked out on the error path only)."""
    if not bool(torch.isfinite(stored).all()):
        return f"{file}: tensor {name} holds NaN or inf values"
    over = ~torch.isfinite(stored.to(dtype))
    largest = stored[over].abs().max().item()
    kind = str(dtype).removeprefix("torch.")
    count = int(over.sum())
    values = "1 value overflows" if count == 1 else f"{count} values overflow"
    return (
        f"{file}: tensor {name}: {values} {kind} (largest {largest:.3g}; "
        f"{kind}'s max is {torch.finfo(dtype).max:.3g}), the dtype the model computes in"
    )


def _check_layer_count(directory: Path, layers: int, names: set[str]) -> None:
    """The checkpoint holds a tensor of each of layers 0..N-1 and of no other, N the config's
    (checked before the config's per-layer names are listed, which for a num_hidden_layers of
    10**12 never ends)."""
    parts = (n.removeprefix("model.").split(".") for n in names)  # a base model's names lack "model."
    held = {
        int(p[1]) for p in parts if len(p) > 2 and p[0] == "layers" and p[1].isascii() and p[1].isdecimal()
    }
    if held == set(range(len(held))):  # 0..N-1
        if len(held) != layers:
            what = (
                f"the tensors of {len(held)} layers (0 to {len(held) - 1})" if held else "no layer's tensors"
            )
            raise WeightsError(
                f"{directory}: config.json's num_hidden_layers is {layers}, but the checkpoint holds {what}"
            )
        return
    beyond = min((i for i in held if i >= layers), default=None)
    if beyond is not None:
        raise WeightsError(
            f"{directory}: the checkpoint holds tensors of layer {beyond}, but config.json's "
            f"num_hidden_layers is {layers}"
        )
    gap = next(i for i in range(layers) if i not in held)  # below max(held): the loop is short
    raise WeightsError(
        f"{directory}: the checkpoint holds no tensor of layer {gap}, but tensors of layer {max(held)}"
    )


def load(
    directory: str | Path,
    config: ModelConfig,
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
) -> Weights:
    """Read and check every tensor of a checkpoint directory, fusing q/k/v and gate/up on ``device``."""
    _check_dtype(dtype)
    directory = Path(directory)
    files = _weight_map(directory)
    present = {n for n in files if not n.endswith(IGNORED_SUFFIXES)}
    _check_layer_count(directory, config.num_layers, present)
    shapes = expected_shapes(config)
    embed_name, head_name = "model.embed_tokens.weight", "lm_head.weight"
    # the config's name -> the name it is stored under: a tied checkpoint may hold its one matrix
    # as the head alone, which HF ties to the embedding the same way
    alias = {}
    if config.tie_word_embeddings and head_name in present and embed_name not in present:
        alias = {embed_name: head_name}
        present = (present - {head_name}) | {embed_name}
    stored_head = config.tie_word_embeddings and head_name in present
    if stored_head:  # some tied checkpoints store the copy anyway: checked against the embedding below
        present.discard("lm_head.weight")
    missing = sorted(set(shapes) - present)
    unexpected = sorted(present - set(shapes))
    if missing:
        bare = all(n.removeprefix("model.") in present for n in missing if n.startswith("model."))
        hint = (
            " (its names lack the 'model.' prefix: a base-model checkpoint, saved without the LM "
            "head class; re-save it from the ...ForCausalLM class)"
            if bare and any(n.startswith("model.") for n in missing)
            else ""
        )
        listed = set(files.values())
        unlisted = sorted(f.name for f in directory.glob("*.safetensors") if f not in listed)
        if unlisted and not hint and (directory / INDEX_FILE).is_file():  # a shard the index forgot
            hint = f" (the shard index does not name {', '.join(unlisted)}, which is in the directory)"
        raise WeightsError(f"{directory}: missing {len(missing)} tensors, e.g. {missing[:3]}{hint}")
    if unexpected:
        where = files[unexpected[0]].name
        raise WeightsError(
            f"{directory}: {len(unexpected)} unexpected tensors, e.g. {unexpected[:3]} in {where}"
        )
    head_shape = {"lm_head.weight": (config.vocab_size, config.hidden_size)} if stored_head else {}
    _check_headers(files, {alias.get(n, n): s for n, s in shapes.items()} | head_shape)

    c = config
    dev = torch.device(device)

    def empty(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=dev)

    weights = _allocate(c, dtype, empty, empty)
    layers, embed, final_norm, lm_head = weights.layers, weights.embed, weights.final_norm, weights.lm_head
    q, kv, inter = c.q_size, c.kv_size, c.intermediate_size
    slices = {
        "input_layernorm.weight": ("input_norm", slice(None)),
        "post_attention_layernorm.weight": ("post_norm", slice(None)),
        "self_attn.q_proj.weight": ("qkv", slice(0, q)),
        "self_attn.k_proj.weight": ("qkv", slice(q, q + kv)),
        "self_attn.v_proj.weight": ("qkv", slice(q + kv, q + 2 * kv)),
        "self_attn.q_proj.bias": ("qkv_bias", slice(0, q)),
        "self_attn.k_proj.bias": ("qkv_bias", slice(q, q + kv)),
        "self_attn.v_proj.bias": ("qkv_bias", slice(q + kv, q + 2 * kv)),
        "self_attn.o_proj.weight": ("o_proj", slice(None)),
        "self_attn.q_norm.weight": ("q_norm", slice(None)),
        "self_attn.k_norm.weight": ("k_norm", slice(None)),
        "mlp.gate_proj.weight": ("gate_up", slice(0, inter)),
        "mlp.up_proj.weight": ("gate_up", slice(inter, 2 * inter)),
        "mlp.down_proj.weight": ("down", slice(None)),
    }
    for name, tensor in _tensors(files, sorted(alias.get(n, n) for n in shapes)):
        if name == embed_name or name in alias.values():
            target = embed
        elif name == "model.norm.weight":
            target = final_norm
        elif name == "lm_head.weight":
            target = lm_head
        else:
            _, index, rest = name.split(".", 3)[1:]
            field_name, rows = slices[rest]
            target = getattr(layers[int(index)], field_name)[rows]
        target.copy_(tensor)
        # checked in the compute dtype, once converted: a finite float32 value past its range (3.4e38
        # in bfloat16, 1e5 in float16) is inf there; one reduction, on the device
        if not bool(torch.isfinite(target).all()):
            raise WeightsError(_not_finite(files[name], name, tensor, dtype))
    if stored_head:
        [(_, head)] = list(_tensors(files, ["lm_head.weight"]))
        if not torch.equal(head.to(dev, dtype), embed):
            raise WeightsError(
                f"{files['lm_head.weight']}: tensor lm_head.weight differs from model.embed_tokens.weight, "
                "but the config ties them (tie_word_embeddings true): which head is meant?"
            )
    return weights


def _check_dtype(dtype: torch.dtype) -> None:
    """The model's weights are one of the float dtypes the kernels take (an int dtype would load,
    truncated, and fail at the first forward)."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dtype: expected torch.bfloat16, torch.float16 or torch.float32, got {dtype}")


def random_weights(
    config: ModelConfig, device: torch.device | str, dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> Weights:
    """Random weights of the real size (benchmarks, GPU e2e of the presets), built on ``device``."""
    _check_dtype(dtype)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    c, dev = config, torch.device(device)

    def normal(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=dev) * std).to(dtype)

    def norm_weight(n: int) -> torch.Tensor:
        return (1 + 0.1 * torch.randn(n, generator=gen, device=dev)).to(dtype)

    return _allocate(c, dtype, normal, norm_weight)


def hf_tensors(weights: Weights) -> dict[str, torch.Tensor]:
    """The weights under their HF names (views of the fused matrices; q/k/v and gate/up split again)."""
    c = weights.config
    q, kv, inter = c.q_size, c.kv_size, c.intermediate_size
    out = {"model.embed_tokens.weight": weights.embed, "model.norm.weight": weights.final_norm}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = weights.lm_head
    for n, layer in enumerate(weights.layers):
        p = f"model.layers.{n}."
        out |= {
            p + "input_layernorm.weight": layer.input_norm,
            p + "post_attention_layernorm.weight": layer.post_norm,
            p + "self_attn.q_proj.weight": layer.qkv[:q],
            p + "self_attn.k_proj.weight": layer.qkv[q : q + kv],
            p + "self_attn.v_proj.weight": layer.qkv[q + kv :],
            p + "self_attn.o_proj.weight": layer.o_proj,
            p + "mlp.gate_proj.weight": layer.gate_up[:inter],
            p + "mlp.up_proj.weight": layer.gate_up[inter:],
            p + "mlp.down_proj.weight": layer.down,
        }
        if layer.qkv_bias is not None:
            out |= {
                p + "self_attn.q_proj.bias": layer.qkv_bias[:q],
                p + "self_attn.k_proj.bias": layer.qkv_bias[q : q + kv],
                p + "self_attn.v_proj.bias": layer.qkv_bias[q + kv :],
            }
        if layer.q_norm is not None:
            out |= {p + "self_attn.q_norm.weight": layer.q_norm, p + "self_attn.k_norm.weight": layer.k_norm}
    return out


def save(weights: Weights, directory: str | Path) -> None:
    """Write an HF-layout checkpoint (config.json + model.safetensors) that ``load`` and HF read."""
    from safetensors.torch import save_file

    from model.config import to_hf_dict

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in hf_tensors(weights).items()}
    save_file(tensors, str(directory / SINGLE_FILE), metadata={"format": "pt"})
    stored = str(weights.embed.dtype).removeprefix("torch.")  # config.json says what the file holds
    config = to_hf_dict(weights.config) | {"dtype": stored}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
