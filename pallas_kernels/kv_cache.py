"""Writing new K/V into the pages, and copying whole blocks (copy-on-write after a fork).

Both kernels alias the pages in to the pages out (input_output_aliases), so when the caller donates
the pages (as the model's jitted step does) XLA hands the kernel the cache buffer itself and only
the written slots move; they are plain vectorised stores, one program per (32 tokens or one block
pair, KV head).

The jnp references are XLA scatters, also in place on a donated buffer. They are the CPU path and
the Mosaic GPU backend's (which needs no Pallas Triton): their indices are declared unique, each
skipped entry given its own out-of-range index (`unique_or_dropped`), because with repeated indices
XLA:GPU turns every element's store into a compare-and-swap loop (`atom.cas` in the H100 PTX of a
256-token bf16 write; a plain `st.global` with unique indices)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import checks
from pallas_kernels.online_softmax import pow2_at_least, zero
from pallas_kernels.quantization import quantize
from pallas_kernels.triton_call import plgpu, triton_call

BLOCK_TOKENS = 32  # tokens per write_kv program
TILE_ELEMENTS = 4096  # elements per copy_blocks step: 16 KiB of f32 in flight per program


def _write_kv_kernel(slots_ref, k_ref, v_ref, *refs, head_dim):
    # slots_ref: i32[num_tokens]; k_ref, v_ref: [num_tokens, num_kv_heads, head_dim]
    # refs: the aliased inputs (same buffers as the outputs; unused), then the outputs
    #   k_pages_ref, v_pages_ref [num_kv_heads, num_blocks, block_size, head_dim] and, for int8/fp8
    #   pages, k_scales_ref, v_scales_ref f32[num_kv_heads, num_blocks, block_size]
    k_pages_ref, v_pages_ref, *scale_refs = refs[len(refs) // 2:]
    chunk, head = pl.program_id(0), pl.program_id(1)
    num_tokens = slots_ref.shape[0]
    _, num_blocks, block_size, _ = k_pages_ref.shape
    tok = chunk * BLOCK_TOKENS + jnp.arange(BLOCK_TOKENS)
    slot = plgpu.load(slots_ref.at[tok], mask=tok < num_tokens, other=-1)
    ok = (slot >= 0) & (slot < num_blocks * block_size)  # -1 (padding) and strays are skipped
    block = jnp.where(ok, jax.lax.div(slot, block_size), num_blocks)  # skipped: never stored
    offset = jnp.where(ok, jax.lax.rem(slot, block_size), 0)
    dims = jnp.arange(pow2_at_least(head_dim, 16))[None, :]
    mask = ok[:, None] & (dims < head_dim)
    for src, dst, scale_ref in zip((k_ref, v_ref), (k_pages_ref, v_pages_ref),
                                   scale_refs or (None, None)):
        x = plgpu.load(src.at[tok[:, None], head, dims], mask=mask, other=0)
        if scale_ref is None:
            x = x.astype(dst.dtype)
        else:  # padded dims load 0, so they do not move a row's scale
            x, scale = quantize(x, dst.dtype)
            plgpu.store(scale_ref.at[head, block, offset], scale, mask=ok)
        plgpu.store(dst.at[head, block[:, None], offset[:, None], dims], x, mask=mask)


def _copy_blocks_kernel(src_ref, dst_ref, _k_in, _v_in, k_pages_ref, v_pages_ref, *, head_dim):
    # src_ref, dst_ref: i32[num_pairs]; _k_in, _v_in: the aliased page inputs (unused)
    # k_pages_ref, v_pages_ref: [num_kv_heads, num_blocks, block_size, head_dim]
    pair, head = pl.program_id(0), pl.program_id(1)
    _, num_blocks, block_size, _ = k_pages_ref.shape
    src, dst = src_ref[pair], dst_ref[pair]
    ok = (src >= 0) & (src < num_blocks) & (dst >= 0) & (dst < num_blocks)
    dims = jnp.arange(pow2_at_least(head_dim, 16))[None, :]
    rows = min(pow2_at_least(block_size), max(1, TILE_ELEMENTS // dims.shape[1]))

    def step(j, carry):
        offset = j * rows + jnp.arange(rows)
        mask = (offset < block_size)[:, None] & (dims < head_dim)
        for ref in (k_pages_ref, v_pages_ref):
            x = plgpu.load(ref.at[head, src, offset[:, None], dims], mask=mask,
                           other=zero(ref.dtype))
            plgpu.store(ref.at[head, dst, offset[:, None], dims], x, mask=mask)
        return carry

    # Strongly typed: jax's Triton lowering gives a weak-typed literal of select_n the predicate's
    # type, so where(ok, 1, 0) became an i1 loop bound that Triton's verifier rejects.
    steps = jnp.where(ok, jnp.int32(pl.cdiv(block_size, rows)), jnp.int32(0))
    jax.lax.fori_loop(0, steps, step, 0)


def _call(kernel, grid, inputs, pages, name, interpret):
    """The `pages` (K/V pages, and scales if any) are the last inputs and alias the outputs."""
    n = len(inputs)
    out_shape = tuple(jax.ShapeDtypeStruct(p.shape, p.dtype) for p in pages)
    return triton_call(kernel, (*inputs, *pages), out_shape, grid=grid, name=name,
                       aliases={n + i: i for i in range(len(pages))}, interpret=interpret,
                       num_warps=4, num_stages=1)


@functools.partial(jax.jit, static_argnames=("interpret",))
def _write_kv(pages, k, v, slot_mapping, *, interpret):
    num_tokens, num_kv_heads, head_dim = k.shape
    kernel = functools.partial(_write_kv_kernel, head_dim=head_dim)
    grid = (pl.cdiv(num_tokens, BLOCK_TOKENS), num_kv_heads)
    return _call(kernel, grid, (slot_mapping.astype(jnp.int32), k, v), pages, "write_kv",
                 interpret)


@functools.partial(jax.jit, static_argnames=("interpret",))
def _copy_blocks(k_pages, v_pages, src, dst, *, interpret):
    kernel = functools.partial(_copy_blocks_kernel, head_dim=k_pages.shape[3])
    return _call(kernel, (src.shape[0], k_pages.shape[0]), (src.astype(jnp.int32),
                 dst.astype(jnp.int32)), (k_pages, v_pages), "copy_blocks", interpret)


def write_kv(
    k_pages,  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_pages,  # [num_kv_heads, num_blocks, block_size, head_dim]
    k,  # [num_tokens, num_kv_heads, head_dim]
    v,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping,  # i32[num_tokens]; block_id * block_size + offset, -1 = skip
    *,
    k_scales=None,  # f32[num_kv_heads, num_blocks, block_size]: with int8/fp8 pages
    v_scales=None,  # f32[num_kv_heads, num_blocks, block_size]
    interpret=False,
):
    """-> (k_pages, v_pages) with token t's K/V at its slot; for int8/fp8 pages, quantized per
    (token, KV head) (quantization.quantize), -> (k_pages, v_pages, k_scales, v_scales). Slots
    must be unique (vLLM's slot_mapping is); donate the pages to update them in place."""
    num_kv_heads, _, _, head_dim = checks.check_pages(k_pages, v_pages)
    quantized = checks.check_scales(k_pages, k_scales, v_scales, interpret=bool(interpret))
    pages = (k_pages, v_pages, k_scales, v_scales) if quantized else (k_pages, v_pages)
    checks.check_rank("k", k, 3)
    num_tokens = jnp.shape(k)[0]
    if tuple(jnp.shape(k)) != (num_tokens, num_kv_heads, head_dim) or jnp.shape(v) != jnp.shape(k):
        raise ValueError(f"k and v must be [num_tokens, {num_kv_heads}, {head_dim}] like the "
                         f"pages, got k {jnp.shape(k)}, v {jnp.shape(v)}")
    checks.check_int("slot_mapping", slot_mapping, (num_tokens,))
    if head_dim > checks.MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is not supported (1..{checks.MAX_HEAD_DIM})")
    if num_tokens == 0:
        return pages
    return _write_kv(pages, k, v, slot_mapping, interpret=bool(interpret))


def copy_blocks(
    k_pages,  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_pages,  # [num_kv_heads, num_blocks, block_size, head_dim]
    src,  # i32[n]; -1 = skip
    dst,  # i32[n]; -1 = skip
    *,
    interpret=False,
):
    """-> (k_pages, v_pages) with block dst[i] a copy of block src[i] in every KV head. The dst
    blocks are fresh (a fork's copy of a partial tail, vLLM's copy-on-write): distinct, and not
    among the src blocks."""
    _, _, _, head_dim = checks.check_pages(k_pages, v_pages)
    checks.check_rank("src", src, 1)
    checks.check_int("src", src, jnp.shape(src))
    checks.check_int("dst", dst, jnp.shape(src))
    if head_dim > checks.MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is not supported (1..{checks.MAX_HEAD_DIM})")
    if jnp.shape(src)[0] == 0:
        return k_pages, v_pages
    return _copy_blocks(k_pages, v_pages, src, dst, interpret=bool(interpret))


def write_kv_reference(
    k_pages,  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_pages,  # [num_kv_heads, num_blocks, block_size, head_dim]
    k,  # [num_tokens, num_kv_heads, head_dim]
    v,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping,  # i32[num_tokens]; block_id * block_size + offset, -1 = skip
    *,
    k_scales=None,  # f32[num_kv_heads, num_blocks, block_size]: with int8/fp8 pages
    v_scales=None,  # f32[num_kv_heads, num_blocks, block_size]
):
    """As `write_kv`: (k_pages, v_pages), or with scales (k_pages, v_pages, k_scales, v_scales).

    One token (a decode step of one sequence) is written as two, the second dropped: XLA rewrites a
    one-index scatter into a dynamic-update-slice, which it may then recompute inside a consumer
    (XLA:CPU fused it into the attention's gather of the same pages), so that consumer read the
    pages from before the write while the update wrote them in place, and XLA copied the whole
    page array, twice, to keep both. A scatter has no elementwise form: it is never recomputed in
    a consumer, and the pages are updated in place."""
    if k.shape[0] == 1:
        k, v = (jnp.concatenate([x, jnp.zeros_like(x)]) for x in (k, v))
        slot_mapping = jnp.concatenate([slot_mapping, jnp.full((1,), -1, slot_mapping.dtype)])
    num_blocks, block_size = k_pages.shape[1:3]
    slot = unique_or_dropped(slot_mapping, num_blocks * block_size)
    block, offset = slot // block_size, slot % block_size  # a skipped slot: a block past the end
    scatter = dict(mode="drop", unique_indices=True)
    if k_scales is None:
        k_pages = k_pages.at[:, block, offset].set(k.swapaxes(0, 1).astype(k_pages.dtype), **scatter)
        v_pages = v_pages.at[:, block, offset].set(v.swapaxes(0, 1).astype(v_pages.dtype), **scatter)
        return k_pages, v_pages
    out = []
    for pages, scales, x in ((k_pages, k_scales, k), (v_pages, v_scales, v)):
        qx, scale = quantize(x.swapaxes(0, 1), pages.dtype)
        out.append((pages.at[:, block, offset].set(qx, **scatter),
                    scales.at[:, block, offset].set(scale, **scatter)))
    (k_pages, k_scales), (v_pages, v_scales) = out
    return k_pages, v_pages, k_scales, v_scales


def unique_or_dropped(index, size: int):
    """-> `index` (i32[n]) with each entry outside [0, size) (-1: skip) moved to its own index
    `size + i`: a scatter with mode="drop" skips them, and valid entries that are unique (a slot
    mapping's, a copy's destinations) stay so, as `unique_indices=True` needs."""
    index = jnp.asarray(index, jnp.int32)
    spare = size + jnp.arange(index.shape[0], dtype=jnp.int32)
    return jnp.where((index >= 0) & (index < size), index, spare)


def copy_blocks_reference(
    k_pages,  # [num_kv_heads, num_blocks, block_size, head_dim]
    v_pages,  # [num_kv_heads, num_blocks, block_size, head_dim]
    src,  # i32[n]; -1 = skip
    dst,  # i32[n]; -1 = skip
):
    num_blocks = k_pages.shape[1]
    ok = (src >= 0) & (src < num_blocks) & (dst >= 0) & (dst < num_blocks)
    src = jnp.where(ok, src, 0)
    dst = unique_or_dropped(jnp.where(ok, dst, -1), num_blocks)
    return tuple(pages.at[:, dst].set(pages[:, src], mode="drop", unique_indices=True)
                 for pages in (k_pages, v_pages))
