"""Every Mosaic GPU attention variant the engine can launch compiles deviceless for H100 and H200
(pallas_kernels/mosaic/compile_check.py) with no spills and its shared memory within sm_90's limit.
Each compile is a subprocess whose stats are cached by the kernel source, variant, GPU and jax
version, so a rerun of unchanged code reads them. Needs jax >= 0.12 with the CUDA plugin and the
compile-only GPU device (pallas_kernels.gpu_target)."""
import pytest

from pallas_kernels import mosaic

pytestmark = [pytest.mark.skipif(not mosaic.AVAILABLE, reason=str(mosaic.UNAVAILABLE)),
              pytest.mark.timeout(900)]
gpu_target = pytest.importorskip("pallas_kernels.gpu_target",
                                 reason="needs the compile-only GPU device (gpu_target)")
from pallas_kernels.mosaic import compile_check  # noqa: E402

@pytest.fixture(scope="module")
def compiled():
    """(gpu, variant) -> KernelStats, compiled two at a time (or read from the cache)."""
    return dict(zip(compile_check.BUILDS, compile_check.compiled_all(compile_check.BUILDS)))


@pytest.mark.parametrize("gpu,variant", compile_check.BUILDS,
                         ids=[f"{g} {v}" for g, v in compile_check.BUILDS])
def test_compiles_without_spills_within_shared_memory(compiled, gpu, variant):
    stats = compiled[gpu, variant]
    assert stats.spill_stores == stats.spill_loads == stats.stack == 0, stats
    assert stats.registers <= 255
    assert stats.shared <= compile_check.SHARED_LIMIT
    assert stats.blocks_per_sm() >= 1
