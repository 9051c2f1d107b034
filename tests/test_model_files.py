"""Config parsing and safetensors loading: real HF layouts in, clear errors for bad ones."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from model import config as model_config
from model import weights as model_weights
from model.config import ConfigError, ModelConfig
from model.weights import WeightsError
from tests.subprocess_env import user_env

ROOT = Path(__file__).resolve().parents[1]

TINY = {  # head_dim 16: the smallest the attention kernels take
    "llama": ModelConfig("llama", 96, 64, 40, 2, 4, 2, 16, tie_word_embeddings=False),
    "qwen2": ModelConfig("qwen2", 96, 64, 40, 2, 4, 2, 16, qkv_bias=True),
    "qwen3": ModelConfig("qwen3", 96, 64, 40, 2, 4, 2, 16, qk_norm=True),
}


def perturb_biases_and_norms(hf_model: torch.nn.Module) -> None:
    """HF zero-inits biases and ones-inits norms: noise on them, so a mix-up of two shows."""
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)


def hf_checkpoint(directory: Path, config: ModelConfig, shards: int = 1) -> dict[str, torch.Tensor]:
    """Write a checkpoint with HF transformers' own model class (real tensor names)."""
    import transformers  # a test dependency: imported here, as only these tests need it

    directory.mkdir(parents=True, exist_ok=True)
    hf_config = transformers.AutoConfig.for_model(**model_config.to_hf_dict(config))
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config).to(torch.bfloat16)
    perturb_biases_and_norms(hf_model)
    hf_model.save_pretrained(directory, max_shard_size="20KB" if shards > 1 else "10GB")
    return {k: v.detach().clone() for k, v in hf_model.state_dict().items()}


@pytest.mark.parametrize("family", sorted(TINY))
def test_hf_checkpoint_round_trip(tmp_path: Path, family: str) -> None:
    cfg = TINY[family]
    state = hf_checkpoint(tmp_path, cfg)
    assert model_config.load(tmp_path).replace(eos_token_ids=()) == cfg  # HF adds its default eos
    w = model_weights.load(tmp_path, cfg, "cpu")
    hf = {k.removeprefix("model.layers.1."): v for k, v in state.items()}
    want = {
        "input_norm": hf["input_layernorm.weight"],
        "qkv": torch.cat([hf[f"self_attn.{p}_proj.weight"] for p in "qkv"]),
        "qkv_bias": torch.cat([hf[f"self_attn.{p}_proj.bias"] for p in "qkv"]) if cfg.qkv_bias else None,
        "q_norm": hf["self_attn.q_norm.weight"] if cfg.qk_norm else None,
        "k_norm": hf["self_attn.k_norm.weight"] if cfg.qk_norm else None,
        "o_proj": hf["self_attn.o_proj.weight"],
        "post_norm": hf["post_attention_layernorm.weight"],
        "gate_up": torch.cat([hf["mlp.gate_proj.weight"], hf["mlp.up_proj.weight"]]),
        "down": hf["mlp.down_proj.weight"],
    }
    for field, expected in want.items():
        got = getattr(w.layers[1], field)
        assert (got is None and expected is None) or torch.equal(got, expected), field
    assert torch.equal(w.embed, state["model.embed_tokens.weight"])
    assert torch.equal(w.final_norm, state["model.norm.weight"])
    if cfg.tie_word_embeddings:
        assert w.lm_head is w.embed
    else:
        assert torch.equal(w.lm_head, state["lm_head.weight"])


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    cfg = TINY["qwen3"]
    state = hf_checkpoint(tmp_path, cfg, shards=3)
    assert (tmp_path / model_weights.INDEX_FILE).is_file()
    w = model_weights.load(tmp_path, cfg, "cpu")
    assert torch.equal(w.layers[0].down, state["model.layers.0.mlp.down_proj.weight"])


def _write(directory: Path, tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model_config.to_hf_dict(cfg)))
    save_file(tensors, str(directory / "model.safetensors"))


