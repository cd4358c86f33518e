"""The device side of the engine: two jitted entry points over the KV pages, the block pool and the
sampling state, all donated so XLA updates them in place.

- `prefill_step`: one ragged batch (prompt chunks, resumed prompts and decode rows) with the host's
  pool operations for the step (cache marks, frees, prefix hits, growth, forks);
- `decode_steps`: a `lax.while_loop` of up to K decode steps, each allocating its slots with the
  block pool's own pure functions, running the model, sampling and checking stops, so the host
  sees results once per K tokens. It leaves early when every sequence has finished, when the pool
  cannot grow (the host then preempts), or, if asked, as soon as one finishes (to admit waiters).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from paged_jax.core import block_pool as bp
from paged_jax.worker import sampler
from paged_jax.worker.attention import AttentionMetadata, KVCache, copy_blocks


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeviceState:
    cache: KVCache
    pool: bp.BlockPool
    output_counts: jax.Array  # i32[max_seqs, vocab] (penalties on) or i32[max_seqs, 0]
    prompt_mask: jax.Array  # bool[max_seqs, vocab] or bool[max_seqs, 0]

    @property
    def penalties(self):
        return None if self.output_counts.shape[1] == 0 else (self.output_counts, self.prompt_mask)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HostOps:
    """Pool operations the host scheduled since the last call, applied in this order first."""

    mark_ids: jax.Array  # i32[max_seqs * max_blocks_per_seq]; blocks that now hold a cache entry, 0 pad
    free_mask: jax.Array  # bool[max_seqs]; finished, aborted or preempted sequences


@dataclasses.dataclass(frozen=True)
class Flags:
    """Static choices that select a compiled variant (hashable)."""

    backend: str
    filters: bool = False  # some row uses top-k / top-p / min-p
    num_logprobs: int = 0  # top-N logprobs returned per token
    mesh: Mesh | None = None  # tensor parallelism: attention runs per shard


def _apply_host_ops(pool: bp.BlockPool, ops: HostOps) -> bp.BlockPool:
    pool = bp.mark_cached(pool, ops.mark_ids, ops.mark_ids.shape[0])
    return bp.free(pool, ops.free_mask)


def _snapshot(pool: bp.BlockPool):
    """What the host mirrors after each call: the tables, with each entry's version."""
    return dict(block_tables=pool.block_tables, seq_lens=pool.seq_lens,
                table_versions=pool.version[pool.block_tables], num_free=pool.num_free_blocks)


def _count_tokens(counts, tokens, live):  # i32[S, V], i32[S], bool[S] -> i32[S, V]
    rows = jnp.arange(tokens.shape[0])
    return counts.at[rows, jnp.where(live, tokens, counts.shape[1])].add(1, mode="drop")


