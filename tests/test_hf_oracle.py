"""HF transformers as an independent oracle for the shared decoder structure.

The reference and Triton models share one forward (model/decoder.py), so a wiring mistake
there (residual order, RoPE layout, GQA mapping, qk-norm placement) would be invisible to
``verify.bisect``. Here the reference model, in fp32 with fp32 weights, must reproduce
transformers' own modeling code for each family on the same checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers  # a test dependency: the independent oracle must not turn into a skip

from model import config as model_config
from model import reference
from model import weights as model_weights
from model.config import ModelConfig
from tests.test_model_files import perturb_biases_and_norms
from verify.e2e import hf_forward

# theta and eps away from the usual defaults (10000, 1e-6) and from each other, so a reference
# that hard-codes either one disagrees with HF here
FAMILIES = {
    "llama": ModelConfig(
        "llama", 120, 64, 72, 2, 4, 2, 16, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False
    ),
    "qwen2": ModelConfig("qwen2", 120, 64, 72, 2, 4, 2, 16, rms_norm_eps=3e-4, rope_theta=1e6, qkv_bias=True),
    "qwen3": ModelConfig("qwen3", 120, 64, 72, 2, 4, 1, 16, rms_norm_eps=1e-4, rope_theta=1e6, qk_norm=True),
}


def _checkpoint(directory: Path, cfg: ModelConfig) -> torch.nn.Module:
    hf_config = transformers.AutoConfig.for_model(**model_config.to_hf_dict(cfg))
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    perturb_biases_and_norms(hf)
    hf.save_pretrained(directory)
    return hf


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_reference_model_matches_transformers(tmp_path: Path, family: str, fused: bool) -> None:
    """Both op sets: the unfused one (the yardstick where `--inject` swaps a part of a fused op)
    uses `add_rms_norm`'s residual sum in every layer, the fused one never."""
    cfg = FAMILIES[family]
    hf = _checkpoint(tmp_path, cfg)
    weights = model_weights.load(tmp_path, model_config.load(tmp_path), "cpu", dtype=torch.float32)
    ref = reference.build(weights, max_batch=2, max_seq=24, fused=fused)
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = ref.forward(ids, torch.zeros(2, dtype=torch.int32), all_logits=True)
        # fp32 on both sides, summed in other orders: 1.8e-7 at most apart (logits ~1); a qk-norm
        # eps of 3e-6 for 1e-6 moves them 3e-5, which 1e-4 had let through
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        # and a decode step through the KV cache, against HF's cached decode
        _, cache = hf_forward(hf, ids, None)
        step = torch.tensor([[3], [77]])
        expected_step = hf_forward(hf, step, cache)[0][:, -1]
        got_step = ref.forward(step, torch.full((2,), 9, dtype=torch.int32))
        torch.testing.assert_close(got_step, expected_step, rtol=1e-5, atol=1e-6)