def _tensors(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    return {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in model_weights.expected_shapes(cfg).items()}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "missing 1 tensors"),
        (lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}), "unexpected tensors"),
        (
            lambda t: t.update({"model.layers.0.self_attn.o_proj.weight": torch.zeros(64, 31)}),
            "model.layers.0.self_attn.o_proj.weight has shape (64, 31), the config implies (64, 64)",
        ),
        (lambda t: t.update({"model.norm.weight": torch.zeros(64, dtype=torch.int32)}), "dtype I32"),
        (
            lambda t: t.update({"model.norm.weight": torch.zeros(64, dtype=torch.float64)}),
            "model.norm.weight has dtype F64, expected one of BF16, F16, F32 (bfloat16, float16 or float32)",
        ),
        (
            lambda t: t.update({"model.norm.weight": torch.zeros(64, dtype=torch.float8_e4m3fn)}),
            "model.norm.weight has dtype F8_E4M3, expected one of BF16, F16, F32",
        ),
        (
            lambda t: t.update({"lm_head.weight": torch.zeros(96, 64, dtype=torch.int8)}),
            "lm_head.weight has dtype I8, expected one of BF16, F16, F32",
        ),
        (
            lambda t: t.update({"model.norm.weight": torch.full((64,), float("nan"), dtype=torch.bfloat16)}),
            "model.norm.weight holds NaN or inf values",
        ),
        (
            lambda t: t.update({"model.norm.weight": torch.full((64,), float("inf"), dtype=torch.bfloat16)}),
            "model.norm.weight holds NaN or inf values",
        ),
        (
            lambda t: t.update({"lm_head.weight": torch.ones(96, 64, dtype=torch.bfloat16)}),
            "lm_head.weight differs from model.embed_tokens.weight, but the config ties them",
        ),
        (
            lambda t: t.update({"lm_head.weight": torch.ones(5, 64, dtype=torch.bfloat16)}),
            "lm_head.weight has shape (5, 64), the config implies (96, 64)",
        ),
    ],
)
def test_bad_tensors_are_named(tmp_path: Path, edit, message: str) -> None:
    cfg = TINY["qwen3"]
    tensors = _tensors(cfg)
    edit(tensors)
    _write(tmp_path, tensors, cfg)
    with pytest.raises(WeightsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        model_weights.load(tmp_path, cfg, "cpu")


@pytest.mark.parametrize(
    ("dtype", "big", "message"),
    [
        (
            torch.bfloat16,
            3.4e38,  # finite in float32, past bfloat16's rounding limit (~3.396e38): inf once converted
            r"model\.safetensors: tensor model\.layers\.0\.mlp\.up_proj\.weight: 3 values overflow "
            r"bfloat16 \(largest 3\.4e\+38; bfloat16's max is 3\.39e\+38\)",
        ),
        (
            torch.float16,
            1e5,
            r"model\.safetensors: tensor model\.layers\.0\.mlp\.up_proj\.weight: 3 values overflow "
            r"float16 \(largest 1e\+05; float16's max is 6\.55e\+04\)",
        ),
    ],
)
def test_finite_float32_values_that_overflow_the_compute_dtype_are_named(
    tmp_path: Path, dtype: torch.dtype, big: float, message: str
) -> None:
    """The finiteness check is of the converted values: a float32 value finite as stored but inf
    in the dtype the model computes in is a named error, not a model whose logits are NaN."""
    cfg = TINY["qwen3"]
    tensors = _tensors(cfg)
    up = torch.zeros(model_weights.expected_shapes(cfg)["model.layers.0.mlp.up_proj.weight"])
    up[0, :3] = torch.tensor([big, -big, big / 1.001])
    tensors["model.layers.0.mlp.up_proj.weight"] = up  # float32, the rest bfloat16
    _write(tmp_path, tensors, cfg)
    assert torch.isfinite(up).all()
    with pytest.raises(WeightsError, match=message):
        model_weights.load(tmp_path, cfg, "cpu", dtype)
    # within range (the dtype's max itself) it loads, the value kept
    up[0, :3] = torch.finfo(dtype).max
    _write(tmp_path, tensors, cfg)
    w = model_weights.load(tmp_path, cfg, "cpu", dtype)
    assert w.layers[0].gate_up[cfg.intermediate_size, 0] == torch.finfo(dtype).max


def test_a_config_far_larger_than_its_checkpoint_is_named_before_allocating(tmp_path: Path) -> None:
    """The stored shapes come from the safetensors header: no fused matrix of the config's size
    (here terabytes) is allocated before the mismatch is found."""
    cfg = TINY["qwen3"]
    _write(tmp_path, _tensors(cfg), cfg)
    huge = cfg.replace(vocab_size=10**12, intermediate_size=10**11)
    with pytest.raises(
        WeightsError,
        match=r"model\.safetensors: tensor model\.embed_tokens\.weight has shape \(96, 64\), "
        r"the config implies \(1000000000000, 64\)",
    ):
        model_weights.load(tmp_path, huge, "cpu")


def test_a_tied_checkpoint_may_store_the_head_copy(tmp_path: Path) -> None:
    cfg = TINY["qwen3"]
    tensors = _tensors(cfg)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    _write(tmp_path, tensors, cfg)
    w = model_weights.load(tmp_path, cfg, "cpu")
    assert w.lm_head is w.embed


def test_buffers_old_checkpoints_carry_are_ignored(tmp_path: Path) -> None:
    cfg = TINY["llama"]
    tensors = _tensors(cfg) | {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(16)}
    _write(tmp_path, tensors, cfg)
    model_weights.load(tmp_path, cfg, "cpu")


def _index(directory: Path, weight_map: object) -> None:
    (directory / model_weights.INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize(
    ("weight_map", "keep_single", "message"),
    [
        ({"model.norm.weight": "model.safetensors"}, True, "both model.safetensors and"),
        ([1, 2], False, "weight_map must map tensor names to shard file names"),
        ({"model.norm.weight": 3}, False, "weight_map must map tensor names to shard file names"),
        ({"model.norm.weight": "../elsewhere.safetensors"}, False, "is not a file of the checkpoint"),
        ({"model.norm.weight": "shard-2.safetensors"}, False, "names shard shard-2.safetensors"),
    ],
)
def test_bad_shard_indexes_are_refused(
    tmp_path: Path, weight_map: object, keep_single: bool, message: str
) -> None:
    cfg = TINY["qwen3"]
    _write(tmp_path, _tensors(cfg), cfg)
    if not keep_single:
        (tmp_path / "model.safetensors").rename(tmp_path / "shard-1.safetensors")
    _index(tmp_path, weight_map)
    with pytest.raises(WeightsError, match=message):
        model_weights.load(tmp_path, cfg, "cpu")


def test_an_index_without_a_weight_map_is_refused(tmp_path: Path) -> None:
    cfg = TINY["qwen3"]
    _write(tmp_path, _tensors(cfg), cfg)
    (tmp_path / "model.safetensors").rename(tmp_path / "shard-1.safetensors")
    for text in ('{"metadata": {}}', "[1, 2]"):
        (tmp_path / model_weights.INDEX_FILE).write_text(text)
        with pytest.raises(WeightsError, match="not a valid safetensors index"):
            model_weights.load(tmp_path, cfg, "cpu")


def _norm_in_its_own_shard(directory: Path, cfg: ModelConfig) -> list[str]:
    """Two shards, ``norm.safetensors`` holding the final norm and ``rest.safetensors`` the rest
    (whose names are returned); the index is the test's to write."""
    tensors = _tensors(cfg)
    norm_weight = tensors.pop("model.norm.weight")
    _write(directory, tensors, cfg)
    (directory / "model.safetensors").rename(directory / "rest.safetensors")
    save_file({"model.norm.weight": norm_weight}, str(directory / "norm.safetensors"))
    return list(tensors)


def test_an_index_mapping_a_tensor_to_the_wrong_shard_names_both(tmp_path: Path) -> None:
    cfg = TINY["qwen3"]
    rest = _norm_in_its_own_shard(tmp_path, cfg)
    _index(tmp_path, dict.fromkeys([*rest, "model.norm.weight"], "rest.safetensors"))  # norm's is wrong
    with pytest.raises(
        WeightsError, match=r"holds no tensor model\.norm\.weight, though the shard index maps"
    ):
        model_weights.load(tmp_path, cfg, "cpu")


@pytest.mark.parametrize(
    ("stray", "where"),
    [
        ("model.extra.weight", "does not list it"),
        ("model.layers.0.input_layernorm.weight", "maps it to rest.safetensors"),  # a second copy
    ],
)
def test_a_shard_holding_a_tensor_the_index_does_not_map_there_is_refused(
    tmp_path: Path, stray: str, where: str
) -> None:
    """In a single file an extra tensor is refused as unexpected; in a shard it would go unread."""
    cfg = TINY["qwen3"]
    tensors = _tensors(cfg)
    norm_weight = tensors.pop("model.norm.weight")
    _write(tmp_path, tensors, cfg)
    (tmp_path / "model.safetensors").rename(tmp_path / "rest.safetensors")
    save_file({"model.norm.weight": norm_weight, stray: -norm_weight}, str(tmp_path / "more.safetensors"))
    _index(tmp_path, dict.fromkeys(tensors, "rest.safetensors") | {"model.norm.weight": "more.safetensors"})
    message = f"holds a tensor the shard index does not map here: {stray} (the index {where})"
    with pytest.raises(WeightsError, match="more.safetensors: " + re.escape(message)):
        model_weights.load(tmp_path, cfg, "cpu")


def test_truncated_file_is_a_clear_error(tmp_path: Path) -> None:
    cfg = TINY["qwen3"]
    _write(tmp_path, _tensors(cfg), cfg)
    file = tmp_path / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(WeightsError, match="truncated or corrupt"):
        model_weights.load(tmp_path, cfg, "cpu")


def test_a_config_claiming_other_layers_than_the_checkpoint_holds(tmp_path: Path) -> None:
    """Checked before the config's per-layer names are listed: for 10**12 layers that listing
    never ended (memory grew without bound)."""
    cfg = TINY["qwen3"]
    _write(tmp_path, _tensors(cfg), cfg)
    for layers in (10**12, 3, 1):
        with pytest.raises(
            WeightsError,
            match=rf"num_hidden_layers is {layers}, but the checkpoint holds the tensors of 2 layers \(0 to",
        ):
            model_weights.load(tmp_path, cfg.replace(num_layers=layers), "cpu")


def test_a_layer_missing_or_beyond_the_config_or_an_odd_number_is_named(tmp_path: Path) -> None:
    """A gap in the layers (with 10**12 claimed: no listing of the config's names), a layer past
    num_hidden_layers, and a non-ASCII digit where the layer number goes ('²'.isdigit() is true,
    int('²') raises): each a clear error, not a hang or a ValueError."""
    cfg = TINY["qwen3"].replace(num_layers=3)
    tensors = _tensors(cfg)
    for name in [n for n in tensors if n.startswith("model.layers.1.")]:
        del tensors[name]
    _write(tmp_path, tensors, cfg)
    for layers in (3, 10**12):
        with pytest.raises(WeightsError, match=r"holds no tensor of layer 1, but tensors of layer 2"):
            model_weights.load(tmp_path, cfg.replace(num_layers=layers), "cpu")
    with pytest.raises(
        WeightsError, match=r"holds tensors of layer 2, but config.json's num_hidden_layers is 1"
    ):
        model_weights.load(tmp_path, cfg.replace(num_layers=1), "cpu")
    cfg = TINY["qwen3"]
    _write(tmp_path, _tensors(cfg) | {"model.layers.\u00b2.extra.weight": torch.zeros(2)}, cfg)
    with pytest.raises(
        WeightsError, match=r"1 unexpected tensors, e.g. \['model.layers.\u00b2.extra.weight'\]"
    ):
        model_weights.load(tmp_path, cfg, "cpu")


def test_a_shard_the_index_forgot_is_named(tmp_path: Path) -> None:
    cfg = TINY["qwen3"]
    _index(tmp_path, dict.fromkeys(_norm_in_its_own_shard(tmp_path, cfg), "rest.safetensors"))
    with pytest.raises(WeightsError, match=r"does not name norm\.safetensors, which is in the directory"):
        model_weights.load(tmp_path, cfg, "cpu")


@pytest.mark.parametrize("name", [model_weights.SINGLE_FILE, model_weights.INDEX_FILE])
def test_a_weights_file_that_is_not_a_file_is_named(tmp_path: Path, name: str) -> None:
    (tmp_path / name).mkdir()
    with pytest.raises(WeightsError, match=rf"{re.escape(name)}: not a regular file"):
        model_weights.load(tmp_path, TINY["llama"], "cpu")


def test_directory_without_weights(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match=r"no model\.safetensors or model\.safetensors\.index\.json$"):
        model_weights.load(tmp_path, TINY["llama"], "cpu")


@pytest.mark.parametrize(
    ("files", "message"),
    [
        (["pytorch_model.bin"], "it holds pytorch_model .bin weights: only safetensors checkpoints are read"),
        (["pytorch_model-00001-of-00002.bin"], "it holds pytorch_model .bin weights"),
        (["model-00001-of-00002.safetensors"], "1 other .safetensors files, e.g. model-00001-of-00002"),
    ],
)
def test_a_directory_in_another_layout_says_what_it_holds(tmp_path: Path, files: list, message: str) -> None:
    for name in files:
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(WeightsError, match=re.escape(message)):
        model_weights.load(tmp_path, TINY["llama"], "cpu")


def test_names_without_the_model_prefix_get_a_hint(tmp_path: Path) -> None:
    """A base-model checkpoint (saved from Qwen3Model, not Qwen3ForCausalLM) has bare names."""
    cfg = TINY["qwen3"]
    tensors = {n.removeprefix("model."): t for n, t in _tensors(cfg).items()}
    _write(tmp_path, tensors, cfg)
    with pytest.raises(WeightsError, match=r"its names lack the 'model\.' prefix: a base-model checkpoint"):
        model_weights.load(tmp_path, cfg, "cpu")


def test_an_unreadable_config_or_index_is_a_named_error(tmp_path: Path, monkeypatch) -> None:
    cfg = TINY["qwen3"]
    hf_checkpoint(tmp_path, cfg, shards=2)
    real_read_text = Path.read_text

    def refuse(self: Path, *args, **kwargs) -> str:
        if self.name in ("config.json", model_weights.INDEX_FILE):
            raise PermissionError(13, "Permission denied", str(self))
        return real_read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", refuse)
    with pytest.raises(ConfigError, match=r"config\.json: cannot read it \(Permission denied\)"):
        model_config.load(tmp_path)
    with pytest.raises(WeightsError, match=r"index\.json: cannot read it \(Permission denied\)"):
        model_weights.load(tmp_path, cfg, "cpu")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e6}}, "rope scaling"),
        (
            {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
            r"use_sliding_window: true, with sliding_window 8 and max_window_layers 1, makes layers 1 to 1",
        ),
        ({"use_sliding_window": True, "max_window_layers": 0}, "sliding_window 4096 and max_window_layers 0"),
        (
            {"use_sliding_window": True, "max_window_layers": -1},
            "max_window_layers: expected an integer >= 0",
        ),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"attention_bias": True}, "attention_bias"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "non-full attention"),
        ({"layer_types": "full_attention"}, "layer_types: expected a list"),
        ({"layer_types": ["full_attention"]}, "layer_types: 1 entries for num_hidden_layers 2"),
        ({"rms_norm_eps": "abc"}, r"rms_norm_eps: expected a positive number in fp32's normal .*, got 'abc'"),
        ({"rms_norm_eps": 0}, "rms_norm_eps: expected a positive number in fp32's normal range"),
        ({"rope_theta": -5, "rope_parameters": None}, "rope_theta: expected a positive number in fp32's"),
        # a JSON integer float() cannot take, and values that are 0 or inf in fp32
        ({"rms_norm_eps": 10**400}, r"rms_norm_eps: expected a positive number in fp32's normal range \("),
        ({"rms_norm_eps": 1e300}, "rms_norm_eps: expected a positive number in fp32's normal range"),
        ({"rope_theta": 1e-300, "rope_parameters": None}, "rope_theta: expected a positive number in fp32's"),
        ({"torch_dtype": "int8"}, "torch_dtype: expected one of bfloat16, float16, float32 or auto, got"),
        ({"dtype": "potato"}, "dtype: expected one of bfloat16, float16, float32 or auto, got 'potato'"),
        ({"rope_parameters": "yarn"}, "rope_parameters: expected an object"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not implemented"),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}},
            "partial_rotary_factor 0.5 is not implemented",
        ),
        ({"head_dim": 0}, "head_dim: expected a positive integer, got 0"),
        ({"num_key_value_heads": 0}, "num_key_value_heads: expected a positive integer, got 0"),
        ({"num_hidden_layers": True}, "num_hidden_layers: expected a positive integer, got True"),
        ({"max_position_embeddings": "big"}, "max_position_embeddings: expected a positive integer"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings: expected true or false, got 'false'"),
        ({"eos_token_id": "2"}, "eos_token_id: expected token ids in"),
        ({"eos_token_id": [1, 96]}, r"eos_token_id: expected token ids in \[0, 96\)"),
        ({"intermediate_size": None}, r"config\.json: missing required field 'intermediate_size'$"),
        (
            {"head_dim": 48},
            r"config\.json: head_dim 48 is not supported by the attention kernels; expected one of \(16, 32",
        ),
        (
            {"model_type": "qwen2", "head_dim": None, "hidden_size": 96},
            r"config\.json: head_dim 24 \(hidden_size 96 / num_attention_heads 4\) is not supported",
        ),
        (
            {"quantization_config": {"quant_method": "gptq", "bits": 4}},
            "quantization_config: quantized checkpoints are not supported",
        ),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling: rope scaling"),
        ({"rope_parameters": {"type": "dynamic", "rope_theta": 1e6}}, "rope_parameters: rope scaling"),
        ({"rope_scaling": "linear"}, "rope_scaling: expected an object"),
        ({"mlp_bias": True}, "mlp_bias is not implemented"),
        ({"pretraining_tp": 0}, "pretraining_tp: expected a positive integer, got 0"),
        ({"use_sliding_window": "false"}, "use_sliding_window: expected true or false, got 'false'"),
        ({"mlp_bias": "false"}, "mlp_bias: expected true or false, got 'false'"),
        ({"attention_bias": 0}, "attention_bias: expected true or false, got 0"),
        ({"rms_norm_eps": math.inf}, "rms_norm_eps: expected a positive number in fp32's normal .*, got inf"),
        ({"eos_token_id": -1}, r"eos_token_id: expected token ids in \[0, 96\), got -1"),
        ({"eos_token_id": True}, r"eos_token_id: expected token ids in \[0, 96\), got True"),
        # transformers 5's per-layer-type form: refused whatever it holds, even default RoPE
        (
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                }
            },
            r"config\.json: rope_parameters: RoPE parameters nested per layer type "
            r"\(full_attention, sliding_attention\) are not implemented",
        ),
        (
            {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
            r"rope_parameters: RoPE parameters nested per layer type \(full_attention\)",
        ),
        (
            {"rope_scaling": {"full_attention": {"rope_type": "linear", "factor": 2.0}}},
            r"rope_scaling: RoPE parameters nested per layer type \(full_attention\)",
        ),
        (  # a null entry: a layer type without RoPE (NoPE) in transformers
            {"layer_types": ["full_attention"] * 2, "rope_parameters": {"full_attention": None}},
            r"rope_parameters: RoPE parameters nested per layer type \(full_attention\)",
        ),
    ],
)
def test_unsupported_configs_are_refused(tmp_path: Path, change: dict, message: str) -> None:
    cfg = model_config.to_hf_dict(TINY["qwen3"]) | change
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=message):
        model_config.load(tmp_path)


