"""The compile-only GPU device (pallas_kernels/gpu_target.py): XLA's target configs in the repository,
the pinned ptxas, and a program compiled for each GPU without one. Each compile runs in a subprocess:
an architecture mismatch aborts the process. Needs the gpu-compile extra (line 2g of
scripts/test.sh); skipped where the CUDA plugin is not installed."""
import json
import os
import subprocess
import sys

import pytest

from pallas_kernels import gpu_target

pytest.importorskip("jax_plugins.xla_cuda12", reason="needs pip install -e '.[gpu-compile]'")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MATMUL = """
import json, sys
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from pallas_kernels import gpu_target
device = gpu_target.compile_only_device(sys.argv[1])
placed = NamedSharding(Mesh([device], ("x",)), P())
x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=placed)
w = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16, sharding=placed)
compiled = jax.jit(jnp.matmul).trace(x, w).lower().compile()
memory = compiled.memory_analysis()
print(json.dumps({"kind": device.device_kind, "arguments": memory.argument_size_in_bytes,
                  "output": memory.output_size_in_bytes,
                  "flops": gpu_target.compiled_cost(compiled)["flops"]}))
"""


def run_python(code, *args, path=None):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    if path is not None:
        env["PATH"] = path
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("gpu", gpu_target.GPUS)
def test_a_matmul_compiles_for_the_gpu_without_one(gpu):
    result = json.loads(run_python(MATMUL, gpu))
    # Hopper's GEMM fusion adds an epilogue pass over the f32 accumulator (4 flops an element).
    flops = result.pop("flops")
    assert flops == pytest.approx(2 * 256 * 512 * 1024, rel=0.004)
    assert result == {"kind": gpu_target.DEVICE_NAMES[gpu], "arguments": (256 * 512 + 512 * 1024) * 2,
                      "output": 256 * 1024 * 2}


def test_specs_match_the_datasheets():
    # NVIDIA's datasheets: H100 SXM 80 GB, 3.35 TB/s, 989 TFLOP/s dense bf16; H200 141 GB,
    # 4.8 TB/s, same SMs and clocks; A100 SXM4 80 GB, 2.04 TB/s, 312 TFLOP/s.
    expected = {"h100": ("9.0", 3.35e12, 989e12), "h200": ("9.0", 4.8e12, 989e12),
                "a100": ("8.0", 2.04e12, 312e12)}
    for gpu, (capability, bandwidth, flops) in expected.items():
        spec = gpu_target.gpu_spec(gpu)
        assert spec.name == gpu_target.DEVICE_NAMES[gpu]
        assert spec.compute_capability == capability
        assert spec.bandwidth == pytest.approx(bandwidth, rel=0.01)
        assert spec.peak_bf16_flops == pytest.approx(flops, rel=0.01)
    assert gpu_target.gpu_spec("h100").memory_bytes == 84942979072  # 79.1 GiB usable of 80 GB


def test_the_wheel_ptxas_goes_first_on_path(tmp_path):
    # A ptxas that fails, first on PATH, as a too-old system CUDA would be.
    fake = tmp_path / "ptxas"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    code = "from pallas_kernels import gpu_target; import shutil; " \
           "print(gpu_target.pip_ptxas() == shutil.which('ptxas'), gpu_target.pip_ptxas())"
    same, used = run_python(code, path=f"{tmp_path}{os.pathsep}{os.environ['PATH']}").split()
    assert same == "True"
    assert used.endswith(os.path.join("nvidia", "cuda_nvcc", "bin", "ptxas"))


def test_an_unknown_gpu_is_refused_by_name():
    with pytest.raises(ValueError, match="'v100'"):
        gpu_target.target_config_text("v100")
