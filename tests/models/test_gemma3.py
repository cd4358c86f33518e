"""Gemma 3 without torch: reading published configs (transformers 4 and 5 forms), what is refused,
the parameter count, and the layer scan over groups of six (its logits and greedy tokens against
transformers are in test_family_parity.py)."""
import json
import re

import jax
import pytest
from flax import nnx

from model_testing import GEMMA3, scan_shape, tiny_config
from models.checkpoint import read_config
from models.gemma3 import Gemma3, Gemma3Config

# google/gemma-3-1b-it's config.json (transformers 4.50), as published.
GEMMA_3_1B_IT = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
    "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
    "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144}
# google/gemma-3-4b-it's text_config (the language model of Gemma3ForConditionalGeneration).
GEMMA_3_4B_TEXT = {
    "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "rope_scaling": {"factor": 8.0,
                                                                                       "rope_type": "linear"},
    "sliding_window": 1024, "vocab_size": 262208, "query_pre_attn_scalar": 256, "torch_dtype": "bfloat16"}


def test_reads_the_published_gemma_3_1b_it_config():
    config = Gemma3Config.from_hf_config(GEMMA_3_1B_IT)
    assert config == Gemma3Config(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_layers=26, num_heads=4, num_kv_heads=1,
        head_dim=256, rms_norm_eps=1e-6, rope_theta=1e6, rope_local_base_freq=1e4, tie_word_embeddings=True,
        max_position_embeddings=32768, bos_token_id=2, eos_token_id=(1, 106), dtype="bfloat16", sliding_window=512,
        query_pre_attn_scalar=256)
    # Every sixth layer global: 5 of 26 (layers 5, 11, 17, 23), the last two after the scan of six.
    assert config.layer_windows == ((512,) * 5 + (None,)) * 4 + (512, 512) and config.kv_window is None
    assert config.qk_norm and config.attn_soft_cap is None and config.final_logit_softcapping is None
    assert config.sm_scale == 1 / 16 and config.rope_linear_factor == 1.0
    assert Gemma3Config.from_hf_config(config.to_hf_config()) == config


def test_gemma_3_1b_has_its_parameter_count():
    """999,885,952 (the model card's 1B): tied head, four norms and a q and k norm a layer."""
    config = Gemma3Config.from_hf_config(GEMMA_3_1B_IT)
    abstract = nnx.eval_shape(lambda: Gemma3(config, rngs=nnx.Rngs(0)))
    assert sum(x.size for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(abstract)))) == 999_885_952


def test_the_4b_linear_rope_scaling_and_a_transformers_5_config_are_read():
    config = Gemma3Config.from_hf_config(GEMMA_3_4B_TEXT)
    assert (config.rope_theta, config.rope_local_base_freq, config.rope_linear_factor) == (1e6, 1e4, 8.0)
    assert config.to_hf_config()["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    # transformers 5 writes the two layer types' RoPE under rope_parameters, and layer_types.
    v5 = {k: v for k, v in GEMMA_3_4B_TEXT.items() if k != "rope_scaling"} | {
        "layer_types": list(config.layer_types), "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}
    assert Gemma3Config.from_hf_config(v5) == config
    assert Gemma3Config.from_hf_config({**GEMMA_3_4B_TEXT, "sliding_window_pattern": 2}).layer_windows == (
        1024, None) * 17


# google/gemma-3-4b-it's config.json (Gemma3ForConditionalGeneration, transformers 4.50), as published:
# its text_config holds only what differs from transformers' Gemma3TextConfig defaults.
GEMMA_3_4B_IT = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
    "model_type": "gemma3", "text_config": {
        "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "vision_config": {
        "hidden_size": 1152, "image_size": 896, "intermediate_size": 4304, "model_type": "siglip_vision_model",
        "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}


def test_the_published_4b_multimodal_config_gives_its_language_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GEMMA_3_4B_IT))
    config = read_config(tmp_path)
    assert config == Gemma3Config(
        vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_layers=34, num_heads=8, num_kv_heads=4,
        head_dim=256, rms_norm_eps=1e-6, rope_theta=1e6, rope_local_base_freq=1e4, rope_linear_factor=8.0,
        tie_word_embeddings=True, max_position_embeddings=131072, bos_token_id=2, eos_token_id=(1, 106),
        dtype="bfloat16", sliding_window=1024, query_pre_attn_scalar=256)
    assert config.layer_windows == ((1024,) * 5 + (None,)) * 5 + (1024,) * 4


@pytest.mark.parametrize("field, value, message", [
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "unsupported rope_scaling type 'yarn' (gemma3_text)"),
    ("rope_local_base_freq", 0, "rope_local_base_freq must be a positive number, got 0.0"),
    ("sliding_window_pattern", 0, "sliding_window_pattern must be a positive int, got 0"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention: true (gemma3_text) is not supported"),
    ("hidden_activation", "gelu", "hidden_activation='gelu' (gemma3_text) is not supported"),
    ("layer_types", ["full_attention"] * 25, "layer_types has 25 entries for num_layers=26"),
])
def test_unsupported_gemma3_configs_are_rejected(field, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Gemma3Config.from_hf_config(dict(GEMMA_3_1B_IT, **{field: value}))


def test_groups_of_six_layers_scan_and_the_program_does_not_grow_with_depth():
    assert scan_shape(GEMMA3, 6)[0] == 1 and scan_shape(GEMMA3, 6) == scan_shape(GEMMA3, 24)
    # Layers left over (Gemma 3 1B: 26 = 4 x 6 + 2) loop on their own: no static slice of a weight stack.
    assert scan_shape(GEMMA3, 26)[0] == 2 and scan_shape(GEMMA3, 26) == scan_shape(GEMMA3, 8)
    assert scan_shape(GEMMA3, 7)[0] == 2
