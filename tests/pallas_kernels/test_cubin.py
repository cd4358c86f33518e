"""Every kernel variant the engine can launch, compiled to real GPU code on a machine without a GPU:
the Triton IR jax lowers for each build of `gpu_variants.engine_builds()`, compiled by the `triton`
package (a test dependency) to an sm_90 or sm_80 cubin that must launch there (shared memory and
registers within the arch's limits) without spilling, at the default tiles of DECODE_TILES and
RAGGED_TILES. jax 0.10 and 0.12 lower the same IR, so on the second jax line of scripts/test.sh
the stats come from `cubin.CACHE_DIR` (keyed by IR, target, launch parameters and Triton release);
the spill check below runs triton on every line."""
import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import cubin, gpu_variants, targets, triton_ir
from pallas_kernels.paged_attention import DECODE_TILES, decode_tiles
from pallas_kernels.ragged_paged_attention import ragged_tiles

# The module fixture compiles every build (about 8 minutes on a loaded 2-core machine when the stats
# are not cached yet); that setup counts against its first test's limit.
pytestmark = [pytest.mark.timeout(1800), pytest.mark.triton]

BUILDS = gpu_variants.engine_builds()
NAMES = {
    "decode": ["paged_attention_decode"],
    "decode_split": ["paged_attention_decode_split", "paged_attention_combine"],
    "ragged": ["ragged_paged_attention"],
    "write_kv": ["write_kv"],
    "copy_blocks": ["copy_blocks"],
}


@pytest.fixture(scope="module")
def compiled():
    """(variant, arch) -> [(TritonKernel, CubinStats)] in launch order, compiled in parallel."""
    launches = {}
    for variant, arch in BUILDS:
        fn, args = variant.call()
        launches[variant, arch] = triton_ir.triton_kernels(fn, *args, target=arch)[1]
    stats = iter(cubin.compile_all([(k.ttir, arch, k.num_warps, k.num_stages)
                                    for (_, arch), kernels in launches.items() for k in kernels]))
    return {build: [(k, next(stats)) for k in kernels] for build, kernels in launches.items()}


def launch_params(variant, arch):
    """-> (num_warps, num_stages) the wrappers pass for this variant: its tile table's row."""
    quantized = variant.kv_dtype is not None
    if variant.kernel in ("decode", "decode_split"):
        tiles = decode_tiles(variant.dtype, variant.head_dim, arch, quantized)
    elif variant.kernel == "ragged":
        tiles = ragged_tiles(variant.dtype, variant.head_dim, arch, quantized)
    else:
        return 4, 1  # write_kv, copy_blocks: fixed (kv_cache.py)
    return tiles["num_warps"], tiles["num_stages"]


@pytest.mark.parametrize("variant,arch", BUILDS, ids=[f"{v.label} {a}" for v, a in BUILDS])
def test_compiles_to_a_cubin_that_fits_without_spills(compiled, variant, arch):
    kernels = compiled[variant, arch]
    assert [kernel.name for kernel, _ in kernels] == NAMES[variant.kernel]
    for kernel, stats in kernels:
        assert (kernel.num_warps, kernel.num_stages) == launch_params(variant, arch)
        assert kernel.compute_capability == targets.lowered_capability(arch)
        assert stats.fits(arch) == "", f"{kernel.name} on {arch}: {stats}"
        assert stats.spill_stores == 0 and stats.stack == 0
        assert stats.registers <= cubin.MAX_REGISTERS
        assert stats.shared <= cubin.SHARED_LIMIT[arch]
        # K/V rows (or partials) move 128 bits per load; not the 64-byte int8/fp8 rows of a
        # hd64 block copy (Triton's choice)
        narrow = variant.kernel == "copy_blocks" and variant.kv_dtype and variant.head_dim == 64
        assert stats.loads_128 > 0 or narrow


def test_the_tiles_before_issue_12_spill():
    """The check sees spills: f32 decode at hd128 with the tiles it had before DECODE_TILES (64
    keys, 4 warps, 2 stages) compiles on sm_90 to 255 registers and 189 spill stores, 480 bytes of
    stack (issue 12 measured 255 and 194 by hand at other table and pool sizes)."""
    variant = gpu_variants.Variant("decode", "float32", 128)
    fn, args = variant.call()
    fn = functools.partial(fn, block_n=64, num_warps=4, num_stages=2)
    [kernel] = triton_ir.triton_kernels(fn, *args, target="sm_90")[1]
    stats = cubin.compile_ttir(kernel.ttir, "sm_90", 4, 2)  # past CACHE_DIR: triton runs here
    assert (stats.registers, stats.spill_stores, stats.stack) == (255, 189, 480)
    assert stats.fits("sm_90") == "189 spill stores, 480 bytes of stack"


def test_tile_tables_cover_every_dtype_and_head_dim_on_each_target():
    for arch in targets.GPU_TARGETS:
        for dtype in gpu_variants.DTYPES:
            for head_dim in (1, 16, 64, 80, 128, 200, 256):
                assert decode_tiles(dtype, head_dim, arch)["block_n"] >= 16
                assert ragged_tiles(dtype, head_dim, arch)["block_m"] >= 16
    # sm_80 has its own head_dim 96 row (sm_90's spilled there); another GPU takes the row of the
    # newest listed arch not newer than it
    assert {k: v for k, v in DECODE_TILES["sm_80"].items() if k[1] != 96} == \
        {k: v for k, v in DECODE_TILES["sm_90"].items() if k[1] != 96}
    assert decode_tiles(jnp.float32, 128, "sm_100") == dict(block_n=32, num_warps=8, num_stages=2)
    assert ragged_tiles(jnp.bfloat16, 64, "sm_75") == dict(block_m=64, block_n=64, num_warps=8,
                                                          num_stages=2)  # sm_80's row


def test_wrappers_read_the_tiles_of_the_target_being_built_for(monkeypatch):
    """Under abstract_target the wrapper looks its tiles up for that arch."""
    seen = []
    lookup = targets.nearest

    def spy(table, arch):
        seen.append(arch)
        return lookup(table, arch)

    monkeypatch.setattr(targets, "nearest", spy)
    fn, args = gpu_variants.Variant("decode", "bfloat16", 128).call()
    for arch in ("sm_80", "sm_90"):
        triton_ir.export(fn, *args, target=arch)
    assert seen == ["sm_80", "sm_90"]
    jax.eval_shape(fn, *args)  # no abstract GPU: this CPU machine builds with the default's tiles
    assert seen[-1] == targets.DEFAULT_GPU
