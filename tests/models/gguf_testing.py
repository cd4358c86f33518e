"""Writing GGUF files as llama.cpp's convert_hf_to_gguf.py writes them, from a models.llama model: the
test side of models/gguf.py, sharing none of its reading code. Tensor names come from gguf-py's own
TensorNameMap, the q/k rows are permuted by a verbatim copy of the converter's `permute`, and the
quantized bytes are gguf-py's `quantize` (or raw blocks the caller builds)."""
from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

import gguf
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from models.loading import MODEL_REGISTRY

Q = gguf.GGMLQuantizationType
_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
         "gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3}
GGUF_ARCH = {"gemma3_text": "gemma3"}  # our model_type -> general.architecture, where they differ
GEMMAS = ("gemma2", "gemma3")


def permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py `LlamaModel.permute` (rows to llama.cpp's interleaved rotary pairs)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def hf_state(model) -> dict[str, np.ndarray]:
    """HF tensor name -> f32 array in HF's layout ([out, in] for a linear), read from our model."""
    ours, state = nnx.to_pure_dict(nnx.state(model)), {}
    for name, t in MODEL_REGISTRY[model.config.model_type].hf_tensors(model.config).items():
        x = ours
        for key in t.param:
            x = x[key]
        x = np.asarray(x if t.layer is None else x[t.layer], np.float32)
        state[name] = x.reshape(t.shape[::-1]).T if t.transpose else x.reshape(t.shape)
    return state


def encode(values: np.ndarray, qtype) -> np.ndarray:
    """What the file stores for f32 `values` as `qtype`: f32/f16 arrays, or the uint8 blocks."""
    if qtype == Q.F32:
        return values.astype(np.float32)
    if qtype == Q.F16:
        return values.astype(np.float16)
    return gguf.quants.quantize(values, qtype)


def write_gguf(path, model, *, types=None, raw=None, metadata=None) -> dict[str, np.ndarray]:
    """Write `model` as llama.cpp would -> {gguf name: the f32 values in HF layout (unpermuted) that the
    file's bytes decode to, by gguf-py}. `types`: gguf name -> GGML type (default F32) that gguf-py
    quantizes to; `raw`: gguf name -> (uint8 blocks in the file's row order, type) written instead of
    the model's tensor (gguf-py has no K-quant quantizer); `metadata`: extra keys as
    {key: (value, GGUFValueType[, the element type of an array])}."""
    c = model.config
    arch = GGUF_ARCH.get(c.model_type, c.model_type)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.num_kv_heads)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    if c.bos_token_id is not None:
        writer.add_bos_token_id(c.bos_token_id)
    if c.eos_token_id is not None:
        writer.add_eos_token_id(c.eos_token_id)
    if c.head_dim != c.hidden_size // c.num_heads or arch in GEMMAS:  # as the converter writes head_dim
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
    if arch == "gemma2":  # Gemma2Model.set_gguf_parameters
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
        writer.add_sliding_window(c.sliding_window)
    if arch == "gemma3":  # Gemma3Model.set_gguf_parameters
        writer.add_sliding_window(c.sliding_window)
        if c.rope_linear_factor != 1.0:
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(c.rope_linear_factor)
    for key, spec in (metadata or {}).items():
        writer.add_key_value(key, *spec)
    names = gguf.get_tensor_name_map(_ARCH[arch], c.num_layers)
    meant = {}
    if c.rope_scaling is not None:
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(c))
    for hf, values in hf_state(model).items():
        base, suffix = hf.rsplit(".", 1)
        name = f"{names.get_name(base)}.{suffix}"
        shift = arch in GEMMAS and hf.endswith("norm.weight")  # Gemma2/3Model.modify_tensors: w + 1
        values = values + np.float32(1) if shift else values
        if arch == "llama" and ".self_attn.q_proj." in hf:
            values = permute(values, c.num_heads)
        elif arch == "llama" and ".self_attn.k_proj." in hf:
            values = permute(values, c.num_kv_heads)
        data, qtype = (raw or {}).get(name) or (None, (types or {}).get(name, Q.F32))
        data = encode(values, qtype) if data is None else data
        writer.add_tensor(name, data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
        decoded = gguf.quants.dequantize(data, qtype).reshape(values.shape).astype(np.float32)
        # Row permutation commutes with row-wise blocks: un-permuting the decoded rows is exact.
        if arch == "llama" and ".attn_q." in name:
            decoded = unpermute(decoded, c.num_heads)
        elif arch == "llama" and ".attn_k." in name:
            decoded = unpermute(decoded, c.num_kv_heads)
        meant[name] = decoded - np.float32(1) if shift else decoded
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return meant


def llama2c_vocab(tok_bin) -> dict:
    """The `tokenizer.ggml.*` metadata convert_hf_to_gguf.py writes for a SentencePiece vocabulary
    (`_create_vocab_sentencepiece`: each piece, its score and type; BOS, EOS, UNK), from the
    tokenizer.bin llama2.c's tokenizer.py exported from the same tokenizer.model: an int32 max token
    length, then per piece an f32 score, an int32 length and the UTF-8 bytes, with "▁" written as a
    space and BOS/EOS as "\\n<s>\\n" / "\\n</s>\\n"."""
    data = Path(tok_bin).read_bytes()
    offset, tokens, scores = 4, [], []
    while offset < len(data):
        score, length = struct.unpack_from("<fi", data, offset)
        tokens.append(data[offset + 8: offset + 8 + length].decode("utf-8").replace(" ", "\u2581"))
        scores.append(score)
        offset += 8 + length
    tokens[1], tokens[2] = "<s>", "</s>"
    T = gguf.TokenType
    types = [T.UNKNOWN, T.CONTROL, T.CONTROL] + [T.BYTE if re.fullmatch(r"<0x[0-9A-F]{2}>", t) else T.NORMAL
                                                  for t in tokens[3:]]
    V = gguf.GGUFValueType
    return {"tokenizer.ggml.model": ("llama", V.STRING), "tokenizer.ggml.tokens": (tokens, V.ARRAY, V.STRING),
            "tokenizer.ggml.scores": (scores, V.ARRAY, V.FLOAT32),
            "tokenizer.ggml.token_type": ([int(t) for t in types], V.ARRAY, V.INT32),
            "tokenizer.ggml.unknown_token_id": (0, V.UINT32)}


def llama3_rope_factors(config) -> np.ndarray:  # f32[head_dim // 2]
    """convert_hf_to_gguf.py `LlamaModel.generate_extra_tensors` for rope_type "llama3"."""
    s = dict(config.rope_scaling)
    factor, low_freq_factor, high_freq_factor = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_context_len = s["original_max_position_embeddings"]
    base, dim = config.rope_theta, config.head_dim
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    rope_factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(rope_factors, dtype=np.float32)


def unpermute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """`permute`'s inverse, written from its definition: the rows it sent to (h, i, j) came from (h, j, i)."""
    out = np.empty_like(weights)
    half = weights.shape[0] // n_head // 2
    for h in range(n_head):
        for j in range(2):
            for i in range(half):
                out[h * 2 * half + j * half + i] = weights[h * 2 * half + i * 2 + j]
    return out


def save_hf_dir(directory, config, gguf_values: dict[str, np.ndarray]):
    """A safetensors directory of `config` holding the values a GGUF file decodes to (HF layout): the
    reference the GGUF loader must reproduce."""
    directory.mkdir(parents=True, exist_ok=True)
    names = gguf.get_tensor_name_map(_ARCH[GGUF_ARCH.get(config.model_type, config.model_type)], config.num_layers)
    tensors = {}
    for hf in MODEL_REGISTRY[config.model_type].hf_tensors(config):
        base, suffix = hf.rsplit(".", 1)
        tensors[hf] = np.ascontiguousarray(gguf_values[f"{names.get_name(base)}.{suffix}"])
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config.to_hf_config()))
    return directory
