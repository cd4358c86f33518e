"""Tensor parallelism over a jax `Mesh` (Megatron-LM's layout): attention heads and MLP columns
split over the mesh's `model` axis, the KV pages split over KV heads, the attention kernel run per
shard under `shard_map`, and the block pool, block tables and sampling state replicated, so one
allocation decision serves every shard. XLA inserts the all-reduces after `wo` and `w_down`.

When the model has fewer KV heads than devices, each KV head is replicated onto
`tensor_parallel_size // num_kv_heads` devices (as vLLM does): its projection weights are repeated,
so every device computes and caches the KV head its query heads read.
"""
from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXIS = "model"

# Parameter name -> spec; stacked layer weights carry the leading num_layers axis.
PARAM_SPECS = {
    "embed": P(), "norm": P(), "lm_head": P(None, AXIS),
    "attn_norm": P(), "mlp_norm": P(), "post_attn_norm": P(), "post_mlp_norm": P(),
    "bo": P(), "q_norm": P(), "k_norm": P(),
    "wq": P(None, None, AXIS, None), "wk": P(None, None, AXIS, None), "wv": P(None, None, AXIS, None),
    "bq": P(None, AXIS, None), "bk": P(None, AXIS, None), "bv": P(None, AXIS, None),
    "wo": P(None, AXIS, None, None),
    "w_gate": P(None, None, AXIS), "w_up": P(None, None, AXIS), "w_down": P(None, AXIS, None),
    # int8 weights' scales (models/quantize.py): one per output channel, split as those channels are
    "wq_scale": P(None, AXIS, None), "wk_scale": P(None, AXIS, None), "wv_scale": P(None, AXIS, None),
    "wo_scale": P(), "w_gate_scale": P(None, AXIS), "w_up_scale": P(None, AXIS), "w_down_scale": P(),
    "embed_scale": P(), "lm_head_scale": P(AXIS),
}


def same_programs_in_every_process() -> None:
    """A program across processes must be the same executable in each: jax (0.12.1 on) derives each
    launch's id from the executable's fingerprint, and the collectives inside match by that id. By
    default jax writes every op's Python traceback into the program, and a server's processes trace
    the engine's steps from different call stacks (process 0 on AsyncLLM's thread, the others in
    the step follower): their ids differed and the first all-reduce waited forever. The programs
    keep each op's own frame only, its file named without directories (a job's hosts may install
    the package in different places). Set for every mesh across processes (EngineArgs.create_mesh)."""
    jax.config.update("jax_include_full_tracebacks_in_locations", False)
    jax.config.update("jax_hlo_source_file_canonicalization_regex", r".*/")


def make_mesh(tensor_parallel_size: int, devices=None) -> Mesh:
    """The first `tensor_parallel_size` devices; across several processes (jax.distributed), the
    same number from each process, since a process with no device in the mesh could not read a step's
    output and every process runs the engine."""
    devices = list(devices if devices is not None else jax.devices())
    num_processes = len({d.process_index for d in devices})
    where = f"the devices of all {num_processes} processes" if num_processes > 1 else "the devices jax sees"
    if not isinstance(tensor_parallel_size, int) or not 1 <= tensor_parallel_size <= len(devices):
        raise ValueError(f"tensor_parallel_size must be in [1, {len(devices)}] ({where}), "
                         f"got {tensor_parallel_size!r}")
    if num_processes == 1:
        return Mesh(np.array(devices[:tensor_parallel_size]), (AXIS,))
    if tensor_parallel_size % num_processes:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} is not a multiple of the "
                         f"{num_processes} processes: each process needs the same share of the mesh")
    per_process = tensor_parallel_size // num_processes
    by_process = [[d for d in devices if d.process_index == p] for p in sorted({d.process_index for d in devices})]
    if any(len(local) < per_process for local in by_process):
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} needs {per_process} devices in each of "
                         f"the {num_processes} processes, which have {[len(local) for local in by_process]}")
    return Mesh(np.array([d for local in by_process for d in local[:per_process]]), (AXIS,))


