"""jax deprecated Pallas Triton in 0.11 and may drop it. On such a jax (simulated: tests/without_triton.py
hides the module) the package still imports, the CPU engine tells stories260K's published story,
"auto" resolves to Mosaic GPU on Hopper and to the jnp reference on other GPUs, asking for Triton
names why, and (jax 0.12) the engine runs Hopper's path, Mosaic GPU attention with XLA's cache
writes, in the Mosaic GPU interpreter. The whole suite runs that way with
`PAGED_JAX_WITHOUT_TRITON=1 pytest` (tests marked `triton` skip)."""
import os
import subprocess
import sys
from pathlib import Path

from pallas_kernels import mosaic
from tests import without_triton

ROOT = Path(__file__).resolve().parents[2]
ENGINE_ON_MOSAIC = "test_engine_backends.py::test_pallas_mosaic_interpret_matches_the_reference_backend[bfloat16]"
TESTS = ["tests/paged_jax/test_mosaic_backend.py", f"tests/paged_jax/{ENGINE_ON_MOSAIC}",
         "tests/paged_jax/test_real_checkpoint.py::test_greedy_from_bos_is_the_published_story",
         "tests/pallas_kernels/test_kv_cache.py"]


def test_a_jax_without_pallas_triton_runs_the_engine():
    env = dict(os.environ, JAX_PLATFORMS="cpu", **{without_triton.ENV: "1"})
    result = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-rs", *TESTS],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    out = result.stdout
    assert result.returncode == 0, out[-6000:] + result.stderr[-3000:]
    assert "needs Pallas Triton: jax" in out and "has no Pallas Triton" in out, out[-3000:]  # it was hidden
    passed = {line.split(" PASSED")[0] for line in out.splitlines() if " PASSED" in line}
    expected = {"test_mosaic_backend.py::test_auto_without_triton_is_mosaic_on_hopper_else_the_reference",
                "test_real_checkpoint.py::test_greedy_from_bos_is_the_published_story",
                "test_kv_cache.py::test_scatter_write_puts_each_token_at_its_slot[9]",
                "test_kv_cache.py::test_scatter_copy_skips_pairs_out_of_range"}
    if mosaic.AVAILABLE:  # bf16 alone here: the main run has both dtypes, and neither path uses Triton
        expected.add(ENGINE_ON_MOSAIC)
    assert expected <= {name.split("/")[-1] for name in passed}, out[-3000:]
