"""Speculative decoding's n-gram proposals on the device, for verifications planned before the call
before them returned (overlapped scheduling): the host reserved each such row's drafts with stand-ins
as it does for a draft model, and the verifying `runner.prefill_step` looks them up here, in the
row's tokens as the device holds them (vLLM's prompt lookup, engine/ngram.py's rule; vLLM's GPU
n-gram proposer keeps a per-request token array on the device for the same reason).

The device holds the tokens where it holds their K/V: `TokenPages`, the token id of every KV slot,
written wherever a call writes a slot's K/V. A block's tokens are part of its contents, so they
travel with it wherever its K/V does (prefix hits, swap, the host tier, copy-on-write of forks), and
a row's tokens are its block table's: a call reads as many as its tables are wide."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenPages:
    """The token each KV slot holds: i32[num_blocks, block_size]. Swapped and copied by block as a
    KV cache is (worker/swap.py reads num_layers, num_blocks and block_axis); 4 bytes a slot."""

    token_ids: jax.Array
    num_layers = 1
    block_axis = 0

    @property
    def num_blocks(self) -> int:
        return self.token_ids.shape[0]

    def write(self, slots, tokens) -> TokenPages:
        """tokens[i] (i32[T]) into KV slot slots[i] (-1: skip)."""
        flat = self.token_ids.reshape(-1)
        at = jnp.where(slots >= 0, slots, flat.shape[0])
        return TokenPages(flat.at[at].set(tokens, mode="drop").reshape(self.token_ids.shape))

    def copy(self, src, dst) -> TokenPages:
        """Blocks src[i] -> dst[i] (i32[n], -1: skip), as `attention.copy_blocks` copies their K/V."""
        at = jnp.where((src >= 0) & (dst >= 0), dst, self.num_blocks)
        return TokenPages(self.token_ids.at[at].set(self.token_ids[jnp.maximum(src, 0)], mode="drop"))

    def rows(self, block_tables):
        """i32[B, W] tables -> i32[B, W * block_size], each row's tokens by position."""
        return self.token_ids[block_tables].reshape(block_tables.shape[0], -1)


def lookup(tokens, lengths, rooms, min_n: int, max_n: int):
    """engine/ngram.propose in jnp: tokens i32[R, W], lengths i32[R], rooms i32[R] -> (starts i32[R],
    counts i32[R]): row r's proposal is tokens[r, starts[r]:starts[r] + counts[r]]."""
    num_rows, width = tokens.shape
    rows, ends = jnp.arange(num_rows), jnp.arange(width)
    run = ends[None, :] <= lengths[:, None] - 2
    matched = jnp.zeros((num_rows, width), jnp.int32)
    for i in range(min(max_n, width)):  # an occurrence of the last i + 1 tokens ends at e >= i
        last = tokens[rows, jnp.maximum(lengths - 1 - i, 0)]
        equal = jnp.concatenate([jnp.zeros((num_rows, i), bool), tokens[:, : width - i] == last[:, None]], axis=1)
        run = run & equal
        matched = matched + run
    n = jnp.max(matched, axis=1)
    hits = (matched >= n[:, None]) & (n >= min_n)[:, None]
    followed = hits & (ends[None, :] + 1 + rooms[:, None] <= lengths[:, None])
    latest = width - 1 - jnp.argmax(followed[:, ::-1], axis=1)
    starts = jnp.where(jnp.any(followed, axis=1), latest, jnp.argmax(hits, axis=1)) + 1
    counts = jnp.where(jnp.any(hits, axis=1), jnp.minimum(rooms, lengths - starts), 0)
    return starts.astype(jnp.int32), counts.astype(jnp.int32)


def propose(pages: TokenPages, batch, min_n: int, max_n: int):
    """The drafts of the batch's optimistic rows (PrefillBatch.optimistic), up to the slots the host
    reserved for them (spec_rows), looked up in each row's tokens through its last one; other rows
    keep the host's -> (drafts i32[B, J - 1], -1 where none)."""
    reserved = batch.spec_rows[:, 1:] >= 0
    first = jnp.maximum(batch.spec_rows[:, 0], 0)
    last = batch.positions[first]  # a row's last token is this call's first of it, not yet in the pages
    tokens = pages.rows(batch.block_tables)
    tokens = tokens.at[jnp.arange(tokens.shape[0]), jnp.minimum(last, tokens.shape[1] - 1)].set(batch.tokens[first])
    starts, counts = lookup(tokens, last + 1, jnp.sum(reserved, axis=1), min_n, max_n)
    j = jnp.arange(reserved.shape[1])
    found = jnp.take_along_axis(tokens, jnp.minimum(starts[:, None] + j, tokens.shape[1] - 1), axis=1)
    found = jnp.where(j < counts[:, None], found, -1)
    return jnp.where(batch.optimistic[:, None] & reserved, found, batch.drafts)


def read_batch(pages: TokenPages, batch, lookup_n: tuple[int, int] | None):
    """With `lookup_n` = (prompt_lookup_min, prompt_lookup_max) in a verifying call, its optimistic
    rows' drafts looked up and written over their stand-ins; then the call's tokens written beside
    their K/V -> (batch, pages)."""
    if lookup_n is not None:
        drafts = propose(pages, batch, *lookup_n)
        at = jnp.where((batch.spec_rows[:, 1:] >= 0) & (drafts >= 0), batch.spec_rows[:, 1:], batch.tokens.shape[0])
        batch = dataclasses.replace(batch, tokens=batch.tokens.at[at].set(drafts, mode="drop"), drafts=drafts)
    return batch, pages.write(batch.slot_mapping, batch.tokens)


def write_steps(pages: TokenPages, block_tables, positions, first, sampled) -> TokenPages:
    """A decode call's tokens beside their K/V: each row's input at step s (first i32[B], then what it
    sampled, sampled i32[B, K], -1 where the row did not run) at position positions[b] + s."""
    num_rows, steps = sampled.shape
    block_size = pages.token_ids.shape[1]
    at = positions[:, None] + jnp.arange(steps)
    block = block_tables[jnp.arange(num_rows)[:, None], jnp.clip(at // block_size, 0, block_tables.shape[1] - 1)]
    slots = jnp.where(sampled >= 0, block * block_size + at % block_size, -1)
    inputs = jnp.concatenate([first[:, None], sampled[:, :-1]], axis=1)
    return pages.write(slots.reshape(-1), inputs.reshape(-1))
