"""attend's backends agree: a two-layer cache written and read by a prefill step (ragged) and a
decode step through "pallas-interpret", and through "tpu" (jax's TPU kernel swapped for its own jnp
reference on CPU), gives the "reference" backend's outputs and cache."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import triton_call
from paged_jax.attention import (AttentionMetadata, KVCache, attend, bytes_per_block, cache_layout,
                                        copy_blocks, resolve_backend)

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, NUM_HEADS, HEAD_DIM = 2, 8, 4, 2, 4, 16


@pytest.fixture
def tpu_kernel_on_cpu(monkeypatch):
    rpa = pytest.importorskip("jax.experimental.pallas.ops.tpu.ragged_paged_attention")
    monkeypatch.setattr(rpa, "ragged_paged_attention", rpa.ref_ragged_paged_attention)


def steps():
    """Sequence A: a 6-token prompt in blocks 1, 2; B: 3 tokens in block 3; a padding row. Then
    one decode token each (A at position 6, B at 3); the padding row writes nowhere."""
    tables = jnp.array([[1, 2], [3, 0], [0, 0]], jnp.int32)
    prefill = AttentionMetadata(
        slot_mapping=jnp.array([4, 5, 6, 7, 8, 9, 12, 13, 14, -1], jnp.int32),
        block_tables=tables, seq_lens=jnp.array([6, 3, 0], jnp.int32),
        query_start_loc=jnp.array([0, 6, 9, 9], jnp.int32))
    decode = AttentionMetadata(
        slot_mapping=jnp.array([10, 15, -1], jnp.int32), block_tables=tables,
        seq_lens=jnp.array([7, 4, 0], jnp.int32), query_start_loc=jnp.arange(4, dtype=jnp.int32),
        decode_only=True)
    rng = np.random.default_rng(0)
    for md, n in ((prefill, 10), (decode, 3)):
        qkv = [jnp.asarray(rng.standard_normal((n, h, HEAD_DIM)), jnp.float32)
               for h in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS)]
        yield md, qkv


def run(backend, **opts):
    """Jitted with the cache donated, as the model calls it; "tpu" runs eagerly (its stand-in
    reference loops over sequences in Python)."""
    cache = KVCache.create(NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM,
                           layout=cache_layout(backend))
    step = functools.partial(attend, backend=backend, **opts)
    if backend != "tpu":
        step = jax.jit(step, donate_argnames="cache")
    outs = []
    for md, (q, k, v) in steps():
        for layer in range(NUM_LAYERS):
            out, cache = step(q, k * (layer + 1), v - layer, cache, jnp.int32(layer), md)
            outs.append(out)
    return outs, cache


def assert_caches_equal(cache, reference):
    if cache.layout == "tpu":  # back to [kv_heads, blocks, block_size, dim] pairs
        blocks, size, heads, dim = cache.kv_pages.shape
        kv = cache.kv_pages.reshape(blocks, size, heads // 2, 2, dim).transpose(3, 2, 0, 1, 4)
        head_dim = reference.k_pages.shape[-1]
        assert not np.asarray(kv[..., head_dim:]).any()  # the lanes past head_dim stay zeros
        pages = (kv[0, ..., :head_dim], kv[1, ..., :head_dim])
    else:
        pages = (cache.k_pages, cache.v_pages)
    for got, expected in zip(pages, (reference.k_pages, reference.v_pages)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


@pytest.mark.parametrize("backend", [pytest.param("pallas-interpret", marks=pytest.mark.triton), "tpu"])
def test_backends_match_reference(backend, tpu_kernel_on_cpu):
    opts = dict(sm_scale=0.3, soft_cap=4.0, sliding_window=5)
    outs, cache = run(backend, **opts)
    expected, reference = run("reference", **opts)
    for out, exp in zip(outs, expected):
        np.testing.assert_allclose(np.asarray(out), np.asarray(exp), rtol=1e-5, atol=1e-5)
    assert not np.asarray(expected[-1][2]).any()  # the padding row of the last decode step
    assert_caches_equal(cache, reference)


@pytest.mark.parametrize("backend", [pytest.param("pallas-interpret", marks=pytest.mark.triton), "tpu"])
def test_copy_blocks_backends_match_reference(backend, tpu_kernel_on_cpu):
    _, cache = run(backend)
    _, reference = run("reference")
    src, dst = jnp.array([2, -1, 3], jnp.int32), jnp.array([5, 6, 7], jnp.int32)
    copied = copy_blocks(cache, src, dst, backend=backend)
    expected = copy_blocks(reference, src, dst)
    assert_caches_equal(copied, expected)
    np.testing.assert_array_equal(np.asarray(expected.k_pages[:, NUM_BLOCKS + 7]),
                                  np.asarray(reference.k_pages[:, NUM_BLOCKS + 3]))


def test_layouts_and_backends_must_match(monkeypatch):
    tpu_cache = KVCache.create(1, 4, 4, 1, 16, layout="tpu")
    assert tpu_cache.kv_pages.shape == (4, 4, 2, 128) and tpu_cache.k_pages is None  # head_dim padded to 128 lanes
    assert (tpu_cache.num_blocks, tpu_cache.block_size) == (4, 4)
    assert KVCache.create(1, 4, 4, 1, 16).bytes_per_block == 512
    assert tpu_cache.bytes_per_block == bytes_per_block(1, 1, 4, 16, jnp.float32, layout="tpu") == 512 * 8
    md, (q, k, v) = next(steps())
    with pytest.raises(ValueError, match="'reference' cannot read a 'tpu' KV cache"):
        attend(q, k, v, tpu_cache, 0, md, backend="reference")
    with pytest.raises(ValueError, match="layout must be one of"):
        KVCache.create(1, 4, 4, 1, 16, layout="nhd")
    with pytest.raises(ValueError, match="attention backend must be one of"):
        attend(q, k, v, KVCache.create(1, 4, 4, 1, 16), 0, md, backend="cuda")
    assert cache_layout("tpu") == "tpu" and cache_layout("reference") == "paged"
    on_gpu = "pallas" if triton_call.AVAILABLE else "reference"  # the model unsaid: not Mosaic GPU
    for platform, backend in (("gpu", on_gpu), ("tpu", "tpu"), ("cpu", "reference")):
        monkeypatch.setattr(jax, "default_backend", lambda p=platform: p)
        assert resolve_backend("auto") == backend
        assert cache_layout("auto") == ("tpu" if platform == "tpu" else "paged")
