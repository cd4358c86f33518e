"""Logits parity with Hugging Face's `LlamaForCausalLM` on checkpoints it saved, loaded by our loader."""
import jax.numpy as jnp
import numpy as np
import pytest

from model_testing import (LLAMA3_SCALING, dense_logits, hf_logits, max_rel_err, paged_prefill_logits,
                           tiny_config)
from models.checkpoint import load_model
from models.llama import rope_inv_freq

torch = pytest.importorskip("torch")

PROMPT = np.random.default_rng(0).integers(0, 128, 24)
CASES = {
    "gqa_4_to_1": dict(config=dict(num_heads=8, num_kv_heads=2, head_dim=8)),
    "tied_llama3_rope": dict(config=dict(tie_word_embeddings=True, rope_scaling=LLAMA3_SCALING)),
    "head_dim_not_hidden_over_heads": dict(config=dict(head_dim=32, num_kv_heads=1)),
    "attention_bias": dict(config=dict(attention_bias=True)),
    "sharded": dict(config=dict(num_layers=3), save=dict(max_shard_size="20KB")),
    "bf16_checkpoint": dict(config=dict(rope_scaling=LLAMA3_SCALING), save=dict(torch_dtype=torch.bfloat16)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_hugging_face(save_hf, case):
    config = tiny_config(**CASES[case]["config"])
    directory, hf_model = save_hf(config, **CASES[case].get("save", {}))
    model = load_model(directory, dtype="float32")
    assert model.config == config
    expected = hf_logits(hf_model, PROMPT)  # the bf16 case: HF's bf16 weights, run in f32 as ours
    assert max_rel_err(dense_logits(model, jnp.asarray(PROMPT)[None])[0], expected) <= 1e-4
    assert max_rel_err(paged_prefill_logits(model, PROMPT), expected) <= 1e-4


def test_sharded_checkpoint_really_is_sharded(save_hf):
    directory, _ = save_hf(tiny_config(num_layers=3), max_shard_size="20KB")
    assert len(list(directory.glob("model-*-of-*.safetensors"))) > 3
    assert not (directory / "model.safetensors").exists()


def test_llama3_inverse_frequencies_match_hugging_face(save_hf):
    config = tiny_config(rope_scaling=LLAMA3_SCALING)
    _, hf_model = save_hf(config)
    np.testing.assert_allclose(rope_inv_freq(config), hf_model.model.rotary_emb.inv_freq.numpy(),
                               rtol=1e-6)


def test_bf16_checkpoint_is_stored_in_bf16(save_hf):
    from safetensors import safe_open
    directory, _ = save_hf(tiny_config(), torch_dtype=torch.bfloat16)
    with safe_open(directory / "model.safetensors", framework="numpy") as f:
        assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"BF16"}
    assert load_model(directory).config.dtype == "bfloat16"  # the checkpoint's dtype by default
