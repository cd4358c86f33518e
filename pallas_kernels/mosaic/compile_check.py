"""Every Mosaic GPU attention variant the engine can launch, compiled for a Hopper (or Blackwell)
GPU on a machine without one: a deviceless XLA compile (pallas_kernels.gpu_target) turns the
kernel's `mosaic_gpu_v2` custom call into sm_90a (sm_100a) code, and ptxas's report
(MOSAIC_GPU_DUMP_PTXAS) gives its registers and spills. Each compile runs in a subprocess (an architecture mismatch can abort the
process) and its stats are cached under cubin.CACHE_DIR, keyed by the kernels' sources, the
variant, the GPU and the jax version.

  python -m pallas_kernels.mosaic.compile_check GPU KIND DTYPE KV_DTYPE HEAD_DIM BLOCK_SIZE \
      SOFT_CAP WINDOW GROUP
prints one variant's stats as JSON (KIND: decode, decode-split (one sequence, split-k over 4
programs) or ragged; KV_DTYPE: the pages', DTYPE for
unquantized; SOFT_CAP, WINDOW: 0 for none)."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import glob
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

from pallas_kernels import cubin

GPUS = ("h100", "h200", "b200")
ARCH = {"h100": "sm_90", "h200": "sm_90", "b200": "sm_100"}
SHARED_LIMIT = 227 * 1024  # sm_90's largest shared memory per block
REGISTERS_PER_SM = 65536
THREADS = 128  # one warpgroup per program
# (kind, dtype, kv_dtype, head_dim, block_size, soft_cap, sliding_window, group): each dtype,
# page dtype and head_dim the kernel takes, plain and with both options (they add code to the
# inner loop); block sizes 8 and 16 issue 8 and 4 copies per step, 128 one 64-row slice; int8 and
# fp8 pages at block_size 32, the least they take (support.MIN_QUANTIZED_BLOCK_SIZE). Both
# wrappers launch the same kernel (the group is a constant in its row arithmetic), so ragged needs
# fewer rows. Split-k adds code (the step share, the log2 sums' store): the benchmark's shape, the
# column halves, both options, and int8 pages (the most registers). f32 (f16 halves: the most
# registers and shared memory) at both head_dims it takes, in each kernel.
VARIANTS = [
    ("decode", "bfloat16", "bfloat16", 256, 16, 0, 0, 8),
    ("decode", "float16", "float16", 256, 8, 50.0, 4096, 2),  # Gemma-2's shape
    ("decode", "bfloat16", "bfloat16", 64, 16, 0, 0, 8),
    ("decode", "bfloat16", "bfloat16", 128, 16, 0, 0, 8),
    ("decode", "bfloat16", "bfloat16", 128, 8, 30.0, 4096, 8),
    ("decode", "bfloat16", "bfloat16", 128, 128, 0, 0, 1),
    ("decode", "float16", "float16", 64, 128, 30.0, 4096, 4),
    ("decode", "float16", "float16", 128, 16, 0, 0, 8),
    ("decode", "bfloat16", "int8", 128, 32, 0, 0, 8),
    ("decode", "bfloat16", "float8_e4m3fn", 64, 32, 30.0, 4096, 4),
    ("decode", "bfloat16", "int8", 256, 32, 0, 0, 8),  # the keys cast 128 columns at a time
    ("decode", "float32", "float32", 64, 8, 30.0, 4096, 4),
    ("decode", "float32", "float32", 128, 16, 0, 0, 8),
    ("decode", "float32", "float32", 128, 8, 30.0, 4096, 8),
    ("decode-split", "bfloat16", "bfloat16", 128, 16, 0, 0, 8),
    ("decode-split", "bfloat16", "bfloat16", 256, 16, 0, 0, 8),
    ("decode-split", "float16", "float16", 64, 128, 30.0, 4096, 4),
    ("decode-split", "bfloat16", "int8", 128, 32, 0, 0, 8),
    ("decode-split", "float32", "float32", 128, 16, 30.0, 4096, 8),
    ("ragged", "bfloat16", "bfloat16", 128, 16, 0, 0, 4),
    ("ragged", "float16", "float16", 64, 8, 30.0, 4096, 8),
    ("ragged", "bfloat16", "int8", 128, 32, 0, 0, 4),
    ("ragged", "bfloat16", "bfloat16", 256, 16, 50.0, 4096, 2),
    ("ragged", "bfloat16", "float8_e4m3fn", 256, 32, 50.0, 4096, 2),
    ("ragged", "float32", "float32", 128, 16, 30.0, 4096, 4),
    ("ragged", "float32", "float32", 64, 8, 0, 0, 8),
]
# H100 and H200 are both sm_90a (the same code; their target configs differ in memory and clocks),
# so H200 compiles decode at the benchmark's head_dim (128, block size 16; 32 for int8) in each
# dtype, H100 every variant.
BUILDS = ([("h100", v) for v in VARIANTS]
          + [("h200", v) for v in VARIANTS if v[0].startswith("decode") and v[3] == 128 and v[4] in (16, 32)]
          + [("b200", v) for v in VARIANTS if v[1] != "float32"])


@dataclasses.dataclass(frozen=True)
class KernelStats:
    registers: int
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    stack: int  # bytes
    shared: int  # bytes of dynamic shared memory (the kernel's scratch)

    def blocks_per_sm(self) -> int:
        """Resident programs per SM the registers and shared memory allow (registers are
        allocated per warp in units of 256, i.e. 8 per thread)."""
        regs = -(-self.registers // 8) * 8 * THREADS
        return min(REGISTERS_PER_SM // regs, (228 * 1024) // (self.shared + 1024))


def _one(gpu, kind, dtype, kv_dtype, head_dim, block_size, soft_cap, window, group):
    """In the subprocess: compile one variant deviceless and read ptxas's report."""
    dump = tempfile.mkdtemp()
    os.environ.update(JAX_PLATFORMS="cpu", MOSAIC_GPU_DUMP_TO=dump, MOSAIC_GPU_DUMP_PTXAS="1")
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from pallas_kernels import gpu_target
    from pallas_kernels import mosaic
    from pallas_kernels.mosaic import scratch
    device = gpu_target.compile_only_device(gpu)
    sharding = NamedSharding(Mesh([device], ("x",)), P())
    num_seqs, kv_heads, num_blocks, max_blocks = (1 if kind == "decode-split" else 64), 8, 4096, 64
    num_tokens = 2048 if kind == "ragged" else num_seqs

    def arg(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=sharding)

    pages = arg((kv_heads, num_blocks, block_size, head_dim), kv_dtype)
    args = [arg((num_tokens, kv_heads * group, head_dim), dtype), pages, pages,
            arg((num_seqs, max_blocks), jnp.int32), arg((num_seqs,), jnp.int32)]
    fn = mosaic.paged_attention_mosaic
    if kind == "decode-split":
        fn = functools.partial(fn, num_splits=4)
    if kind == "ragged":
        fn, args = mosaic.ragged_paged_attention_mosaic, args + [arg((num_seqs + 1,), jnp.int32)]
    opts = dict(soft_cap=soft_cap or None, sliding_window=int(window) or None)
    quantized = kv_dtype != dtype
    if quantized:
        args += [arg(pages.shape[:3], jnp.float32)] * 2

    def call(*a):
        if quantized:
            return fn(*a[:-2], k_scales=a[-2], v_scales=a[-1], **opts)
        return fn(*a, **opts)

    with jax.default_device(device):
        jax.jit(call).trace(*args).lower().compile()
    report = "".join(open(p).read() for p in glob.glob(os.path.join(dump, "*ptxas*")))
    used = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill "
                       r"loads", report)
    if used is None or spills is None:
        raise RuntimeError(f"no ptxas report in {dump}: {report!r}")
    stack, stores, loads = map(int, spills.groups())
    return KernelStats(int(used.group(1)), stores, loads, stack,
                       scratch.nbytes(scratch.scratch(dtype, kv_dtype, head_dim, block_size,
                                                      4 if kind == "decode-split" else 1, ARCH[gpu])))


