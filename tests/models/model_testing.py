"""Shared builders for the model tests (imported by name: pytest puts this directory on sys.path).

Every config comes from one factory, `tiny_config(**overrides)` (its model_type picks the config
class: Gemma2Config for gemma2); models get weights large enough that attention is far from
uniform, so a wrong mask, position or head mapping moves the logits."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.checkpoint import MODEL_REGISTRY
from models.llama import PRESETS, Llama, LlamaConfig, forward
from paged_jax.attention import AttentionMetadata

LLAMA3_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=64)
# Sliding windows shorter than the tests' sequences. Mistral's (v0.1's is 4096) in every layer, not a
# block multiple. Gemma 2's three layers: a sliding/global pair in the layer scan and one sliding
# layer after it; caps near the scores' and logits' size, so tanh bends them; a scale not head_dim's.
MISTRAL_WINDOW = dict(model_type="mistral", sliding_window=12)
GEMMA2 = dict(model_type="gemma2", num_layers=3, head_dim=32, sliding_window=16, query_pre_attn_scalar=24,
              attn_logit_softcapping=5.0, final_logit_softcapping=3.0, tie_word_embeddings=True)


def tiny_config(**overrides) -> LlamaConfig:
    config_cls = MODEL_REGISTRY[overrides.get("model_type", "llama")].config_cls
    return config_cls(**{**PRESETS["tiny"], **overrides})


def max_rel_err(actual, expected) -> float:
    """max |actual - expected| relative to the largest |expected|: a scale-free error for logits."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


def _fan_in(name, config):
    c = config
    return {"wq": c.hidden_size, "wk": c.hidden_size, "wv": c.hidden_size, "w_gate": c.hidden_size,
            "w_up": c.hidden_size, "wo": c.num_heads * c.head_dim, "w_down": c.intermediate_size,
            "lm_head": c.hidden_size, "embed": 1}.get(name)


def random_model(config: LlamaConfig, seed: int = 0) -> Llama:
    """Weights ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.1^2), biases ~ N(0, 0.1^2); the same draws for
    the same seed whatever the dtype. Built from shapes: eager random init would cost seconds."""
    model_cls = MODEL_REGISTRY[config.model_type].model_cls
    graphdef, state = nnx.split(nnx.eval_shape(lambda: model_cls(config, rngs=nnx.Rngs(seed))))
    pure = nnx.to_pure_dict(state)
    rng = np.random.default_rng(seed)

    def draw(path, x):
        name = str(path[-1].key)
        z = rng.standard_normal(x.shape)
        fan_in = _fan_in(name, config)
        scaled = z / np.sqrt(fan_in) if fan_in else (1 + 0.1 * z if "norm" in name else 0.1 * z)
        return jnp.asarray(scaled, x.dtype)

    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(draw, pure))
    return nnx.merge(graphdef, state)


@nnx.jit
def dense_logits(model: Llama, tokens):  # i32[batch, seq] -> f32[batch, seq, vocab]
    """`Llama.dense_logits` compiled: eager op-by-op dispatch would dominate the tests' run time."""
    return model.dense_logits(tokens)


def hf_logits(model, tokens):  # a transformers model's f32[seq, vocab] for one prompt
    import torch

    with torch.no_grad():
        return model(torch.tensor(tokens)[None]).logits[0].numpy()


def paged_prefill_logits(model, tokens):
    """The whole prompt (up to 28 tokens) in one ragged step through the paged cache, blocks out of order."""
    n, block_size = len(tokens), 4
    table = np.array([7, 2, 9, 4, 1, 8, 3], np.int32)  # a 24-token prompt uses 6 blocks, then padding
    pos = np.arange(n)
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(table[pos // block_size] * block_size + pos % block_size, jnp.int32),
        block_tables=jnp.asarray(table[None]), seq_lens=jnp.array([n], jnp.int32),
        query_start_loc=jnp.array([0, n], jnp.int32))
    logits, _ = forward(*nnx.split(model), jnp.asarray(tokens, jnp.int32), jnp.asarray(pos, jnp.int32),
                        model.init_cache(10, block_size), md, jnp.arange(n, dtype=jnp.int32))
    return np.asarray(logits)
