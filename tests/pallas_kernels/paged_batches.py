"""Paged batches for the kernel tests: one factory, and a dense float64 numpy attention over K/V
gathered from the pages (the independent reference)."""
import jax.numpy as jnp
import numpy as np

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
TOL = {F32: 1e-5, BF16: 2e-2, F16: 5e-3}


def make_batch(seed, seq_lens, q_lens, *, group=4, num_kv_heads=2, head_dim=64, block_size=8,
               dtype=F32, pad_tokens=0, spare_blocks=3):
    """Sequences' blocks drawn from a random permutation of the pool (block 0 is the null block
    that padding table entries point at); one spare table column beyond the longest sequence."""
    rng = np.random.default_rng(seed)
    needed = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(needed) + 1
    num_blocks = 1 + sum(needed) + spare_blocks
    ids = iter(rng.permutation(np.arange(1, num_blocks)))
    tables = np.zeros((len(seq_lens), max_blocks), np.int32)
    for s, n in enumerate(needed):
        tables[s, :n] = [next(ids) for _ in range(n)]
    num_tokens = int(sum(q_lens)) + pad_tokens
    num_heads = group * num_kv_heads
    pages_shape = (num_kv_heads, num_blocks, block_size, head_dim)
    return dict(
        q=jnp.asarray(rng.standard_normal((num_tokens, num_heads, head_dim)), dtype),
        k_pages=jnp.asarray(rng.standard_normal(pages_shape), dtype),
        v_pages=jnp.asarray(rng.standard_normal(pages_shape), dtype),
        block_tables=jnp.asarray(tables),
        seq_lens=jnp.asarray(seq_lens, jnp.int32),
        query_start_loc=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32))


def spans(batch, sliding_window=None):
    """Per sequence: (s, [(token, first key, last key + 1)]) for its tokens that see a key."""
    qsl, lens = np.asarray(batch["query_start_loc"]), np.asarray(batch["seq_lens"])
    for s in range(len(lens)):
        q_len = qsl[s + 1] - qsl[s]
        rows = []
        for j in range(q_len):
            pos = lens[s] - q_len + j
            if pos >= 0:
                lo = 0 if sliding_window is None else max(pos + 1 - sliding_window, 0)
                rows.append((qsl[s] + j, lo, pos + 1))
        yield s, rows


def dense_attention(batch, sm_scale=None, soft_cap=None, sliding_window=None):
    """float64 softmax attention, token by token, over only the keys each token may see."""
    f64 = [np.asarray(jnp.asarray(batch[n], F32), np.float64) for n in ("q", "k_pages", "v_pages")]
    q, k_pages, v_pages = f64
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    group = num_heads // num_kv_heads
    sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
    tables = np.asarray(batch["block_tables"])
    out = np.zeros_like(q)
    for s, rows in spans(batch, sliding_window):
        # [num_heads, max_blocks_per_seq * block_size, head_dim]: the sequence's keys in order
        k = np.repeat(k_pages[:, tables[s]].reshape(num_kv_heads, -1, head_dim), group, axis=0)
        v = np.repeat(v_pages[:, tables[s]].reshape(num_kv_heads, -1, head_dim), group, axis=0)
        for t, lo, hi in rows:
            logits = np.einsum("hd,hkd->hk", q[t], k[:, lo:hi]) * sm_scale
            if soft_cap is not None:
                logits = soft_cap * np.tanh(logits / soft_cap)
            w = np.exp(logits - logits.max(axis=1, keepdims=True))
            out[t] = np.einsum("hk,hkd->hd", w / w.sum(axis=1, keepdims=True), v[:, lo:hi])
    return out


def poison_unseen(batch, sliding_window=None):
    """NaN in every page slot no token may see: unused blocks, slots past a sequence's length and
    before its window. A kernel that let one into its arithmetic (0 * NaN) would return NaN."""
    k, v = (np.array(jnp.asarray(batch[n], F32)) for n in ("k_pages", "v_pages"))
    seen = np.zeros(k.shape[1:3], bool)
    tables = np.asarray(batch["block_tables"])
    block_size = k.shape[2]
    for s, rows in spans(batch, sliding_window):
        for _, lo, hi in rows:
            for p in range(lo, hi):
                seen[tables[s, p // block_size], p % block_size] = True
    k[:, ~seen] = np.nan
    v[:, ~seen] = np.nan
    dtype = batch["q"].dtype
    return {**batch, "k_pages": jnp.asarray(k, dtype), "v_pages": jnp.asarray(v, dtype)}


def rel_err(out, expected):
    """max |out - expected| / max |expected| over the whole output."""
    out, expected = np.asarray(jnp.asarray(out, F32), np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(out - expected)) / np.max(np.abs(expected)))
