"""The Mosaic GPU attention kernels' compiled costs for H100 and H200, without a GPU: registers, spills,
shared memory and the programs per SM they allow, per variant the engine can launch (a markdown
table). Needs the gpu-compile extra (jax-cuda12-plugin, jax-cuda12-pjrt, nvidia-cuda-nvcc-cu12).
  JAX_PLATFORMS=cpu python scripts/check_mosaic_kernels.py"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pallas_kernels.mosaic import compile_check  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    print("| gpu | kernel | dtype | pages | head_dim | block_size | soft cap, window | group "
          "| registers | spill bytes | shared KB | programs/SM (warps) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    stats = compile_check.compiled_all(compile_check.BUILDS)
    for (gpu, variant), s in zip(compile_check.BUILDS, stats):
        kind, dtype, kv_dtype, head_dim, block_size, cap, window, group = variant
        opts = f"{cap:g}, {window}" if cap else "-"
        blocks = s.blocks_per_sm()
        print(f"| {gpu} | {kind} | {dtype} | {kv_dtype} | {head_dim} | {block_size} | {opts} "
              f"| {group} | {s.registers} | {s.spill_stores} | {s.shared / 1024:.1f} "
              f"| {blocks} ({blocks * compile_check.THREADS // 32}) |")

if __name__ == "__main__":
    main()
