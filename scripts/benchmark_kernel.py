"""Decode attention time and achieved bandwidth: our Pallas Triton kernel, our Pallas Mosaic GPU
kernel (Hopper, where this jax has it; pallas_kernels/mosaic/), jax's own Pallas-Triton
paged_attention (where this jax still ships it: 0.12 deprecates it), and a dense attention over
contiguous K/V, side by side, with the Mosaic kernel's speedup over ours on Triton. Our Triton
kernel runs at its DECODE_TILES row, which the output records.

Bandwidth is the K/V bytes a decode step must read over its time, in TB/s and as a fraction of
this device's copy bandwidth (read + write) and read bandwidth (a sum), measured in the same run. Without a GPU (or with --smoke) it runs
the jnp references and the kernel in interpret mode at tiny sizes, so CI exercises it.

    python scripts/benchmark_kernel.py [--contexts 512 2048 8192 --batch 64 --out kernel.json]
"""
import argparse
import functools
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from pallas_kernels import mosaic, targets  # noqa: E402
from pallas_kernels.paged_attention import decode_tiles  # noqa: E402
from scripts import jax_paged_kernel  # noqa: E402


def make_inputs(batch, context, num_heads, num_kv_heads, head_dim, block_size, dtype):
    """Every sequence `context` tokens long, its blocks scattered over the pool (block 0: null)."""
    rng = np.random.default_rng(0)
    per_seq = context // block_size
    tables = rng.permutation(np.arange(1, batch * per_seq + 1)).reshape(batch, per_seq)
    shape = (num_kv_heads, batch * per_seq + 1, block_size, head_dim)
    key = jax.random.key(0)
    k_pages, v_pages, q = (jax.random.normal(k, s, dtype) for k, s in zip(
        jax.random.split(key, 3), (shape, shape, (batch, num_heads, head_dim))))
    return q, k_pages, v_pages, jnp.asarray(tables, jnp.int32), jnp.full(batch, context, jnp.int32)


def contiguous(pages, tables):  # -> [batch, context, num_kv_heads, head_dim]
    num_kv_heads, _, _, head_dim = pages.shape
    per_seq = pages[:, tables].reshape(num_kv_heads, tables.shape[0], -1, head_dim)
    return per_seq.transpose(1, 2, 0, 3)


def mosaic_status(gpu, head_dim, block_size):
    """-> None when the Mosaic GPU kernel runs here at these sizes (bf16; Hopper's or Blackwell's,
    on CPU Hopper's in its interpreter), else why not."""
    return mosaic.supports(jnp.bfloat16, head_dim, block_size, arch=targets.gpu_arch())


def methods(gpu, jax_paged_attention, with_mosaic):
    """name -> (q, k_pages, v_pages, tables, lens, k_dense, v_dense) -> out; jax's kernel only
    where `jax_paged_attention` is not None, ours on Mosaic GPU only `with_mosaic`."""
    def ours(q, kp, vp, t, n, kd, vd):
        return pk.paged_attention(q, kp, vp, t, n, interpret=not gpu)

    def ours_mosaic(q, kp, vp, t, n, kd, vd):  # bf16 inputs (the CPU smoke run's are f32)
        q, kp, vp = (x.astype(jnp.bfloat16) for x in (q, kp, vp))
        return mosaic.paged_attention_mosaic(q, kp, vp, t, n, interpret=not gpu)

    def jax_paged(q, kp, vp, t, n, kd, vd):
        return jax_paged_kernel.attention(jax_paged_attention, q, kp, vp, t, n, interpret=not gpu)

    def dense(q, kp, vp, t, n, kd, vd):  # all sequences full length: no mask needed
        return jax.nn.dot_product_attention(q[:, None], kd, vd)[:, 0]

    def reference(q, kp, vp, t, n, kd, vd):
        return pk.paged_attention_reference(q, kp, vp, t, n)

    suffix = "" if gpu else " (interpret)"
    rows = {"paged-jax" + suffix: ours}
    if with_mosaic:
        rows[MOSAIC + suffix] = ours_mosaic
    if jax_paged_attention is not None:
        rows["jax pallas paged_attention" + suffix] = jax_paged
    rows["dense (contiguous K/V)"] = dense
    return rows if gpu else {**rows, "paged-jax jnp reference": reference}


MOSAIC = "paged-jax mosaic gpu"


def timed(fn, args, iters, repeats=5):
    """-> (compile seconds, median milliseconds per call, output). Calls are queued back to back
    and waited for once, so a short kernel is not timed as host dispatch."""
    jitted = jax.jit(fn)
    start = time.perf_counter()
    out = jax.block_until_ready(jitted(*args))
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            result = jitted(*args)
        jax.block_until_ready(result)
        times.append((time.perf_counter() - start) / iters)
    return compile_s, 1e3 * float(np.median(times)), out


