"""Gemma 2 without torch: reading published configs, what is refused, the parameter count, the layer
scan over sliding/global pairs, and an Orbax round trip (its logits against transformers are in
test_family_parity.py)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model_testing import GEMMA2, dense_logits, random_model, scan_shape, tiny_config
from models import load_model, save_orbax
from models.gemma2 import Gemma2, Gemma2Config
from models.layers import window_period

# google/gemma-2-9b-it's config.json (transformers 4.42), as published.
GEMMA_2_9B_IT = {
    "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1,
    "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3584, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "gemma2",
    "num_attention_heads": 16, "num_hidden_layers": 42, "num_key_value_heads": 8, "pad_token_id": 0,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
    "sliding_window_size": 4096, "torch_dtype": "bfloat16", "transformers_version": "4.42.0.dev0",
    "use_cache": True, "vocab_size": 256000}


def test_reads_the_published_gemma_2_9b_it_config():
    config = Gemma2Config.from_hf_config(GEMMA_2_9B_IT)
    assert config == Gemma2Config(
        vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_layers=42, num_heads=16,
        num_kv_heads=8, head_dim=256, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
        max_position_embeddings=8192, bos_token_id=2, eos_token_id=1, dtype="bfloat16", sliding_window=4096,
        query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    # No layer_types in a transformers-4 config: even layers slide (HF's rule).
    assert config.layer_windows == (4096, None) * 21 and config.kv_window is None
    assert config.sm_scale == 1 / 16 and config.attn_soft_cap == 50.0
    assert Gemma2Config.from_hf_config(config.to_hf_config()) == config


def test_gemma_2_9b_has_its_parameter_count():
    """9,241,705,984 = HF's shapes summed (the model card's 9.24B): tied head, four norms a layer."""
    config = Gemma2Config.from_hf_config(GEMMA_2_9B_IT)
    abstract = nnx.eval_shape(lambda: Gemma2(config, rngs=nnx.Rngs(0)))
    assert sum(x.size for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(abstract)))) == 9_241_705_984


def test_layer_types_of_a_transformers_5_config_are_read():
    hf = dict(GEMMA_2_9B_IT, num_hidden_layers=3,
              layer_types=["full_attention", "sliding_attention", "sliding_attention"])
    assert Gemma2Config.from_hf_config(hf).layer_windows == (None, 4096, 4096)


@pytest.mark.parametrize("field, value, message", [
    ("hidden_activation", "gelu",
     "hidden_activation='gelu' (gemma2) is not supported; supported: ('gelu_pytorch_tanh',)"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention: true (gemma2) is not supported"),
    ("layer_types", ["sliding_attention", "chunked_attention"] * 21,
     "unsupported layer_types ['chunked_attention']: each layer is one of ('sliding_attention', 'full_attention')"),
    ("layer_types", ["full_attention"] * 41, "layer_types has 41 entries for num_layers=42"),
    ("sliding_window", None, "layer_types has sliding_attention layers but sliding_window is None"),
    ("sliding_window", 0, "sliding_window must be a positive int or None, got 0"),
    ("attn_logit_softcapping", 0.0, "attn_logit_softcapping must be a positive number or None, got 0.0"),
    ("final_logit_softcapping", -30.0, "final_logit_softcapping must be a positive number or None, got -30.0"),
    ("query_pre_attn_scalar", 0, "query_pre_attn_scalar must be a positive number, got 0"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "unsupported rope_scaling type 'yarn'"),
])
def test_unsupported_gemma2_configs_are_rejected(field, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Gemma2Config.from_hf_config(dict(GEMMA_2_9B_IT, **{field: value}))


def test_no_soft_caps_and_global_layers_are_allowed():
    config = tiny_config(**dict(GEMMA2, attn_logit_softcapping=None, final_logit_softcapping=None,
                                layer_types=("full_attention",) * 3, sliding_window=None))
    assert config.attn_soft_cap is None and config.layer_windows == (None,) * 3


@pytest.mark.parametrize("windows, period", [((None,) * 4, 1), ((8,) * 3, 1), ((8, None) * 3, 2),
                                             ((8, None, 8), 2), ((8, 8, None) * 2, 3), ((None, 8, 8), 3)])
def test_window_period(windows, period):
    assert window_period(windows) == period


def test_pairs_of_layers_scan_and_the_program_does_not_grow_with_depth():
    assert scan_shape(GEMMA2, 2)[0] == 1 and scan_shape(GEMMA2, 2) == scan_shape(GEMMA2, 8)
    # An odd count: the last sliding layer runs in a loop of its own after the pairs', whatever the depth.
    assert scan_shape(GEMMA2, 3)[0] == 2 and scan_shape(GEMMA2, 3) == scan_shape(GEMMA2, 9)


def test_orbax_round_trip_keeps_config_and_logits(tmp_path):
    model = random_model(tiny_config(**GEMMA2))
    restored = load_model(save_orbax(model, tmp_path / "gemma2"))
    assert isinstance(restored, Gemma2) and restored.config == model.config
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 20)), jnp.int32)
    np.testing.assert_array_equal(dense_logits(restored, tokens), dense_logits(model, tokens))
