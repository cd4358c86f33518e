"""Verification of speculative proposals on the device (vLLM V1's RejectionSampler; Leviathan et
al., "Fast Inference from Transformers via Speculative Decoding", 2023).

A row with d drafts was scored at d + 1 positions in one forward: position j's logits are the
target's distribution of the token after draft j - 1 (position 0: after the row's last sampled
token). Each position's distribution is the one plain decoding would sample from there, with every
row's own penalties (counting the drafts before it), min_tokens, temperature and top-k/top-p/min-p.
Greedy rows accept the longest prefix of drafts equal to the target's argmax. Sampled rows accept
draft j with probability min(1, p_j(d_j) / q_j(d_j)), where q is the proposer's distribution, one-hot
for n-gram proposals; the first rejected position samples from norm(max(0, p_j - q_j)) and a row
that accepts every draft samples a bonus token from p_d, so every emitted token is distributed as
the target's own. Draws use the row's key folded with the token's output index, as plain sampling
does: a row with no drafts samples exactly what a decode step would.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from paged_jax.sampling_params import SAMPLING_EPS
from paged_jax.worker import sampler

NEG_INF = float("-inf")
_ACCEPT_STREAM = 0x5BEC  # folded into a token's key for its accept/reject draw


def verify(logits, drafts, sp: sampler.SlotParams, num_output, total_len, penalties=None, draft_probs=None, *,
           filters: bool, num_logprobs: int, random: bool):
    """-> (tokens i32[B, J] (-1 after a row's last), logprob f32[B, J], rank i32[B, J], top_ids i32[B, J, N],
    top_logprobs f32[B, J, N], finish i32[B], num_accepted i32[B]).

    logits: f32[B, J, V], the model's at each row's J = d_max + 1 scored positions; drafts:
    i32[B, J - 1], each row's proposals then -1; num_output, total_len: i32[B], counting the token
    sampled at position 0 (as `sampler.stop_check` takes them); penalties: (output_counts i32[B, V],
    prompt_mask bool[B, V]) or None; draft_probs: f32[B, J - 1, V], the distribution q each draft
    was drawn from (a draft model's), or None for one-hot q (n-gram proposals, a greedy draft);
    `sp.allowed`, `sp.mask_row`: the grammars' masks and each row's, one per row or one per
    position (i32[masks, J, words]: position j's after the row's drafts before it, so a grammar's
    drafts are verified as it samples). A row
    stops at its first stop token or length limit, accepted draft or not, so its output ends where
    plain decoding's would.
    """
    rows, width, vocab = logits.shape
    position = jnp.arange(width)
    padded = jnp.concatenate([drafts, jnp.full((rows, 1), -1, jnp.int32)], axis=1)  # i32[B, J]
    has_draft = padded >= 0
    offset = jnp.tile(position, rows)  # each flattened entry's position in its row

    def flat(x):  # per-row values repeated for each of the row's positions
        return jnp.repeat(x, width, axis=0)

    fsp = jax.tree.map(flat, dataclasses.replace(sp, allowed=sp.allowed[:0]))  # `allowed` is not per row
    allowed, mask_row = sp.allowed, fsp.mask_row
    if allowed.ndim == 3:  # a grammar's mask per position, past the drafts before it
        mask_row = jnp.where(mask_row >= 0, mask_row * width + offset, -1)
        allowed = allowed.reshape(-1, allowed.shape[-1])
    fsp = dataclasses.replace(fsp, allowed=allowed, mask_row=mask_row)
    before = (num_output[:, None] - 1 + position).reshape(-1)  # output tokens before position j's token
    pens = None
    if penalties is not None:  # position j also counts drafts 0 .. j - 1 as output
        drafted = jax.nn.one_hot(padded, vocab, dtype=jnp.int32)  # i32[B, J, V]; -1 pads are all zero
        counts = penalties[0][:, None, :] + jnp.cumsum(drafted, axis=1) - drafted
        pens = (counts.reshape(rows * width, vocab), flat(penalties[1]))
    raw, lse, target = sampler.prepare(logits.reshape(rows * width, vocab), fsp, before, pens)

    greedy = jnp.argmax(target, axis=-1).astype(jnp.int32).reshape(rows, width)
    accept = padded == greedy
    final = greedy
    if random:
        keys = jax.vmap(jax.random.fold_in)(fsp.key, before)
        dist = sampler.scaled(target, fsp, filters=filters)  # f32[B * J, V]
        safe = jnp.maximum(padded, 0).reshape(-1)
        p = jax.nn.softmax(dist, axis=-1)
        p_draft = jnp.take_along_axis(p, safe[:, None], axis=-1)[:, 0]
        u = jax.vmap(jax.random.uniform)(jax.vmap(jax.random.fold_in, (0, None))(keys, _ACCEPT_STREAM))
        if draft_probs is None:  # q one-hot at the draft: accept with p(d); max(0, p - q) is p without d
            residual = jnp.where(has_draft.reshape(-1, 1) & (jnp.arange(vocab) == safe[:, None]), NEG_INF, dist)
        else:  # accept with min(1, p(d) / q(d)); resample from max(0, p - q) (p itself where q is 0)
            q = jnp.concatenate([draft_probs, jnp.zeros((rows, 1, vocab), draft_probs.dtype)], axis=1)
            q = jnp.where(has_draft[:, :, None], q, 0.0).reshape(rows * width, vocab)
            q_draft = jnp.take_along_axis(q, safe[:, None], axis=-1)[:, 0]
            p_draft = jnp.where(has_draft.reshape(-1), p_draft / jnp.maximum(q_draft, 1e-30), p_draft)
            left = jnp.maximum(p - q, 0.0)
            residual = jnp.where(jnp.any(left > 0, axis=-1, keepdims=True), jnp.log(left), dist)
        drawn = jax.vmap(jax.random.categorical)(keys, residual).astype(jnp.int32).reshape(rows, width)
        sampled = (sp.temperature >= SAMPLING_EPS)[:, None]
        accept = jnp.where(sampled, (u < p_draft).reshape(rows, width), accept)
        final = jnp.where(sampled, drawn, greedy)
    num_accepted = jnp.sum(jnp.cumprod(accept & has_draft, axis=1), axis=1).astype(jnp.int32)
    tokens = jnp.where(position < num_accepted[:, None], padded,
                       jnp.take_along_axis(final, num_accepted[:, None], axis=1))  # valid up to num_accepted

    # Stops: the first position whose token ends the row, among those it emits.
    stop = sampler.stop_check(tokens.reshape(-1), fsp, flat(num_output) + offset,
                              flat(total_len) + offset).reshape(rows, width)
    stop = jnp.where(position <= num_accepted[:, None], stop, 0)
    stopped = jnp.any(stop > 0, axis=1)
    last = jnp.where(stopped, jnp.argmax(stop > 0, axis=1), num_accepted)
    emitted = position <= last[:, None]
    tokens = jnp.where(emitted, tokens, -1)
    finish = jnp.where(stopped, jnp.take_along_axis(stop, last[:, None], axis=1)[:, 0], 0)

    logprob, rank, top_ids, top_lps = sampler.token_logprobs(raw, jnp.maximum(tokens, 0).reshape(-1), num_logprobs, lse)
    return (tokens, logprob.reshape(rows, width), rank.reshape(rows, width),
            top_ids.reshape(rows, width, -1), top_lps.reshape(rows, width, -1), finish, num_accepted)
