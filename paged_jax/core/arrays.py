"""One array vocabulary for the block pool on either side of the host/device line.

The pool's functions are written once. On the device they run as jnp under `jax.jit` (scatters with
`.at[...](mode="drop")`, the pool donated so XLA updates it in place). On the host, where the
scheduler owns the pool, they run as numpy: a jax computation on the CPU backend queues behind the
model's own work on a CPU-only machine (a pool update dispatched after a 5 s matmul finished after
it), while numpy answers at once. A host pool is updated in place, as a donated one is: callers use
the returned pool only.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def on_host(x) -> bool:
    return isinstance(x, np.ndarray)


def xp(x):
    """numpy for a host array, jax.numpy otherwise."""
    return np if on_host(x) else jnp


def at(x, index):
    """`x.at[index]` with out-of-range integer indices dropped (jax's mode="drop"), on either side."""
    return _HostAt(x, index) if on_host(x) else _DeviceAt(x, index)


def cond(pred, true_fn, false_fn, *operands):
    """`jax.lax.cond` on the device; a plain branch on the host."""
    if on_host(pred) or isinstance(pred, (bool, np.bool_)):
        return true_fn(*operands) if pred else false_fn(*operands)
    return jax.lax.cond(pred, true_fn, false_fn, *operands)


class _DeviceAt:
    def __init__(self, x, index):
        self.ref = x.at[index]

    def set(self, values):
        return self.ref.set(values, mode="drop")

    def add(self, values):
        return self.ref.add(values, mode="drop")

    def max(self, values):
        return self.ref.max(values, mode="drop")


class _HostAt:
    """Writes into `x` itself. Integer-array parts of the index are broadcast together; an entry
    where any of them falls outside its axis is skipped, like jax's mode="drop"."""

    def __init__(self, x, index):
        self.x = x
        index = index if isinstance(index, tuple) else (index,)
        arrays = [(axis, np.asarray(i)) for axis, i in enumerate(index) if not isinstance(i, slice)]
        shape = np.broadcast_shapes(*(a.shape for _, a in arrays))
        keep = np.ones(shape, bool)
        for axis, a in arrays:
            keep &= (a >= 0) & (a < x.shape[axis])
        self.keep = keep
        self.index = tuple(i if isinstance(i, slice) else np.broadcast_to(np.asarray(i), shape)[keep]
                           for i in index)

    def _values(self, values):
        values = np.asarray(values)
        if values.ndim == 0:
            return values
        # Values line up with the broadcast index, then any sliced axes follow.
        lead = self.keep.ndim
        full = np.broadcast_to(values, self.keep.shape + values.shape[lead:]) if values.ndim >= lead else values
        return full[self.keep] if lead else full

    def set(self, values):
        self.x[self.index] = self._values(values)
        return self.x

    def add(self, values):
        np.add.at(self.x, self.index, self._values(values))
        return self.x

    def max(self, values):
        np.maximum.at(self.x, self.index, self._values(values))
        return self.x