def bandwidth_tb_s(nbytes, iters):
    """-> (copy, read) device bandwidth in TB/s: an elementwise op over `nbytes` reads and writes
    each byte once; a sum only reads them, as decode attention (almost) only reads."""
    x = jnp.zeros(nbytes // 4, jnp.uint32)
    _, copy_ms, _ = timed(functools.partial(jnp.add, jnp.uint32(1)), (x,), iters)
    _, read_ms, _ = timed(functools.partial(jnp.sum, dtype=jnp.uint32), (x,), iters)
    return 2 * nbytes / (copy_ms * 1e-3) / 1e12, nbytes / (read_ms * 1e-3) / 1e12


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--num-heads", type=int, default=32)
    ap.add_argument("--num-kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="tiny CPU sizes (the default without GPU)")
    ap.add_argument("--out", default="benchmark_kernel.json")
    args = ap.parse_args()
    gpu = jax.default_backend() == "gpu" and not args.smoke
    if not gpu:  # tiny sizes: the references and interpret mode are slow on CPU
        args.contexts, args.batch, args.num_heads, args.num_kv_heads, args.head_dim = (
            [64, 128], 2, 8, 2, 64)
        args.iters = min(args.iters, 2)
    dtype = jnp.bfloat16 if gpu else jnp.float32
    jax_paged_attention, jax_status = jax_paged_kernel.load()
    tiles = decode_tiles(dtype, args.head_dim)
    no_mosaic = mosaic_status(gpu, args.head_dim, args.block_size)
    copy, read = bandwidth_tb_s(1 << 30 if gpu else 1 << 24, args.iters)
    print(f"{jax.devices()[0].device_kind}: copy bandwidth {copy:.3g} TB/s, read {read:.3g} TB/s")
    print(f"paged-jax tiles (DECODE_TILES): {tiles}; jax's own paged_attention: {jax_status}; "
          f"mosaic gpu: {no_mosaic or 'runs'}")
    print(f"{'method':40} {'context':>7} {'ms':>9} {'TB/s':>8} {'of copy':>8} {'of read':>8} "
          f"{'compile s':>9} {'max |diff| vs first':>20}")
    rows = []
    for context in args.contexts:
        q, k_pages, v_pages, tables, lens = make_inputs(
            args.batch, context, args.num_heads, args.num_kv_heads, args.head_dim,
            args.block_size, dtype)
        inputs = (q, k_pages, v_pages, tables, lens, contiguous(k_pages, tables),
                  contiguous(v_pages, tables))
        kv_bytes = 2 * args.batch * context * args.num_kv_heads * args.head_dim * q.dtype.itemsize
        expected = None
        for name, fn in methods(gpu, jax_paged_attention, no_mosaic is None).items():
            try:
                compile_s, ms, out = timed(fn, inputs, args.iters)
            except Exception as e:  # one method failing must not hide the others' figures
                error = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                rows.append(dict(method=name, context=context, error=error))
                print(f"{name:40} {context:7} failed: {error}")
                traceback.print_exc(limit=-8)
                continue
            out = np.asarray(out, np.float32)
            expected = out if expected is None else expected
            tb_s = kv_bytes / (ms * 1e-3) / 1e12
            err = float(np.max(np.abs(out - expected)))
            rows.append(dict(method=name, context=context, ms=ms, tb_s=tb_s, of_copy=tb_s / copy,
                             of_read=tb_s / read,
                             compile_s=compile_s, max_err_vs_first=err))
            print(f"{name:40} {context:7} {ms:9.3f} {tb_s:8.3g} {tb_s / copy:8.1%} {tb_s / read:8.1%} "
                  f"{compile_s:9.2f} {err:20.1e}")
        ms = {row["method"].split(" (")[0]: row["ms"] for row in rows
              if row["context"] == context and "ms" in row}
        if MOSAIC in ms and "paged-jax" in ms:
            print(f"{'':40} {context:7} mosaic gpu {ms['paged-jax'] / ms[MOSAIC]:.2f}x our triton")
    result = dict(device=jax.devices()[0].device_kind, smoke=not gpu, dtype=jnp.dtype(dtype).name,
                  batch=args.batch, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                  head_dim=args.head_dim, block_size=args.block_size, copy_tb_s=copy, read_tb_s=read,
                  tiles=tiles,
                  jax_kernel=jax_status, mosaic=no_mosaic or "runs", rows=rows)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
