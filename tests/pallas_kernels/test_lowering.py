"""The GPU path lowers to Triton on a machine without a GPU, for an H100/H200 (sm_90) and an A100
(sm_80): `jax.export` for CUDA inside `targets.abstract_target` runs the Pallas Triton lowering of
every kernel (shapes that Triton cannot tile fail here) and the module holds one
`__gpu$xla.gpu.triton` custom call per pallas_call. test_cubin.py compiles what it holds."""
import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import (copy_blocks, paged_attention, ragged_paged_attention, targets,
                            triton_ir, write_kv)

ARCHS = pytest.mark.parametrize("arch", targets.GPU_TARGETS)
pytestmark = pytest.mark.triton


def triton_calls(module):
    """Kernel names of the Triton custom calls, in order."""
    return [name for name, _, _ in triton_ir.triton_calls(module)]


def spec(shape, dtype=jnp.int32):
    return jax.ShapeDtypeStruct(shape, dtype)


def attention_args(dtype, head_dim, num_tokens=6, num_seqs=6, group=4, block_size=16):
    pages = spec((2, 40, block_size, head_dim), dtype)
    return (spec((num_tokens, 2 * group, head_dim), dtype), pages, pages, spec((num_seqs, 7)),
            spec((num_seqs,)))


@ARCHS
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 80])
def test_decode_lowers_to_triton(dtype, head_dim, arch):
    args = attention_args(dtype, head_dim)
    one = triton_ir.export(functools.partial(paged_attention, num_splits=1, soft_cap=5.0), *args,
                           target=arch)
    assert triton_calls(one) == ["paged_attention_decode"]
    split = triton_ir.export(functools.partial(paged_attention, num_splits=4, sliding_window=100),
                             *args, target=arch)
    assert triton_calls(split) == ["paged_attention_decode_split", "paged_attention_combine"]


@ARCHS
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim,group", [(64, 1), (128, 8), (256, 4), (80, 3)])
def test_ragged_lowers_to_triton(dtype, head_dim, group, arch):
    args = attention_args(dtype, head_dim, num_tokens=45, num_seqs=5, group=group)
    module = triton_ir.export(
        functools.partial(ragged_paged_attention, soft_cap=5.0, sliding_window=64), *args,
        spec((6,)), target=arch)
    assert triton_calls(module) == ["ragged_paged_attention"]


@ARCHS
@pytest.mark.parametrize("block_size", [8, 256])
def test_cache_writes_lower_in_place(block_size, arch):
    """With the pages donated, the pages are both the aliased operand of the Triton call and an
    aliased output of the function: XLA writes the slots into the cache buffer itself."""
    pages = spec((2, 10, block_size, 128), jnp.bfloat16)
    new = spec((5, 2, 128), jnp.float32)
    write = triton_ir.export(write_kv, pages, pages, new, new, spec((5,)), donate=(0, 1),
                             target=arch)
    copy = triton_ir.export(copy_blocks, pages, pages, spec((3,)), spec((3,)), donate=(0, 1),
                            target=arch)
    for module, name in ((write, "write_kv"), (copy, "copy_blocks")):
        assert triton_calls(module) == [name]
        assert "output_operand_aliases" in module
        assert module.count("tf.aliasing_output") == 2


@ARCHS
def test_f32_dots_are_ieee_not_tf32(arch):
    """jax lowers a Triton dot with DEFAULT precision as `inputPrecision = tf32` (10-bit
    mantissa, ~1e-3 error); ours ask for HIGHEST, which is IEEE f32. Reads the Triton modules
    through jax's internal lowering hook (triton_ir fails, naming it, if jax moves it)."""
    args = attention_args(jnp.float32, 64)
    _, decode = triton_ir.triton_kernels(functools.partial(paged_attention, num_splits=1), *args,
                                         target=arch)
    _, ragged = triton_ir.triton_kernels(ragged_paged_attention, *args, spec((7,)), target=arch)
    assert [k.name for k in decode + ragged] == ["paged_attention_decode", "ragged_paged_attention"]
    for kernel in decode + ragged:
        assert kernel.ttir.count("tt.dot") >= 2
        assert "inputPrecision = tf32" not in kernel.ttir
        assert kernel.compute_capability == targets.lowered_capability(arch)


def test_without_an_abstract_gpu_jax_lowers_for_sm_90_or_asks_for_one():
    """What moved between jax lines: without an abstract target, jax lowers for the local GPU when
    there is one; without a GPU, jax 0.10 lowers for sm_90 and jax >= 0.11 refuses, naming
    AbstractDevice (so every lowering here goes through targets.abstract_target)."""
    plain = jax.export.export(
        jax.jit(functools.partial(paged_attention, num_splits=1)), platforms=("cuda",),
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(triton_ir.TRITON)])
    args = attention_args(jnp.bfloat16, 64)
    if jax.default_backend() != "gpu" and jax.__version_info__ >= targets.TRITON_READS_ABSTRACT_GPU:
        with pytest.raises(RuntimeError, match="No supported GPU devices found, please specify an "
                                               "abstract GPU device using AbstractDevice"):
            plain(*args)
    else:
        assert triton_calls(plain(*args).mlir_module()) == ["paged_attention_decode"]
