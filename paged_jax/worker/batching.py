"""Host-side assembly of one device call's inputs from the scheduler's plan: numpy arrays whose shapes
are bucketed (rows to a power of two up to max_num_seqs, tables to a power of two of blocks
covering the batch's longest sequence, tokens to a power of two), so a call costs the work in
flight, never the capacity, and a workload reuses a handful of compiled programs."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from paged_jax.core.scheduler import Plan
from paged_jax.core.sequence import Sequence
from paged_jax.worker import sampler

MIN_TOKEN_BUCKET = 16
MIN_WIDTH_BUCKET = 4


def bucket(n: int, cap: int, low: int = 1) -> int:
    """n rounded up to a power of two, at least `low`, at most `cap`."""
    return min(max(low, 1 << (max(n, 1) - 1).bit_length()), cap)


def token_bucket(n: int, cap: int) -> int:
    """Pad a ragged batch of n tokens to a power of two (at least 16, at most `cap`)."""
    return bucket(n, cap, MIN_TOKEN_BUCKET)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PoolOps:
    """Pool operations the host decided since the last call, applied before it: cache marks first,
    then sliding-window skips and frees (so a released block that now holds an entry goes to the
    cached end of the queue)."""

    mark_ids: np.ndarray  # i32[m]; blocks that now hold a prefix-cache entry, 0 pad
    free_slots: np.ndarray  # i32[f]; finished, aborted or preempted slots, -1 pad
    skip_slots: np.ndarray  # i32[s]; slots whose leading blocks left the sliding window, -1 pad
    num_skipped: np.ndarray  # i32[s]; entries [0, num_skipped) of each become the null block


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillBatch:
    """A ragged batch of B rows (scheduled sequences and forked children) and T tokens; tables are W
    wide (the shape of `hits`)."""

    slots: np.ndarray  # i32[B]; sequence slot of each row, -1 pad
    tokens: np.ndarray  # i32[T]
    positions: np.ndarray  # i32[T]
    token_row: np.ndarray  # i32[T]; row of each token, -1 pad
    query_start_loc: np.ndarray  # i32[B + 1]
    attn_seq_lens: np.ndarray  # i32[B]; tokens in the cache once this batch is written
    new_lens: np.ndarray  # i32[B]; pool growth targets
    hits: np.ndarray  # i32[B, W]; prefix-hit blocks of newly admitted rows
    hit_versions: np.ndarray  # i32[B, W]
    num_hits: np.ndarray  # i32[B]
    logits_rows: np.ndarray  # i32[B]; token whose logits the row samples from, -1 none
    fork_parent: np.ndarray  # i32[B]; row of the parent a child forks from, -1 none
    num_output: np.ndarray  # i32[B]; output tokens counting the one sampled now
    total_len: np.ndarray  # i32[B]; tokens counting the one sampled now
    # prompt_logprobs: batch token i's logits score prompt token prompt_lp_positions[i] of row
    # prompt_lp_rows[i] (the token after it); P = 0 when no row asks.
    prompt_lp_tokens: np.ndarray  # i32[P]; -1 pad
    prompt_lp_targets: np.ndarray  # i32[P]
    prompt_lp_rows: np.ndarray  # i32[P]; -1 pad
    prompt_lp_positions: np.ndarray  # i32[P]
    # Blocks loaded from host memory (swapped in, host prefix cache hits): block j goes to table
    # entry (swap_rows[j], swap_cols[j]) of the batch (-1 pad); S = 0 when none is.
    swap_rows: np.ndarray  # i32[S]
    swap_cols: np.ndarray  # i32[S]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeBatch:
    """B running sequences, each with one sampled token not yet in the cache."""

    slots: np.ndarray  # i32[B]; -1 pad
    last_tokens: np.ndarray  # i32[B]
    num_output: np.ndarray  # i32[B]; output tokens so far
    total_len: np.ndarray  # i32[B]; prompt + output tokens so far
    stop_on_finish: np.ndarray  # bool[]; leave as soon as one sequence finishes (requests wait)


def pool_ops(plan: Plan, mark_cap: int) -> PoolOps:
    marks = np.zeros(bucket(len(plan.marks), mark_cap, 8), np.int32)
    marks[: len(plan.marks)] = plan.marks
    free = np.full(bucket(len(plan.free_slots), 1 << 30, 8), -1, np.int32)
    free[: len(plan.free_slots)] = plan.free_slots
    skip_slots = np.full(bucket(len(plan.skips), 1 << 30, 8), -1, np.int32)
    num_skipped = np.zeros_like(skip_slots)
    for i, (slot, n) in enumerate(plan.skips):
        skip_slots[i], num_skipped[i] = slot, n
    return PoolOps(mark_ids=marks, free_slots=free, skip_slots=skip_slots, num_skipped=num_skipped)


def padded(ids, fill=0) -> np.ndarray:
    """i32 ids padded with `fill` to a power of two (at least 8): block copies compile few programs."""
    out = np.full(bucket(len(ids), 1 << 30, 8), fill, np.int32)
    out[: len(ids)] = ids
    return out


def prefill_rows(plan: Plan) -> list[Sequence]:
    return [s for s, _ in plan.scheduled] + [child for child, _ in plan.forks]


def prefill_batch(plan: Plan, *, block_size: int, max_num_seqs: int, max_blocks_per_seq: int,
                  token_cap: int) -> PrefillBatch:
    rows = prefill_rows(plan)
    index = {seq.slot: i for i, seq in enumerate(rows)}
    num_rows = bucket(len(rows), max_num_seqs)
    widest = max(-(-(seq.num_computed + n) // block_size) for seq, n in plan.scheduled)
    width = bucket(widest, max_blocks_per_seq, MIN_WIDTH_BUCKET)
    size = token_bucket(sum(n for _, n in plan.scheduled), token_cap)
    i32 = np.int32
    b = dict(slots=np.full(num_rows, -1, i32), tokens=np.zeros(size, i32), positions=np.zeros(size, i32),
             token_row=np.full(size, -1, i32), query_start_loc=np.zeros(num_rows + 1, i32),
             attn_seq_lens=np.zeros(num_rows, i32), new_lens=np.zeros(num_rows, i32),
             hits=np.zeros((num_rows, width), i32), hit_versions=np.zeros((num_rows, width), i32),
             num_hits=np.zeros(num_rows, i32), logits_rows=np.full(num_rows, -1, i32),
             fork_parent=np.full(num_rows, -1, i32), num_output=np.zeros(num_rows, i32),
             total_len=np.zeros(num_rows, i32))
    b["slots"][: len(rows)] = [seq.slot for seq in rows]
    at = 0
    for i, (seq, n) in enumerate(plan.scheduled):
        start, end = seq.num_computed, seq.num_computed + n
        b["tokens"][at:at + n] = seq.token_ids[start:end]
        b["positions"][at:at + n] = np.arange(start, end)
        b["token_row"][at:at + n] = i
        b["attn_seq_lens"][i] = b["new_lens"][i] = end
        if end == seq.num_tokens:  # the chunk completes what is known: sample the next token
            b["logits_rows"][i] = at + n - 1
            b["num_output"][i], b["total_len"][i] = seq.num_output + 1, seq.num_tokens + 1
        at += n
        b["query_start_loc"][i + 1] = at
    b["query_start_loc"][len(plan.scheduled) + 1:] = at
    b.update(_prompt_logprob_entries(plan, size))
    rows, cols = [], []
    for slot, ids, first in plan.host_loads:
        rows += [index[slot]] * len(ids)
        cols += range(first, first + len(ids))
    b["swap_rows"], b["swap_cols"] = padded(rows, -1) if rows else np.zeros(0, i32), padded(cols) if rows else np.zeros(0, i32)
    for slot, (hits, versions) in plan.admitted.items():
        b["hits"][index[slot], : len(hits)] = hits
        b["hit_versions"][index[slot], : len(hits)] = versions
        b["num_hits"][index[slot]] = len(hits)
    for child, parent in plan.forks:
        i, p = index[child.slot], index[parent.slot]
        b["fork_parent"][i], b["logits_rows"][i] = p, b["logits_rows"][p]
        b["num_output"][i], b["total_len"][i] = 1, parent.num_tokens + 1
    return PrefillBatch(**b)


def _prompt_logprob_entries(plan: Plan, cap: int) -> dict:
    """Which batch tokens score which prompt tokens, for the rows whose request asks for
    prompt_logprobs: a chunk [start, end) scores prompt tokens start + 1 .. min(end, prompt) - 1
    (the last prompt token's logits sample the first output token instead)."""
    tokens, targets, rows, positions, at = [], [], [], [], 0
    for i, (seq, n) in enumerate(plan.scheduled):
        start = seq.num_computed
        if seq.request.params.prompt_logprobs is not None and seq.index == 0:
            for p in range(start, min(start + n, seq.num_prompt_tokens - 1)):
                tokens.append(at + p - start)
                targets.append(seq.token_ids[p + 1])
                rows.append(i)
                positions.append(p + 1)
        at += n
    size = bucket(len(tokens), cap, MIN_TOKEN_BUCKET) if tokens else 0
    out = dict(prompt_lp_tokens=np.full(size, -1, np.int32), prompt_lp_targets=np.zeros(size, np.int32),
               prompt_lp_rows=np.full(size, -1, np.int32), prompt_lp_positions=np.zeros(size, np.int32))
    for name, values in (("prompt_lp_tokens", tokens), ("prompt_lp_targets", targets),
                         ("prompt_lp_rows", rows), ("prompt_lp_positions", positions)):
        out[name][: len(values)] = values
    return out


def decode_batch(plan: Plan, *, block_size: int, max_num_seqs: int, max_blocks_per_seq: int,
                 num_steps: int) -> tuple[DecodeBatch, int]:
    """-> (batch, table width covering `num_steps` more tokens of every row)."""
    seqs = [seq for seq, _ in plan.scheduled]
    num_rows = bucket(len(seqs), max_num_seqs)
    widest = max(-(-(seq.num_tokens - 1 + num_steps) // block_size) for seq in seqs)
    i32 = np.int32
    b = dict(slots=np.full(num_rows, -1, i32), last_tokens=np.zeros(num_rows, i32),
             num_output=np.zeros(num_rows, i32), total_len=np.zeros(num_rows, i32))
    for i, seq in enumerate(seqs):
        b["slots"][i], b["last_tokens"][i] = seq.slot, seq.token_ids[-1]
        b["num_output"][i], b["total_len"][i] = seq.num_output, seq.num_tokens
    batch = DecodeBatch(**b, stop_on_finish=np.bool_(plan.num_waiting > 0))
    return batch, bucket(widest, max_blocks_per_seq, MIN_WIDTH_BUCKET)


def stop_ids(seq: Sequence, eos_token_ids) -> list[int]:
    params = seq.request.params
    return ([] if params.ignore_eos else list(eos_token_ids)) + params.stop_token_ids


def row_params(seqs: list[Sequence], num_rows: int, eos_token_ids, max_model_len: int) -> sampler.SlotParams:
    """The sampling parameters of each batch row (padding rows idle)."""
    rows = [(s.request.params, s.key, stop_ids(s, eos_token_ids), max_model_len) for s in seqs]
    rows += [None] * (num_rows - len(rows))
    width = max([8] + [len(r[2]) for r in rows if r is not None])
    return sampler.slot_params(rows, 1 << (width - 1).bit_length())
