"""The device side of the engine: jitted entry points over the KV pages and the sampling state,
both donated so XLA updates them in place. The block pool stays on the host with the scheduler;
each call reads only its rows' block tables, cut to the batch's width, so its cost follows the work
in flight:

- `prefill_step`: one ragged batch (prompt chunks, resumed prompts, decode rows, forked children),
  writing K/V at the slots the host mapped, then copying the forks' tail blocks;
- `decode_steps`: a `lax.while_loop` of up to K decode steps over blocks the host reserved before
  the call (vLLM's lookahead slots), each running the model, sampling and checking stops, so the
  host sees results once per K tokens. It leaves early when every row has finished or, if asked, as
  soon as one finishes (to admit waiters);
- `copy_blocks_step`: copy-on-write copies the host decided between steps (beam search).

With a draft model (speculative decoding), the state holds its pages too, under the same block ids:
every forward of the target runs the draft over the same tokens, so wherever the target's cache
holds a token (prefix hits, swapped blocks, forks' copies) the draft's holds it too, and a
verifying `prefill_step` first runs k draft decode steps to propose the drafts it then scores.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from models import layers
from models.lora import LoRAInputs
from paged_jax.attention import AttentionMetadata, KVCache, copy_blocks
from paged_jax.core.model_output import ModelOutput, PromptLogprobs
from paged_jax.worker import draft_proposer, ngram_proposer, penalty_state, rejection_sampler, sampler, swap
from paged_jax.worker.batching import DecodeBatch, PrefillBatch


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeviceState:
    cache: KVCache
    output_counts: jax.Array  # i32[max_seqs, vocab] (once a request uses penalties) or i32[max_seqs, 0]
    prompt_mask: jax.Array  # bool[max_seqs, vocab] or bool[max_seqs, 0]
    # i32[max_seqs]: each slot's latest sampled token. Overlapped scheduling plans a call before the
    # one before it has returned: a batch token the host does not know yet is -1 there, and the call
    # reads it here (`_fill_pending`), never fetched first.
    last_sampled: jax.Array
    # i32[max_seqs]: the drafts each slot's latest verification rejected, by which a call planned
    # before that one returned, as if it accepted every draft, moves its rows back (`_move_back`).
    num_rejected: jax.Array
    # Speculative decoding with a draft model: its pages, under the target's block ids (the same
    # tables and slots), written by every forward the target runs; None without one.
    draft_cache: KVCache | None = None
    # n-gram speculation: the token of each KV slot, where a verification planned ahead looks its
    # drafts up (worker/ngram_proposer.py); None otherwise.
    token_pages: ngram_proposer.TokenPages | None = None

    @property
    def caches(self) -> tuple:
        """The target's cache, then the draft's and the token pages if any: a block's contents, what
        a swap or a block copy moves."""
        return tuple(c for c in (self.cache, self.draft_cache, self.token_pages) if c is not None)

    def with_caches(self, caches) -> DeviceState:
        given = iter(caches)
        return dataclasses.replace(self, cache=next(given),
                                   draft_cache=None if self.draft_cache is None else next(given),
                                   token_pages=None if self.token_pages is None else next(given))


@dataclasses.dataclass(frozen=True)
class Flags:
    """Static choices that select a compiled variant (hashable)."""

    backend: str
    random: bool = True  # some row samples with a temperature (else every row takes the argmax)
    filters: bool = False  # some row uses top-k / top-p / min-p
    num_logprobs: int = 0  # top-N logprobs returned per token
    penalties: bool = False  # some row uses presence / frequency / repetition penalties
    forks: bool = False  # some row forks from another this step
    num_prompt_logprobs: int | None = None  # top-N per prompt token when some row asks (prefill)
    mesh: Mesh | None = None  # tensor parallelism: attention runs per shard
    ngram: tuple[int, int] | None = None  # (prompt_lookup_min, prompt_lookup_max) of n-gram speculation


def _last_tokens(tokens):
    """i32[B, J] sampled tokens (-1 after a row's last) -> (i32[B] each row's last, bool[B] any)."""
    taken = jnp.sum(tokens >= 0, axis=1)
    return jnp.take_along_axis(tokens, jnp.maximum(taken - 1, 0)[:, None], axis=1)[:, 0], taken > 0


def _keep_last_sampled(state: DeviceState, slots, tokens) -> DeviceState:
    """Record each row's latest sampled token (i32[B, J], -1 none) under its slot."""
    last, any_taken = _last_tokens(tokens)
    target = jnp.where((slots >= 0) & any_taken, slots, state.last_sampled.shape[0])
    return dataclasses.replace(state, last_sampled=state.last_sampled.at[target].set(last, mode="drop"))


