"""LoRA adapters (Hu et al., 2021) served beside the base model, several at once (vLLM's multi-LoRA).

A PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`) adds to a linear layer
y = x W the low-rank term (x A^T B^T) * scaling. The device holds `max_loras` adapter slots for every
projection of every layer, each slot's A and B side by side on one axis of `max_loras * max_rank`
columns (`LoRAWeights`). A ragged batch whose tokens belong to different adapters then runs one
extra pair of matmuls per projection: x @ A_all gives every slot's rank-r activations, a mask keeps
the token's own slot's columns (zero for a token without an adapter), and @ B_all adds its delta.
That is max_loras x max_rank more columns per projection (64 for 4 slots of rank 16) beside the
base weight's thousands (Llama-3.1-8B: 2.4% more multiply-adds, 2.1% more bytes a forward), and the batch
needs no grouping by adapter; kernels that read only the adapters a batch uses (vLLM's punica
kernels) would do max_loras / (adapters in use) times less, at the price of kernels of their own.

Adapters for the projections of `TARGETS` load, and for Phi-3's fused ones (`qkv_proj`,
`gate_up_proj`: one A shared by the parts, B's rows split among them); an adapter that trains anything else (embeddings,
the LM head, biases, DoRA magnitudes, `modules_to_save`) is refused by name, as is a rank above the
engine's `max_lora_rank`. A rank below it is padded with zero columns; the scaling (lora_alpha / r,
or / sqrt(r) with rsLoRA) is folded into B.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

# PEFT's module names -> ours (models/llama.py's stacked weights).
TARGETS = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
           "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_REFUSED = {"use_dora": "DoRA", "modules_to_save": "modules_to_save", "rank_pattern": "rank_pattern",
            "alpha_pattern": "alpha_pattern", "fan_in_fan_out": "fan_in_fan_out"}


def module_parts(config, module: str) -> tuple[tuple[str, int | None], ...] | None:
    """Our projections a PEFT module feeds, each with the rows of its B it takes (None: all of them);
    None for a module this model does not have."""
    if module in TARGETS:
        return ((TARGETS[module], None),)
    q, kv, f = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.intermediate_size
    return {"qkv_proj": (("wq", q), ("wk", kv), ("wv", kv)), "gate_up_proj": (("w_gate", f), ("w_up", f))}.get(module)


def target_shapes(config) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each projection's (input axes, output axes) in our layout: wq is [hidden, heads, head_dim]."""
    d, f, h, kvh, hd = (config.hidden_size, config.intermediate_size, config.num_heads, config.num_kv_heads,
                        config.head_dim)
    return {"wq": ((d,), (h, hd)), "wk": ((d,), (kvh, hd)), "wv": ((d,), (kvh, hd)), "wo": ((h, hd), (d,)),
            "w_gate": ((d,), (f,)), "w_up": ((d,), (f,)), "w_down": ((f,), (d,))}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRAWeights:
    """Every slot's adapter for every layer: `a[name]` [num_layers, *input axes, slots * rank],
    `b[name]` [num_layers, slots * rank, *output axes]; slot s owns columns s*rank .. (s+1)*rank."""

    a: dict
    b: dict
    rank: int = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def zeros(cls, config, max_loras: int, max_rank: int) -> LoRAWeights:
        dtype, n, width = jnp.dtype(config.dtype), config.num_layers, max_loras * max_rank
        shapes = target_shapes(config)
        return cls(a={k: jnp.zeros((n, *i, width), dtype) for k, (i, _) in shapes.items()},
                   b={k: jnp.zeros((n, width, *o), dtype) for k, (_, o) in shapes.items()}, rank=max_rank)

    @property
    def num_slots(self) -> int:
        return self.a["wq"].shape[-1] // self.rank

    def layer_arrays(self) -> dict:
        """The stacked arrays under the names `project` looks for, for the layer scan to slice."""
        return {**{k + "_lora_a": v for k, v in self.a.items()}, **{k + "_lora_b": v for k, v in self.b.items()}}

    @staticmethod
    def nbytes_for(config, max_loras: int, max_rank: int) -> int:
        """The bytes of `zeros(config, max_loras, max_rank)`."""
        columns = config.num_layers * max_loras * max_rank
        return columns * jnp.dtype(config.dtype).itemsize * sum(
            math.prod(i) + math.prod(o) for i, o in target_shapes(config).values())


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRAInputs:
    """What a forward reads of the adapters: the slots' weights and each token's slot."""

    weights: LoRAWeights
    slots: jax.Array  # i32[num_tokens] (or per row, before the runner maps rows to tokens); -1: no adapter

    def mask(self, dtype):  # -> [num_tokens, slots * rank]: 1 on the token's own slot's columns
        columns = jnp.arange(self.weights.num_slots * self.weights.rank) // self.weights.rank
        return (self.slots[:, None] == columns[None, :]).astype(dtype)


def delta(spec: str, h, a, b, mask):
    """The adapters' term of `jnp.einsum(spec, h, w)` for one layer: (h A) masked to each token's
    slot, then B. `spec` names w's contracted axes, which A takes, and its output axes, which B gives."""
    inputs, out = spec.split("->")
    x, w = inputs.split(",")
    contracted = "".join(c for c in w if c in x)
    kept = "".join(c for c in w if c not in x)
    xa = jnp.einsum(f"{x},{contracted}z->...z", h, a.astype(h.dtype)) * mask
    return jnp.einsum(f"...z,z{kept}->{out}", xa, b.astype(h.dtype))


