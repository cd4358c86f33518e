"""The engine as `LLM` builds it on a GPU that is not here: its model with abstract weights (shapes
and shardings, nothing allocated) placed on compile-only devices (`pallas_kernels.gpu_target`), a
draft model's beside it, and the sizes `gpu_programs.build` gave it."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from paged_jax.engine import config as config_lib
from paged_jax.worker import hlo_audit, sharding


@dataclasses.dataclass(frozen=True)
class AbstractEngine:
    model: Any  # the model with ShapeDtypeStruct weights, placed on `placement`
    config: config_lib.EngineConfig
    placement: Mesh  # the compile-only devices, axis sharding.AXIS
    weight_bytes: int  # per device, a draft model's and the LoRA slots included
    draft_model: Any = None  # speculative decoding's draft, placed as `model` is

    @property
    def mesh(self) -> Mesh | None:  # what the engine's Flags carry: None without tensor parallelism
        return self.placement if self.placement.size > 1 else None

    @property
    def kv_bytes(self) -> int:  # per device
        return self.config.num_blocks * self.config.bytes_per_block // self.placement.size

    def layer_slices(self) -> dict[int, str]:
        """Elements of one layer's slice of each stacked weight on one device (the draft's too) ->
        its name: what `hlo_audit.copied_layer_slices` looks for in a compiled program."""
        sizes = {}
        for model in (self.model, self.draft_model):
            if model is not None:
                leaves = jax.tree_util.tree_leaves_with_path(nnx.state(model.layers, nnx.Param))
                shapes = {str(path[0].key): x.sharding.shard_shape(x.shape) for path, x in leaves}
                sizes.update(hlo_audit.layer_slice_sizes(shapes, model.config.num_layers))
        return sizes


def placed(tree, specs, mesh):
    """ShapeDtypeStructs of `tree`'s leaves with NamedShardings from `specs` (a tree of
    PartitionSpecs, or one spec for every leaf)."""
    if isinstance(specs, P):
        specs = jax.tree.map(lambda _: specs, tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=NamedSharding(mesh, s)),
                        tree, specs, is_leaf=lambda x: isinstance(x, P))


def abstract_model(model_cls, model_config, mesh: Mesh):
    """The model as `LLM` holds it on `mesh`: KV heads replicated up to the mesh size, weights split
    by sharding.PARAM_SPECS (replicated on one device); shapes only."""
    tp = mesh.size
    model = nnx.eval_shape(lambda: sharding.replicate_kv_heads(model_cls(model_config, rngs=nnx.Rngs(0)), tp))
    if tp > 1:
        sharding.check_mesh(mesh, model_config)
    graphdef, state = nnx.split(model)

    def place(path, x):  # the pure dict's paths end in the parameter's name
        spec = sharding.PARAM_SPECS[str(path[-1].key)] if tp > 1 else P()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(place, nnx.to_pure_dict(state)))
    return nnx.merge(graphdef, state)


def weight_bytes_per_device(model) -> int:
    leaves = jax.tree.leaves(nnx.state(model))
    return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in leaves)