@pytest.mark.parametrize(
    "change",
    [
        {"use_sliding_window": True},  # max_window_layers 28 (its default) >= the 2 layers
        {"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0},
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
        {"use_sliding_window": True, "sliding_window": 8, "layer_types": ["full_attention"] * 2},
        {"pretraining_tp": 2},  # Megatron's rank in pretraining: transformers 5 ignores it
    ],
)
def test_settings_transformers_runs_as_plain_layers_load(change: dict) -> None:
    """transformers runs these as plain full-attention layers (a window switched on for no layer,
    a pretraining tensor-parallel rank), so they are taken."""
    cfg = model_config.to_hf_dict(TINY["qwen3"]) | change
    assert model_config.from_hf_dict(cfg) == model_config.from_hf_dict(model_config.to_hf_dict(TINY["qwen3"]))


def test_fields_at_their_defaults_or_null_load() -> None:
    """null where transformers reads its default (pretraining_tp 1), and features switched off."""
    off = {"pretraining_tp": None, "use_sliding_window": False, "sliding_window": 4096, "mlp_bias": False}
    cfg = model_config.to_hf_dict(TINY["qwen3"]) | off | {"attention_bias": False}
    assert model_config.from_hf_dict(cfg) == model_config.from_hf_dict(model_config.to_hf_dict(TINY["qwen3"]))


@pytest.mark.parametrize(
    "change",
    [
        {"rope_scaling": {"rope_type": "default"}},
        {"rope_scaling": {"type": "default"}},
        {"rope_scaling": {"rope_type": "default", "type": "dynamic"}},  # rope_type wins, as in transformers
        {"rope_scaling": {"rope_type": "default", "rope_theta": 3000.0}},
        {"rope_scaling": {}},
        {"rope_parameters": {"type": "default"}},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 7000.0}},
    ],
)
def test_default_rope_is_plain_rope_as_transformers_reads_it(change: dict) -> None:
    """A non-empty rope_scaling replaces rope_parameters in transformers (its rope_theta then
    comes from the top level): the theta parsed here is the one transformers uses."""
    import transformers

    cfg = model_config.to_hf_dict(TINY["qwen3"]) | {"rope_theta": 5e5} | change
    parsed = model_config.from_hf_dict(json.loads(json.dumps(cfg)))
    hf = transformers.AutoConfig.for_model(**json.loads(json.dumps(cfg)))
    assert parsed.rope_theta == hf.rope_parameters["rope_theta"]