@jax.jit
def write_slot(weights: LoRAWeights, slot, a: dict, b: dict) -> LoRAWeights:
    """`weights` with slot `slot` (a traced i32: one program for every slot) holding the adapter
    (a[name] [num_layers, *input axes, rank], b[name] [num_layers, rank, *output axes])."""
    r = weights.rank
    new_a = {k: jax.lax.dynamic_update_slice_in_dim(v, a[k].astype(v.dtype), slot * r, axis=v.ndim - 1)
             for k, v in weights.a.items()}
    new_b = {k: jax.lax.dynamic_update_slice_in_dim(v, b[k].astype(v.dtype), slot * r, axis=1)
             for k, v in weights.b.items()}
    return dataclasses.replace(weights, a=new_a, b=new_b)


class LoRAError(ValueError):
    """An adapter that cannot be served by this model or engine; the message names what."""


def load_peft(path, config, max_rank: int) -> tuple[dict, dict]:
    """A PEFT LoRA directory -> (a, b) as `write_slot` takes them, in the model's dtype, the rank
    padded to `max_rank` with zeros and the scaling folded into b (LoRAError naming what is wrong)."""
    path = Path(path)
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    for file in (config_file, weights_file):
        if not file.is_file():
            raise LoRAError(f"LoRA adapter {str(path)!r}: no {file.name} (a PEFT adapter directory holds "
                            "adapter_config.json and adapter_model.safetensors)")
    peft = json.loads(config_file.read_text())
    if peft.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"LoRA adapter {str(path)!r}: peft_type {peft.get('peft_type')!r} is not LORA")
    for key, what in _REFUSED.items():
        if peft.get(key):
            raise LoRAError(f"LoRA adapter {str(path)!r}: {what} ({key}={peft[key]!r}) is not supported")
    if peft.get("bias", "none") != "none":
        raise LoRAError(f"LoRA adapter {str(path)!r}: trained biases (bias={peft['bias']!r}) are not supported")
    rank, alpha = int(peft["r"]), float(peft.get("lora_alpha", peft["r"]))
    if not 1 <= rank <= max_rank:
        raise LoRAError(f"LoRA adapter {str(path)!r} has rank {rank}, more than max_lora_rank={max_rank}: "
                        "raise max_lora_rank")
    scaling = alpha / math.sqrt(rank) if peft.get("use_rslora") else alpha / rank
    shapes, n = target_shapes(config), config.num_layers
    dtype = jnp.dtype(config.dtype)
    a = {k: np.zeros((n, *i, max_rank), np.float32) for k, (i, _) in shapes.items()}
    b = {k: np.zeros((n, max_rank, *o), np.float32) for k, (_, o) in shapes.items()}

    def put(name: str, layer: int, x, which: str, key: str):
        """One projection's A or B of one layer, checked, into its stacked zero-padded array."""
        inputs, outputs = shapes[name]
        expected = (rank, math.prod(inputs)) if which == "A" else (math.prod(outputs), rank)
        if which == "B" and name in ("wk", "wv"):
            x = _repeat_kv_heads(x, expected, config.head_dim)
        if layer >= n or x.shape != expected:
            raise LoRAError(f"LoRA adapter {str(path)!r}: tensor {key!r} has shape {x.shape}, expected "
                            f"{expected} for layer {layer} of this model's {n}")
        if which == "A":
            a[name][layer, ..., :rank] = x.T.reshape(*inputs, rank)
        else:
            b[name][layer, :rank] = (x.T * scaling).reshape(rank, *outputs)

    with jax.default_device(jax.local_devices(backend="cpu")[0]), safe_open(weights_file, framework="flax") as f:
        for key in sorted(f.keys()):
            found = _KEY.search(key)
            parts = None if found is None else module_parts(config, found[2])
            if parts is None:
                raise LoRAError(f"LoRA adapter {str(path)!r}: tensor {key!r} is not a LoRA A/B of a supported "
                                f"projection ({', '.join(TARGETS)}; Phi-3's qkv_proj, gate_up_proj)")
            layer, which = int(found[1]), found[3]
            tensor, start = np.asarray(f.get_tensor(key), np.float32), 0
            for name, rows in parts:
                # PEFT's A is [rank, in features], its B [out features, rank] (torch's Linear layout).
                x = tensor if which == "A" or rows is None else tensor[start:start + rows]
                start += rows or 0
                put(name, layer, x, which, key)
            if which == "B" and start and start != tensor.shape[0]:
                raise LoRAError(f"LoRA adapter {str(path)!r}: tensor {key!r} has {tensor.shape[0]} rows, expected "
                                f"{start} ({found[2]} of this model)")
    return ({k: v.astype(dtype) for k, v in a.items()}, {k: v.astype(dtype) for k, v in b.items()})


def _repeat_kv_heads(b, expected, head_dim: int):
    """A k/v projection's B [kv_heads * head_dim, rank] for a model whose KV heads were replicated
    for tensor parallelism (paged_jax.worker.sharding.replicate_kv_heads: each head repeated in
    place) -> its rows repeated alike; anything else as it is."""
    rows, wanted = b.shape[0], expected[0]
    if b.ndim != 2 or rows >= wanted or wanted % rows or rows % head_dim:
        return b
    return np.repeat(b.reshape(rows // head_dim, head_dim, -1), wanted // rows, axis=0).reshape(wanted, -1)
