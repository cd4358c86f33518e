"""Every Mosaic GPU attention variant the engine can launch compiles deviceless for H100 and H200
(pallas_kernels/mosaic/compile_check.py) with no spills and its shared memory within sm_90's limit,
and for a B200 (the tcgen05 kernel) the same, but for the one variant whose spill is known.
Each compile is a subprocess whose stats are cached by the kernel source, variant, GPU and jax
version, so a rerun of unchanged code reads them. Needs jax >= 0.12 with the CUDA plugin and the
compile-only GPU device (pallas_kernels.gpu_target)."""
import pytest

from pallas_kernels import mosaic

pytestmark = [pytest.mark.skipif(not mosaic.AVAILABLE, reason=str(mosaic.UNAVAILABLE)),
              pytest.mark.timeout(900)]
pytest.importorskip("jax_plugins.xla_cuda12", reason="needs pip install -e '.[gpu-compile]'")
gpu_target = pytest.importorskip("pallas_kernels.gpu_target",
                                 reason="needs the compile-only GPU device (gpu_target)")
from pallas_kernels.mosaic import compile_check  # noqa: E402

# (spill stores, spill loads, stack) in bytes of the one variant known to spill: B200's ragged
# kernel with fp8 pages at head_dim 256 under a soft cap, at 255 registers (its fp8 keys are
# dequantized 128 columns at a time, one swizzled tile, the least a slice may take).
KNOWN_SPILLS = {("b200", ("ragged", "bfloat16", "float8_e4m3fn", 256, 32, 50.0, 4096, 2)): (24, 16, 16)}


@pytest.fixture(scope="module")
def compiled():
    """(gpu, variant) -> KernelStats, compiled two at a time (or read from the cache)."""
    return dict(zip(compile_check.BUILDS, compile_check.compiled_all(compile_check.BUILDS)))


@pytest.mark.parametrize("gpu,variant", compile_check.BUILDS,
                         ids=[f"{g} {v}" for g, v in compile_check.BUILDS])
def test_compiles_without_spills_within_shared_memory(compiled, gpu, variant):
    stats = compiled[gpu, variant]
    spills = (stats.spill_stores, stats.spill_loads, stats.stack)
    assert spills == KNOWN_SPILLS.get((gpu, variant), (0, 0, 0)), stats
    assert stats.registers <= 255
    assert stats.shared <= compile_check.SHARED_LIMIT
    assert stats.blocks_per_sm() >= 1
