"""How every kernel here is launched: pallas_call lowered through Triton. jax 0.10's Pallas GPU
default is Mosaic GPU (Hopper and newer only), so the Triton compiler params are passed explicitly;
that is also what makes `interpret=True` run the same kernel on CPU.

jax 0.11 deprecated Pallas Triton and may remove it. On a jax without it this package still imports
(the jnp references, the XLA cache writes and the Mosaic GPU kernels need no Triton), `AVAILABLE` is
False, `UNAVAILABLE` says why, and launching a Triton kernel raises that reason."""
from __future__ import annotations

import jax
from jax.experimental import pallas as pl

USED = ("CompilerParams", "load", "store", "dot")  # what the kernels here take from it


def _import():
    """-> (jax's Pallas Triton module or None, why it cannot be used or None)."""
    try:
        from jax.experimental.pallas import triton as module
    except ImportError as e:
        return None, f"jax {jax.__version__} has no Pallas Triton ({e})"
    missing = [name for name in USED if not hasattr(module, name)]
    if missing:
        return None, f"jax {jax.__version__}'s Pallas Triton lacks {', '.join(missing)}"
    return module, None


plgpu, UNAVAILABLE = _import()
AVAILABLE = UNAVAILABLE is None


def triton_call(kernel, inputs, out_shape, *, grid, name, interpret, num_warps, num_stages,
                in_specs=None, aliases=None, out=None):
    """-> the pallas_call's outputs. Inputs without a spec are whole arrays the kernel indexes
    itself; `aliases` maps input to output indices; `out`, when given, is appended as an input
    aliased to output 0, so the kernel writes into that buffer (in place when it is donated)."""
    if not AVAILABLE:
        raise RuntimeError(f"{name}: {UNAVAILABLE}; the Mosaic GPU kernels (Hopper) and the jnp "
                           "references (the *_reference functions) do not need it")
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
