"""The transformer pieces the families share (Llama, Qwen2/3, Mistral, Gemma 2): RoPE, RMSNorm, the
attention and MLP sub-blocks of a decoder layer, dense causal attention, and the layer scan.

Each sub-block takes one layer's weights as a dict (the stacked `LlamaLayers` arrays without their
leading layer axis) and is written for a ragged token batch `[..., hidden]`, so the paged forward
(`[num_tokens, hidden]`) and the dense one (`[batch, seq, hidden]`) run the same code.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from models import lora
from pallas_kernels import targets


def rope(x, cos, sin):  # x [..., heads, head_dim]; cos, sin f32[..., rotary_dim // 2]
    """Rotate the two halves of each head's first rotary_dim dims (HF's `rotate_half` layout, which
    its checkpoints assume; all of head_dim but for a partial rotary, whose other dims pass)."""
    rotary = 2 * cos.shape[-1]
    x1, x2 = jnp.split(x[..., :rotary].astype(jnp.float32), 2, axis=-1)
    cos, sin = cos[..., None, :], sin[..., None, :]
    turned = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
    return turned if rotary == x.shape[-1] else jnp.concatenate([turned, x[..., rotary:]], axis=-1)


def rope_tables(inv_freq, positions):  # f32[rotary_dim // 2] (a config's constant), i32[...]
    """-> (cos, sin), each f32[..., rotary_dim // 2]: the angles of `positions` at each frequency."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)
    return jnp.cos(angles), jnp.sin(angles)


def rms_norm(x, weight, eps):  # x [..., hidden]; weight [hidden]
    """Normalise in f32, scale in the model dtype (as HF's LlamaRMSNorm, so bf16 rounds alike)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def causal_attention(
    q,  # [batch, seq, num_heads, head_dim]
    k,  # [batch, seq, num_kv_heads, head_dim]
    v,  # [batch, seq, num_kv_heads, head_dim]
    *,
    sm_scale,
    soft_cap=None,
    sliding_window=None,
):
    """Dense causal GQA attention, f32 softmax: the no-cache path (training, reference). A query at
    position p sees keys at positions (p - sliding_window, p], as the paged kernels and transformers'
    sliding_window_causal mask; the soft cap bends the scaled scores before the mask (as HF's eager)."""
    b, t, h, d = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, d)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    pos = jnp.arange(t)
    visible = pos[None, :] <= pos[:, None]  # bool[t (query), t (key)]
    if sliding_window is not None:
        visible &= pos[None, :] > pos[:, None] - sliding_window
    p = jax.nn.softmax(jnp.where(visible, s, -jnp.inf), axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32))
    return out.reshape(b, t, h, d).astype(q.dtype)


def project(spec: str, h, w, name: str):
    """`jnp.einsum(spec, h, w[name])`. An int8 weight (models/quantize.py) is widened to h's dtype
    inside the product, which accumulates in f32 and is scaled per output channel by
    w[name + "_scale"] after it, so the weight is read as int8. With LoRA slots in `w` (`name +
    "_lora_a"`, `"_lora_b"` and the tokens' `"lora_mask"`), each token's adapter adds its term."""
    scale = w.get(name + "_scale")
    if scale is None:
        out = jnp.einsum(spec, h, w[name])
    else:
        out = (jnp.einsum(spec, h, w[name].astype(h.dtype), preferred_element_type=jnp.float32)
               * scale).astype(h.dtype)
    if name + "_lora_a" in w:  # LoRA adapters (models/lora.py), each token its own
        out = out + lora.delta(spec, h, w[name + "_lora_a"], w[name + "_lora_b"], w["lora_mask"])
    return out


def self_attention(
    h,  # [..., hidden_size], already normalised
    w,  # one layer's weights
    cos,  # f32[..., head_dim // 2]
    sin,  # f32[..., head_dim // 2]
    attention,  # (q, k, v, attn_state) -> (out, attn_state)
    attn_state,  # the paged cache, or None for the dense path
    eps,
    norm=None,  # the q/k norm, (x, w, eps) -> x: rms_norm, or Gemma's (1 + w) one
):
    """q/k/v projections (with Qwen's biases, Qwen3's and Gemma 3's per-head q/k norms), RoPE,
    attention, the output projection -> ([..., hidden_size], attn_state)."""
    q = project("...d,dhk->...hk", h, w, "wq")
    k = project("...d,dhk->...hk", h, w, "wk")
    v = project("...d,dhk->...hk", h, w, "wv")
    if "bq" in w:
        q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
    if "q_norm" in w:
        norm = norm or rms_norm
        q, k = norm(q, w["q_norm"], eps), norm(k, w["k_norm"], eps)
    out, attn_state = attention(rope(q, cos, sin), rope(k, cos, sin), v, attn_state)
    o = project("...hk,hkd->...d", out, w, "wo")
    return (o + w["bo"] if "bo" in w else o), attn_state