def tensor_parallel_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape[AXIS]


def check_mesh(mesh: Mesh, config) -> None:
    if AXIS not in mesh.axis_names:
        raise ValueError(f"the mesh needs a {AXIS!r} axis for tensor parallelism, got axes {mesh.axis_names}")
    if any(mesh.shape[name] != 1 for name in mesh.axis_names if name != AXIS):
        raise ValueError(f"only the {AXIS!r} axis may be larger than 1 (no data parallelism), got {dict(mesh.shape)}")
    tp = mesh.shape[AXIS]
    for name, size in (("num_heads", config.num_heads), ("intermediate_size", config.intermediate_size)):
        if size % tp:
            raise ValueError(f"{name}={size} is not divisible by tensor_parallel_size={tp}")
    if not config.tie_word_embeddings and config.vocab_size % tp:
        raise ValueError(f"vocab_size={config.vocab_size} is not divisible by tensor_parallel_size={tp}")
    kvh = config.num_kv_heads
    if kvh % tp and tp % kvh:
        raise ValueError(f"num_kv_heads={kvh} and tensor_parallel_size={tp}: one must divide the other")


def replicate_kv_heads(model, tp: int):
    """Repeat the model's KV heads (in place) up to `tp`, one per device, if it has fewer."""
    config = model.config
    factor = tp // config.num_kv_heads
    if factor <= 1:
        return model
    print(f"paged-jax: {config.num_kv_heads} KV heads on {tp} devices: each KV head is replicated "
          f"on {factor} devices (its K/V computed and cached {factor} times)", file=sys.stderr)
    layers = model.layers
    # wk [L, hidden, kv_heads, d]; bk and an int8 wk's scales [L, kv_heads, d]
    for name, axis in (("wk", 2), ("wv", 2), ("bk", 1), ("bv", 1), ("wk_scale", 1), ("wv_scale", 1)):
        if name in layers.names:
            setattr(layers, name, nnx.Param(jnp.repeat(getattr(layers, name)[...], factor, axis=axis)))
    model.config = dataclasses.replace(config, num_kv_heads=tp)
    return model


def param_shardings(model, mesh: Mesh):
    """NamedShardings for `nnx.state(model)`, by parameter name."""
    def spec(path, _):
        return NamedSharding(mesh, PARAM_SPECS[str(path[-1].key)])
    return jax.tree_util.tree_map_with_path(spec, nnx.to_pure_dict(nnx.state(model)))


def shard_model(model, mesh: Mesh):
    """The model with its weights placed on the mesh (KV heads replicated first if needed)."""
    check_mesh(mesh, model.config)
    model = replicate_kv_heads(model, mesh.shape[AXIS])
    state = nnx.state(model)
    pure = nnx.to_pure_dict(state)
    placed = jax.tree.map(place, pure, param_shardings(model, mesh))
    nnx.replace_by_pure_dict(state, placed)
    nnx.update(model, state)
    return model


def place(x, sharding: NamedSharding):
    """`x` (a whole array, the same in every process) laid out as `sharding`. A mesh across processes
    (jax.distributed) holds devices this process cannot send to: each process places only its own
    devices' shards, cut from its own copy."""
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def cache_specs(cache):
    """PartitionSpecs of a KVCache: pages split over their KV-head axis."""
    if cache.layout == "tpu":  # [pages, block_size, 2 * kv_heads (K/V interleaved per head), head_dim]
        return dataclasses.replace(cache, kv_pages=P(None, None, AXIS, None))
    scales = None if cache.k_scales is None else P(AXIS)  # [kv_heads, blocks, block_size]
    return dataclasses.replace(cache, k_pages=P(AXIS), v_pages=P(AXIS), k_scales=scales,
                               v_scales=scales)


def named(specs, mesh: Mesh):
    """NamedShardings for a pytree of PartitionSpecs."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def replicate(tree, mesh: Mesh):
    whole = NamedSharding(mesh, P())
    return jax.tree.map(lambda x: place(x, whole), tree)
