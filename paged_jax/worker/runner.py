"""The device side of the engine: jitted entry points over the KV pages, the block pool and the
sampling state, all donated so XLA updates them in place. Each works on the rows of the batch (a
`block_pool.rows` view, tables cut to the batch's width), so its cost follows the work in flight:

- `prefill_step`: one ragged batch (prompt chunks, resumed prompts, decode rows, forked children)
  with its prefix hits, growth and forks;
- `decode_steps`: a `lax.while_loop` of up to K decode steps, each allocating its rows' blocks with
  the block pool's own pure functions, running the model, sampling and checking stops, so the host
  sees results once per K tokens. It leaves early when every row has finished, when the pool cannot
  grow (the host then preempts), or, if asked, as soon as one finishes (to admit waiters);
- `apply_pool_ops`: the host's cache marks and frees, before a step or when the engine goes idle;
- `fork_slots`: copy-on-write forks the host decided between steps (beam search).
Each returns what changed (`ModelOutput` with its `PoolDelta`), never whole tables.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from paged_jax.core import block_pool as bp
from paged_jax.core.model_output import ModelOutput, PoolDelta, PromptLogprobs
from paged_jax.worker import sampler, swap
from paged_jax.worker.attention import AttentionMetadata, KVCache, copy_blocks
from paged_jax.worker.batching import DecodeBatch, PoolOps, PrefillBatch


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeviceState:
    cache: KVCache
    pool: bp.BlockPool
    output_counts: jax.Array  # i32[max_seqs, vocab] (once a request uses penalties) or i32[max_seqs, 0]
    prompt_mask: jax.Array  # bool[max_seqs, vocab] or bool[max_seqs, 0]


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


def _delta(pool: bp.BlockPool, view: bp.BlockPool, slots, start, width: int) -> PoolDelta:
    """Entries [start, start + width) of each view row, with their versions."""
    idx = jnp.clip(start[:, None] + jnp.arange(width), 0, view.max_blocks_per_seq - 1)
    blocks = jnp.take_along_axis(view.block_tables, idx, axis=1)
    return PoolDelta(slots=slots, seq_lens=view.seq_lens, start=start, blocks=blocks,
                     versions=pool.version[blocks], num_free=pool.num_free_blocks)


def _penalty_rows(state: DeviceState, slots, flags: Flags):
    if not flags.penalties:
        return None
    safe = jnp.maximum(slots, 0)
    return state.output_counts[safe], state.prompt_mask[safe]


def _count_tokens(counts, tokens, live):  # i32[B, V], i32[B], bool[B] -> i32[B, V]
    rows = jnp.arange(tokens.shape[0])
    return counts.at[rows, jnp.where(live, tokens, counts.shape[1])].add(1, mode="drop")


def _put_counts(state: DeviceState, slots, counts) -> DeviceState:
    target = jnp.where(slots >= 0, slots, state.output_counts.shape[0])
    return dataclasses.replace(state, output_counts=state.output_counts.at[target].set(counts, mode="drop"))


def _fork_rows(view: bp.BlockPool, fork_parent):
    """Fork each row whose fork_parent (i32[B]) is a row -> (view, ok, copy_src i32[B], copy_dst i32[B])."""
    def fork_one(child, carry):
        view, src, dst, ok = carry
        parent = fork_parent[child]

        def fork(view):
            view, forked, s, d = bp.fork(view, parent, child)
            return view, s, d, forked

        def skip(view):
            return view, jnp.int32(-1), jnp.int32(-1), jnp.array(True)

        view, s, d, forked = jax.lax.cond(parent >= 0, fork, skip, view)
        return view, src.at[child].set(s), dst.at[child].set(d), ok & forked

    none = jnp.full(fork_parent.shape, -1, jnp.int32)
    return jax.lax.fori_loop(0, fork_parent.shape[0], fork_one, (view, none, none, jnp.array(True)))


@functools.partial(jax.jit, static_argnames=("graphdef", "flags"), donate_argnames=("state",))
def prefill_step(graphdef, params, state: DeviceState, batch: PrefillBatch, sp: sampler.SlotParams,
                 swapped=None, *, flags: Flags):
    """One ragged forward over the batch's rows -> (state, ModelOutput with k = 1, ok bool[]).
    `swapped`: the blocks of rows resumed after a swap (`swap.gather_blocks`' layout), which fill
    the first blocks they are given here, after the prefix hits took theirs out of the free queue;
    None when no row resumes so."""
    num_rows, width = batch.hits.shape
    view = bp.rows(state.pool, batch.slots, width)
    admitted = batch.num_hits > 0
    view, shared = bp.share(view, jnp.where(admitted, jnp.arange(num_rows), -1), batch.hits,
                            batch.num_hits, batch.hit_versions)
    view, grown = bp.allocate(view, batch.new_lens,
                              max_new_blocks=batch.tokens.shape[0] // view.block_size + num_rows
                              + batch.swap_rows.shape[0])
    cache = state.cache
    if swapped is not None:
        rows, cols = jnp.maximum(batch.swap_rows, 0), jnp.maximum(batch.swap_cols, 0)
        cache = swap.scatter_blocks(cache, jnp.where(batch.swap_rows >= 0, view.block_tables[rows, cols], -1), swapped)
    md = AttentionMetadata(slot_mapping=bp.slot_mapping(view, batch.token_row, batch.positions),
                           block_tables=view.block_tables, seq_lens=batch.attn_seq_lens,
                           query_start_loc=batch.query_start_loc)
    model = nnx.merge(graphdef, params)
    wanted = jnp.maximum(batch.logits_rows, 0)
    if flags.num_prompt_logprobs is not None:  # prompt tokens' logits too, only in steps that ask
        wanted = jnp.concatenate([wanted, jnp.maximum(batch.prompt_lp_tokens, 0)])
    logits, cache = model(batch.tokens, batch.positions, cache, md, wanted,
                          backend=flags.backend, mesh=flags.mesh)
    prompt = None
    if flags.num_prompt_logprobs is not None:
        logits, prompt_logits = logits[:num_rows], logits[num_rows:]
        prompt = PromptLogprobs(batch.prompt_lp_rows, batch.prompt_lp_positions, *sampler.token_logprobs(
            prompt_logits, batch.prompt_lp_targets, flags.num_prompt_logprobs))
    forked = jnp.array(True)
    if flags.forks:  # copy-on-write of the partial tail blocks: only in steps that fork
        view, src, dst, forked = _fork_rows(view, batch.fork_parent)
        cache = copy_blocks(cache, src, dst, backend=flags.backend)

    live = batch.logits_rows >= 0
    penalties = _penalty_rows(state, batch.slots, flags)
    tokens, logprob, rank, top_ids, top_lps = sampler.sample(
        logits, sp, batch.num_output - 1, penalties, filters=flags.filters, num_logprobs=flags.num_logprobs,
        random=flags.random)
    finish = jnp.where(live, sampler.stop_check(tokens, sp, batch.num_output, batch.total_len), 0)
    pool = bp.put_rows(state.pool, view, batch.slots)
    new = dataclasses.replace(state, cache=cache, pool=pool)
    if penalties is not None:
        new = _put_counts(new, batch.slots, _count_tokens(penalties[0], tokens, live))
    out = ModelOutput(tokens=jnp.where(live, tokens, -1)[:, None], logprob=logprob[:, None], rank=rank[:, None],
                      top_ids=top_ids[:, None], top_logprobs=top_lps[:, None], finish=finish,
                      delta=_delta(pool, view, batch.slots, jnp.zeros(num_rows, jnp.int32), width),
                      steps=jnp.int32(1), pool_full=jnp.array(False), prompt_logprobs=prompt)
    return new, out, jnp.all(shared) & grown & forked


@functools.partial(jax.jit, static_argnames=("graphdef", "flags", "num_steps", "width"), donate_argnames=("state",))
def decode_steps(graphdef, params, state: DeviceState, batch: DecodeBatch, sp: sampler.SlotParams,
                 *, flags: Flags, num_steps: int, width: int):
    """Up to `num_steps` decode steps of the batch's rows, tables `width` blocks wide (enough for
    num_steps more tokens) -> (state, ModelOutput with k = num_steps)."""
    model = nnx.merge(graphdef, params)
    num_rows = batch.slots.shape[0]
    n = flags.num_logprobs
    view = bp.rows(state.pool, batch.slots, width)
    start = -(-view.seq_lens // view.block_size)  # blocks this call may add start here
    out = dict(tokens=jnp.full((num_rows, num_steps), -1, jnp.int32),
               logprob=jnp.zeros((num_rows, num_steps), jnp.float32),
               rank=jnp.zeros((num_rows, num_steps), jnp.int32),
               top_ids=jnp.zeros((num_rows, num_steps, n), jnp.int32),
               top_logprobs=jnp.zeros((num_rows, num_steps, n), jnp.float32),
               finish=jnp.zeros((num_rows,), jnp.int32))
    penalties = _penalty_rows(state, batch.slots, flags)
    counts = penalties[0] if penalties is not None else None
    active = batch.slots >= 0
    carry = (state.cache, view, counts, out, batch.last_tokens, active, batch.num_output, batch.total_len,
             jnp.array(False), jnp.array(0))

    def cond(carry):
        *_, out, _, active, _, _, pool_full, step = carry
        any_finished = jnp.any(out["finish"] > 0)
        return (step < num_steps) & jnp.any(active) & ~pool_full & ~(batch.stop_on_finish & any_finished)

    def body(carry):
        cache, view, counts, out, last, active, num_output, total_len, _, step = carry
        positions = view.seq_lens
        # When the pool cannot grow, `allocate` returns it unchanged and this step writes and keeps
        # nothing. No lax.cond around the model: a conditional would copy the KV pages every step.
        view, ok = bp.allocate(view, positions + active, max_new_blocks=num_rows)
        live = active & ok
        md = AttentionMetadata(slot_mapping=bp.slot_mapping(view, jnp.where(live, jnp.arange(num_rows), -1), positions),
                               block_tables=view.block_tables, seq_lens=jnp.where(live, positions + 1, 0),
                               query_start_loc=jnp.arange(num_rows + 1, dtype=jnp.int32), decode_only=True)
        logits, cache = model(last, positions, cache, md, jnp.arange(num_rows), backend=flags.backend, mesh=flags.mesh)
        pens = None if counts is None else (counts, penalties[1])
        tokens, logprob, rank, top_ids, top_lps = sampler.sample(
            logits, sp, num_output, pens, filters=flags.filters, num_logprobs=n, random=flags.random)
        finish = jnp.where(live, sampler.stop_check(tokens, sp, num_output + 1, total_len + 1), 0)
        at = jnp.where(ok, step, num_steps)  # out of range: dropped
        o = dict(tokens=out["tokens"].at[:, at].set(jnp.where(live, tokens, -1), mode="drop"),
                 logprob=out["logprob"].at[:, at].set(logprob, mode="drop"),
                 rank=out["rank"].at[:, at].set(rank, mode="drop"),
                 top_ids=out["top_ids"].at[:, at].set(top_ids, mode="drop"),
                 top_logprobs=out["top_logprobs"].at[:, at].set(top_lps, mode="drop"),
                 finish=jnp.where(finish > 0, finish, out["finish"]))
        if counts is not None:
            counts = _count_tokens(counts, tokens, live)
        return (cache, view, counts, o, jnp.where(live, tokens, last), active & (finish == 0),
                num_output + live, total_len + live, ~ok, step + ok)

    cache, view, counts, out, *_, pool_full, steps = jax.lax.while_loop(cond, body, carry)
    pool = bp.put_rows(state.pool, view, batch.slots)
    new = dataclasses.replace(state, cache=cache, pool=pool)
    if counts is not None:
        new = _put_counts(new, batch.slots, counts)
    reach = -(-num_steps // view.block_size) + 1  # blocks one row can gain in num_steps tokens
    return new, ModelOutput(**out, delta=_delta(pool, view, batch.slots, start, reach), steps=steps,
                            pool_full=pool_full)


@functools.partial(jax.jit, static_argnames=("width", "backend"), donate_argnames=("state",))
def fork_slots(state: DeviceState, parents, children, *, width: int, backend: str):
    """Copy-on-write forks before a step (beam search: a beam kept with several continuations):
    slot children[i] becomes a fork of slot parents[i] (i32[F] each, -1 pad; a parent may repeat),
    tables `width` wide -> (state, PoolDelta of the parents' then the children's rows, ok bool[])."""
    num = parents.shape[0]
    slots = jnp.concatenate([parents, children])
    view = bp.rows(state.pool, slots, width)
    fork_parent = jnp.concatenate([jnp.full(num, -1, jnp.int32),
                                   jnp.where(children >= 0, jnp.arange(num, dtype=jnp.int32), -1)])
    view, src, dst, ok = _fork_rows(view, fork_parent)
    cache = copy_blocks(state.cache, src, dst, backend=backend)
    pool = bp.put_rows(state.pool, view, slots)
    delta = _delta(pool, view, slots, jnp.zeros(2 * num, jnp.int32), width)
    return dataclasses.replace(state, cache=cache, pool=pool), delta, ok


@functools.partial(jax.jit, static_argnames=("width", "skip_width"), donate_argnames=("state",))
def apply_pool_ops(state: DeviceState, ops: PoolOps, *, width: int, skip_width: int) -> DeviceState:
    """Cache marks, then sliding-window skips (tables `skip_width` wide cover them; 0: none this
    call), then frees of the listed slots (tables `width` wide cover them)."""
    pool = bp.mark_cached(state.pool, ops.mark_ids, ops.mark_ids.shape[0])
    if skip_width:
        view = bp.remove_skipped(bp.rows(pool, ops.skip_slots, skip_width), ops.num_skipped)
        pool = bp.put_rows(pool, view, ops.skip_slots)
    view = bp.free(bp.rows(pool, ops.free_slots, width), ops.free_slots >= 0)
    return dataclasses.replace(state, pool=bp.put_rows(pool, view, ops.free_slots))


@functools.partial(jax.jit, donate_argnames=("state",))
def reset_penalty_rows(state: DeviceState, slots, prompt_tokens, output_tokens):
    """Rebuild the penalty rows of newly admitted slots (i32[m]; -1 skip) from their prompt and
    output tokens so far (i32[m, L], -1 pad)."""
    num_slots, vocab = state.output_counts.shape
    rows = jnp.where(slots >= 0, slots, num_slots)[:, None]
    counts = state.output_counts.at[rows[:, 0]].set(0, mode="drop")
    counts = counts.at[rows, jnp.where(output_tokens >= 0, output_tokens, vocab)].add(1, mode="drop")
    mask = state.prompt_mask.at[rows[:, 0]].set(False, mode="drop")
    mask = mask.at[rows, jnp.where(prompt_tokens >= 0, prompt_tokens, vocab)].set(True, mode="drop")
    return dataclasses.replace(state, output_counts=counts, prompt_mask=mask)


@functools.partial(jax.jit, donate_argnames=("state",))
def uncache_all(state: DeviceState) -> DeviceState:
    return dataclasses.replace(state, pool=bp.uncache_all(state.pool))
