"""Our contract over jax's TPU ragged paged attention and its interleaved K/V cache layout, on CPU:
the kernel itself needs a TPU to run, so it is swapped for the same module's jnp reference,
`ref_ragged_paged_attention` (eager only: it loops over the sequences in Python). The real kernel
is lowered to its Mosaic custom call for v5e and v6e under `targets.abstract_target`."""
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (copy_blocks_reference, copy_blocks_tpu,
                            ragged_paged_attention_reference, ragged_paged_attention_tpu, targets,
                            write_kv_reference, write_kv_tpu)
from pallas_kernels.tpu_layout import TPU_BLOCKS, kv_pages_shape, tpu_block_sizes
from tests.pallas_kernels.paged_batches import TOL, dense_attention, make_batch, rel_err

RPA = "jax.experimental.pallas.ops.tpu.ragged_paged_attention"  # in jax 0.10 and 0.12 alike


@pytest.fixture
def tpu_kernel_on_cpu(monkeypatch):
    rpa = pytest.importorskip("jax.experimental.pallas.ops.tpu.ragged_paged_attention")
    monkeypatch.setattr(rpa, "ragged_paged_attention", rpa.ref_ragged_paged_attention)


def interleave(k_pages, v_pages):
    """[num_kv_heads, num_blocks, block_size, head_dim] x 2 -> [num_blocks, block_size,
    2 * num_kv_heads, head_dim] with K of head h at 2h and its V at 2h + 1."""
    kv = jnp.stack([k_pages, v_pages], axis=1)  # [kv_heads, 2, blocks, block_size, dim]
    kvh, _, nb, bs, d = kv.shape
    return kv.transpose(2, 3, 0, 1, 4).reshape(nb, bs, 2 * kvh, d)


@pytest.mark.parametrize("opts", [dict(), dict(soft_cap=3.0, sliding_window=11, sm_scale=0.2)])
def test_ragged_batch_matches_reference(tpu_kernel_on_cpu, opts):
    seq_lens, q_lens = [9, 1, 29, 8, 7, 0, 16], [1, 1, 7, 8, 7, 0, 10]
    batch = make_batch(20, seq_lens, q_lens, group=4, block_size=8, pad_tokens=3)
    names = ("block_tables", "seq_lens", "query_start_loc")
    out = ragged_paged_attention_tpu(batch["q"], interleave(batch["k_pages"], batch["v_pages"]),
                                     *(batch[n] for n in names), **opts)
    reference = ragged_paged_attention_reference(
        *(batch[n] for n in ("q", "k_pages", "v_pages", *names)), **opts)
    assert out.shape == batch["q"].shape
    assert rel_err(out, reference) <= TOL[jnp.float32]
    assert rel_err(out, dense_attention(batch, **opts)) <= TOL[jnp.float32]
    assert not np.asarray(out[-3:]).any()


def test_decode_batch_padding_rows_are_zeros(tpu_kernel_on_cpu):
    """A decode batch gives each padding row (seq_len 0) a query token the TPU kernel has no key
    for; the adapter returns zeros there, as the contract says."""
    lens = [5, 0, 17, 0]
    batch = make_batch(21, lens, [1] * 4, group=2, block_size=8)
    qsl = jnp.arange(5, dtype=jnp.int32)
    out = ragged_paged_attention_tpu(batch["q"], interleave(batch["k_pages"], batch["v_pages"]),
                                     batch["block_tables"], batch["seq_lens"], qsl)
    np.testing.assert_array_equal(np.asarray(out[1]), 0)
    np.testing.assert_array_equal(np.asarray(out[3]), 0)
    assert rel_err(out, dense_attention(batch)) <= TOL[jnp.float32]


def test_cache_writes_match_the_paged_layout():
    batch = make_batch(22, [12, 5], [12, 5], num_kv_heads=3, block_size=4)
    k_pages, v_pages = batch["k_pages"], batch["v_pages"]
    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.standard_normal((6, 3, 64)), jnp.float32) for _ in range(2))
    slots = jnp.array([3, 17, -1, 8, 30, -1], jnp.int32)
    got = write_kv_tpu(interleave(k_pages, v_pages), k, v, slots)
    expected = interleave(*write_kv_reference(k_pages, v_pages, k, v, slots))
    np.testing.assert_array_equal(got, expected)
    src, dst = jnp.array([1, -1, 2], jnp.int32), jnp.array([6, 3, 7], jnp.int32)
    got = copy_blocks_tpu(interleave(k_pages, v_pages), src, dst)
    expected = interleave(*copy_blocks_reference(k_pages, v_pages, src, dst))
    np.testing.assert_array_equal(got, expected)


