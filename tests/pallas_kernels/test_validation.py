"""Bad shapes, dtypes and options raise ValueError naming the offending value, before any kernel
is built (so these run on any machine)."""
import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import copy_blocks, paged_attention, ragged_paged_attention, write_kv


def arrays(num_tokens=4, num_seqs=4, num_heads=8, num_kv_heads=2, head_dim=64, dtype=jnp.float32,
           page_dtype=None, page_head_dim=None):
    pages = jax.ShapeDtypeStruct((num_kv_heads, 16, 8, page_head_dim or head_dim),
                                 page_dtype or dtype)
    return dict(q=jax.ShapeDtypeStruct((num_tokens, num_heads, head_dim), dtype), k_pages=pages,
                v_pages=pages, block_tables=jax.ShapeDtypeStruct((num_seqs, 3), jnp.int32),
                seq_lens=jax.ShapeDtypeStruct((num_seqs,), jnp.int32))


def decode(args, **kw):
    """Traced with abstract arrays: the checks run at trace time, no kernel is compiled."""
    return jax.eval_shape(lambda a: paged_attention(**a, **kw), args)


def ragged(args, qsl=(5,), **kw):
    args = dict(args, query_start_loc=jax.ShapeDtypeStruct(qsl, jnp.int32))
    return jax.eval_shape(lambda a: ragged_paged_attention(**a, **kw), args)


BAD = [  # (arrays(...) overrides, extra keyword args, message)
    (dict(), dict(soft_cap=0.0), "soft_cap must be a positive float or None, got 0.0"),
    (dict(), dict(sliding_window=0), "sliding_window must be a positive int or None, got 0"),
    (dict(), dict(sliding_window=2.5), "got 2.5"),
    (dict(), dict(block_n=24), "block_n must be a power of two, got 24"),
    (dict(), dict(block_n=8), "block_n must be >= 16"),
    (dict(), dict(num_warps=0), "num_warps must be a positive int, got 0"),
    (dict(num_heads=6, num_kv_heads=4), dict(), "num_heads 6 is not a multiple of num_kv_heads 4"),
    (dict(head_dim=512), dict(), "head_dim 512 is not supported"),
    (dict(page_head_dim=128), dict(), "q head_dim 64 != pages head_dim 128"),
    (dict(page_dtype=jnp.bfloat16), dict(), "got q float32, pages bfloat16"),
    (dict(dtype=jnp.int32), dict(), "got q int32"),
]


@pytest.mark.parametrize("overrides,kw,message", BAD)
def test_decode_rejects(overrides, kw, message):
    with pytest.raises(ValueError, match=message):
        decode(arrays(**overrides), **kw)


@pytest.mark.parametrize("overrides,kw,message", BAD)
def test_ragged_rejects(overrides, kw, message):
    with pytest.raises(ValueError, match=message):
        ragged(arrays(**overrides), **kw)


def test_unknown_tuning_options():
    with pytest.raises(ValueError, match=r"unknown tuning options \['block_m'\]"):
        decode(arrays(), block_m=32)
    with pytest.raises(ValueError, match=r"unknown tuning options \['num_splits'\]"):
        ragged(arrays(), num_splits=2)


def test_array_shapes_are_named():
    a = arrays()
    cases = [
        (decode, dict(a, q=jax.ShapeDtypeStruct((4, 8), jnp.float32)), "q must have rank 3"),
        (decode, dict(a, v_pages=jax.ShapeDtypeStruct((2, 16, 4, 64), jnp.float32)),
         r"v_pages shape \(2, 16, 4, 64\) != k_pages shape \(2, 16, 8, 64\)"),
        (decode, dict(a, block_tables=jax.ShapeDtypeStruct((4, 3), jnp.float32)),
         "block_tables must be an integer array"),
        (decode, dict(a, seq_lens=jax.ShapeDtypeStruct((5,), jnp.int32)),
         r"seq_lens must have shape \(4,\), got \(5,\)"),
        (decode, dict(a, q=jax.ShapeDtypeStruct((3, 8, 64), jnp.float32)),
         "q has 3 sequences, block_tables 4"),
        (ragged, a, r"query_start_loc must have shape \(5,\), got \(4,\)"),
    ]
    for fn, args, message in cases:
        with pytest.raises(ValueError, match=message):
            fn(args, qsl=(4,)) if fn is ragged else fn(args)
    with pytest.raises(ValueError, match=r"out must be float32\[4, 8, 64\] like q"):
        decode(a, out=jnp.zeros((4, 8, 32)))


def test_cache_writes_reject_bad_shapes():
    pages = jnp.zeros((2, 4, 8, 64))
    k = jnp.zeros((3, 2, 64))
    slots = jnp.zeros((3,), jnp.int32)
    with pytest.raises(ValueError, match=r"k and v must be \[num_tokens, 2, 64\]"):
        write_kv(pages, pages, jnp.zeros((3, 1, 64)), k, slots)
    with pytest.raises(ValueError, match=r"slot_mapping must have shape \(3,\), got \(2,\)"):
        write_kv(pages, pages, k, k, slots[:2])
    with pytest.raises(ValueError, match="slot_mapping must be an integer array"):
        write_kv(pages, pages, k, k, slots.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"dst must have shape \(3,\), got \(2,\)"):
        copy_blocks(pages, pages, slots, slots[:2])


def test_cache_writes_reject_head_dims_past_256():
    """A [rows, head_dim] tile per program past 256 is more than the kernels are built for: named
    before any kernel is built, as in attention (test_cubin.py compiles every head_dim up to 256;
    block sizes need no power of two, they compile at 12)."""
    pages = jax.ShapeDtypeStruct((2, 4, 8, 320), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((3, 2, 320), jnp.bfloat16)
    slots = jax.ShapeDtypeStruct((3,), jnp.int32)
    with pytest.raises(ValueError, match=r"head_dim 320 is not supported \(1..256\)"):
        jax.eval_shape(write_kv, pages, pages, k, k, slots)
    with pytest.raises(ValueError, match=r"head_dim 320 is not supported \(1..256\)"):
        jax.eval_shape(copy_blocks, pages, pages, slots, slots)
