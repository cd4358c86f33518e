"""A GPU that XLA compiles for without one: a compile-only device built from the GPU's target config.

XLA's GPU compiler (the jax-cuda12-pjrt plugin) compiles whole programs, Pallas kernels included,
for a `stream_executor.GpuTargetConfigProto` text with no GPU present ("deviceless compilation").
The texts are XLA's own, read out of the plugin by scripts/extract_gpu_target_configs.py and kept
in gpu_target_configs/. Needs `pip install -e '.[gpu-compile]'` and JAX_PLATFORMS=cpu (without it
the plugin looks for cuDNN and a driver). An architecture mismatch can abort the process (an LLVM
"Cannot select"), so callers compile each target in a subprocess."""
from __future__ import annotations

import functools
import os
import re
import shutil
from dataclasses import dataclass

import jax

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "gpu_target_configs")
# short name -> the device_description_str of XLA's text (what the real device reports)
DEVICE_NAMES = {
    "h100": "NVIDIA H100 80GB HBM3",
    "h200": "NVIDIA H200 141GB HBM3e",
    "a100": "NVIDIA A100-SXM4-80GB",
    "b200": "NVIDIA B200",
}
GPUS = ("h100", "h200", "a100")  # the GPUs CI compiles the engine for; b200 is available too
# xla::PrimitiveType numbers, the keys of the text's rate_infos
_BF16 = 16


@dataclass(frozen=True)
class GpuSpec:
    """What a roofline needs, read from the target config."""
    name: str                # device_description_str
    compute_capability: str  # "9.0"
    memory_bytes: int        # device_memory_size
    bandwidth: float         # memory_bandwidth, bytes/s
    peak_bf16_flops: float   # dense bf16 matrix-unit flops/s: 2 * SMs * units * ops/clock * clock


def target_config_text(gpu: str) -> str:
    """-> XLA's GpuTargetConfigProto text for `gpu` (a key of DEVICE_NAMES)."""
    if gpu not in DEVICE_NAMES:
        raise ValueError(f"unknown gpu {gpu!r}; known: {sorted(DEVICE_NAMES)}")
    with open(os.path.join(CONFIG_DIR, gpu + ".txtpb")) as f:
        return f.read()


def pip_ptxas() -> str:
    """-> the ptxas that XLA will use, after putting the nvidia-cuda-nvcc-cu12 wheel's first on PATH.
    XLA searches PATH, then /usr/local/cuda, then that wheel; a system CUDA older than the PTX that
    triton 3.9 emits for sm_90 fails ("Unsupported .version"), so the wheel's is pinned."""
    try:
        import nvidia.cuda_nvcc
    except ImportError as e:
        raise RuntimeError("no nvidia-cuda-nvcc-cu12: pip install -e '.[gpu-compile]'") from e
    bin_dir = os.path.join(list(nvidia.cuda_nvcc.__path__)[0], "bin")
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != bin_dir:
        os.environ["PATH"] = bin_dir + os.pathsep + path
    found = shutil.which("ptxas")
    if found is None or os.path.dirname(found) != bin_dir:
        raise RuntimeError(f"ptxas not found in {bin_dir}")
    return found


@functools.cache
def compile_only_devices(gpu: str, count: int = 1) -> tuple[jax.Device, ...]:
    """-> `count` compile-only devices of `gpu` on one host (topology 1x1xcount), for meshes of
    tensor parallelism; programs placed on them compile and never run."""
    if os.environ.get("JAX_PLATFORMS") != "cpu":
        raise RuntimeError("set JAX_PLATFORMS=cpu before jax starts: the CUDA plugin otherwise "
                           "looks for a driver and cuDNN")
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    pip_ptxas()
    from jax.experimental import topologies
    topology = topologies.get_topology_desc(gpu, "cuda", target_config=target_config_text(gpu),
                                            topology=f"1x1x{count}")
    return tuple(topology.devices)


def compile_only_device(gpu: str) -> jax.Device:
    """-> one compile-only device of `gpu` ("h100", "h200", "a100", "b200"). Compile under
    `with jax.default_device(device):` so Pallas kernels target its architecture too."""
    return compile_only_devices(gpu, 1)[0]


def jax_bytes_limit(memory_bytes: int) -> int:
    """-> the `bytes_limit` jax's GPU allocator reports on a GPU of `memory_bytes`: it takes
    XLA_PYTHON_CLIENT_MEM_FRACTION of the memory (0.75 unless set; jax's "GPU memory allocation"
    docs), and gpu_memory_utilization is a fraction of that limit."""
    return int(memory_bytes * float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")))


def _field(text, name):
    match = re.search(rf'^\s*{name}: ("[^"]*"|\S+)', text, re.MULTILINE)
    if match is None:
        raise ValueError(f"target config lacks {name}")
    return match.group(1).strip('"')


def gpu_spec(gpu: str) -> GpuSpec:
    """-> `gpu`'s memory, bandwidth and bf16 matrix peak as XLA's target config states them
    (H100 SXM: 3.35 TB/s and 989 TFLOP/s dense bf16, NVIDIA's H100 datasheet; A100 SXM4 80GB:
    2.04 TB/s and 312 TFLOP/s, NVIDIA's A100 datasheet; the texts agree within 1%)."""
    text = target_config_text(gpu)
    matrix = text[text.index("matrix_unit_description"):]
    rate = re.search(rf"key: {_BF16}\s*value {{\s*clock_rate_ghz: (\S+)\s*units_per_core: (\d+)"
                     r"\s*ops_per_clock: (\d+)", matrix)
    if rate is None:
        raise ValueError(f"target config of {gpu} has no bf16 matrix rate")
    clock, units, ops = float(rate.group(1)), int(rate.group(2)), int(rate.group(3))
    cores = int(_field(text, "core_count"))
    capability = re.search(r"cuda_compute_capability {\s*major: (\d+)(?:\s*minor: (\d+))?", text)
    return GpuSpec(name=_field(text, "device_description_str"),
                   compute_capability=f"{capability.group(1)}.{capability.group(2) or 0}",
                   memory_bytes=int(_field(text, "device_memory_size")),
                   bandwidth=float(_field(text, "memory_bandwidth")),
                   peak_bf16_flops=2 * cores * units * ops * clock * 1e9)


def compiled_cost(compiled) -> dict:
    """-> XLA's HloCostAnalysis ("flops", "bytes accessed", ...) of a deviceless-compiled program's
    optimized HLO. The compile-only executable answers cost_analysis() with None (there is no GPU
    client to ask), so the same analysis runs through the CPU client on the GPU's fused HLO; a
    custom call (a Pallas kernel) counts as no flops there."""
    from jax._src.lib import _jax
    cpu = jax.devices("cpu")[0].client
    modules = compiled.runtime_executable().hlo_modules()
    return _jax.hlo_module_cost_analysis(cpu, modules[0])