def test_head_dim_64_pages_are_padded_to_the_lanes(tpu_kernel_on_cpu):
    """jax's kernel needs head_dim in whole 128-lane tiles: the cache stores hd 64 as 128, zeros
    after 64, and attention through it is attention at hd 64."""
    seq_lens, q_lens = [9, 20, 5], [9, 3, 1]
    batch = make_batch(23, seq_lens, q_lens, head_dim=64, block_size=8)
    num_blocks = batch["k_pages"].shape[1]
    assert kv_pages_shape(num_blocks, 8, 2, 64) == (num_blocks, 8, 4, 128)
    rng = np.random.default_rng(1)
    k, v = (jnp.asarray(rng.standard_normal((3, 2, 64)), jnp.float32) for _ in range(2))
    slots = jnp.array([2, 11, 40], jnp.int32)
    padded = write_kv_tpu(jnp.pad(interleave(batch["k_pages"], batch["v_pages"]), [(0, 0)] * 3 + [(0, 64)]),
                          k, v, slots)
    assert padded.shape == kv_pages_shape(num_blocks, 8, 2, 64) and not np.asarray(padded[..., 64:]).any()
    k_pages, v_pages = write_kv_reference(batch["k_pages"], batch["v_pages"], k, v, slots)
    names = ("block_tables", "seq_lens", "query_start_loc")
    out = ragged_paged_attention_tpu(batch["q"], padded, *(batch[n] for n in names))
    reference = ragged_paged_attention_reference(batch["q"], k_pages, v_pages, *(batch[n] for n in names))
    assert out.shape == batch["q"].shape
    assert rel_err(out, reference) <= TOL[jnp.float32]


def tpu_args(num_tokens, max_blocks_per_seq, num_seqs=8, head_dim=128):
    """Abstract inputs of a Llama-3.1-8B-like layer: 8 query heads on 2 KV heads, hd128, bf16
    (SmolLM2-like at head_dim 64: its pages as the engine's cache holds them, kv_pages_shape)."""
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    return (jax.ShapeDtypeStruct((num_tokens, 8, head_dim), jnp.bfloat16),
            jax.ShapeDtypeStruct(kv_pages_shape(1024, 16, 2, head_dim), jnp.bfloat16),
            i32((num_seqs, max_blocks_per_seq)), i32((num_seqs,)), i32((num_seqs + 1,)))


@pytest.mark.parametrize("target", targets.TPU_TARGETS)
@pytest.mark.parametrize("head_dim", [128, 64])
@pytest.mark.parametrize("num_tokens,max_blocks,blocks", [(128, 512, (16, 32)), (20, 7, (7, 20))])
def test_lowers_to_mosaic_for_each_tpu(monkeypatch, target, head_dim, num_tokens, max_blocks, blocks):
    """On this CPU machine jax's TPU kernel lowers to one Mosaic `tpu_custom_call` for the TPU the
    abstract device names, with TPU_BLOCKS' block sizes (capped by the table and the tokens)."""
    rpa = importlib.import_module(RPA)
    kernel, seen = rpa.ragged_paged_attention, []

    def spy(*args, **kwargs):
        seen.append((kwargs["num_kv_pages_per_block"], kwargs["num_queries_per_block"]))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(rpa, "ragged_paged_attention", spy)
    with targets.abstract_target(target):
        exported = jax.export.export(jax.jit(ragged_paged_attention_tpu), platforms=("tpu",))(
            *tpu_args(num_tokens, max_blocks, head_dim=head_dim))
    module = exported.mlir_module()
    assert module.count("stablehlo.custom_call @tpu_custom_call(") == 1
    assert 'kernel_name = "ragged_paged_attention_kernel"' in module
    assert TPU_BLOCKS[target] == (16, 32)
    assert seen == [blocks]


def test_jax_alone_asks_the_local_device_for_its_block_sizes():
    """Why TPU_BLOCKS exists: left to choose its block sizes, jax's kernel looks the chip up on the
    local device, so it cannot lower ahead of time for an abstract TPU; given ours, it does."""
    rpa = importlib.import_module(RPA)
    q, kv, tables, lens, qsl = tpu_args(128, 512)
    num_seqs = jax.ShapeDtypeStruct((1,), jnp.int32)
    with targets.abstract_target("v6e"):
        with pytest.raises(NotImplementedError, match="TPU version must be 4 or higher"):
            jax.export.export(jax.jit(rpa.ragged_paged_attention), platforms=("tpu",))(
                q, kv, lens, tables, qsl, num_seqs)
        ours = functools.partial(rpa.ragged_paged_attention, **tpu_block_sizes(128, 512))
        module = jax.export.export(jax.jit(ours), platforms=("tpu",))(q, kv, lens, tables, qsl, num_seqs).mlir_module()
    assert module.count("stablehlo.custom_call @tpu_custom_call(") == 1


def test_block_sizes_are_only_chosen_for_a_listed_tpu():
    assert tpu_block_sizes(300, 40, "v5e") == dict(num_kv_pages_per_block=16,
                                                  num_queries_per_block=32)
    assert tpu_block_sizes(300, 40, "TPU7x") == {}  # jax's own lookup on a real one
    assert targets.tpu_target() is None and tpu_block_sizes(300, 40) == {}  # this CPU
    with targets.abstract_target("v5e"):
        assert targets.tpu_target() == "v5e"
