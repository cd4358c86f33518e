"""Shared builders for the model tests (imported by name: pytest puts this directory on sys.path).

Every config comes from one factory, `tiny_config(**overrides)`; models get weights large enough
that attention is far from uniform, so a wrong mask, position or head mapping moves the logits."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.llama import Llama, LlamaConfig, preset

LLAMA3_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=64)


def tiny_config(**overrides) -> LlamaConfig:
    return preset("tiny", **overrides)


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
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(seed))))
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