@functools.partial(jax.jit, static_argnames=("graphdef", "flags"), donate_argnames=("state",))
def prefill_step(graphdef, params, state: DeviceState, ops: HostOps, batch: dict, sp: sampler.SlotParams,
                 *, flags: Flags):
    """One ragged forward. `batch` (host-built, see Engine._prefill_batch):
    tokens, positions, token_slot i32[T] (slot of each token, -1 padding); query_start_loc i32[S+1];
    attn_seq_lens i32[S] (0 for slots not in this batch); new_lens i32[S] (pool growth targets);
    hits i32[S, max_blocks], num_hits i32[S] (prefix hits of newly admitted slots);
    logits_rows i32[S] (token whose logits slot s samples from, -1 none); fork_parent i32[S] (-1 none);
    num_output, total_len i32[S] (counting the token sampled now)."""
    pool = _apply_host_ops(state.pool, ops)
    admitted = batch["num_hits"] > 0
    pool, shared = bp.share(pool, jnp.where(admitted, jnp.arange(admitted.shape[0]), -1),
                            batch["hits"], batch["num_hits"])
    pool, grown = bp.allocate(pool, batch["new_lens"],
                              max_new_blocks=batch["tokens"].shape[0] // pool.block_size + pool.max_seqs)
    slots = bp.slot_mapping(pool, batch["token_slot"], batch["positions"])
    md = AttentionMetadata(slot_mapping=slots, block_tables=pool.block_tables,
                           seq_lens=batch["attn_seq_lens"], query_start_loc=batch["query_start_loc"])
    model = nnx.merge(graphdef, params)
    logits, cache = model(batch["tokens"], batch["positions"], state.cache, md,
                          jnp.maximum(batch["logits_rows"], 0), backend=flags.backend, mesh=flags.mesh)

    def fork_one(child, carry):
        pool, src, dst, ok = carry
        parent = batch["fork_parent"][child]

        def fork(pool):
            pool, forked, s, d = bp.fork(pool, parent, child)
            return pool, s, d, forked

        def skip(pool):
            return pool, jnp.int32(-1), jnp.int32(-1), jnp.array(True)

        pool, s, d, forked = jax.lax.cond(parent >= 0, fork, skip, pool)
        return pool, src.at[child].set(s), dst.at[child].set(d), ok & forked

    def fork_all(pool):
        none = jnp.full((pool.max_seqs,), -1, jnp.int32)
        return jax.lax.fori_loop(0, pool.max_seqs, fork_one, (pool, none, none, jnp.array(True)))

    def no_forks(pool):  # the common step: no loop over the slots at all
        none = jnp.full((pool.max_seqs,), -1, jnp.int32)
        return pool, none, none, jnp.array(True)

    pool, src, dst, forked = jax.lax.cond(jnp.any(batch["fork_parent"] >= 0), fork_all, no_forks, pool)
    cache = copy_blocks(cache, src, dst, backend=flags.backend)

    live = batch["logits_rows"] >= 0
    tokens, logprob, rank, top_ids, top_lps = sampler.sample(
        logits, sp, batch["num_output"] - 1, state.penalties,
        filters=flags.filters, num_logprobs=flags.num_logprobs)
    finish = jnp.where(live, sampler.stop_check(tokens, sp, batch["num_output"], batch["total_len"]), 0)
    state = dataclasses.replace(state, cache=cache, pool=pool)
    if state.penalties is not None:
        state = dataclasses.replace(state, output_counts=_count_tokens(state.output_counts, tokens, live))
    out = dict(tokens=jnp.where(live, tokens, -1), logprob=logprob, rank=rank, top_ids=top_ids, top_logprobs=top_lps,
               finish=finish, ok=jnp.all(shared) & grown & forked, **_snapshot(pool))
    return state, out


@functools.partial(jax.jit, static_argnames=("graphdef", "flags", "num_steps"), donate_argnames=("state",))
def decode_steps(graphdef, params, state: DeviceState, ops: HostOps, last_tokens, active, num_output,
                 total_len, stop_on_finish, sp: sampler.SlotParams, *, flags: Flags, num_steps: int):
    """Up to `num_steps` decode steps on the device.

    last_tokens i32[S] (sampled, not yet in the cache); active bool[S]; num_output, total_len i32[S]
    (output and total tokens so far); stop_on_finish bool[] (leave as soon as one sequence finishes).
    -> (state, dict(tokens i32[S, K] (-1 where none), logprob f32[S, K], rank i32[S, K], top_ids i32[S, K, N],
        top_logprobs f32[S, K, N], finish i32[S], pool_full bool[], steps i32[], snapshot))."""
    model = nnx.merge(graphdef, params)
    num_slots = active.shape[0]
    n = flags.num_logprobs
    out = dict(tokens=jnp.full((num_slots, num_steps), -1, jnp.int32),
               logprob=jnp.zeros((num_slots, num_steps), jnp.float32),
               rank=jnp.zeros((num_slots, num_steps), jnp.int32),
               top_ids=jnp.zeros((num_slots, num_steps, n), jnp.int32),
               top_logprobs=jnp.zeros((num_slots, num_steps, n), jnp.float32),
               finish=jnp.zeros((num_slots,), jnp.int32))
    state = dataclasses.replace(state, pool=_apply_host_ops(state.pool, ops))
    carry = (state, out, last_tokens, active, num_output, total_len, jnp.array(False), jnp.array(0))

    def cond(carry):
        _, out, _, active, _, _, pool_full, step = carry
        any_finished = jnp.any(out["finish"] > 0)
        return (step < num_steps) & jnp.any(active) & ~pool_full & ~(stop_on_finish & any_finished)

    def body(carry):
        state, out, last, active, num_output, total_len, _, step = carry
        positions = state.pool.seq_lens
        pool, ok = bp.allocate(state.pool, positions + active, max_new_blocks=num_slots)

        def run(state):
            seq_ids = jnp.where(active, jnp.arange(num_slots), -1)
            md = AttentionMetadata(slot_mapping=bp.slot_mapping(pool, seq_ids, positions),
                                   block_tables=pool.block_tables,
                                   seq_lens=jnp.where(active, positions + 1, 0),
                                   query_start_loc=jnp.arange(num_slots + 1, dtype=jnp.int32),
                                   decode_only=True)
            logits, cache = model(last, positions, state.cache, md, jnp.arange(num_slots),
                                  backend=flags.backend, mesh=flags.mesh)
            tokens, logprob, rank, top_ids, top_lps = sampler.sample(
                logits, sp, num_output, state.penalties, filters=flags.filters, num_logprobs=n)
            finish = jnp.where(active, sampler.stop_check(tokens, sp, num_output + 1, total_len + 1), 0)
            new = dataclasses.replace(state, cache=cache, pool=pool)
            if state.penalties is not None:
                new = dataclasses.replace(new, output_counts=_count_tokens(state.output_counts, tokens, active))
            o = dict(tokens=out["tokens"].at[:, step].set(jnp.where(active, tokens, -1)),
                     logprob=out["logprob"].at[:, step].set(logprob),
                     rank=out["rank"].at[:, step].set(rank),
                     top_ids=out["top_ids"].at[:, step].set(top_ids),
                     top_logprobs=out["top_logprobs"].at[:, step].set(top_lps),
                     finish=jnp.where(finish > 0, finish, out["finish"]))
            return (new, o, jnp.where(active, tokens, last), active & (finish == 0),
                    num_output + active, total_len + active, jnp.array(False), step + 1)

        def stop(state):  # the pool cannot grow: leave the loop with nothing changed
            return state, out, last, active, num_output, total_len, jnp.array(True), step

        return jax.lax.cond(ok, run, stop, state)

    state, out, _, _, _, _, pool_full, steps = jax.lax.while_loop(cond, body, carry)
    return state, dict(out, pool_full=pool_full, steps=steps, **_snapshot(state.pool))


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
def apply_host_ops(state: DeviceState, ops: HostOps):
    """Apply pending frees and cache marks when no step follows (the engine went idle)."""
    pool = _apply_host_ops(state.pool, ops)
    return dataclasses.replace(state, pool=pool), _snapshot(pool)


@jax.jit
def block_versions(pool: bp.BlockPool, block_ids):  # i32[n] -> i32[n]
    return pool.version[block_ids]