def _cache_file(gpu, variant):
    import jax
    here = os.path.dirname(__file__)
    sources = [open(os.path.join(here, name)).read()
               for name in ("kernel.py", "mma.py", "scratch.py", "decode.py", "ragged.py")]
    key = json.dumps([sources, gpu, list(variant), jax.__version__])
    return os.path.join(cubin.CACHE_DIR, "mosaic-" + hashlib.sha256(key.encode()).hexdigest()[:40]
                        + ".json")


def compiled_stats(gpu: str, variant) -> KernelStats:
    """-> KernelStats of `variant` (a VARIANTS row) compiled for `gpu`, from the cache or a
    subprocess."""
    path = _cache_file(gpu, variant)
    if os.path.exists(path):
        with open(path) as f:
            return KernelStats(**json.load(f))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, "-m", "pallas_kernels.mosaic.compile_check", gpu,
                          *map(str, variant)], capture_output=True, text=True, env=env, cwd=root)
    if run.returncode:
        raise RuntimeError(f"compiling {variant} for {gpu} failed:\n{run.stderr[-3000:]}")
    stats = KernelStats(**json.loads(run.stdout.strip().splitlines()[-1]))
    os.makedirs(cubin.CACHE_DIR, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=cubin.CACHE_DIR, delete=False) as f:
        json.dump(dataclasses.asdict(stats), f)
    os.replace(f.name, path)
    return stats


def compiled_all(builds, workers=2) -> list[KernelStats]:
    """-> KernelStats of each (gpu, variant) in `builds`, `workers` subprocesses at a time."""
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda build: compiled_stats(*build), builds))


if __name__ == "__main__":
    gpu, kind, dtype, kv_dtype, head_dim, block_size, soft_cap, window, group = sys.argv[1:10]
    stats = _one(gpu, kind, dtype, kv_dtype, int(head_dim), int(block_size), float(soft_cap),
                 float(window), int(group))
    print(json.dumps(dataclasses.asdict(stats)))
