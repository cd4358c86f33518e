"""GPU code without a GPU: the Triton IR jax lowers for a kernel (`triton_ir`), compiled to a cubin
for sm_80/sm_90 by the `triton` package from PyPI (its ptxas, cuobjdump and nvdisasm ship inside
the wheel), and what the cubin costs: registers, spill stores, shared memory, 128-bit loads.

XLA compiles the same module with its own copy of Triton's passes and ptxas, so these numbers are
Triton's build of our IR, close to XLA's but not byte-identical. `triton` is a test dependency,
imported on use: the kernels themselves need only jax."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import tempfile

# Shared memory one block may use (the opt-in maximum of the CUDA C++ Programming Guide's table of
# compute capabilities) and registers one thread may use.
SHARED_LIMIT = {"sm_90": 227 * 1024, "sm_80": 163 * 1024}
MAX_REGISTERS = 255


@dataclasses.dataclass(frozen=True)
class CubinStats:
    registers: int  # per thread
    stack: int  # bytes of local memory per thread: spills (Triton allocates no local arrays)
    spill_stores: int  # STL instructions in the SASS
    shared: int  # bytes of shared memory per block (Triton's dynamic allocation)
    cubin_bytes: int
    loads_128: int  # 128-bit global loads (LDG.E.128, or cp.async LDGSTS .128 into shared memory)
    loads_narrow: int  # narrower global loads (indices, masked or unaligned rows)

    def fits(self, arch):
        """-> '' when the kernel can launch on `arch` without spilling, else what is wrong."""
        problems = []
        if self.shared > SHARED_LIMIT[arch]:
            problems.append(f"shared memory {self.shared} > {SHARED_LIMIT[arch]} bytes")
        if self.registers > MAX_REGISTERS:
            problems.append(f"{self.registers} registers > {MAX_REGISTERS}")
        if self.spill_stores or self.stack:
            problems.append(f"{self.spill_stores} spill stores, {self.stack} bytes of stack")
        return "; ".join(problems)


def _tool(name):
    import triton  # noqa: F401  (knobs locate the binaries inside the wheel)
    from triton import knobs
    return getattr(knobs.nvidia, name).path


def sass_stats(cubin):
    """-> the CubinStats of a single-kernel cubin, read by cuobjdump. `shared` is left 0: Triton
    allocates it at launch, and the size is in its compile metadata (compile_ttir)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", path], check=True,
                               capture_output=True, text=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", path], check=True,
                              capture_output=True, text=True).stdout
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    loads = [op for op in ops if op.startswith(("LDG.", "LDGSTS."))]
    wide = sum(op.endswith(".128") for op in loads)
    return CubinStats(registers=int(re.search(r"REG:(\d+)", usage).group(1)),
                      stack=int(re.search(r"STACK:(\d+)", usage).group(1)),
                      spill_stores=sum(op.startswith("STL") for op in ops), shared=0,
                      cubin_bytes=len(cubin), loads_128=wide, loads_narrow=len(loads) - wide)


def compile_ttir(ttir, arch, num_warps, num_stages):
    """-> CubinStats of Triton IR text compiled for `arch` ("sm_90", "sm_80") with the launch
    parameters jax passes XLA."""
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ttir")  # triton.compile reads the stage from the suffix
        with open(path, "w") as f:
            f.write(ttir)
        kernel = triton.compile(path, target=GPUTarget("cuda", int(arch[3:]), 32), options=dict(
            num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=True))
    stats = sass_stats(kernel.asm["cubin"])
    return dataclasses.replace(stats, shared=int(kernel.metadata.shared))


CACHE_DIR = os.environ.get("PAGED_JAX_CUBIN_CACHE",
                           os.path.join(os.path.expanduser("~"), ".cache", "paged-jax", "cubin"))
STATS_VERSION = 1  # bump when compile_ttir or sass_stats measure differently: old entries go stale


def _cache_file(job):
    """Stats are a function of the IR, the target, the launch parameters and the Triton release
    (which ships its ptxas): one file per such key. Triton's own cache does not carry over between
    jax lines, as it keys on its binary, which differs between Python versions."""
    key = hashlib.sha256(json.dumps([*job, triton_version(), STATS_VERSION]).encode()).hexdigest()
    return os.path.join(CACHE_DIR, key[:40] + ".json")


def _compiled(job):
    """-> CubinStats of one job, from CACHE_DIR or compiled (and stored there)."""
    path = _cache_file(job)
    if os.path.exists(path):
        with open(path) as f:
            return CubinStats(**json.load(f))
    stats = compile_ttir(*job)
    os.makedirs(CACHE_DIR, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=CACHE_DIR, delete=False) as f:
        json.dump(dataclasses.asdict(stats), f)
    os.replace(f.name, path)  # atomic: a concurrent reader sees all of it or nothing
    return stats


def compile_all(jobs, workers=None):
    """-> [CubinStats] of jobs [(ttir, arch, num_warps, num_stages)], each distinct one compiled
    once (stats kept in CACHE_DIR, so the other jax line, which lowers the same IR, and later runs
    reuse them), on `workers` threads (default: one per CPU; Triton's passes and ptxas run
    outside the GIL)."""
    todo = list(dict.fromkeys(jobs))
    with concurrent.futures.ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
        stats = dict(zip(todo, pool.map(_compiled, todo)))
    return [stats[job] for job in jobs]


def triton_version():
    import triton
    return triton.__version__
