"""jax's own Pallas-Triton GPU paged_attention as a baseline for scripts/benchmark_kernel.py, on the
jax lines that still ship it (0.12 deprecates it; 0.12.1 removed it)."""
import importlib
import sys
import warnings

import jax

MODULE = "jax.experimental.pallas.ops.gpu.paged_attention"


def splits(pages_per_seq, pages_per_block):
    """jax's kernel asserts pages_per_seq % k_splits == 0 and the partition % pages_per_block."""
    return max(k for k in range(1, 17) if pages_per_seq % k == 0
               and (pages_per_seq // k) % min(pages_per_block, pages_per_seq // k) == 0)


def load():
    """-> (jax's paged_attention, or None where this jax lacks it; what became of it). Its
    deprecation warning fires on import, so an earlier import is re-run to hear it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            imported = MODULE in sys.modules
            module = importlib.import_module(MODULE)
            if imported:
                importlib.reload(module)
        except ImportError as e:
            return None, f"gone from jax {jax.__version__} ({e})"
    deprecated = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    if deprecated:
        return module.paged_attention, f"deprecated in jax {jax.__version__}: {deprecated[0]}"
    return module.paged_attention, f"in jax {jax.__version__}"


def attention(paged_attention, q, k_pages, v_pages, tables, lens, *, interpret):
    """Our decode contract on jax's kernel: it has no softmax scale, so q is pre-scaled."""
    k = splits(tables.shape[1], 8)
    return paged_attention(q * q.shape[-1] ** -0.5, k_pages, v_pages, tables, lens, k_splits=k,
                           pages_per_compute_block=min(8, tables.shape[1] // k),
                           interpret=interpret)
