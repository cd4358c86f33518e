"""Time one `allocate` that grows many sequence slots by one token each, jitted, against the same
growth with a Python free list (a deque, as nano-vllm's BlockManager does).

    python scripts/benchmark_block_pool.py [--num-blocks 65536 --num-seqs 256 --block-size 16]
"""
import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from paged_jax import block_pool as bp  # noqa: E402


class DequePool:
    """nano-vllm's host-side bookkeeping: a deque of free ids, a ref count list, Python tables."""

    def __init__(self, num_blocks, num_seqs):
        self.free = collections.deque(range(1, num_blocks))
        self.ref = [0] * num_blocks
        self.tables = [[] for _ in range(num_seqs)]
        self.lens = [0] * num_seqs

    def grow_by_one(self, block_size):
        for s, table in enumerate(self.tables):
            if self.lens[s] % block_size == 0:
                block = self.free.popleft()
                self.ref[block] = 1
                table.append(block)
            self.lens[s] += 1


def median_us(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * float(np.median(times))


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--num-blocks", type=int, default=65536)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-blocks-per-seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    bs, n = args.block_size, args.num_seqs

    rows = []
    for case, start_len in (("every slot crosses a block boundary", bs), ("no slot crosses one", 1)):
        pool = bp.init(args.num_blocks, bs, n, args.max_blocks_per_seq)
        pool, _ = bp.allocate(pool, np.full(n, start_len, np.int32))
        for label, k in (("jitted call, max_new_blocks=max_seqs", n), ("jitted call, max_new_blocks=None", None)):
            step = jax.jit(lambda p, k=k: bp.allocate(p, p.seq_lens + 1, max_new_blocks=k))
            jax.block_until_ready(step(pool))
            rows.append((case, label, median_us(lambda: jax.block_until_ready(step(pool)), args.repeats)))

        # Inside a jitted loop (how the decode loop calls it): no dispatch, amortised over 64 steps.
        @jax.jit
        def loop(p):
            return jax.lax.fori_loop(0, 64, lambda i, p: bp.allocate(p, p.seq_lens + 1, max_new_blocks=n)[0], p)

        jax.block_until_ready(loop(pool))
        rows.append((case, "in a jitted loop, mean of 64 steps of +1 token",
                     median_us(lambda: jax.block_until_ready(loop(pool)), max(5, args.repeats // 20)) / 64))

        def deque_step():
            dq = DequePool(args.num_blocks, n)
            dq.lens = [start_len] * n
            dq.tables = [[0] * (-(-start_len // bs)) for _ in range(n)]
            start = time.perf_counter()
            dq.grow_by_one(bs)
            return time.perf_counter() - start

        rows.append((case, "Python deque (nano-vllm)", 1e6 * float(np.median([deque_step() for _ in range(args.repeats)]))))

    print(f"allocate: {n} slots grow by one token, pool of {args.num_blocks} blocks, block_size {bs}, "
          f"{jax.default_backend()} ({jax.devices()[0].device_kind})")
    print(f"{'case':38s} {'implementation':44s} {'median us':>10s}")
    for case, label, us in rows:
        print(f"{case:38s} {label:44s} {us:10.1f}")


if __name__ == "__main__":
    main()
