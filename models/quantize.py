"""Weight-only int8 quantization (`quantization="int8"`): the matmul weights of every layer (q, k,
v, o, gate, up, down), the embedding and the LM head are stored as int8 with one f32 scale per
output channel (symmetric: scale = max |w| over the channel's inputs / 127). A product widens the
int8 weight to the activations' dtype and scales its output (`models.layers.project`), so a decode
step reads a quarter of an f32 model's weight bytes (half a bf16 one's); activations, norms,
biases and the KV cache keep their dtype.

Decode at small batch reads every weight once per token: on a CPU, whose matmuls at one row are
bound by memory, that is its speed (scripts/benchmark_gguf.py). A GGUF file's 4-bit or 8-bit blocks
dequantized to the model's dtype and quantized again here differ from them by at most half an int8
step of their channel's largest value.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

QUANTIZATIONS = ("int8",)
# Each stacked layer weight's input axes (after the leading num_layers axis): what one output
# channel sums over. wq/wk/wv [L, hidden, heads, head_dim], wo [L, heads, head_dim, hidden],
# w_gate/w_up [L, hidden, intermediate], w_down [L, intermediate, hidden].
LAYER_INPUTS = {"wq": (1,), "wk": (1,), "wv": (1,), "wo": (1, 2), "w_gate": (1,), "w_up": (1,), "w_down": (1,)}
SCALE = "_scale"  # a quantized weight `name`'s scales are `name + SCALE`, beside it
HEAD_CHUNK_BYTES = 4 << 20  # the LM head's vocabulary is read in chunks whose widened weights are this size


def check(quantization) -> None:
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not supported; supported: {list(QUANTIZATIONS)} "
                         f"(or None: the weights' own dtype)")


def int8(w, axes: tuple[int, ...]):
    """(int8 weights, f32 scales without `axes`): w ~= q * scale, per output channel."""
    w32 = jnp.asarray(w, jnp.float32)
    scale = jnp.max(jnp.abs(w32), axis=axes, keepdims=True) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0)  # an all-zero channel stays zero
    q = jnp.clip(jnp.round(w32 / scale), -127, 127).astype(jnp.int8)
    return q, jnp.squeeze(scale, axes)


def head_logits(h, q, scale, *, tied: bool):
    """f32 logits of h [..., hidden] through an int8 LM head: `q` the tied embedding [vocab, hidden]
    or an untied head [hidden, vocab], `scale` f32[vocab]. The vocabulary is read in chunks of
    HEAD_CHUNK_BYTES once widened, in a loop: XLA widens a loop step's slice where the product
    reads it, but a whole head widened at once would be written out in f32 first, four times the
    bytes the int8 weights save (the layers' weights are sliced by the layer scan alike)."""
    axis = 0 if tied else 1
    vocab, hidden = q.shape[axis], h.shape[-1]
    spec = "...d,vd->...v" if tied else "...d,dv->...v"

    def part(q_part, s_part):
        return jnp.einsum(spec, h, q_part.astype(h.dtype), preferred_element_type=jnp.float32) * s_part

    rows = max(256, 1 << (HEAD_CHUNK_BYTES // (4 * hidden)).bit_length() - 1)
    chunks = vocab // rows
    if chunks <= 1:
        return part(q, scale)

    def chunk(i):
        start = i * rows
        return part(jax.lax.dynamic_slice_in_dim(q, start, rows, axis),
                    jax.lax.dynamic_slice_in_dim(scale, start, rows))

    out = jnp.moveaxis(jax.lax.map(chunk, jnp.arange(chunks)), 0, -2)  # [..., chunks, rows]
    out = out.reshape(*out.shape[:-2], chunks * rows)
    if chunks * rows == vocab:
        return out
    rest = chunks * rows  # the last vocab % rows entries, read at once
    tail = q[rest:] if tied else q[:, rest:]
    return jnp.concatenate([out, part(tail, scale[rest:])], axis=-1)


def quantize(model, quantization: str | None):
    """A copy of `model` (a models.llama.Llama or subclass; its arrays shared, the caller's model
    unchanged) whose matmul weights are quantized; `model` itself for None or a model quantized
    already. ValueError names an unknown method."""
    check(quantization)
    if quantization is None or getattr(model, "embed_scale", None) is not None:  # None, or done already
        return model
    model = nnx.merge(*nnx.split(model))
    layers = model.layers
    for name, axes in LAYER_INPUTS.items():
        q, scale = int8(getattr(layers, name)[...], axes)
        setattr(layers, name, nnx.Param(q))
        setattr(layers, name + SCALE, nnx.Param(scale))
    layers.names = layers.names + tuple(name + SCALE for name in LAYER_INPUTS)
    q, scale = int8(model.embed[...], (1,))  # [vocab, hidden]: a row's scale serves lookup and tied head
    model.embed, model.embed_scale = nnx.Param(q), nnx.Param(scale)
    if model.lm_head is not None:  # [hidden, vocab]
        q, scale = int8(model.lm_head[...], (0,))
        model.lm_head, model.lm_head_scale = nnx.Param(q), nnx.Param(scale)
    return model


def dequantize(model):
    """A copy of a quantized model with its weights back in f32 (q * scale): what the int8 products
    compute, for tests and references."""
    model = nnx.merge(*nnx.split(model))
    layers = model.layers
    for name, axes in LAYER_INPUTS.items():
        scale = getattr(layers, name + SCALE)[...]
        setattr(layers, name, nnx.Param(getattr(layers, name)[...].astype(jnp.float32)
                                        * jnp.expand_dims(scale, axes)))
        delattr(layers, name + SCALE)
    layers.names = tuple(name for name in layers.names if not name.endswith(SCALE))
    model.embed = nnx.Param(model.embed[...].astype(jnp.float32) * model.embed_scale[...][:, None])
    del model.embed_scale
    if model.lm_head is not None:
        model.lm_head = nnx.Param(model.lm_head[...].astype(jnp.float32) * model.lm_head_scale[...])
        del model.lm_head_scale
    return model
