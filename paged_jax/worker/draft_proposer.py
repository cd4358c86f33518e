"""Speculative decoding's draft model on the device: the k decode steps that propose a verifying
row's drafts inside `runner.prefill_step`, before the target scores them."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_jax.attention import AttentionMetadata, KVCache
from paged_jax.sampling_params import SAMPLING_EPS
from paged_jax.worker import sampler
from paged_jax.worker.batching import PrefillBatch

_DRAFT_STREAM = 0xD4AF  # folded into a row's key for its draft model's draws


def propose(draft, cache: KVCache, batch: PrefillBatch, sp: sampler.SlotParams, flags):
    """k decode steps of the draft model from each verifying row's last token, over the slots the
    host mapped for the row's proposals -> (drafts i32[B, k] (-1 where the row has no slot), q f32[B,
    k, V]: the distribution each was drawn from, or None when every row is greedy (q one-hot), cache).
    Draft j of a row is drawn as the target's token there would be: temperature, top-k / top-p /
    min-p, min_tokens, with the row's key (its own stream) and the index of that output token; the
    penalties are left out of q (any q keeps verification exact; a closer one is accepted more)."""
    num_rows, k = batch.drafts.shape
    rows = jnp.arange(num_rows)
    first = jnp.maximum(batch.spec_rows[:, 0], 0)  # each row's last sampled token in the batch
    start, last = batch.positions[first], batch.tokens[first]
    keys = jax.vmap(jax.random.fold_in, (0, None))(sp.key, _DRAFT_STREAM)

    def step(carry, j):
        cache, last = carry
        active = batch.drafts[:, j] >= 0
        positions = start + j
        md = AttentionMetadata(slot_mapping=jnp.where(active, batch.slot_mapping[batch.spec_rows[:, j]], -1),
                               block_tables=batch.block_tables, seq_lens=jnp.where(active, positions + 1, 0),
                               query_start_loc=jnp.arange(num_rows + 1, dtype=jnp.int32), decode_only=True)
        logits, cache = draft(last, positions, cache, md, rows, backend=flags.backend, mesh=flags.mesh)
        index = batch.num_output - 1 + j  # the output index of the token draft j proposes
        _, _, target = sampler.prepare(logits, sp, index)
        tokens = jnp.argmax(target, axis=-1).astype(jnp.int32)
        q = None
        if flags.random:
            dist = sampler.scaled(target, sp, filters=flags.filters)
            drawn = jax.vmap(jax.random.categorical)(jax.vmap(jax.random.fold_in)(keys, index), dist)
            tokens = jnp.where(sp.temperature < SAMPLING_EPS, tokens, drawn.astype(jnp.int32))
            q = jax.nn.softmax(dist, axis=-1)
        tokens = jnp.where(active, tokens, -1)
        return (cache, jnp.where(active, tokens, last)), (tokens, q)

    (cache, _), (drafts, q) = jax.lax.scan(step, (cache, last), jnp.arange(k))
    return drafts.T, None if q is None else jnp.swapaxes(q, 0, 1), cache