def _fill_pending(state: DeviceState, tokens, slots, live):
    """Live tokens the host left -1 (sampled by the call before, which it has not fetched) take
    their slot's latest sampled token."""
    pending = live & (tokens < 0)
    return jnp.where(pending, state.last_sampled[jnp.maximum(slots, 0)], tokens)


def _move_back(state: DeviceState, batch: PrefillBatch) -> PrefillBatch:
    """The batch with its optimistic rows (Plan.optimistic) moved back by the drafts the call before
    rejected: positions, KV slots and lengths. Their tables map the blocks of the longest outcome."""
    back = jnp.where(batch.optimistic, state.num_rejected[jnp.maximum(batch.slots, 0)], 0)
    row = jnp.maximum(batch.token_row, 0)
    moved = (batch.token_row >= 0) & (back[row] > 0)
    positions = batch.positions - jnp.where(moved, back[row], 0)
    size, width = state.cache.block_size, batch.block_tables.shape[1]
    block = batch.block_tables[row, jnp.minimum(positions // size, width - 1)]
    slots = jnp.where(block > 0, block * size + positions % size, -1)
    return dataclasses.replace(batch, positions=positions, slot_mapping=jnp.where(moved, slots, batch.slot_mapping),
                               attn_seq_lens=batch.attn_seq_lens - back, num_output=batch.num_output - back,
                               total_len=batch.total_len - back)


@functools.partial(jax.jit, static_argnames=("graphdef", "flags", "draft_graphdef"), donate_argnames=("state",),
                   compiler_options=layers.COMPILER_OPTIONS)
def prefill_step(graphdef, params, state: DeviceState, batch: PrefillBatch, sp: sampler.SlotParams,
                 swapped=None, draft_params=None, lora: LoRAInputs | None = None, *, flags: Flags,
                 draft_graphdef=None):
    """One ragged forward over the batch's rows -> (state, ModelOutput with k = 1, or k = J when
    rows carry speculative proposals: each row's verified tokens, worker/rejection_sampler.py).
    `swapped`: the blocks of rows resumed after a swap or hitting the host prefix tier, one entry
    per cache of `state.caches` (`swap.gather_blocks`' layout), written to `batch.swap_blocks`
    before the forward; None when no row loads any. `draft_graphdef`, `draft_params`: a draft
    model, which proposes the verifying rows' drafts into the slots the host reserved for them (the
    batch's tokens there are stand-ins, written over before the target reads them) and runs over the
    batch too. `lora`: the adapter slots and each row's (the draft runs without them)."""
    num_rows = batch.slots.shape[0]
    token_row = jnp.maximum(batch.token_row, 0)
    token_slots = batch.slots[token_row]
    batch = dataclasses.replace(batch, tokens=_fill_pending(state, batch.tokens, token_slots, batch.token_row >= 0))
    verifying = batch.drafts.shape[1] > 0  # static: some row's proposals are scored (speculative decoding)
    if verifying:
        batch = _move_back(state, batch)
    if swapped is not None:
        state = state.with_caches(tuple(swap.scatter_blocks(c, batch.swap_blocks, s)
                                        for c, s in zip(state.caches, swapped)))
    if state.token_pages is not None:  # the tokens this call writes, and n-gram drafts planned ahead
        batch, pages = ngram_proposer.read_batch(state.token_pages, batch, flags.ngram if verifying else None)
        state = dataclasses.replace(state, token_pages=pages)
    cache, draft_cache = state.cache, state.draft_cache
    md = AttentionMetadata(slot_mapping=batch.slot_mapping, block_tables=batch.block_tables,
                           seq_lens=batch.attn_seq_lens, query_start_loc=batch.query_start_loc)
    model = nnx.merge(graphdef, params)
    draft_probs = None
    if draft_graphdef is not None:
        draft_model = nnx.merge(draft_graphdef, draft_params)
        if verifying:
            drafts, draft_probs, draft_cache = draft_proposer.propose(draft_model, draft_cache, batch, sp, flags)
            at = jnp.where(batch.spec_rows[:, 1:] >= 0, batch.spec_rows[:, 1:], batch.tokens.shape[0])
            batch = dataclasses.replace(batch, tokens=batch.tokens.at[at].set(drafts, mode="drop"), drafts=drafts)
        # The draft's K/V of every token the target computes (its last proposal's included).
        _, draft_cache = draft_model(batch.tokens, batch.positions, draft_cache, md, jnp.zeros(1, jnp.int32),
                                     backend=flags.backend, mesh=flags.mesh)
    wanted = jnp.maximum(batch.spec_rows if verifying else batch.logits_rows, 0).reshape(-1)
    num_wanted = wanted.shape[0]
    if flags.num_prompt_logprobs is not None:  # prompt tokens' logits too, only in steps that ask
        wanted = jnp.concatenate([wanted, jnp.maximum(batch.prompt_lp_tokens, 0)])
    if lora is not None:  # each token takes its row's adapter
        lora = dataclasses.replace(lora, slots=jnp.where(batch.token_row >= 0, lora.slots[token_row], -1))
    logits, cache = model(batch.tokens, batch.positions, cache, md, wanted,
                          backend=flags.backend, mesh=flags.mesh, lora=lora)
    prompt = None
    if flags.num_prompt_logprobs is not None:
        logits, prompt_logits = logits[:num_wanted], logits[num_wanted:]
        prompt = PromptLogprobs(batch.prompt_lp_rows, batch.prompt_lp_positions, *sampler.token_logprobs(
            prompt_logits, batch.prompt_lp_targets, flags.num_prompt_logprobs))
    state = dataclasses.replace(state, cache=cache, draft_cache=draft_cache)
    if flags.forks:  # copy-on-write of the forks' partial tail blocks, once the parents' K/V is in
        state = _copy_blocks(state, batch.copy_src, batch.copy_dst, flags.backend)

    live = batch.logits_rows >= 0
    penalties = penalty_state.rows(state, batch.slots, flags)
    accepted = None
    if verifying:
        tokens, logprob, rank, top_ids, top_lps, finish, accepted = rejection_sampler.verify(
            logits.reshape(num_rows, batch.spec_rows.shape[1], -1), batch.drafts, sp, batch.num_output,
            batch.total_len, penalties, draft_probs, filters=flags.filters, num_logprobs=flags.num_logprobs,
            random=flags.random)
    else:
        tokens, logprob, rank, top_ids, top_lps = (x[:, None] for x in sampler.sample(
            logits, sp, batch.num_output - 1, penalties, filters=flags.filters, num_logprobs=flags.num_logprobs,
            random=flags.random))
        finish = sampler.stop_check(tokens[:, 0], sp, batch.num_output, batch.total_len)
    tokens = jnp.where(live[:, None], tokens, -1)
    new = _keep_last_sampled(state, batch.slots, tokens)
    if verifying:
        rejected = jnp.sum(batch.spec_rows[:, 1:] >= 0, axis=1) - accepted  # of the reserved slots
        target = jnp.where(live, batch.slots, new.num_rejected.shape[0])
        new = dataclasses.replace(new, num_rejected=new.num_rejected.at[target].set(rejected, mode="drop"))
    if penalties is not None:
        new = penalty_state.put_counts(new, batch.slots, penalty_state.count_tokens(penalties[0], tokens))
    out = ModelOutput(tokens=tokens, logprob=logprob, rank=rank, top_ids=top_ids, top_logprobs=top_lps,
                      finish=jnp.where(live, finish, 0), steps=jnp.int32(1), prompt_logprobs=prompt,
                      num_accepted=accepted, num_drafts=jnp.sum(batch.drafts >= 0, axis=1) if verifying else None)
    return new, out


@functools.partial(jax.jit, static_argnames=("graphdef", "flags", "num_steps", "draft_graphdef"),
                   donate_argnames=("state",), compiler_options=layers.COMPILER_OPTIONS)
def decode_steps(graphdef, params, state: DeviceState, batch: DecodeBatch, sp: sampler.SlotParams,
                 draft_params=None, lora: LoRAInputs | None = None, *, flags: Flags, num_steps: int,
                 draft_graphdef=None):
    """Up to `num_steps` decode steps of the batch's rows over the blocks their tables hold (the
    host reserved them for up to num_steps more tokens; a row pauses where its reservation ends)
    -> (state, ModelOutput with k = num_steps). `draft_graphdef`, `draft_params`: a draft model,
    which writes its K/V of each token beside the target's. `lora`: the adapter slots and each row's."""
    model = nnx.merge(graphdef, params)
    draft_model = None if draft_graphdef is None else nnx.merge(draft_graphdef, draft_params)
    num_rows, width = batch.block_tables.shape
    block_size = state.cache.block_size
    n = flags.num_logprobs
    out = dict(tokens=jnp.full((num_rows, num_steps), -1, jnp.int32),
               logprob=jnp.zeros((num_rows, num_steps), jnp.float32),
               rank=jnp.zeros((num_rows, num_steps), jnp.int32),
               top_ids=jnp.zeros((num_rows, num_steps, n), jnp.int32),
               top_logprobs=jnp.zeros((num_rows, num_steps, n), jnp.float32),
               finish=jnp.zeros((num_rows,), jnp.int32))
    penalties = penalty_state.rows(state, batch.slots, flags)
    counts = penalties[0] if penalties is not None else None
    active = batch.live
    rows = jnp.arange(num_rows)
    # The step count a strong i32 (not jnp.array(0)'s weak type): the warm-up compiles continue_decode for it.
    last = _fill_pending(state, batch.last_tokens, batch.slots, active)
    carry = ((state.cache, state.draft_cache), counts, out, last, active, batch.num_output, batch.total_len,
             jnp.int32(0))

    def cond(carry):
        *_, out, _, active, _, _, step = carry
        any_finished = jnp.any(out["finish"] > 0)
        runnable = active & (batch.positions + step < batch.num_mapped)
        return (step < num_steps) & jnp.any(runnable) & ~(batch.stop_on_finish & any_finished)

    def body(carry):
        caches, counts, out, last, active, num_output, total_len, step = carry
        positions = batch.positions + step
        active = active & (positions < batch.num_mapped)  # a row pauses where its reserved blocks end
        block = batch.block_tables[rows, jnp.clip(positions // block_size, 0, width - 1)]
        md = AttentionMetadata(slot_mapping=jnp.where(active, block * block_size + positions % block_size, -1),
                               block_tables=batch.block_tables, seq_lens=jnp.where(active, positions + 1, 0),
                               query_start_loc=jnp.arange(num_rows + 1, dtype=jnp.int32), decode_only=True)
        logits, cache = model(last, positions, caches[0], md, rows, backend=flags.backend, mesh=flags.mesh, lora=lora)
        caches = (cache, caches[1] if draft_model is None else draft_model(
            last, positions, caches[1], md, rows[:1], backend=flags.backend, mesh=flags.mesh)[1])
        pens = None if counts is None else (counts, penalties[1])
        tokens, logprob, rank, top_ids, top_lps = sampler.sample(
            logits, sp, num_output, pens, filters=flags.filters, num_logprobs=n, random=flags.random)
        finish = jnp.where(active, sampler.stop_check(tokens, sp, num_output + 1, total_len + 1), 0)
        o = dict(tokens=out["tokens"].at[:, step].set(jnp.where(active, tokens, -1)),
                 logprob=out["logprob"].at[:, step].set(logprob),
                 rank=out["rank"].at[:, step].set(rank),
                 top_ids=out["top_ids"].at[:, step].set(top_ids),
                 top_logprobs=out["top_logprobs"].at[:, step].set(top_lps),
                 finish=jnp.where(finish > 0, finish, out["finish"]))
        if counts is not None:
            counts = penalty_state.count_tokens(counts, jnp.where(active, tokens, -1)[:, None])
        return (caches, counts, o, jnp.where(active, tokens, last), active & (finish == 0),
                num_output + active, total_len + active, step + 1)

    caches, counts, out, *_, steps = jax.lax.while_loop(cond, body, carry)
    new = _keep_last_sampled(dataclasses.replace(state, cache=caches[0], draft_cache=caches[1]), batch.slots,
                             out["tokens"])
    if state.token_pages is not None:
        new = dataclasses.replace(new, token_pages=ngram_proposer.write_steps(
            state.token_pages, batch.block_tables, batch.positions, last, out["tokens"]))
    if counts is not None:
        new = penalty_state.put_counts(new, batch.slots, counts)
    return new, ModelOutput(**out, steps=steps)


@jax.jit
def continue_decode(prev: DecodeBatch, out: ModelOutput, slots, block_tables, num_mapped) -> DecodeBatch:
    """The next decode call's batch, built on the device from the one before it and its output,
    which the host has not fetched (overlapped scheduling): each row resumes after the tokens it
    sampled, a row that finished stays idle. The host gives what it owns: the rows' slots (-1 for
    a sequence it finished meanwhile), their tables and reserved slots."""
    taken = jnp.sum(out.tokens >= 0, axis=1)
    last, _ = _last_tokens(out.tokens)
    return DecodeBatch(slots=slots, block_tables=block_tables, positions=prev.positions + taken,
                       num_mapped=num_mapped, live=prev.live & (out.finish == 0) & (slots >= 0),
                       last_tokens=jnp.where(taken > 0, last, prev.last_tokens),
                       num_output=prev.num_output + taken, total_len=prev.total_len + taken,
                       stop_on_finish=prev.stop_on_finish)


@functools.partial(jax.jit, static_argnames=("backend",), donate_argnames=("state",))
def copy_blocks_step(state: DeviceState, src, dst, *, backend: str) -> DeviceState:
    """Copy-on-write between steps (beam search's forks): block src[i] -> dst[i] (i32[F], -1 pad)."""
    return _copy_blocks(state, src, dst, backend)


def _copy_blocks(state: DeviceState, src, dst, backend: str) -> DeviceState:
    """Blocks src[i] -> dst[i] (i32[F], -1 pad) in every cache: K/V and the tokens beside them."""
    return state.with_caches(tuple(c.copy(src, dst) if isinstance(c, ngram_proposer.TokenPages)
                                   else copy_blocks(c, src, dst, backend=backend) for c in state.caches))
