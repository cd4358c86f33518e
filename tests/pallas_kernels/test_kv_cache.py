"""write_kv and copy_blocks kernels against their scatter references, exactly, compiled on a GPU
(marked `gpu`) and in interpret mode on CPU; the scatter references (the CPU's and Mosaic GPU's
writes) against numpy."""
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import copy_blocks, copy_blocks_reference, write_kv, write_kv_reference
from pallas_kernels.kv_cache import unique_or_dropped


def make_pages(seed, num_kv_heads, num_blocks, block_size, head_dim, dtype):
    rng = np.random.default_rng(seed)
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    return (jnp.asarray(rng.standard_normal(shape), dtype),
            jnp.asarray(rng.standard_normal(shape), dtype), rng)


def assert_same(got, expected):
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(e, np.float32))


def test_skipped_entries_get_indices_of_their_own():
    got = unique_or_dropped(jnp.array([3, -1, 7, -1, 8, 12, -5, 0], jnp.int32), 8)
    np.testing.assert_array_equal(np.asarray(got), [3, 9, 7, 11, 12, 13, 14, 0])


@pytest.mark.parametrize("num_tokens", [1, 2, 9])
def test_scatter_write_puts_each_token_at_its_slot(num_tokens):
    """Against a numpy loop: repeated -1s, a slot past the pool and a negative one are skipped
    (all unique to the scatter once moved past the end); one token is a scatter too."""
    k_pages, v_pages, rng = make_pages(3, 2, 6, 4, 16, jnp.bfloat16)
    slots = rng.permutation(24)[:num_tokens].astype(np.int32)
    if num_tokens == 9:
        slots[[1, 4]] = -1
        slots[[6, 7]] = 24, -3
    k, v = (jnp.asarray(rng.standard_normal((num_tokens, 2, 16)), jnp.float32) for _ in range(2))
    got = write_kv_reference(k_pages, v_pages, k, v, jnp.asarray(slots))
    for pages, new, out in zip((k_pages, v_pages), (k, v), got):
        expected = np.asarray(pages, np.float32).copy()
        for token, slot in enumerate(slots):
            if 0 <= slot < 24:
                expected[:, slot // 4, slot % 4] = np.asarray(new[token].astype(jnp.bfloat16), np.float32)
        np.testing.assert_array_equal(np.asarray(out, np.float32), expected)


def test_scatter_copy_skips_pairs_out_of_range():
    k_pages, v_pages, _ = make_pages(4, 2, 6, 4, 16, jnp.float32)
    src, dst = jnp.array([1, -1, 2, 9, 3], jnp.int32), jnp.array([4, 5, -1, 0, 5], jnp.int32)
    got = copy_blocks_reference(k_pages, v_pages, src, dst)
    for pages, out in zip((k_pages, v_pages), got):
        expected = np.asarray(pages).copy()
        expected[:, 4], expected[:, 5] = expected[:, 1], expected[:, 3]
        np.testing.assert_array_equal(np.asarray(out), expected)


@pytest.mark.triton
class KVCacheCases:
    INTERPRET = False

    @pytest.mark.parametrize("head_dim,block_size,dtype", [
        (64, 8, jnp.float32), (80, 16, jnp.bfloat16), (128, 256, jnp.float16)])
    def test_write_kv_matches_reference(self, head_dim, block_size, dtype):
        """37 tokens (more than one 32-token program) into distinct random slots; -1 (padding)
        and a slot past the pool are skipped; k/v arrive in f32 and are cast to the pages'
        dtype."""
        k_pages, v_pages, rng = make_pages(0, 3, 12, block_size, head_dim, dtype)
        num_tokens = 37
        slots = rng.permutation(12 * block_size)[:num_tokens].astype(np.int32)
        slots[[0, 9, 30]] = -1
        slots[5] = 12 * block_size + 3
        k = jnp.asarray(rng.standard_normal((num_tokens, 3, head_dim)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((num_tokens, 3, head_dim)), jnp.float32)
        got = write_kv(k_pages, v_pages, k, v, jnp.asarray(slots), interpret=self.INTERPRET)
        assert_same(got, write_kv_reference(k_pages, v_pages, k, v, jnp.asarray(slots)))
        changed = np.any(np.asarray(got[0] != k_pages), axis=(0, 3)).sum()
        assert changed == num_tokens - 4  # every written slot moved, nothing else did

    def test_copy_blocks_matches_reference(self):
        k_pages, v_pages, _ = make_pages(1, 2, 10, 16, 64, jnp.bfloat16)
        src = jnp.array([1, 2, -1, 3, 4], jnp.int32)
        dst = jnp.array([5, 6, 7, -1, 9], jnp.int32)
        got = copy_blocks(k_pages, v_pages, src, dst, interpret=self.INTERPRET)
        assert_same(got, copy_blocks_reference(k_pages, v_pages, src, dst))
        for s, d in ((1, 5), (2, 6), (4, 9)):
            np.testing.assert_array_equal(np.asarray(got[1][:, d], np.float32),
                                          np.asarray(v_pages[:, s], np.float32))
        np.testing.assert_array_equal(np.asarray(got[0][:, 7], np.float32),
                                      np.asarray(k_pages[:, 7], np.float32))

    def test_empty_batches_change_nothing(self):
        k_pages, v_pages, _ = make_pages(2, 1, 4, 8, 64, jnp.float32)
        empty = jnp.zeros((0, 1, 64), jnp.float32)
        none = jnp.zeros((0,), jnp.int32)
        assert_same(write_kv(k_pages, v_pages, empty, empty, none, interpret=self.INTERPRET),
                    (k_pages, v_pages))
        assert_same(copy_blocks(k_pages, v_pages, none, none, interpret=self.INTERPRET),
                    (k_pages, v_pages))


@pytest.mark.gpu
class TestKVCacheGpu(KVCacheCases):
    INTERPRET = False


class TestKVCacheInterpret(KVCacheCases):
    INTERPRET = True
