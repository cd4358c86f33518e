"""Sampling on the device, one row per sequence slot, every row with its own parameters (vLLM V1's
Sampler: penalties, min_tokens masking, greedy or temperature, top-k / top-p / min-p, logprobs).

A row's randomness depends only on its request's key and the index of the token it samples, so the
same seed gives the same output whatever else shares the batch, and a preempted request that is
recomputed resumes the same stream.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.sampling_params import SAMPLING_EPS, SamplingParams

NEG_INF = float("-inf")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotParams:
    """The sampling and stopping parameters of every sequence slot (host-built, a few KB)."""

    temperature: jax.Array  # f32[max_seqs]
    top_k: jax.Array  # i32[max_seqs]; 0 = off
    top_p: jax.Array  # f32[max_seqs]
    min_p: jax.Array  # f32[max_seqs]
    presence_penalty: jax.Array  # f32[max_seqs]
    frequency_penalty: jax.Array  # f32[max_seqs]
    repetition_penalty: jax.Array  # f32[max_seqs]
    key: jax.Array  # u32[max_seqs, 2]; the sequence's own PRNG key
    stop_ids: jax.Array  # i32[max_seqs, max_stop_ids]; EOS (unless ignore_eos) and stop_token_ids, -1 pad
    min_tokens: jax.Array  # i32[max_seqs]
    max_tokens: jax.Array  # i32[max_seqs]; output tokens allowed
    max_len: jax.Array  # i32[max_seqs]; prompt + output tokens allowed (max_model_len)
    # Structured output: the masks of the rows with a grammar alone (vLLM sends the same), i32[masks,
    # ceil(vocab / 32)], bit t % 32 of word t // 32 allowing token t; a verification of a grammar's
    # drafts has one per position, i32[masks, positions, words] (worker/rejection_sampler.py).
    # [0, 0] when no row has a grammar, so those programs stay as they were.
    allowed: jax.Array
    mask_row: jax.Array  # i32[max_seqs]: the slot's mask in `allowed`; -1: no grammar (every token)


_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")


def slot_params(rows: list[tuple[SamplingParams, np.ndarray, list[int], int] | None], max_stop_ids: int,
                bitmask: tuple[np.ndarray, np.ndarray] | None = None):
    """Host: SlotParams from one entry per slot, (params, key u32[2], stop ids, max_len) or None for
    an idle slot; `bitmask`: the grammars' (allowed, mask_row), or None when no row has one."""
    idle = (SamplingParams(temperature=0.0), np.zeros(2, np.uint32), [], 1)
    rows = [row or idle for row in rows]
    stop = np.full((len(rows), max_stop_ids), -1, np.int32)
    for s, (_, _, ids, _) in enumerate(rows):
        stop[s, : len(ids)] = ids
    return SlotParams(
        **{f: np.array([getattr(p, f) for p, *_ in rows], np.float32) for f in _FLOAT_FIELDS},
        top_k=np.array([p.top_k for p, *_ in rows], np.int32),
        key=np.stack([key for _, key, _, _ in rows]).astype(np.uint32),
        stop_ids=stop,
        min_tokens=np.array([p.min_tokens for p, *_ in rows], np.int32),
        max_tokens=np.array([m if p.max_tokens is None else p.max_tokens for p, _, _, m in rows], np.int32),
        max_len=np.array([m for *_, m in rows], np.int32),
        allowed=np.zeros((0, 0), np.int32) if bitmask is None else bitmask[0],
        mask_row=np.full(len(rows), -1, np.int32) if bitmask is None else bitmask[1],
    )


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """logits: f[rows, vocab]; bitmask: i32[rows, words], words * 32 >= vocab (vLLM's and
    llguidance's layout). Masked-out tokens become -inf; a row of all -1 comes back unchanged. Bits
    past `vocab` are ignored (a tokenizer vocabulary rounded up to whole words)."""
    rows, vocab = logits.shape
    words = bitmask.shape[-1]
    if bitmask.shape[0] != rows or words * 32 < vocab:
        raise ValueError(f"bitmask i32{list(bitmask.shape)} does not cover logits {list(logits.shape)}")
    bits = jax.lax.bitcast_convert_type(bitmask, jnp.uint32)[:, :, None] >> jnp.arange(32, dtype=jnp.uint32)
    allowed = (bits & 1).astype(bool).reshape(rows, words * 32)[:, :vocab]  # bool[rows, vocab]
    return jnp.where(allowed, logits, jnp.array(-jnp.inf, logits.dtype))


def apply_penalties(logits, sp: SlotParams, output_counts, prompt_mask):
    """logits f32[S, V]; output_counts i32[S, V]; prompt_mask bool[S, V]. vLLM's order: repetition
    (over prompt and output tokens, HF's divide-positive/multiply-negative), then frequency and
    presence (output tokens only)."""
    seen = prompt_mask | (output_counts > 0)
    rep = sp.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - sp.frequency_penalty[:, None] * output_counts
    return logits - sp.presence_penalty[:, None] * (output_counts > 0)


