"""What every checkpoint reader shares (Hugging Face safetensors and Orbax in models.checkpoint, GGUF in
models.gguf): the registry of families, where each Hugging Face tensor goes in our parameters, and
the model's buffers, allocated from its abstract shapes, filled on the host and moved to the device."""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.gemma2 import Gemma2, Gemma2Config
from models.gemma3 import Gemma3, Gemma3Config
from models.llama import Llama
from models.llama_config import ARCHITECTURES, LlamaConfig


class HFTensor(NamedTuple):
    param: tuple[str, ...]  # path of our parameter in `nnx.to_pure_dict(nnx.state(model))`
    layer: int | None  # index on the stacked layer axis, None for unstacked parameters
    shape: tuple[int, ...]  # the tensor's shape in the HF file
    transpose: bool  # HF's nn.Linear stores [out, in]; ours are [in, out]
    # A fused HF tensor (Phi-3's qkv_proj, gate_up_proj): (our parameter, its rows of the tensor) in
    # order; `param` is then the first of them.
    parts: tuple[tuple[tuple[str, ...], int], ...] = ()


def llama_hf_tensors(c: LlamaConfig, extra_per_layer=None) -> dict[str, HFTensor]:
    """HF tensor name -> where it goes in our parameters (reshaped to the parameter's per-layer shape).
    `extra_per_layer`: a family's layer tensors, added to (or replacing) Llama's."""
    d, f, q, kv = c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    out = {"model.embed_tokens.weight": HFTensor(("embed",), None, (c.vocab_size, d), False),
           "model.norm.weight": HFTensor(("norm",), None, (d,), False)}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = HFTensor(("lm_head",), None, (c.vocab_size, d), True)
    per_layer = {"input_layernorm.weight": ("attn_norm", (d,), False),
                 "self_attn.q_proj.weight": ("wq", (q, d), True),
                 "self_attn.k_proj.weight": ("wk", (kv, d), True),
                 "self_attn.v_proj.weight": ("wv", (kv, d), True),
                 "self_attn.o_proj.weight": ("wo", (d, q), True),
                 "post_attention_layernorm.weight": ("mlp_norm", (d,), False),
                 "mlp.gate_proj.weight": ("w_gate", (f, d), True),
                 "mlp.up_proj.weight": ("w_up", (f, d), True),
                 "mlp.down_proj.weight": ("w_down", (d, f), True)}
    if c.qkv_bias:
        per_layer.update({"self_attn.q_proj.bias": ("bq", (q,), False),
                          "self_attn.k_proj.bias": ("bk", (kv,), False),
                          "self_attn.v_proj.bias": ("bv", (kv,), False)})
    if c.attention_bias:
        per_layer["self_attn.o_proj.bias"] = ("bo", (d,), False)
    if c.qk_norm:
        per_layer.update({"self_attn.q_norm.weight": ("q_norm", (c.head_dim,), False),
                          "self_attn.k_norm.weight": ("k_norm", (c.head_dim,), False)})
    per_layer.update(extra_per_layer or {})
    for i in range(c.num_layers):
        for name, (param, shape, transpose) in per_layer.items():
            out[f"model.layers.{i}.{name}"] = HFTensor(("layers", param), i, shape, transpose)
    return out


def phi3_hf_tensors(c: LlamaConfig) -> dict[str, HFTensor]:
    """Llama's tensors with Phi-3's two fused ones per layer: qkv_proj holds q, k and v's rows,
    gate_up_proj the gate's then up's (HF's Phi3MLP chunks it in two, gate first)."""
    d, f, q, kv = c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    out = {name: t for name, t in llama_hf_tensors(c).items()
           if not name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight",
                                 "up_proj.weight"))}
    for i in range(c.num_layers):
        for name, rows, shape in (("self_attn.qkv_proj.weight", (("wq", q), ("wk", kv), ("wv", kv)), (q + 2 * kv, d)),
                                  ("mlp.gate_up_proj.weight", (("w_gate", f), ("w_up", f)), (2 * f, d))):
            parts = tuple((("layers", param), n) for param, n in rows)
            out[f"model.layers.{i}.{name}"] = HFTensor(parts[0][0], i, shape, True, parts)
    return out


def gemma2_hf_tensors(c: Gemma2Config) -> dict[str, HFTensor]:
    """Gemma 2's and 3's (whose q_norm and k_norm come with qk_norm): Llama's tensors; HF's
    post_attention_layernorm follows attention here (it precedes the MLP in Llama),
    pre_feedforward_layernorm precedes the MLP, post_feedforward_layernorm follows it."""
    d = (c.hidden_size,)
    return llama_hf_tensors(c, {"post_attention_layernorm.weight": ("post_attn_norm", d, False),
                                "pre_feedforward_layernorm.weight": ("mlp_norm", d, False),
                                "post_feedforward_layernorm.weight": ("post_mlp_norm", d, False)})


class ModelSpec(NamedTuple):
    config_cls: type
    model_cls: type
    hf_tensors: Callable[[LlamaConfig], dict[str, HFTensor]]


# config.json's model_type -> how to build and fill the model (vLLM's model registry, in small).
MODEL_REGISTRY = {**{model_type: ModelSpec(LlamaConfig, Llama, llama_hf_tensors) for model_type in ARCHITECTURES},
                  "gemma2": ModelSpec(Gemma2Config, Gemma2, gemma2_hf_tensors),
                  "gemma3_text": ModelSpec(Gemma3Config, Gemma3, gemma2_hf_tensors),
                  "phi3": ModelSpec(LlamaConfig, Llama, phi3_hf_tensors)}


def abstract_model(config: LlamaConfig):
    """(graphdef, abstract state, pure dict of ShapeDtypeStructs): the model's shapes, no memory."""
    model_cls = MODEL_REGISTRY[config.model_type].model_cls
    abstract = nnx.eval_shape(lambda: model_cls(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    return graphdef, state, nnx.to_pure_dict(state)


def put_tensor(buffers, t: HFTensor, values: np.ndarray) -> None:
    """Copy one checkpoint tensor (in the file's layout) into its place in the preallocated buffers
    (a fused one's rows into each of its parts)."""
    if t.parts:
        start = 0
        for param, rows in t.parts:
            put_tensor(buffers, t._replace(param=param, shape=(rows, *t.shape[1:]), parts=()),
                       values[start:start + rows])
            start += rows
        return
    values = values.T if t.transpose else values
    target = buffers
    for key in t.param:
        target = target[key]
    if t.layer is None:
        target[...] = values.reshape(target.shape)
    else:
        target[t.layer] = values.reshape(target.shape[1:])


def to_device(buffers):
    """Move host arrays one at a time, dropping each host copy as it goes (peak: one extra array)."""
    if isinstance(buffers, dict):
        return {key: to_device(buffers.pop(key)) for key in list(buffers)}
    return jnp.asarray(buffers)