def test_presets_and_the_embedded_configs_pass_the_parser() -> None:
    """Their head_dims (128, 64, 32) are ones the attention kernels take."""
    from model import embedded

    for preset in model_config.PRESETS.values():
        assert model_config.from_hf_dict(model_config.to_hf_dict(preset)) == preset
    for family in embedded.FAMILIES:
        assert model_config.from_hf_dict(embedded.tiny_config(family)).head_dim == 32


def test_absent_fields_take_transformers_defaults() -> None:
    """As transformers reads config.json: Qwen3's head_dim defaults to 128, nothing is tied unless
    said, qwen2/qwen3 need num_key_value_heads (their default, 32, is no checkpoint's), llama's
    defaults to the head count and its max_position_embeddings to 2048."""

    def parse(family: str, *absent: str) -> ModelConfig:
        cfg = model_config.to_hf_dict(TINY[family])
        for key in absent:
            del cfg[key]
        return model_config.from_hf_dict(cfg)

    assert parse("qwen3", "head_dim").head_dim == 128
    assert parse("qwen2", "head_dim").head_dim == 64 // 4
    assert not parse("qwen3", "tie_word_embeddings").tie_word_embeddings
    llama = parse("llama", "num_key_value_heads", "max_position_embeddings")
    assert (llama.num_kv_heads, llama.max_position_embeddings) == (4, 2048)
    with pytest.raises(ConfigError, match="missing required field 'num_key_value_heads'"):
        parse("qwen3", "num_key_value_heads")
    swish = {**model_config.to_hf_dict(TINY["qwen3"]), "hidden_act": "swish"}  # transformers: SiLU
    assert model_config.from_hf_dict(swish) == parse("qwen3")


