"""Phi-3 and Phi-4 (`Phi3ForCausalLM`) without torch: published configs, parameter counts, LongRoPE
and partial rotary, what is refused (their logits and greedy tokens against transformers are in
test_family_parity.py)."""
import dataclasses
import math
import re

import jax
import numpy as np
import pytest
from flax import nnx

from models.llama import Llama, LlamaConfig
from models.llama_config import rope_attention_factor, rope_frequencies, rope_inv_freq

# microsoft/Phi-3-mini-4k-instruct's config.json (transformers 4.40), as published (auto_map left out).
PHI_3_MINI_4K = {
    "architectures": ["Phi3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1,
    "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072, "initializer_range": 0.02,
    "intermediate_size": 8192, "max_position_embeddings": 4096, "model_type": "phi3", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 32, "original_max_position_embeddings": 4096,
    "pad_token_id": 32000, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
    "sliding_window": 2047, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.2", "use_cache": True, "vocab_size": 32064}
# microsoft/phi-4's (transformers 4.47).
PHI_4 = {
    "architectures": ["Phi3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 100257,
    "embd_pdrop": 0.0, "eos_token_id": 100265, "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02,
    "intermediate_size": 17920, "max_position_embeddings": 16384, "model_type": "phi3", "num_attention_heads": 40,
    "num_hidden_layers": 40, "num_key_value_heads": 10, "original_max_position_embeddings": 16384,
    "pad_token_id": 100349, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 250000,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.47.0", "use_cache": True, "vocab_size": 100352}


@pytest.mark.parametrize("hf, window, params", [(PHI_3_MINI_4K, 2047, 3_821_079_552), (PHI_4, None, 14_659_507_200)],
                         ids=["phi-3-mini-4k", "phi-4"])
def test_published_configs_and_parameter_counts(hf, window, params):
    """The model cards' 3.8B and 14.7B: HF's shapes summed (fused q/k/v and gate/up counted as ours)."""
    config = LlamaConfig.from_hf_config(hf)
    assert (config.model_type, config.sliding_window, config.head_dim) == ("phi3", window, 96 if window else 128)
    assert config.layer_windows == (window,) * config.num_layers and not config.tie_word_embeddings
    assert LlamaConfig.from_hf_config(config.to_hf_config()) == config
    abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    assert sum(x.size for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(abstract)))) == params


def test_longrope_and_partial_rotary_of_phi_3_5_and_phi_4_mini():
    """Phi-3.5-mini and the 128k Phi-3s (LongRoPE, 48 factors a kind for head_dim 96) and Phi-4-mini
    (partial rotary 0.75 of head_dim 128: 48 factors too), in their published layout (the original
    context at the config's top level); the published factors stand in as 48 positive numbers."""
    factors = dict(short_factor=[1.0 + i / 100 for i in range(48)], long_factor=[1.0 + i for i in range(48)])
    phi35 = {**PHI_3_MINI_4K, "max_position_embeddings": 131072, "sliding_window": 262144,
             "rope_scaling": {"type": "longrope", **factors}}
    config = LlamaConfig.from_hf_config(phi35)
    assert dict(config.rope_scaling) == {"rope_type": "longrope", "original_max_position_embeddings": 4096,
                                         **{k: tuple(v) for k, v in factors.items()}}
    assert rope_attention_factor(config) == pytest.approx((1 + math.log(32) / math.log(4096)) ** 0.5)
    assert LlamaConfig.from_hf_config(config.to_hf_config()) == config
    base = rope_frequencies(10000.0, 96)
    np.testing.assert_allclose(rope_inv_freq(config), base / np.array(factors["short_factor"]), rtol=1e-6)
    long = dataclasses.replace(config, long_rope=True)
    np.testing.assert_allclose(rope_inv_freq(long), base / np.array(factors["long_factor"]), rtol=1e-6)
    mini = LlamaConfig.from_hf_config({**phi35, "num_attention_heads": 24, "num_key_value_heads": 8,
                                       "partial_rotary_factor": 0.75})
    assert (mini.head_dim, mini.rotary_dim, rope_inv_freq(mini).shape) == (128, 96, (48,))


@pytest.mark.parametrize("changes, message", [
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 47, "long_factor": [2.0] * 48}},
     "longrope rope_scaling short_factor must be 48 positive numbers (one per rotary frequency)"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48}}, "longrope rope_scaling lacks ['long_factor']"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "unsupported rope_scaling type 'yarn'"),
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor=1.5 must be in (0, 1]"),
])
def test_bad_rope_configs_are_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LlamaConfig.from_hf_config({**PHI_3_MINI_4K, **changes})
