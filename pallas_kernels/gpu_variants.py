"""Every kernel variant the engine can launch on a GPU, as a function and abstract inputs to export
for a target (`triton_ir`) and compile (`cubin`). tests/pallas_kernels/test_cubin.py and
scripts/check_gpu_kernels.py walk the same list.

What changes a kernel's code: the kernel, the dtype, head_dim (padded to a power of two, masked
when it is not one), the tiles (DECODE_TILES, RAGGED_TILES: per arch), soft cap and sliding window,
quantized pages (int8, fp8, with their scales), and as constants the GQA group and block_size.
Other shapes (sequences, blocks, KV heads) only change the grid or index arithmetic, so they are
fixed at sizes of real models: tables 512 wide."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import targets
from pallas_kernels.kv_cache import copy_blocks, write_kv
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

KERNELS = ("decode", "decode_split", "ragged", "write_kv", "copy_blocks")
DTYPES = ("float32", "bfloat16", "float16")
HEAD_DIMS = (64, 80, 128, 256)
GROUPS = (1, 3, 4, 7, 8)
BLOCK_SIZES = (16, 32)
ATTENTION = ("decode", "decode_split", "ragged")
TABLE_WIDTH = 512  # blocks per sequence: 8k tokens at block_size 16
NUM_SEQS, NUM_TOKENS, NUM_KV_HEADS, NUM_BLOCKS = 8, 128, 2, 1024


@dataclasses.dataclass(frozen=True)
class Variant:
    kernel: str  # one of KERNELS; "decode_split" launches the split kernel and the combine kernel
    dtype: str
    head_dim: int
    group: int = 4  # query heads per KV head
    block_size: int = 16
    soft_cap: float | None = None
    sliding_window: int | None = None
    kv_dtype: str | None = None  # "int8" or "float8_e4m3fn": quantized pages with f32 scales

    @property
    def label(self):
        extra = "" if self.soft_cap is None else f" cap {self.soft_cap:g} window {self.sliding_window}"
        extra += "" if self.kv_dtype is None else f" kv {self.kv_dtype}"
        return (f"{self.kernel} {self.dtype} hd{self.head_dim} g{self.group} "
                f"bs{self.block_size}{extra}")

    def call(self):
        """-> (function, abstract args) whose CUDA export launches this variant's kernels."""
        dtype = jnp.dtype(self.dtype)
        pages = jax.ShapeDtypeStruct((NUM_KV_HEADS, NUM_BLOCKS, self.block_size, self.head_dim),
                                     jnp.dtype(self.kv_dtype or dtype))
        scales = ()
        if self.kv_dtype is not None and self.kernel != "copy_blocks":  # scales: copied by XLA
            scales = (jax.ShapeDtypeStruct(pages.shape[:3], jnp.float32),) * 2
        fn, args = self._call(dtype, pages)
        if scales:
            return functools.partial(_with_scales, fn), (*args, *scales)
        return fn, args

    def _call(self, dtype, pages):
        if self.kernel in ("write_kv", "copy_blocks"):
            new = jax.ShapeDtypeStruct((NUM_TOKENS, NUM_KV_HEADS, self.head_dim), dtype)
            if self.kernel == "write_kv":
                return write_kv, (pages, pages, new, new, _ints(NUM_TOKENS))
            return copy_blocks, (pages, pages, _ints(NUM_SEQS), _ints(NUM_SEQS))
        options = dict(soft_cap=self.soft_cap, sliding_window=self.sliding_window)
        rows = NUM_TOKENS if self.kernel == "ragged" else NUM_SEQS
        q = jax.ShapeDtypeStruct((rows, NUM_KV_HEADS * self.group, self.head_dim), dtype)
        args = (q, pages, pages, _ints(NUM_SEQS, TABLE_WIDTH), _ints(NUM_SEQS))
        if self.kernel == "ragged":
            return functools.partial(ragged_paged_attention, **options), (*args, _ints(NUM_SEQS + 1))
        splits = 4 if self.kernel == "decode_split" else 1
        return functools.partial(paged_attention, num_splits=splits, **options), args


def _ints(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.int32)


def _with_scales(fn, *args, **options):
    """The kernels take the scales by keyword; an export passes abstract arguments by position."""
    return fn(*args[:-2], k_scales=args[-2], v_scales=args[-1], **options)


def engine_builds():
    """-> [(Variant, arch)]: every kernel x dtype x head_dim at GQA 4 and block_size 16 for each
    GPU target; each GQA group and block size for decode and ragged at hd128 (f32, bf16) on sm_90
    (these only change constants in the same IR), and block_size 12 for each kernel; soft cap and
    sliding window (Gemma-2: hd256, GQA 2) for each attention kernel and dtype on each target;
    head_dim 96 (Phi-3: bf16, no GQA, block_size 16 and 32) for each attention kernel and target."""
    base = [Variant(k, d, h) for k in KERNELS for d in DTYPES for h in HEAD_DIMS]
    shapes = [Variant(k, d, 128, g, b) for k in ("decode", "ragged") for d in ("float32", "bfloat16")
              for g in GROUPS for b in BLOCK_SIZES if (g, b) != (4, 16)]
    capped = [Variant(k, d, 256, 2, 16, soft_cap=50.0, sliding_window=4096) for k in ATTENTION
              for d in DTYPES]
    # block_size need not be a power of two: keys are gathered token by token
    odd = [Variant(k, "bfloat16", 128, 4, 12) for k in KERNELS]
    # Phi-3's head_dim 96 without GQA, at both block sizes: sm_80 decode has its own tile row
    phi3 = [Variant(k, "bfloat16", 96, 1, b) for k in ATTENTION for b in BLOCK_SIZES]
    every = [(v, arch) for v in base + capped + phi3 for arch in targets.GPU_TARGETS]
    return every + [(v, targets.DEFAULT_GPU) for v in shapes + odd] + quantized_builds()


def quantized_builds():
    """-> [(Variant, arch)]: int8 pages on each target and fp8 on sm_90 (Triton casts fp8 on
    sm_89 and newer), for every kernel with bf16 queries at hd 64, 128, 256 and f32 at hd128
    (copy_blocks reads no query: its f32 build would be the bf16 one)."""
    shapes = [("bfloat16", 64), ("bfloat16", 128), ("bfloat16", 256), ("float32", 128)]
    kv = [("int8", arch) for arch in targets.GPU_TARGETS] + [("float8_e4m3fn", "sm_90")]
    return [(Variant(k, d, h, kv_dtype=q), arch) for q, arch in kv for k in KERNELS
            for d, h in shapes if (k, d) != ("copy_blocks", "float32")]  # no query: bf16's copy