def _filter(logits, sp: SlotParams):
    """top-k, then top-p over what is left, then min-p; each row keeps at least its best token."""
    vocab = logits.shape[-1]
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]  # f32[S, V], descending
    k = jnp.where(sp.top_k > 0, jnp.minimum(sp.top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    logits = jnp.where(logits < kth, NEG_INF, logits)
    sorted_logits = jnp.where(jnp.arange(vocab)[None, :] < k[:, None], sorted_logits, NEG_INF)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the better tokens
    keep = before < sp.top_p[:, None]
    cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < cutoff, NEG_INF, logits)
    # min-p: drop tokens below min_p times the best probability, i.e. logit < max + log(min_p).
    threshold = sorted_logits[:, :1] + jnp.log(jnp.maximum(sp.min_p[:, None], 1e-30))
    return jnp.where((sp.min_p[:, None] > 0) & (logits < threshold), NEG_INF, logits)


def sample(logits, sp: SlotParams, num_output, penalties=None, *, filters: bool, num_logprobs: int,
           random: bool = True):
    """-> (tokens i32[S], logprob f32[S], rank i32[S], top_ids i32[S, N], top_logprobs f32[S, N]).

    logits: f32[S, V], the model's; num_output: i32[S], output tokens the sequence has before this
    one; penalties: (output_counts i32[S, V], prompt_mask bool[S, V]) or None when no row uses them.
    Logprobs are of the model's own distribution (vLLM V1's default "raw" logprobs), after the
    grammar's mask where a row has one (as vLLM masks the logits before its sampler). `random`
    (static): some row samples with a temperature; False when every row is greedy.
    """
    raw, lse, logits = prepare(logits, sp, num_output, penalties)
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if random:  # a batch of greedy rows draws no noise: S x V random bits cost more than the argmax
        keys = jax.vmap(jax.random.fold_in)(sp.key, num_output)
        drawn = jax.vmap(jax.random.categorical)(keys, scaled(logits, sp, filters=filters)).astype(jnp.int32)
        tokens = jnp.where(sp.temperature < SAMPLING_EPS, tokens, drawn)

    return (tokens, *token_logprobs(raw, tokens, num_logprobs, lse))


def prepare(logits, sp: SlotParams, num_output, penalties=None):
    """The logits a row samples from, before its temperature: the grammar's mask, the penalties,
    and min_tokens (stop tokens cannot be sampled before the minimum) -> (raw f32[S, V]: the
    model's, masked, which logprobs score; lse f32[S] of raw; the logits to sample f32[S, V])."""
    logits = logits.astype(jnp.float32)
    if sp.allowed.shape[-1]:  # static: only programs whose batch holds a grammar's row mask
        masks = sp.allowed[jnp.maximum(sp.mask_row, 0)]  # each row's, all tokens where it has none
        logits = apply_token_bitmask(logits, jnp.where((sp.mask_row >= 0)[:, None], masks, -1))
    raw = logits  # logprob(t) = raw[t] - logsumexp(raw): one pass, no S x V log-softmax written out
    lse = jax.nn.logsumexp(raw, axis=-1)
    if penalties is not None:
        logits = apply_penalties(logits, sp, *penalties)
    vocab = logits.shape[-1]
    blocked = (num_output < sp.min_tokens)[:, None] & (sp.stop_ids >= 0)
    logits = logits.at[jnp.arange(logits.shape[0])[:, None], jnp.where(blocked, sp.stop_ids, vocab)].set(
        NEG_INF, mode="drop")
    return raw, lse, logits


def scaled(logits, sp: SlotParams, *, filters: bool):
    """The distribution a sampled row draws from (log-space, unnormalised): temperature, then
    top-k / top-p / min-p when some row uses them (static `filters`)."""
    out = logits / jnp.maximum(sp.temperature, SAMPLING_EPS)[:, None]
    return _filter(out, sp) if filters else out


def token_logprobs(logits, tokens, num_logprobs: int, lse=None):
    """The logprob and rank of `tokens` (i32[S]) under `logits` (f32[S, V], the model's raw ones) and
    the top `num_logprobs` (static) -> (logprob f32[S], rank i32[S], top_ids i32[S, N], top_logprobs
    f32[S, N]). Rank 1 is the most likely; ties rank alike (vLLM)."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1) if lse is None else lse
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
    rank = 1 + jnp.sum(logits > chosen[:, None], axis=-1, dtype=jnp.int32)
    if num_logprobs:
        top_raw, top_ids = jax.lax.top_k(logits, num_logprobs)
        top_logprobs = top_raw - lse[:, None]
    else:
        top_logprobs = jnp.zeros((logits.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return chosen - lse, rank, top_ids.astype(jnp.int32), top_logprobs


def stop_check(tokens, sp: SlotParams, num_output, total_len):
    """After sampling: -> finish code i32[S]: 0 running, 1 stopped by a stop token, 2 length.

    tokens: i32[S]; num_output, total_len: i32[S], counting the new token. vLLM's check_stop order:
    below min_tokens nothing stops; then EOS / stop_token_ids; then max_model_len / max_tokens."""
    stop_token = jnp.any(tokens[:, None] == sp.stop_ids, axis=-1) & (num_output >= sp.min_tokens)
    length = (num_output >= sp.max_tokens) | (total_len >= sp.max_len)
    return jnp.where(stop_token, 1, jnp.where(length, 2, 0)).astype(jnp.int32)
