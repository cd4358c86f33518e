"""What every kernel variant costs on a real GPU, without one: each variant is exported for CUDA as
built for sm_90 (H100/H200) and sm_80 (A100), its Triton IR compiled to a cubin by the `triton`
package, and the cubin read: registers and spill stores per thread, shared memory per block, cubin
size, and how many global loads are 128-bit (the page loads should be). A row that would not
launch, or spills, is marked; the exit status is 1 if any is.

    python scripts/check_gpu_kernels.py [--kernels decode ragged --dtypes float32 --archs sm_90]
    python scripts/check_gpu_kernels.py --all   # also every GQA group and block size, soft cap
    python scripts/check_gpu_kernels.py --quantized  # int8 / fp8 pages (quantized_builds)
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from pallas_kernels import cubin, gpu_variants, targets, triton_ir  # noqa: E402

COLUMNS = ("kernel", "dtype", "hd", "group", "bs", "arch", "warps", "stages", "regs", "spills",
           "stack B", "shared KB", "cubin KB", "128-bit loads", "fits")


def builds(args):
    """-> [(Variant, arch)] the filters select: from engine_builds() with --all (quantized_builds()
    with --quantized), else their cross product."""
    every = gpu_variants.quantized_builds() if args.quantized else gpu_variants.engine_builds()
    chosen = every if args.all or args.quantized else [
        (gpu_variants.Variant(k, d, h, g, b), arch) for k in args.kernels for d in args.dtypes
        for h in args.head_dims for g in args.groups for b in args.block_sizes for arch in args.archs]
    return [(v, arch) for v, arch in chosen if v.kernel in args.kernels and v.dtype in args.dtypes
            and v.head_dim in args.head_dims and arch in args.archs]


def measure(chosen, workers):
    """-> rows: one dict per (variant, arch, Triton kernel), and the seconds lowering and
    compiling took."""
    start = time.perf_counter()
    launches = []  # (variant, arch, TritonKernel)
    for variant, arch in chosen:
        fn, inputs = variant.call()
        _, kernels = triton_ir.triton_kernels(fn, *inputs, target=arch)
        launches += [(variant, arch, kernel) for kernel in kernels]
    lowered = time.perf_counter()
    stats = cubin.compile_all([(k.ttir, arch, k.num_warps, k.num_stages)
                               for _, arch, k in launches], workers)
    rows = []
    for (v, arch, k), s in zip(launches, stats):
        rows.append(dict(
            kernel=k.name, dtype=v.dtype, hd=v.head_dim, group=v.group, bs=v.block_size,
            soft_cap=v.soft_cap, sliding_window=v.sliding_window, kv=v.kv_dtype, arch=arch,
            warps=k.num_warps,
            stages=k.num_stages, regs=s.registers, spills=s.spill_stores, stack=s.stack,
            shared=s.shared, cubin=s.cubin_bytes, loads_128=s.loads_128,
            loads=s.loads_128 + s.loads_narrow, problem=s.fits(arch)))
    return rows, lowered - start, time.perf_counter() - lowered


def markdown(rows):
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for r in rows:
        name = r["kernel"] + ("" if r["soft_cap"] is None else
                              f" (cap {r['soft_cap']:g}, window {r['sliding_window']})")
        name += "" if r["kv"] is None else f" ({r['kv']} pages)"
        cells = (name, r["dtype"], r["hd"], r["group"], r["bs"], r["arch"], r["warps"],
                 r["stages"], r["regs"], r["spills"], r["stack"], f"{r['shared'] / 1024:.1f}",
                 f"{r['cubin'] / 1024:.0f}", f"{r['loads_128']} of {r['loads']}",
                 r["problem"] or "yes")
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--kernels", nargs="+", default=list(gpu_variants.KERNELS),
                    choices=gpu_variants.KERNELS)
    ap.add_argument("--dtypes", nargs="+", default=list(gpu_variants.DTYPES),
                    choices=gpu_variants.DTYPES)
    ap.add_argument("--head-dims", type=int, nargs="+", default=list(gpu_variants.HEAD_DIMS))
    ap.add_argument("--groups", type=int, nargs="+", default=[4], help="GQA: heads per KV head")
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[16])
    ap.add_argument("--archs", nargs="+", default=list(targets.GPU_TARGETS),
                    choices=targets.GPU_TARGETS)
    ap.add_argument("--all", action="store_true",
                    help="every build the tests compile (engine_builds), within the filters")
    ap.add_argument("--quantized", action="store_true",
                    help="the int8 / fp8 page builds the tests compile, within the filters")
    ap.add_argument("--workers", type=int, default=None, help="parallel compiles (default: CPUs)")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    rows, lower_s, compile_s = measure(builds(args), args.workers)
    print(markdown(rows))
    bad = [r for r in rows if r["problem"]]
    print(f"\n{len(rows)} kernels lowered in {lower_s:.0f} s and compiled in {compile_s:.0f} s "
          f"(triton {cubin.triton_version()}); {len(bad)} do not fit or spill")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
