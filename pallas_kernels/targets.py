"""The chip a kernel is built for: the local device, or an abstract one named for lowering ahead of
time on a machine that lacks it (jax's `AbstractDevice` inside `use_abstract_mesh`).

Tile tables are keyed by these target names. jax >= 0.11's Pallas Triton lowering reads the GPU it
lowers for from the abstract mesh and raises "No supported GPU devices found" without one, so GPU
lowering without a GPU always happens inside `abstract_target`; jax 0.10 ignores the abstract
device there and lowers for sm_90 (only fp8 casts differ by arch; ours have none). Mosaic (TPU)
reads the chip from it on both lines."""
from __future__ import annotations

import re

import jax
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

# name -> (platform, device_kind as the real device reports it, cores: SMs or TensorCores)
TARGETS = {
    "sm_90": ("gpu", "NVIDIA H100 80GB HBM3", 132),  # H100 and H200 (also sm_90, 132 SMs)
    "sm_80": ("gpu", "NVIDIA A100-SXM4-80GB", 108),
    "v5e": ("tpu", "TPU v5 lite", 1),
    "v6e": ("tpu", "TPU v6 lite", 1),
}
GPU_TARGETS = tuple(name for name, (platform, _, _) in TARGETS.items() if platform == "gpu")
TPU_TARGETS = tuple(name for name, (platform, _, _) in TARGETS.items() if platform == "tpu")
DEFAULT_GPU = "sm_90"  # off a GPU (CPU, interpret mode) the wrappers pick the H100's tiles
# From this jax on, the Pallas Triton lowering takes its arch from the abstract device (and
# without a GPU needs one); before it, it lowered for sm_90 unless a GPU was present.
TRITON_READS_ABSTRACT_GPU = (0, 11)


def abstract_target(name, axis_sizes=(1,), axis_names=("x",)):
    """-> a context manager under which jit/export trace and lower for target `name` (see TARGETS).
    Pass the axis sizes and names of the mesh the traced code shards over, if any; the axes are
    Explicit, which jax requires for a top-level abstract mesh to take effect."""
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; known: {sorted(TARGETS)}")
    platform, device_kind, cores = TARGETS[name]
    device = AbstractDevice(device_kind=device_kind, num_cores=cores, platform=platform)
    mesh = AbstractMesh(tuple(axis_sizes), tuple(axis_names),
                        axis_types=(AxisType.Explicit,) * len(axis_sizes), abstract_device=device)
    return jax.sharding.use_abstract_mesh(mesh)


def lowered_capability(name):
    """-> the compute capability jax's Triton lowering uses, on a machine without a GPU, under
    abstract_target(name): the target's on jax >= 0.11, sm_90's (jax's fallback) before."""
    if jax.__version_info__ >= TRITON_READS_ABSTRACT_GPU:
        return int(name.removeprefix("sm_"))
    return 90


def _device():
    """-> (platform, device_kind, compute capability or None) of the device being built for: the
    abstract one in force, unless it just mirrors the local device (as a concrete mesh's does), else
    a GPU set as jax's default device (`with jax.default_device(...)`), else the local device."""
    local = jax.local_devices()[0]
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    if abstract is not None and abstract.device_kind != local.device_kind:
        return abstract.platform, abstract.device_kind, None
    default = jax.config.jax_default_device
    if isinstance(default, jax.Device) and default.platform == "gpu":  # a compile-only GPU (gpu_target.py)
        local = default
    return local.platform, local.device_kind, getattr(local, "compute_capability", None)


def platform() -> str:
    """-> "gpu", "tpu" or "cpu": the platform of the device being built for (as `gpu_arch` finds it)."""
    name = _device()[0]
    return "gpu" if name == "cuda" else name


def gpu_arch():
    """-> the GPU target being built for ("sm_90", "sm_80", or "sm_XY" of another local GPU);
    DEFAULT_GPU when that is not a GPU."""
    platform, kind, capability = _device()
    if platform not in ("gpu", "cuda"):
        return DEFAULT_GPU
    if capability is not None:  # a real GPU reports "9.0"
        return "sm_" + str(capability).replace(".", "")
    return _named(kind, GPU_TARGETS, DEFAULT_GPU)


def tpu_target():
    """-> the TPU target being built for ("v5e", "v6e", or the device kind of another TPU); None
    when that is not a TPU."""
    platform, kind, _ = _device()
    if platform != "tpu":
        return None
    return _named(kind, TPU_TARGETS, kind)


def _named(kind, names, other):
    return next((name for name in names if TARGETS[name][1] == kind), other)


def _arch_number(arch):
    return int(re.sub(r"\D", "", arch) or 0)


def nearest(table, arch):
    """table[arch], else the row of the newest listed arch not newer than it (the oldest listed
    for an older one): sm_100 gets sm_90's row, sm_86 gets sm_80's."""
    if arch in table:
        return table[arch]
    listed = sorted(table, key=_arch_number)
    fits = [a for a in listed if _arch_number(a) <= _arch_number(arch)]
    return table[fits[-1] if fits else listed[0]]
