"""Checkpoints: Hugging Face safetensors directories (read without torch) and Orbax directories.

An Orbax directory written by `save_orbax` holds `config.json` (HF style, with `model_type`), the
tokenizer files of its source and the parameters under `state/`; `load_model` tells the two kinds
apart, so the engine has one entry point. Loading an HF directory streams tensor by tensor into
preallocated stacked arrays: peak host memory is about one model, not two.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from safetensors import safe_open

from models.gemma2 import Gemma2, Gemma2Config
from models.llama import ARCHITECTURES, Llama, LlamaConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "tokenizer.model", "chat_template.jinja")
ORBAX_STATE = "state"


class CheckpointError(ValueError):
    """A checkpoint whose contents do not match what its config.json describes."""


class HFTensor(NamedTuple):
    param: tuple[str, ...]  # path of our parameter in `nnx.to_pure_dict(nnx.state(model))`
    layer: int | None  # index on the stacked layer axis, None for unstacked parameters
    shape: tuple[int, ...]  # the tensor's shape in the HF file
    transpose: bool  # HF's nn.Linear stores [out, in]; ours are [in, out]


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


def gemma2_hf_tensors(c: Gemma2Config) -> dict[str, HFTensor]:
    """Llama's tensors; HF's post_attention_layernorm follows attention here (it precedes the MLP in
    Llama), pre_feedforward_layernorm precedes the MLP, post_feedforward_layernorm follows it."""
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
                  "gemma2": ModelSpec(Gemma2Config, Gemma2, gemma2_hf_tensors)}
# Tensors some checkpoints carry that the model recomputes (old HF Llama saved RoPE's table).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_config(path, *, dtype=None) -> LlamaConfig:
    """`path/config.json` (or `path` itself, a config.json file) as our config; `dtype` (None: the
    checkpoint's) overrides the compute dtype."""
    file = Path(path) if Path(path).is_file() else Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file}: missing; a checkpoint directory needs an HF-style config.json")
    hf = json.loads(file.read_text())
    model_type = hf.get("model_type")
    if model_type not in MODEL_REGISTRY:
        raise CheckpointError(f"{file}: unsupported model_type {model_type!r}; "
                              f"supported: {sorted(MODEL_REGISTRY)}")
    try:
        return MODEL_REGISTRY[model_type].config_cls.from_hf_config(hf, dtype=dtype)
    except KeyError as e:
        raise CheckpointError(f"{file}: required field {e} is missing") from e
    except ValueError as e:
        raise CheckpointError(f"{file}: {e}") from e


