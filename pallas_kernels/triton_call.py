"""How every kernel here is launched: pallas_call lowered through Triton. jax 0.10's Pallas GPU
default is Mosaic GPU (Hopper and newer only), so the Triton compiler params are passed explicitly;
that is also what makes `interpret=True` run the same kernel on CPU."""
from __future__ import annotations

from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def triton_call(kernel, inputs, out_shape, *, grid, name, interpret, num_warps, num_stages,
                in_specs=None, aliases=None, out=None):
    """-> the pallas_call's outputs. Inputs without a spec are whole arrays the kernel indexes
    itself; `aliases` maps input to output indices; `out`, when given, is appended as an input
    aliased to output 0, so the kernel writes into that buffer (in place when it is donated)."""
    in_specs = [pl.no_block_spec] * len(inputs) if in_specs is None else list(in_specs)
    aliases = dict(aliases or {})
    if out is not None:
        aliases[len(inputs)] = 0
        inputs, in_specs = (*inputs, out), [*in_specs, pl.no_block_spec]
    return pl.pallas_call(
        kernel, grid=grid, out_shape=out_shape, in_specs=in_specs, input_output_aliases=aliases,
        interpret=interpret, name=name,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
    )(*inputs)
