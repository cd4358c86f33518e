"""Checkpoints: Hugging Face safetensors directories (read without torch) and Orbax directories.

An Orbax directory written by `save_orbax` holds `config.json` (HF style, with `model_type`), the
tokenizer files of its source and the parameters under `state/`; `load_model` tells the two kinds
apart, and hands a file to models.gguf, so the engine has one entry point. Loading an HF directory streams tensor by tensor into
preallocated stacked arrays: peak host memory is about one model, not two.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from safetensors import safe_open

from models.errors import CheckpointError
from models.gguf import load_gguf_model
from models.llama import Llama
from models.llama_config import LlamaConfig
from models.loading import MODEL_REGISTRY, HFTensor, abstract_model, put_tensor, to_device

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "tokenizer.model", "chat_template.jinja")
ORBAX_STATE = "state"
# Tensors some checkpoints carry that the model recomputes (old HF Llama saved RoPE's table).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Multimodal checkpoints whose language model runs here, read from the config's `text_config`
# (the vision tower's tensors are left unread): config.json's model_type -> the text model's. Gemma
# 3 4B-27B (Gemma3ForConditionalGeneration): their text_config holds only what differs from
# transformers' defaults; their eos and dtype are the top level's.
LANGUAGE_MODELS = {"gemma3": "gemma3_text"}
_TOP_LEVEL_FIELDS = ("torch_dtype", "dtype", "bos_token_id", "eos_token_id", "tie_word_embeddings")
# Where such a checkpoint keeps its language model's tensors -> the text model's own prefix: as
# published (and saved by transformers 4.50 and 5), and as transformers 4.52-4.57 saved them.
_LANGUAGE_MODEL_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                            ("model.language_model.", "model."), ("lm_head.", "lm_head."))


def read_config(path, *, dtype=None) -> LlamaConfig:
    """`path/config.json` (or `path` itself, a config.json file) as our config; `dtype` (None: the
    checkpoint's) overrides the compute dtype."""
    file = Path(path) if Path(path).is_file() else Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file}: missing; a checkpoint directory needs an HF-style config.json")
    hf = json.loads(file.read_text())
    model_type = hf.get("model_type")
    if model_type in LANGUAGE_MODELS:
        model_type = LANGUAGE_MODELS[model_type]
        hf = {**(hf.get("text_config") or {}), **{k: hf[k] for k in _TOP_LEVEL_FIELDS if k in hf},
              "model_type": model_type}
    if model_type not in MODEL_REGISTRY:
        raise CheckpointError(f"{file}: unsupported model_type {model_type!r}; "
                              f"supported: {sorted(MODEL_REGISTRY)}")
    try:
        return MODEL_REGISTRY[model_type].config_cls.from_hf_config(hf, dtype=dtype)
    except KeyError as e:
        raise CheckpointError(f"{file}: required field {e} is missing") from e
    except ValueError as e:
        raise CheckpointError(f"{file}: {e}") from e


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


def _language_model_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor name as its language model's own; None for another tower's."""
    for prefix, own in _LANGUAGE_MODEL_PREFIXES:
        if name.startswith(prefix):
            return own + name[len(prefix):]
    return None


def _tensor_names(file: Path, multimodal: bool) -> dict[str, str]:
    """The file's tensor names that the model reads -> the text model's names for them."""
    with safe_open(file, framework="numpy") as f:
        names = {name: _language_model_name(name) if multimodal else name for name in f.keys()}
    return {name: own for name, own in names.items() if own is not None}


def _check_tensors(files: list[Path], expected: dict[str, HFTensor], config_file: Path, multimodal: bool):
    """Names and shapes from the headers alone, before any weight is read: fail fast and loudly."""
    seen = set()
    for file in files:
        with safe_open(file, framework="numpy") as f:
            for stored, name in sorted(_tensor_names(file, multimodal).items()):
                if name.endswith(_IGNORED_SUFFIXES) or (name not in expected and name == "lm_head.weight"):
                    continue  # a tied model's saved lm_head is the embedding again
                if name not in expected:
                    raise CheckpointError(f"{file}: unexpected tensor {stored!r} for {config_file}")
                found = tuple(f.get_slice(stored).get_shape())
                if found != expected[name].shape:
                    raise CheckpointError(f"{file}: tensor {stored!r} has shape {found}, expected "
                                          f"{expected[name].shape} from {config_file}")
                seen.add(name)
    missing = sorted(set(expected) - seen)
    if missing:
        raise CheckpointError(f"{config_file.parent}: {len(missing)} tensors missing from the "
                              f"safetensors files, first {missing[0]!r}")


def load_hf(path, *, dtype=None) -> Llama:
    """A Hugging Face safetensors Llama directory -> model, without torch. A multimodal checkpoint
    (LANGUAGE_MODELS) gives its language model."""
    path = Path(path)
    config = read_config(path, dtype=dtype)
    multimodal = json.loads((path / "config.json").read_text()).get("model_type") in LANGUAGE_MODELS
    expected = MODEL_REGISTRY[config.model_type].hf_tensors(config)
    files = _hf_weight_files(path)
    _check_tensors(files, expected, path / "config.json", multimodal)
    graphdef, state, shapes = abstract_model(config)
    buffers = jax.tree.map(lambda s: np.empty(s.shape, s.dtype), shapes)
    # framework="flax" because numpy has no bf16; pinned to the host so nothing visits the GPU.
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        for file in files:
            with safe_open(file, framework="flax") as f:
                for stored, name in sorted(_tensor_names(file, multimodal).items()):
                    if name in expected:
                        put_tensor(buffers, expected[name], np.asarray(f.get_tensor(stored)))
    nnx.replace_by_pure_dict(state, to_device(buffers))
    return nnx.merge(graphdef, state)


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
    graphdef, state, shapes = abstract_model(config)
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
        return load_gguf_model(path, dtype=dtype)
    if checkpoint_kind(path) == "orbax":
        return load_orbax(path, dtype=dtype)
    return load_hf(path, dtype=dtype)