def _abstract_model(config: LlamaConfig):
    """(graphdef, abstract state, pure dict of ShapeDtypeStructs): the model's shapes, no memory."""
    model_cls = MODEL_REGISTRY[config.model_type].model_cls
    abstract = nnx.eval_shape(lambda: model_cls(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    return graphdef, state, nnx.to_pure_dict(state)


def _hf_weight_files(path: Path) -> list[Path]:
    """The safetensors files of an HF directory: the shards its index names, or the single file."""
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        if not (path / "model.safetensors").is_file():
            raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
        return [path / "model.safetensors"]
    shards = sorted({path / shard for shard in json.loads(index.read_text())["weight_map"].values()})
    for shard in shards:
        if not shard.is_file():
            raise FileNotFoundError(f"{shard}: shard named by {index} is missing")
    return shards


def _check_tensors(files: list[Path], expected: dict[str, HFTensor], config_file: Path):
    """Names and shapes from the headers alone, before any weight is read: fail fast and loudly."""
    seen = set()
    for file in files:
        with safe_open(file, framework="numpy") as f:
            for name in sorted(f.keys()):
                if name.endswith(_IGNORED_SUFFIXES) or (name not in expected and name == "lm_head.weight"):
                    continue  # a tied model's saved lm_head is the embedding again
                if name not in expected:
                    raise CheckpointError(f"{file}: unexpected tensor {name!r} for {config_file}")
                found = tuple(f.get_slice(name).get_shape())
                if found != expected[name].shape:
                    raise CheckpointError(f"{file}: tensor {name!r} has shape {found}, expected "
                                          f"{expected[name].shape} from {config_file}")
                seen.add(name)
    missing = sorted(set(expected) - seen)
    if missing:
        raise CheckpointError(f"{config_file.parent}: {len(missing)} tensors missing from the "
                              f"safetensors files, first {missing[0]!r}")


def load_hf(path, *, dtype=None) -> Llama:
    """A Hugging Face safetensors Llama directory -> model, without torch."""
    path = Path(path)
    config = read_config(path, dtype=dtype)
    expected = MODEL_REGISTRY[config.model_type].hf_tensors(config)
    files = _hf_weight_files(path)
    _check_tensors(files, expected, path / "config.json")
    graphdef, state, shapes = _abstract_model(config)
    buffers = jax.tree.map(lambda s: np.empty(s.shape, s.dtype), shapes)
    # framework="flax" because numpy has no bf16; pinned to the host so nothing visits the GPU.
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        for file in files:
            with safe_open(file, framework="flax") as f:
                for name in sorted(set(f.keys()) & set(expected)):
                    put_tensor(buffers, expected[name], np.asarray(f.get_tensor(name)))
    nnx.replace_by_pure_dict(state, _to_device(buffers))
    return nnx.merge(graphdef, state)


def put_tensor(buffers, t: HFTensor, values: np.ndarray) -> None:
    """Copy one checkpoint tensor (in the file's layout) into its place in the preallocated buffers."""
    values = values.T if t.transpose else values
    target = buffers
    for key in t.param:
        target = target[key]
    if t.layer is None:
        target[...] = values.reshape(target.shape)
    else:
        target[t.layer] = values.reshape(target.shape[1:])


def _to_device(buffers):
    """Move host arrays one at a time, dropping each host copy as it goes (peak: one extra array)."""
    if isinstance(buffers, dict):
        return {key: _to_device(buffers.pop(key)) for key in list(buffers)}
    return jnp.asarray(buffers)


def save_orbax(model: Llama, out_dir, *, source_dir=None) -> Path:
    """Write `out_dir/{config.json, state/}` and copy the tokenizer files found in `source_dir`."""
    out = Path(out_dir).absolute()
    out.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(out / ORBAX_STATE, nnx.to_pure_dict(nnx.state(model)), force=True)
    (out / "config.json").write_text(json.dumps(model.config.to_hf_config(), indent=2) + "\n")
    for name in TOKENIZER_FILES if source_dir is not None else ():
        if (Path(source_dir) / name).is_file():
            shutil.copy2(Path(source_dir) / name, out / name)
    return out


def load_orbax(path, *, dtype=None) -> Llama:
    """An Orbax directory written by `save_orbax` -> model; `dtype` casts while restoring."""
    path = Path(path).absolute()
    config = read_config(path, dtype=dtype)
    graphdef, state, shapes = _abstract_model(config)
    # The whole model on this process's first device, as in one process: without a target sharding
    # Orbax reuses the saved one, which names the saving job's devices and is refused in another
    # topology (e.g. a jax.distributed job); shard_model places it on a mesh afterwards.
    here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=here), shapes)
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(path / ORBAX_STATE, shapes)
    nnx.replace_by_pure_dict(state, restored)
    return nnx.merge(graphdef, state)


def checkpoint_kind(path) -> str:
    """Which kind of checkpoint directory `path` is: "orbax" or "hf"; raises if neither."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such checkpoint directory")
    if (path / ORBAX_STATE).is_dir():
        return "orbax"
    if (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file():
        return "hf"
    raise CheckpointError(f"{path}: neither an HF checkpoint (model.safetensors or "
                          f"model.safetensors.index.json) nor an Orbax one ({ORBAX_STATE}/)")


def load_model(path, *, dtype=None) -> Llama:
    """The engine's loader: an HF safetensors or an Orbax directory, told apart by its contents, or a
    GGUF file (models.gguf)."""
    if Path(path).is_file():
        from models.gguf import load_gguf_model  # imported here: models.gguf builds on this module

        return load_gguf_model(path, dtype=dtype)
    if checkpoint_kind(path) == "orbax":
        return load_orbax(path, dtype=dtype)
    return load_hf(path, dtype=dtype)