def gated_mlp(h, w, activation):  # h [..., hidden_size] -> [..., hidden_size]
    """SwiGLU (activation silu) or GeGLU (gelu): down(activation(gate(h)) * up(h))."""
    gate = project("...d,df->...f", h, w, "w_gate")
    up = project("...d,df->...f", h, w, "w_up")
    return project("...f,fd->...d", activation(gate) * up, w, "w_down")


def window_period(windows) -> int:
    """The shortest p with windows[i] == windows[i % p] for every layer i: 1 when all layers share
    one window, 2 for Gemma 2's sliding/global alternation."""
    n = len(windows)
    return next(p for p in range(1, n + 1) if all(w == windows[i % p] for i, w in enumerate(windows)))


# XLA:GPU copies a dynamic slice of a stacked weight into a buffer of its own before a Triton gemm
# fusion reads it: each layer's weights were read, written and read again (Llama-3.1-8B on an H100:
# 400 MiB a layer, 2.6x the weight bytes a decode step must read). cuBLAS gemms read the slice in
# place under XLA's dynamic-slice fusion when its offset is the loop's induction variable
# (scan_layers). A 16-bit x 16-bit -> f32 product must then name its algorithm (HALF_ALGORITHMS), or
# XLA widens the whole weight to f32 first. The jitted model steps compile with these options; CPU
# and TPU ignore them.
COMPILER_OPTIONS = {"xla_gpu_enable_dynamic_slice_fusion": True, "xla_gpu_enable_triton_gemm": False}
# A product of 16-bit operands into f32, named for XLA: without it XLA:GPU's cuBLAS path widened
# Llama-3.1-8B's whole LM head to f32 (2 GiB) before the product. The same arithmetic either way.
HALF_ALGORITHMS = {jnp.dtype(jnp.bfloat16): jax.lax.DotAlgorithmPreset.BF16_BF16_F32,
                   jnp.dtype(jnp.float16): jax.lax.DotAlgorithmPreset.F16_F16_F32}


def scan_layers(
    layer_fn,  # (x, w, attention, attn_state, window) -> (x, attn_state)
    x,  # [..., hidden_size]
    weights,  # dict name -> [num_layers, ...]: every layer's weights stacked
    windows,  # tuple of num_layers ints or None (global): each layer's static sliding window
    attention,  # (q, k, v, attn_state, layer, sliding_window) -> (out, attn_state)
    attn_state,  # carried through the scan: the paged cache, or None
):
    """Run every layer in loops, so compile time does not grow with depth -> (x, attn_state).

    The attention kernels take the sliding window as a static Python int (it sets their loop bounds
    and tile skipping), so one loop step cannot choose it from a traced layer index, and a `lax.cond`
    between two windows would copy the carried KV pages. So a loop steps over groups of
    `window_period(windows)` consecutive layers, each layer of a group unrolled with its own static
    window (one layer for Llama or Mistral, a sliding/global pair for Gemma 2, six layers for Gemma
    3). The `num_layers % period` layers left over (Gemma 3 1B: 26 = 4 x 6 + 2 sliding ones) run in a
    loop of their own, by the same rule: unrolled, each would read its weights as a static slice of
    the stacks, which XLA copies out (Gemma-3-1B: 214 MB of temporaries a step beside the loop's)."""
    start = 0
    with jax.named_scope("layers"):
        while start < len(windows):
            pattern = windows[start:][:window_period(windows[start:])]
            groups = (len(windows) - start) // len(pattern)
            x, attn_state = _layer_loop(layer_fn, x, weights, pattern, groups, start, attention, attn_state)
            start += groups * len(pattern)
    return x, attn_state


def _layer_loop(layer_fn, x, weights, pattern, groups, start, attention, attn_state):
    """Layers start, start + 1, ... in `groups` loop steps of len(pattern) layers (pattern: their windows)."""
    period = len(pattern)

    def step(carry, group):
        x, state = carry
        for j, window in enumerate(pattern):
            layer = start + period * group + j
            w = {name: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False) for name, a in weights.items()}
            bound = functools.partial(attention, layer=layer, sliding_window=window)
            x, state = layer_fn(x, w, bound, state, window)
        return (x, state), None

    # The loop indexes the stacked [num_layers, ...] arrays itself rather than taking them as `xs`
    # regrouped to [groups, period, ...]: that reshape, even with period 1, gave XLA:CPU a layout
    # for the inner loop's operand ({..., 0, 1}: the size-1 axis outermost) that it then copied to
    # the loop's default one, every stacked weight once per decode step. On a GPU the index is the
    # loop's own counter, so that XLA:GPU can read each slice in place (COMPILER_OPTIONS: an index
    # read from an array defeats it); elsewhere it is read from the scanned group indices, which
    # XLA:CPU ran 10% faster (SmolLM2 f32, one row: 32.0 against 35.7 ms a decode step).
    if targets.platform() == "gpu":
        return jax.lax.fori_loop(0, groups, lambda g, carry: step(carry, g)[0], (x, attn_state))
    (x, attn_state), _ = jax.lax.scan(step, (x, attn_state), jnp.arange(groups, dtype=jnp.int32))
    return x, attn_state
