"""The two tensor-core engines kernel.py runs on: WGMMA (Hopper, sm_90a) and tcgen05 (Blackwell,
sm_100a, which refuses WGMMA). Each computes the step's logits q.k^T into registers and keeps the
output accumulator, rescaled by the online softmax's alpha before each p.v.

- Hopper: a warpgroup's WGMMA tile is 64 rows; both products land in registers (WGMMA_LAYOUT) and
  the output accumulates there.
- Blackwell: a tcgen05 tile is 128 rows (one per thread of the warpgroup: row statistics never
  leave a thread) and accumulates in tensor memory. The logits are loaded from it; the output
  stays in it [128, cols] (in registers it would take 128 of a thread's 255 registers at
  head_dim 128), is scaled by alpha 64 columns at a time before each p.v accumulates onto it,
  and is loaded once at the end."""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

RESCALE_COLS = 64  # Blackwell: columns of the output scaled per load/store of tensor memory


def _terms(a, b):
    """a, b: [ref] or f32's f16 halves [hi, lo] -> the products a.b sums: hi.hi + hi.lo + lo.hi,
    the small terms first (they round into a smaller sum)."""
    return ([(a[0], b[1]), (a[1], b[0])] if len(b) == 2 else []) + [(a[0], b[0])]


class Wgmma:
    rows = 64
    layout = plgpu.Layout.WGMMA
    # A program keeps at most 128 output columns: at head_dim 256 one [64, 256] f32 accumulator
    # and the step's p.v took all 255 registers and spilled 360 bytes (H100). There a third grid
    # axis splits the columns in two: each program computes the same q.k^T and softmax (reads K
    # whole) and the p.v of its half, so K is read twice (the second time likely from L2).
    pv_cols = 128

    def __init__(self, scratch):
        del scratch  # WGMMA's accumulators are scoped registers

    @staticmethod
    def scratch(cols, keys):
        return {}

    @staticmethod
    def _dot(terms, acc_ref):
        for a, b in terms:
            plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]  # waits for the WGMMAs

    def logits(self, q_parts, keys, shape):  # -> f32[rows, KEYS] = q.k^T
        return pl.run_scoped(functools.partial(self._dot, _terms(q_parts, [k.T for k in keys])),
                             plgpu.ACC(shape, jnp.float32))

    def zeros(self, cols):
        return plgpu.layout_cast(jnp.zeros((self.rows, cols), jnp.float32), self.layout)

    def accumulate(self, acc, alpha, p_parts, values):  # -> acc * alpha + p.v
        pv = pl.run_scoped(functools.partial(self._dot, _terms(p_parts, values)),
                           plgpu.ACC(acc.shape, jnp.float32))
        return acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv

    @staticmethod
    def result(acc):  # -> [(first column, f32[rows, n])]: the accumulator, a chunk at a time
        return [(0, acc)]


class Tcgen05:
    rows = 128
    layout = plgpu.Layout.TCGEN05
    # At head_dim 256 the program's columns split in two as on Hopper: with all 256 in tensor
    # memory, scaling and reading them 64 at a time still spilled 128-264 bytes (B200).
    pv_cols = 128

    def __init__(self, scratch):
        self.s_tmem, self.o_tmem, self.barriers = (scratch[n] for n in ("s_tmem", "o_tmem", "mma_barriers"))

    @classmethod
    def scratch(cls, cols, keys):
        return dict(s_tmem=plgpu.TMEM((cls.rows, keys), jnp.float32),
                    o_tmem=plgpu.TMEM((cls.rows, cols), jnp.float32),
                    mma_barriers=plgpu.Barrier(num_arrivals=1, num_barriers=2, orders_tensor_core=True))

    def _mma(self, tmem, terms, barrier, accumulate):
        for i, (a, b) in enumerate(terms):  # the last one's commit arrives once all are done
            plgpu.tcgen05_mma(tmem, a, b, barrier if i == len(terms) - 1 else None,
                              accumulate=accumulate or i > 0)
        plgpu.barrier_wait(barrier)

    def _load(self, tmem):
        x = plgpu.async_load_tmem(tmem, layout=self.layout)
        plgpu.wait_load_tmem()  # before anything writes that tensor memory again
        return x

    def logits(self, q_parts, keys, shape):
        self._mma(self.s_tmem, _terms(q_parts, [k.T for k in keys]), self.barriers.at[0], False)
        return self._load(self.s_tmem)

    def zeros(self, cols):
        plgpu.async_store_tmem(self.o_tmem, plgpu.layout_cast(
            jnp.zeros((self.rows, cols), jnp.float32), self.layout))
        plgpu.commit_tmem()
        return None  # the accumulator lives in tensor memory

    def accumulate(self, acc, alpha, p_parts, values):
        cols = self.o_tmem.shape[1]
        for c in range(0, cols, RESCALE_COLS):
            span = self.o_tmem.at[:, pl.ds(c, min(RESCALE_COLS, cols))]
            o = self._load(span)
            plgpu.async_store_tmem(span, o * lax.broadcast_in_dim(alpha, o.shape, [0]))
        plgpu.commit_tmem()
        self._mma(self.o_tmem, _terms(p_parts, values), self.barriers.at[1], True)
        return acc

    def result(self, acc):
        cols = self.o_tmem.shape[1]
        return [(c, self._load(self.o_tmem.at[:, pl.ds(c, min(RESCALE_COLS, cols))]))
                for c in range(0, cols, RESCALE_COLS)]


def engine(arch: str):
    """-> the engine class for `arch` ("sm_90" or "sm_100")."""
    return {"sm_90": Wgmma, "sm_100": Tcgen05}[arch]
