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
# Seven layers: transformers' default pattern makes the sixth global, and the seventh runs after the
# scan of six; the two bases and the linear factor far apart, so that a layer given the other's
# RoPE is seen.
GEMMA3 = dict(model_type="gemma3_text", num_layers=7, head_dim=32, sliding_window=16, query_pre_attn_scalar=24,
              rope_theta=10000.0, rope_local_base_freq=100.0, rope_linear_factor=8.0, tie_word_embeddings=True)


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


# PEFT's module names and where each sits in a Llama layer, for adapters written by the tests.
PEFT_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def hf_linear_shapes(config) -> dict[str, tuple[int, int]]:
    """(out features, in features) of each projection, torch's Linear layout."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"q_proj": (q, c.hidden_size), "k_proj": (kv, c.hidden_size), "v_proj": (kv, c.hidden_size),
            "o_proj": (c.hidden_size, q), "gate_proj": (c.intermediate_size, c.hidden_size),
            "up_proj": (c.intermediate_size, c.hidden_size), "down_proj": (c.hidden_size, c.intermediate_size)}


def save_peft_adapter(directory, config, *, rank, alpha, targets=tuple(PEFT_MODULES), seed=0, rslora=False,
                      layers=None, extra_config=None):
    """A PEFT LoRA adapter directory written with numpy and safetensors alone (no peft): A ~ N(0,
    1/in), B ~ N(0, 0.5) so that its term moves the logits -> {(layer, module): (A [r, in], B [out,
    r]) in float64}, the values saved (rounded to f32)."""
    import json
    from pathlib import Path

    from safetensors.numpy import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    shapes, tensors, saved = hf_linear_shapes(config), {}, {}
    for layer in range(config.num_layers) if layers is None else layers:
        for module in targets:
            out_f, in_f = shapes[module]
            a = (rng.standard_normal((rank, in_f)) / np.sqrt(in_f)).astype(np.float32)
            b = (0.5 * rng.standard_normal((out_f, rank))).astype(np.float32)
            prefix = f"base_model.model.model.layers.{layer}.{PEFT_MODULES[module]}.{module}"
            tensors[prefix + ".lora_A.weight"], tensors[prefix + ".lora_B.weight"] = a, b
            saved[layer, module] = (a.astype(np.float64), b.astype(np.float64))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    peft = {**dict(peft_type="LORA", r=rank, lora_alpha=alpha, target_modules=list(targets), bias="none",
                   use_rslora=rslora, use_dora=False, modules_to_save=None), **(extra_config or {})}
    (directory / "adapter_config.json").write_text(json.dumps(peft))
    return saved


def merged_model(model, adapter, scaling):
    """`model` with the adapter's term folded into its weights in float64 (W + scaling * B A, in our
    layout): the reference a LoRA forward must equal."""
    c = model.config
    ours = {"q_proj": ("wq", (c.hidden_size, c.num_heads, c.head_dim)),
            "k_proj": ("wk", (c.hidden_size, c.num_kv_heads, c.head_dim)),
            "v_proj": ("wv", (c.hidden_size, c.num_kv_heads, c.head_dim)),
            "o_proj": ("wo", (c.num_heads, c.head_dim, c.hidden_size)),
            "gate_proj": ("w_gate", None), "up_proj": ("w_up", None), "down_proj": ("w_down", None)}
    graphdef, state = nnx.split(model)
    merged = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
    for (layer, module), (a, b) in adapter.items():
        name, shape = ours[module]
        param = getattr(merged.layers, name)
        w = np.asarray(param[...], np.float64)
        term = (scaling * b @ a).T  # [in, out]
        w[layer] += term.reshape(shape or term.shape)
        param[...] = jnp.asarray(w, param[...].dtype)
    return merged


def scan_shape(family: dict, num_layers: int) -> tuple[int, int]:
    """(layer loops, top-level equations) of a family's traced paged forward at `num_layers`, from
    shapes alone: what grows with depth, and how many loops the layers take."""
    config = tiny_config(**dict(family, num_layers=num_layers))
    model_cls = MODEL_REGISTRY[config.model_type].model_cls
    graphdef, state = nnx.split(nnx.eval_shape(lambda: model_cls(config, rngs=nnx.Rngs(0))))
    tokens = jnp.zeros((8,), jnp.int32)
    md = AttentionMetadata(slot_mapping=jnp.arange(8, dtype=jnp.int32), block_tables=jnp.ones((1, 2), jnp.int32),
                           seq_lens=jnp.array([8], jnp.int32), query_start_loc=jnp.array([0, 8], jnp.int32))

    def run(state):
        model = nnx.merge(graphdef, state)
        return model(tokens, tokens, model.init_cache(4, 4), md, jnp.zeros(1, jnp.int32))

    names = [e.primitive.name for e in jax.make_jaxpr(run)(state).jaxpr.eqns]
    return names.count("scan"), len(names)
