"""GGUF files (llama.cpp's format): a Llama, Qwen2, Qwen3 or Gemma 2 and its tokenizer from one file.

The metadata (read through models.gguf_file) gives the config (`llama.block_count`,
`llama.embedding_length`, ...) and the tokenizer (`models.gguf_tokenizer`). Each tensor is dequantized
to f32 as it is read, cast to the compute dtype and written into the preallocated stacked arrays, so
peak host memory is about one model (as models.checkpoint loads safetensors, both through
models.loading). A GGUF tensor is its Hugging Face tensor under another name (convert_hf_to_gguf.py
renames, and dims listed innermost first read back as HF's [out, in]), so the placement is the
model's HF placement (models.loading). Two exceptions: llama.cpp runs a Llama with interleaved rotary
pairs, and its converter permutes the q/k projection rows to match; they are put back into HF's
rotate-half layout here, which models.llama assumes (Qwen2/Qwen3 are written unpermuted: llama.cpp
runs them with the rotate-half "NEOX" rotary). And Gemma 2's norms scale by (1 + w); the converter
stores 1 + w, which is taken back to w.
"""
from __future__ import annotations

import dataclasses

import gguf
import jax
import numpy as np
from flax import nnx

from models.errors import CheckpointError
from models.gemma2 import Gemma2Config
from models.gemma3 import Gemma3Config
from models.gguf_file import GGUFFile, GGUFTensor, field, open_gguf
from models.gguf_tokenizer import gguf_tokenizer
from models.llama import Llama
from models.llama_config import LlamaConfig, rope_inv_freq
from models.loading import MODEL_REGISTRY, HFTensor, abstract_model, put_tensor, to_device

Q = gguf.GGMLQuantizationType
# What the common files hold: full precision, Q8_0, the legacy 4- and 5-bit types, the K-quants of
# Q2_K to Q6_K files (llama.cpp writes rows whose length is not a multiple of 256 as Q5_0, Q5_1 or
# Q8_0 instead, e.g. SmolLM2's 576), and the non-linear 4-bit types of IQ4_NL / IQ4_XS files. Not the
# 1- to 3-bit I-quants (lattice codebooks) nor the ternary TQ types.
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K,
                   Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS)
# general.architecture -> models.llama's model_type (llama.cpp writes Llama 2, Mistral v0.1-0.3 and TinyLlama as
# "llama" too, with a SentencePiece vocabulary: models.gguf_tokenizer builds either kind).
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3_text"}
_GEMMA = {"gemma2": Gemma2Config, "gemma3": Gemma3Config}
_GEMMA_MODEL_TYPES = tuple(ARCHITECTURES[arch] for arch in _GEMMA)  # their (1 + w) norms, four a layer
# llama.cpp's Gemma 27B models (by depth) scale scores by (hidden / heads) ** -1/2, not head_dim's.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
GEMMA3_LOCAL_ROPE_BASE = 10000.0  # llama.cpp's rope_freq_base_train_swa: a file does not carry it
_PERMUTED_QK = ("llama",)
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
# The part after "blk.N." -> the part after "model.layers.N." (llama.cpp's gguf-py TensorNameMap).
_LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
# Gemma 2's and 3's four norms a layer: llama.cpp's ffn_norm is the one before the MLP, which HF calls
# pre_feedforward_layernorm there (post_attention_layernorm follows attention).
_GEMMA2_LAYER_NAMES = {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                       "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# Meta's Llama 3.1 / 3.2 RoPE scaling but for its factor: a GGUF keeps only the per-frequency factors
# these give (convert_hf_to_gguf.py writes them as rope_freqs.weight), so they are checked, not read.
_LLAMA3_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)