@pytest.mark.parametrize("family", sorted(TINY))
def test_absent_eps_and_rope_theta_take_transformers_defaults(family: str) -> None:
    import transformers

    cfg = model_config.to_hf_dict(TINY[family])
    for key in ("rms_norm_eps", "rope_theta", "rope_parameters"):
        cfg.pop(key, None)
    ours = model_config.from_hf_dict(dict(cfg))
    hf = transformers.AutoConfig.for_model(**cfg)
    assert ours.rms_norm_eps == hf.rms_norm_eps
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]


def test_missing_config_and_bad_json(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no config\.json"):
        model_config.load(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ConfigError, match="not valid JSON"):
        model_config.load(tmp_path)
    (tmp_path / "config.json").write_bytes(bytes(range(128, 256)))
    with pytest.raises(ConfigError, match="not valid JSON"):
        model_config.load(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a JSON object"):
        model_config.load(tmp_path)
    for text in ('{"vocab_size": ' + "9" * 5000 + "}", "[" * 100_000):  # past json's digit and depth limits
        (tmp_path / "config.json").write_text(text)
        with pytest.raises(ConfigError, match="not valid JSON"):
            model_config.load(tmp_path)
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ConfigError, match=r"config\.json: not a regular file"):
        model_config.load(tmp_path)


def test_a_config_built_in_code_is_checked_as_a_parsed_one_is() -> None:
    with pytest.raises(ConfigError, match="family 'gpt2' is not one of"):
        TINY["llama"].replace(family="gpt2")
    with pytest.raises(ConfigError, match="num_layers: expected a positive int, got 0"):
        TINY["llama"].replace(num_layers=0)


def test_article_preset_is_the_seed_article_config() -> None:
    a = model_config.PRESETS["article"]
    assert (a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim) == (28, 1024, 8, 2, 128)
    assert (a.intermediate_size, a.vocab_size, a.rms_norm_eps, a.rope_theta) == (4864, 151936, 1e-6, 1e6)
    assert a.tie_word_embeddings and not a.qkv_bias and not a.qk_norm


def test_config_head_dims_are_the_attention_kernels() -> None:
    from ops.attention import HEAD_DIMS

    assert model_config.HEAD_DIMS == HEAD_DIMS


def test_parsing_a_config_imports_no_triton(tmp_path: Path) -> None:
    """A script that imported triton first (torch.compile does) can still read a config."""
    (tmp_path / "config.json").write_text(json.dumps(model_config.to_hf_dict(TINY["qwen3"])))
    code = (
        "import sys; from model import config; config.load(sys.argv[1]); "
        "assert 'triton' not in sys.modules and 'ops' not in sys.modules"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], check=True, cwd=ROOT, env=user_env(), timeout=120
    )


def test_a_bad_preset_name_or_training_length_is_named() -> None:
    from model import embedded, presets

    with pytest.raises(ValueError, match=r"^name: 'nope' is not a preset; expected one of article"):
        presets.checkpoint("nope")
    for steps in (0, -3):
        with pytest.raises(ValueError, match=rf"^steps: expected a positive int, got {steps}"):
            embedded.ensure("qwen3", Path("/nonexistent"), steps=steps)


def test_a_tied_checkpoint_holding_only_the_head_loads_it_as_the_embedding(tmp_path: Path) -> None:
    """Tied, with its one matrix stored as lm_head.weight: HF ties it to the embedding, so does
    the loader (it used to refuse the embedding as missing)."""
    cfg = TINY["qwen3"]
    tensors = _tensors(cfg)
    tensors["lm_head.weight"] = torch.randn(tensors["model.embed_tokens.weight"].shape).to(torch.bfloat16)
    del tensors["model.embed_tokens.weight"]
    _write(tmp_path, tensors, cfg)
    w = model_weights.load(tmp_path, cfg, "cpu")
    assert torch.equal(w.embed, tensors["lm_head.weight"]) and w.lm_head is w.embed
