"""The GPU path lowers to Triton on a machine without a GPU: `jax.export` for CUDA runs the Pallas
Triton lowering of every kernel (shapes that Triton cannot tile fail here) and the module holds one
`__gpu$xla.gpu.triton` custom call per pallas_call."""
import functools
import re

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import copy_blocks, paged_attention, ragged_paged_attention, write_kv

TRITON = "__gpu$xla.gpu.triton"


def export_cuda(f, *args, donate=()):
    exported = jax.export.export(
        jax.jit(f, donate_argnums=donate), platforms=("cuda",),
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])(*args)
    return exported.mlir_module()


def triton_calls(module):
    """Kernel names of the Triton custom calls, in order."""
    names = []
    for call in module.split(f"@{TRITON}(")[1:]:
        names.append(re.search(r'name = "([^"]*)"', call).group(1))
    return names


def spec(shape, dtype=jnp.int32):
    return jax.ShapeDtypeStruct(shape, dtype)


def attention_args(dtype, head_dim, num_tokens=6, num_seqs=6, group=4, block_size=16):
    pages = spec((2, 40, block_size, head_dim), dtype)
    return (spec((num_tokens, 2 * group, head_dim), dtype), pages, pages, spec((num_seqs, 7)),
            spec((num_seqs,)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 80])
def test_decode_lowers_to_triton(dtype, head_dim):
    args = attention_args(dtype, head_dim)
    one = export_cuda(functools.partial(paged_attention, num_splits=1, soft_cap=5.0), *args)
    assert triton_calls(one) == ["paged_attention_decode"]
    split = export_cuda(functools.partial(paged_attention, num_splits=4, sliding_window=100), *args)
    assert triton_calls(split) == ["paged_attention_decode_split", "paged_attention_combine"]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim,group", [(64, 1), (128, 8), (256, 4), (80, 3)])
def test_ragged_lowers_to_triton(dtype, head_dim, group):
    args = attention_args(dtype, head_dim, num_tokens=45, num_seqs=5, group=group)
    module = export_cuda(functools.partial(ragged_paged_attention, soft_cap=5.0, sliding_window=64),
                         *args, spec((6,)))
    assert triton_calls(module) == ["ragged_paged_attention"]


@pytest.mark.parametrize("block_size", [8, 256])
def test_cache_writes_lower_in_place(block_size):
    """With the pages donated, the pages are both the aliased operand of the Triton call and an
    aliased output of the function: XLA writes the slots into the cache buffer itself."""
    pages = spec((2, 10, block_size, 128), jnp.bfloat16)
    new = spec((5, 2, 128), jnp.float32)
    write = export_cuda(write_kv, pages, pages, new, new, spec((5,)), donate=(0, 1))
    copy = export_cuda(copy_blocks, pages, pages, spec((3,)), spec((3,)), donate=(0, 1))
    for module, name in ((write, "write_kv"), (copy, "copy_blocks")):
        assert triton_calls(module) == [name]
        assert "output_operand_aliases" in module
        assert module.count("tf.aliasing_output") == 2


def test_f32_dots_are_ieee_not_tf32(monkeypatch):
    """jax lowers a Triton dot with DEFAULT precision as `inputPrecision = tf32` (10-bit
    mantissa, ~1e-3 error); ours ask for HIGHEST, which is IEEE f32. Reads the Triton module
    through jax's internal lowering hook."""
    registration = pytest.importorskip("jax._src.pallas.triton.pallas_call_registration")
    lower = getattr(registration.lowering, "lower_jaxpr_to_triton_module", None)
    assert lower is not None, "jax moved its Triton lowering hook: point this test at the new one"
    modules = []

    def spy(*args, **kwargs):
        result = lower(*args, **kwargs)
        modules.append(result.module.operation.get_asm())
        return result

    monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", spy)
    args = attention_args(jnp.float32, 64)
    export_cuda(functools.partial(paged_attention, num_splits=1), *args)
    export_cuda(ragged_paged_attention, *args, spec((7,)))
    assert len(modules) == 2
    for module in modules:
        assert module.count("tt.dot") >= 2
        assert "inputPrecision = tf32" not in module