def hf_name(name: str, model_type: str = "llama") -> str | None:
    """The Hugging Face tensor name of a GGUF one, None for a name llama.cpp uses and HF does not."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    layer_names = _GEMMA2_LAYER_NAMES if model_type in _GEMMA_MODEL_TYPES else _LAYER_NAMES
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    return None


def _decimal(value: float) -> float:
    """A float32 of the metadata as the shortest decimal that rounds to it: what the converter was
    given (1e-05, not 9.99999974e-06)."""
    return float(np.format_float_positional(np.float32(value), unique=True))


def read_config(reader: GGUFFile, *, dtype=None) -> LlamaConfig:
    """The file's metadata as our config; `dtype` (None: float32, what every type dequantizes to
    exactly) is the compute dtype."""
    file = reader.path
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{file}: GGUF architecture {arch!r} is not supported; "
                              f"supported: {sorted(ARCHITECTURES)}")

    def get(key, *default):
        return field(reader, f"{arch}.{key}", *default)

    names = {t.name for t in reader.tensors}
    heads = get("attention.head_count")
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(heads, list) or isinstance(kv_heads, list):
        raise CheckpointError(f"{file}: per-layer head counts ({heads}, {kv_heads}) are not supported")
    if get("expert_count", 0):
        raise CheckpointError(f"{file}: a mixture of experts ({arch}.expert_count={get('expert_count')}) "
                              "is not supported")
    scaling = get("rope.scaling.type", "none")
    if scaling != "none" and (arch, scaling) != ("gemma3", "linear"):
        raise CheckpointError(f"{file}: scaled RoPE ({arch}.rope.scaling.type={scaling!r}) is not supported yet")
    hidden = get("embedding_length")
    head_dim = get("attention.key_length", hidden // heads)
    rotary = get("rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise CheckpointError(f"{file}: partial rotary ({arch}.rope.dimension_count={rotary} of head_dim "
                              f"{head_dim}) is not supported")
    tokens = field(reader, "tokenizer.ggml.tokens", None)
    fields = dict(
        vocab_size=len(tokens) if tokens is not None else get("vocab_size"), hidden_size=hidden,
        intermediate_size=get("feed_forward_length"), num_layers=get("block_count"), num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=_decimal(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)), tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_output.bias" in names, max_position_embeddings=get("context_length"),
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_id=field(reader, "tokenizer.ggml.eos_token_id", None),
        dtype=dtype or "float32", model_type=ARCHITECTURES[arch])
    if arch in _GEMMA:
        config = _GEMMA[arch](**fields, **_gemma_fields(arch, get, hidden, heads, head_dim))
    else:
        config = LlamaConfig(**fields)
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    return config if rope_freqs is None else _llama3_rope(config, dequantize(rope_freqs), file)


def _gemma_fields(arch: str, get, hidden: int, heads: int, head_dim: int) -> dict:
    """Gemma 2's and 3's own metadata. A file does not carry query_pre_attn_scalar: llama.cpp scales
    the scores by head_dim ** -1/2, or (hidden / heads) ** -1/2 for the 27B models (46 layers in
    Gemma 2, 62 in Gemma 3), which is what each released model's config.json says (Gemma 2: 256,
    256, 144; Gemma 3: 256 and 168). Gemma 3's sliding layers turn at llama.cpp's fixed base; its
    global ones at rope.freq_base, slowed by a linear rope.scaling.factor (4B-27B)."""
    softcaps = {name: (None if get(name, None) is None else _decimal(get(name)))
                for name in ("attn_logit_softcapping", "final_logit_softcapping")}
    scalar = hidden // heads if get("block_count") == _GEMMA_27B_LAYERS[arch] else head_dim
    fields = dict(sliding_window=get("attention.sliding_window"), query_pre_attn_scalar=scalar, **softcaps)
    if arch == "gemma3":
        linear = get("rope.scaling.type", "none") == "linear"
        fields.update(rope_local_base_freq=GEMMA3_LOCAL_ROPE_BASE,
                      rope_linear_factor=_decimal(get("rope.scaling.factor")) if linear else 1.0)
    return fields


def _llama3_rope(config: LlamaConfig, factors: np.ndarray, file) -> LlamaConfig:  # factors f32[head_dim // 2]
    """`config` with the Llama 3 rope_scaling whose frequencies are the base ones over `factors`."""
    scaled = dataclasses.replace(config, rope_scaling={**_LLAMA3_ROPE, "factor": float(factors.max())})
    base = 1.0 / config.rope_theta ** (np.arange(0, config.head_dim, 2, dtype=np.float64) / config.head_dim)
    if factors.shape != base.shape or not np.allclose(rope_inv_freq(scaled), base / factors, rtol=1e-5, atol=0):
        raise CheckpointError(f"{file}: rope_freqs.weight holds factors that Llama 3's RoPE scaling "
                              f"({dict(scaled.rope_scaling)}) does not give; other scalings are not supported")
    return scaled


def dequantize(tensor: GGUFTensor) -> np.ndarray:  # -> f32 in HF's shape (the ggml dims reversed)
    """A tensor of the file as f32 values (every supported type is exact in f32); ValueError naming the
    tensor and its type for any other."""
    if tensor.tensor_type not in SUPPORTED_TYPES:
        raise ValueError(f"tensor {tensor.name!r} has type {tensor.tensor_type.name}, which is not supported; "
                         f"supported: {', '.join(t.name for t in SUPPORTED_TYPES)}")
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(values, np.float32).reshape(tensor.shape)


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:  # [num_heads * head_dim, ...] -> same
    """Undo convert_hf_to_gguf.py's `permute` of q/k rows (weights and biases): it reshapes each head's
    rows as (2, head_dim // 2) and swaps them, pairing dimension i with i + head_dim // 2 for
    llama.cpp's interleaved rotary; this is its inverse."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _plan(reader: GGUFFile, config: LlamaConfig) -> list[tuple[GGUFTensor, HFTensor, int | None]]:
    """(tensor, where it goes, heads to un-permute or None) for every tensor, from the header alone:
    names, shapes and types are checked before any weight is read."""
    file = reader.path
    expected = MODEL_REGISTRY[config.model_type].hf_tensors(config)
    permuted = config.model_type in _PERMUTED_QK
    plan, seen = [], set()
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight" and config.rope_scaling is not None:
            continue  # read by read_config: models.llama computes the scaled frequencies itself
        name = hf_name(tensor.name, config.model_type)
        if name not in expected:
            raise CheckpointError(f"{file}: unexpected tensor {tensor.name!r} for a {config.model_type} of this config")
        shape = tensor.shape
        if shape != expected[name].shape:
            raise CheckpointError(f"{file}: tensor {tensor.name!r} has shape {shape}, expected "
                                  f"{expected[name].shape} from the file's metadata")
        if tensor.tensor_type not in SUPPORTED_TYPES:
            dequantize(tensor)  # raises, naming the tensor and its type
        heads = None
        if permuted and ".attn_q." in tensor.name:
            heads = config.num_heads
        elif permuted and ".attn_k." in tensor.name:
            heads = config.num_kv_heads
        plan.append((tensor, expected[name], heads))
        seen.add(name)
    missing = sorted(set(expected) - seen)
    if missing:
        raise CheckpointError(f"{file}: {len(missing)} tensors missing, first (Hugging Face name) {missing[0]!r}")
    return plan


def load_gguf_model(path, *, dtype=None, reader=None) -> Llama:
    """A GGUF file -> model, each tensor dequantized on the host and cast to the compute dtype."""
    reader = reader if reader is not None else open_gguf(path)
    config = read_config(reader, dtype=dtype)
    plan = _plan(reader, config)
    graphdef, state, shapes = abstract_model(config)
    buffers = jax.tree.map(lambda s: np.empty(s.shape, s.dtype), shapes)
    for tensor, t, heads in plan:
        values = dequantize(tensor)
        if config.model_type in _GEMMA_MODEL_TYPES and tensor.name.endswith("norm.weight"):
            values = values - 1.0  # llama.cpp stores Gemma's (1 + w) scales (q/k norms too); HF's take w
        put_tensor(buffers, t, unpermute_qk(values, heads) if heads else values)
    nnx.replace_by_pure_dict(state, to_device(buffers))
    return nnx.merge(graphdef, state)


def load_gguf(path, *, dtype=None):
    """(model, tokenizer or None) from one GGUF file, its metadata parsed once for both."""
    reader = open_gguf(path)
    return load_gguf_model(path, dtype=dtype, reader=reader), gguf_tokenizer(reader)
