"""``ModelConfig``: the decoder's shape, parsed from an HF ``config.json`` or a named preset.

Supported families: ``llama``, ``qwen2`` (QKV bias) and ``qwen3`` (per-head q/k RMSNorm).
Anything that changes the math and that the kernels do not implement (rope scaling, sliding
window, MLP bias, another activation, a head_dim the attention kernels do not take, quantized
weights) is refused with a message, never ignored.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FAMILIES = ("llama", "qwen2", "qwen3")
# The head sizes the attention kernels take (ops.attention.HEAD_DIMS, kept equal by a test):
# written here so that parsing a config imports no Triton (importing ops picks the backend,
# which fails once something else has imported triton on a CPU machine).
HEAD_DIMS = (16, 32, 64, 128, 256)


class ConfigError(ValueError):
    """A config this project cannot run faithfully."""


def token_ids_in_vocab(ids: Sequence[object], vocab: int) -> bool:
    """Whether every item is an int token id of the vocabulary (a bool is not one)."""
    return all(isinstance(e, int) and not isinstance(e, bool) and 0 <= e < vocab for e in ids)


@dataclass(frozen=True)
class ModelConfig:
    """What the kernels need of a checkpoint's config.json, in the model's own terms; checked on
    construction, so a malformed preset fails as a malformed file does."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    tie_word_embeddings: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 32768
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(f"family {self.family!r} is not one of {FAMILIES}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name}: expected a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_kv_heads})"
            )
        # what from_hf_dict checks of a file, checked of a config built in code too
        if not isinstance(self.max_position_embeddings, int) or self.max_position_embeddings <= 0:
            raise ConfigError(
                f"max_position_embeddings: expected a positive int, got {self.max_position_embeddings!r}"
            )
        if self.head_dim not in HEAD_DIMS:
            raise ConfigError(
                f"head_dim {self.head_dim} is not supported by the attention kernels ({HEAD_DIMS})"
            )
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"{name}: expected a positive finite number, got {value!r}")
        for name in ("tie_word_embeddings", "qkv_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        # the family fixes these (model_type is all a config.json says of them): another pairing
        # would save a checkpoint that HF loads as another model and the loader refuses
        for name, implied in (("qkv_bias", self.family == "qwen2"), ("qk_norm", self.family == "qwen3")):
            if getattr(self, name) != implied:
                raise ConfigError(
                    f"{name}: family {self.family} implies {implied}, got {getattr(self, name)}"
                )
        if not token_ids_in_vocab(self.eos_token_ids, self.vocab_size):
            raise ConfigError(
                f"eos_token_ids: expected token ids in [0, {self.vocab_size}), got {self.eos_token_ids}"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_size(self) -> int:
        return self.q_size + 2 * self.kv_size

    def num_parameters(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        layer = h * self.qkv_size + self.q_size * h + 3 * h * i + 2 * h
        layer += self.qkv_size if self.qkv_bias else 0
        layer += 2 * self.head_dim if self.qk_norm else 0
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * layer + h + head

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


PRESETS: dict[str, ModelConfig] = {
    # The seed article's dense config: Qwen3-0.6B-like widths, no bias, no qk-norm.
    "article": ModelConfig("llama", 151936, 1024, 4864, 28, 8, 2, 128, 1e-6, 1e6, eos_token_ids=(151645,)),
    "qwen3-0.6b": ModelConfig(
        "qwen3",
        151936,
        1024,
        3072,
        28,
        16,
        8,
        128,
        1e-6,
        1e6,
        qk_norm=True,
        max_position_embeddings=40960,
        eos_token_ids=(151645,),
    ),
    "qwen2.5-0.5b": ModelConfig(
        "qwen2",
        151936,
        896,
        4864,
        24,
        14,
        2,
        64,
        1e-6,
        1e6,
        qkv_bias=True,
        eos_token_ids=(151645,),
    ),
}


_MISSING = object()
WEIGHT_DTYPES = ("bfloat16", "float16", "float32")  # what the loader reads; the model computes in bf16
FP32_MIN, FP32_MAX = 2.0**-126, (2 - 2.0**-23) * 2.0**127


def _field(cfg: dict, key: str, kind: str, default: Any = _MISSING) -> Any:
    """``cfg[key]`` checked as ``kind`` ("count": a positive int; "index": an int >= 0; "positive":
    a positive number in fp32's normal range; "bool"); ``default`` when absent or null, and
    without a default the field is required."""
    value = cfg.get(key)
    if value is None:
        if default is _MISSING:
            raise ConfigError(f"missing required field {key!r}")
        return default
    if kind == "bool":
        ok = isinstance(value, bool)
        want = "true or false"
    elif kind in ("count", "index"):
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= (kind == "count")
        want = "a positive integer" if kind == "count" else "an integer >= 0"
    else:  # used in fp32 (eps, the RoPE base): past its range it would be 0 or inf there
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and FP32_MIN <= value <= FP32_MAX
        want = f"a positive number in fp32's normal range ({FP32_MIN:.3g} to {FP32_MAX:.3g})"
    if not ok:
        raise ConfigError(f"{key}: expected {want}, got {value!r}")
    return value


def _rope_parameters(cfg: dict) -> tuple[str, dict]:
    """``(field, dict)``: the RoPE parameters as transformers reads them, where a non-empty
    ``rope_scaling`` (older configs) replaces ``rope_parameters`` (transformers 5)."""
    scaling, rope = cfg.get("rope_scaling"), cfg.get("rope_parameters")
    if scaling and not isinstance(scaling, dict):
        raise ConfigError(f"rope_scaling: expected an object, got {scaling!r}")
    if rope is not None and not isinstance(rope, dict):
        raise ConfigError(f"rope_parameters: expected an object, got {rope!r}")
    key, params = ("rope_scaling", scaling) if scaling else ("rope_parameters", rope or {})
    # transformers 5's per-layer-type form, {"full_attention": {...}, "sliding_attention": {...}}:
    # the kernels apply one RoPE to every layer (and transformers' llama/qwen2/qwen3 cannot run it)
    types = cfg.get("layer_types")
    type_names = {t for t in types if isinstance(t, str)} if isinstance(types, list) else set()
    nested = sorted(
        str(k)
        for k, v in params.items()
        if isinstance(v, dict) or k in type_names or str(k).endswith("_attention")
    )
    if nested:
        raise ConfigError(
            f"{key}: RoPE parameters nested per layer type ({', '.join(nested)}) are not implemented, "
            f"got {params!r}; expected one flat object such as "
            '{"rope_type": "default", "rope_theta": 1000000.0}'
        )
    return key, params


def _rope(cfg: dict) -> tuple[float, float]:
    """``(rope_theta, partial_rotary_factor)``: from the RoPE parameters or the top level (older
    configs); any rope type but "default" (plain RoPE, as transformers computes it) is refused."""
    key, rope = _rope_parameters(cfg)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"{key}: rope scaling {rope!r} is not implemented (only default RoPE)")
    theta = _field(rope, "rope_theta", "positive", _field(cfg, "rope_theta", "positive", 10000.0))
    factor = _field(cfg, "partial_rotary_factor", "positive", 1.0)
    factor = _field(rope, "partial_rotary_factor", "positive", factor)
    return float(theta), float(factor)


def _head_dim(cfg: dict, family: str, hidden: int, heads: int) -> int:
    """``head_dim`` with transformers' default (Qwen3: 128, the others: hidden / heads), refused
    here when the attention kernels do not take it rather than mid-run."""
    derived = family != "qwen3" and cfg.get("head_dim") is None
    head_dim = _field(cfg, "head_dim", "count", 128 if family == "qwen3" else hidden // heads)
    if head_dim not in HEAD_DIMS:
        source = f" (hidden_size {hidden} / num_attention_heads {heads})" if derived else ""
        raise ConfigError(
            f"head_dim {head_dim}{source} is not supported by the attention kernels; "
            f"expected one of {HEAD_DIMS}"
        )
    return head_dim


def _refuse_sliding_layers(cfg: dict, layers: int) -> None:
    """Without ``layer_types``, transformers (qwen2, qwen3) makes layer i sliding-window attention
    when ``use_sliding_window`` is true, ``sliding_window`` is not null (4096 when absent) and
    i >= ``max_window_layers`` (28 when absent); a config where no layer qualifies runs full
    attention everywhere and is taken."""
    if not _field(cfg, "use_sliding_window", "bool", False):
        return
    window = cfg.get("sliding_window", 4096)
    first = _field(cfg, "max_window_layers", "index", 28)
    if window is not None and first < layers:
        raise ConfigError(
            f"use_sliding_window: true, with sliding_window {window} and max_window_layers {first}, "
            f"makes layers {first} to {layers - 1} sliding-window attention, which is not implemented"
        )


def from_hf_dict(cfg: dict, path: str = "config.json") -> ModelConfig:
    """Parse an HF config dict as transformers would (its defaults for absent fields); refuse
    what the kernels would silently get wrong. Errors name the field as config.json does."""
    try:
        return _parse(cfg)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def _parse(cfg: dict) -> ModelConfig:
    family = cfg.get("model_type")
    if family not in FAMILIES:
        raise ConfigError(f"model_type {family!r} is not supported; expected one of {FAMILIES}")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers maps both names to SiLU
        raise ConfigError(f"hidden_act {act!r} is not supported (the MLP kernel is SwiGLU with silu)")
    rope_theta, rotary_factor = _rope(cfg)
    if rotary_factor != 1.0:  # transformers' llama/qwen2/qwen3 rotate the whole head
        raise ConfigError(f"partial_rotary_factor {rotary_factor} is not implemented for {family}")
    layer_types = cfg.get("layer_types") or []
    if not isinstance(layer_types, list):
        raise ConfigError(f"layer_types: expected a list, got {layer_types!r}")
    if any(t != "full_attention" for t in layer_types):
        raise ConfigError(f"layer_types {sorted(set(map(str, layer_types)))} include non-full attention")
    if _field(cfg, "mlp_bias", "bool", False):
        raise ConfigError("mlp_bias is not implemented")
    if family != "qwen2" and _field(cfg, "attention_bias", "bool", False):  # llama/qwen3: on o_proj too
        raise ConfigError(f"attention_bias (q/k/v/o projection bias) is not implemented for {family}")
    for key in ("dtype", "torch_dtype"):  # transformers 5's name, and 4's
        if cfg.get(key) not in (None, *WEIGHT_DTYPES, "auto"):
            raise ConfigError(f"{key}: expected one of {', '.join(WEIGHT_DTYPES)} or auto, got {cfg[key]!r}")
    if cfg.get("quantization_config") is not None:
        raise ConfigError(
            "quantization_config: quantized checkpoints are not supported "
            "(the loader reads bfloat16, float16 or float32 weights)"
        )
    # Megatron's tensor-parallel rank in pretraining: transformers 5 ignores it (4.x summed the
    # same products in slices), so any value computes this model; checked only as a count
    _field(cfg, "pretraining_tp", "count", 1)
    hidden = _field(cfg, "hidden_size", "count")
    heads = _field(cfg, "num_attention_heads", "count")
    layers = _field(cfg, "num_hidden_layers", "count")
    if layer_types and len(layer_types) != layers:
        raise ConfigError(f"layer_types: {len(layer_types)} entries for num_hidden_layers {layers}")
    if not layer_types:
        _refuse_sliding_layers(cfg, layers)
    # transformers' defaults: qwen2/qwen3 default num_key_value_heads to 32 (not the head count),
    # so a checkpoint of theirs states it; Qwen3's head_dim defaults to 128, the others' to
    # hidden / heads; nothing is tied unless the config says so
    kv_default = heads if family == "llama" or "num_key_value_heads" in cfg else _MISSING  # null: heads
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    vocab = _field(cfg, "vocab_size", "count")
    if not token_ids_in_vocab(eos_ids, vocab):
        raise ConfigError(f"eos_token_id: expected token ids in [0, {vocab}), got {eos!r}")
    return ModelConfig(
        family=family,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=_field(cfg, "intermediate_size", "count"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=_field(cfg, "num_key_value_heads", "count", kv_default),
        head_dim=_head_dim(cfg, family, hidden, heads),
        rms_norm_eps=float(_field(cfg, "rms_norm_eps", "positive", 1e-6)),
        rope_theta=rope_theta,
        tie_word_embeddings=_field(cfg, "tie_word_embeddings", "bool", False),
        qkv_bias=family == "qwen2",
        qk_norm=family == "qwen3",
        max_position_embeddings=_field(
            cfg, "max_position_embeddings", "count", 2048 if family == "llama" else 32768
        ),
        eos_token_ids=eos_ids,
    )


def not_a_file(path: Path) -> str:
    """Why ``path`` cannot be read as a file though it is there (a directory, a FIFO, a broken or
    looping link), or '' (a regular file, or nothing there)."""
    there = path.is_symlink() or path.exists()
    return (
        f"{path}: not a regular file (a directory, a FIFO or a broken or looping link)"
        if there and not path.is_file()
        else ""
    )


def load(path: str | Path) -> ModelConfig:
    """A config from a checkpoint directory (its ``config.json``) or a ``config.json`` file."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not_a_file(file):
        raise ConfigError(not_a_file(file))
    if not file.is_file():
        raise ConfigError(f"{path}: no config.json found")
    try:
        cfg = json.loads(file.read_text())
    except OSError as exc:
        raise ConfigError(f"{file}: cannot read it ({exc.strerror or exc})") from None
    except (ValueError, RecursionError) as exc:  # bad JSON or UTF-8, a 5000-digit int, deep nesting
        raise ConfigError(f"{file}: not valid JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{file}: expected a JSON object")
    return from_hf_dict(cfg, str(file))


def to_hf_dict(config: ModelConfig) -> dict:
    """The HF ``config.json`` for a config (random-weight checkpoints of the presets use it)."""
    out = {
        "model_type": config.family,
        "architectures": [
            {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[
                config.family
            ]
        ],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "default"},
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_word_embeddings,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": False,
        "dtype": "bfloat16",
    }
    if config.eos_token_ids:
        out["eos_token_id"] = (
            list(config.eos_token_ids) if len(config.eos_token_ids) > 1 else config.eos_token_ids[0]
        )
    return out
