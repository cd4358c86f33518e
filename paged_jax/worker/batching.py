"""Host-side assembly of one device call's inputs from the scheduler's plan: numpy arrays whose shapes
are bucketed (rows to a power of two up to max_num_seqs, tables to a power of two of blocks
covering the batch's longest sequence, tokens to a power of two), so a call costs the work in
flight, never the capacity, and a workload reuses a handful of compiled programs."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from paged_jax.core.plan import Plan
from paged_jax.core.sequence import Sequence
from paged_jax.worker import sampler

MIN_TOKEN_BUCKET = 16
MIN_WIDTH_BUCKET = 4


def bucket(n: int, cap: int, low: int = 1) -> int:
    """n rounded up to a power of two, at least `low`, at most `cap`."""
    return min(max(low, 1 << (max(n, 1) - 1).bit_length()), cap)


def token_bucket(n: int, cap: int, verifying: bool = False) -> int:
    """Pad a ragged batch of n tokens to a power of two (at least 16, at most `cap`). A call that
    verifies speculative proposals pads from 1: a few decoding rows' 1 + k tokens are its whole
    forward, whose cost on a compute-bound device grows with the padded count."""
    return bucket(n, cap, 1 if verifying else MIN_TOKEN_BUCKET)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillBatch:
    """A ragged batch of B rows (scheduled sequences and forked children) and T tokens, over block
    tables W wide that the host's pool already holds (prefix hits, growth and forks included)."""

    slots: np.ndarray  # i32[B]; sequence slot of each row, -1 pad
    tokens: np.ndarray  # i32[T]
    positions: np.ndarray  # i32[T]
    token_row: np.ndarray  # i32[T]; row of each token, -1 pad
    slot_mapping: np.ndarray  # i32[T]; KV slot each token writes, -1 pad
    block_tables: np.ndarray  # i32[B, W]
    query_start_loc: np.ndarray  # i32[B + 1]
    attn_seq_lens: np.ndarray  # i32[B]; tokens in the cache once this batch is written
    logits_rows: np.ndarray  # i32[B]; token whose logits the row samples from, -1 none
    copy_src: np.ndarray  # i32[F]; forks' tail blocks, copied after the forward, -1 pad
    copy_dst: np.ndarray  # i32[F]
    num_output: np.ndarray  # i32[B]; output tokens counting the one sampled now
    total_len: np.ndarray  # i32[B]; tokens counting the one sampled now
    # prompt_logprobs: batch token i's logits score prompt token prompt_lp_positions[i] of row
    # prompt_lp_rows[i] (the token after it); P = 0 when no row asks.
    prompt_lp_tokens: np.ndarray  # i32[P]; -1 pad
    prompt_lp_targets: np.ndarray  # i32[P]
    prompt_lp_rows: np.ndarray  # i32[P]; -1 pad
    prompt_lp_positions: np.ndarray  # i32[P]
    # Blocks loaded from host memory (swapped in, host prefix cache hits): host block j goes to
    # device block swap_blocks[j] (-1 pad); S = 0 when none is.
    swap_blocks: np.ndarray  # i32[S]
    # Speculative decoding: row i's proposals drafts[i] (-1 pad) follow its last sampled token in
    # the batch; spec_rows[i, j] is the batch token whose logits score its position j (the token
    # after draft j - 1), -1 pad. J = num_speculative_tokens + 1 in a call that verifies, else 0.
    spec_rows: np.ndarray  # i32[B, J]
    drafts: np.ndarray  # i32[B, J - 1]
    # Rows planned while the verification before this call ran, as if it had accepted every draft
    # (AsyncScheduler.schedule_next): the device moves them back by what it rejected. bool[B] in a
    # call that verifies, else bool[0] (only a verifying call follows one).
    optimistic: np.ndarray


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeBatch:
    """B running sequences, each with one sampled token not yet in the cache, over tables W wide
    holding the blocks of their next num_steps tokens (reserved by the host)."""

    slots: np.ndarray  # i32[B]; -1 pad
    block_tables: np.ndarray  # i32[B, W]
    positions: np.ndarray  # i32[B]; position of each row's last token (its K/V is written first)
    num_mapped: np.ndarray  # i32[B]; token slots the row's table maps: it pauses there
    live: np.ndarray  # bool[B]; rows that run (not padding, not finished)
    last_tokens: np.ndarray  # i32[B]
    num_output: np.ndarray  # i32[B]; output tokens so far
    total_len: np.ndarray  # i32[B]; prompt + output tokens so far
    stop_on_finish: np.ndarray  # bool[]; leave as soon as one sequence finishes (requests wait)


def padded(ids, fill=0) -> np.ndarray:
    """i32 ids padded with `fill` to a power of two (at least 8): block copies compile few programs."""
    out = np.full(bucket(len(ids), 1 << 30, 8), fill, np.int32)
    out[: len(ids)] = ids
    return out


def prefill_rows(plan: Plan) -> list[Sequence]:
    return [s for s, _ in plan.scheduled] + [child for child, _ in plan.forks]


def _tables(plan: Plan, num_rows: int, max_blocks_per_seq: int) -> np.ndarray:
    """The plan's block tables padded to `num_rows` rows and a bucketed width (null entries)."""
    rows, widest = plan.block_tables.shape
    width = bucket(widest, max_blocks_per_seq, MIN_WIDTH_BUCKET)
    tables = np.zeros((num_rows, width), np.int32)
    tables[:rows, :widest] = plan.block_tables
    return tables


def prefill_batch(plan: Plan, *, block_size: int, max_num_seqs: int, max_blocks_per_seq: int,
                  token_cap: int, num_speculative_tokens: int = 0) -> PrefillBatch:
    rows = prefill_rows(plan)
    index = {seq.slot: i for i, seq in enumerate(rows)}
    num_rows = bucket(len(rows), max_num_seqs)
    size = token_bucket(sum(n for _, n in plan.scheduled), token_cap, verifying=plan.verifies)
    i32 = np.int32
    tables = _tables(plan, num_rows, max_blocks_per_seq)
    width = num_speculative_tokens + 1 if plan.verifies else 0
    b = dict(slots=np.full(num_rows, -1, i32), tokens=np.zeros(size, i32), positions=np.zeros(size, i32),
             token_row=np.full(size, -1, i32), block_tables=tables, query_start_loc=np.zeros(num_rows + 1, i32),
             attn_seq_lens=np.zeros(num_rows, i32), logits_rows=np.full(num_rows, -1, i32),
             num_output=np.zeros(num_rows, i32), total_len=np.zeros(num_rows, i32),
             spec_rows=np.full((num_rows, width), -1, i32), drafts=np.full((num_rows, max(width - 1, 0)), -1, i32),
             optimistic=np.zeros(num_rows if width else 0, bool))
    b["slots"][: len(rows)] = [seq.slot for seq in rows]
    at = 0
    for i, (seq, n) in enumerate(plan.scheduled):
        drafts = plan.drafts.get(seq, [])
        start, end = seq.num_computed, seq.num_computed + n - len(drafts)
        b["tokens"][at:at + n] = seq.token_ids[start:end] + drafts
        b["positions"][at:at + n] = np.arange(start, start + n)
        b["token_row"][at:at + n] = i
        b["attn_seq_lens"][i] = start + n
        if seq in plan.optimistic:
            b["optimistic"][i] = True
        if end == seq.num_tokens:  # the chunk completes what is known: sample the next token
            b["logits_rows"][i] = at + n - 1 - len(drafts)
            b["num_output"][i], b["total_len"][i] = seq.num_output + 1, seq.num_tokens + 1
            if width:
                b["spec_rows"][i, : len(drafts) + 1] = b["logits_rows"][i] + np.arange(len(drafts) + 1)
                b["drafts"][i, : len(drafts)] = drafts
        at += n
        b["query_start_loc"][i + 1] = at
    b["query_start_loc"][len(plan.scheduled) + 1:] = at
    live = b["token_row"] >= 0
    pos = b["positions"]
    block = tables[np.maximum(b["token_row"], 0), np.minimum(pos // block_size, tables.shape[1] - 1)]
    b["slot_mapping"] = np.where(live & (block > 0), block * block_size + pos % block_size, -1).astype(i32)
    b.update(_prompt_logprob_entries(plan, size))
    loads = [tables[index[slot], first + j] for slot, ids, first in plan.host_loads for j in range(len(ids))]
    b["swap_blocks"] = padded(loads, -1) if loads else np.zeros(0, i32)
    b["copy_src"] = padded([s for s, _ in plan.copies], -1) if plan.copies else np.zeros(0, i32)
    b["copy_dst"] = padded([d for _, d in plan.copies], -1) if plan.copies else np.zeros(0, i32)
    for child, parent in plan.forks:
        i, p = index[child.slot], index[parent.slot]
        b["logits_rows"][i] = b["logits_rows"][p]
        b["num_output"][i], b["total_len"][i] = 1, parent.num_tokens + 1
        if width:
            b["spec_rows"][i, 0] = b["logits_rows"][p]
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


def decode_batch(plan: Plan, *, max_num_seqs: int, max_blocks_per_seq: int) -> DecodeBatch:
    seqs = [seq for seq, _ in plan.scheduled]
    num_rows = bucket(len(seqs), max_num_seqs)
    i32 = np.int32
    b = dict(slots=np.full(num_rows, -1, i32), positions=np.zeros(num_rows, i32), num_mapped=np.zeros(num_rows, i32),
             last_tokens=np.zeros(num_rows, i32),
             num_output=np.zeros(num_rows, i32), total_len=np.zeros(num_rows, i32))
    for i, seq in enumerate(seqs):
        b["slots"][i], b["last_tokens"][i] = seq.slot, seq.token_ids[-1]
        b["positions"][i] = seq.num_tokens - 1
        b["num_output"][i], b["total_len"][i] = seq.num_output, seq.num_tokens
    b["num_mapped"][: len(seqs)] = plan.num_mapped
    return DecodeBatch(**b, block_tables=_tables(plan, num_rows, max_blocks_per_seq), live=b["slots"] >= 0,
                       stop_on_finish=np.bool_(plan.stop_on_finish))


def stop_ids(seq: Sequence, eos_token_ids) -> list[int]:
    params = seq.request.params
    return ([] if params.ignore_eos else list(eos_token_ids)) + params.stop_token_ids


def row_params(seqs: list[Sequence], num_rows: int, eos_token_ids, max_model_len: int,
               bitmask: tuple[np.ndarray, np.ndarray] | None = None) -> sampler.SlotParams:
    """The sampling parameters of each batch row (padding rows idle); `bitmask`: the grammars'
    masks and each row's (SlotParams.allowed, mask_row; structured output), or None."""
    rows = [(s.request.params, s.key, stop_ids(s, eos_token_ids), max_model_len) for s in seqs]
    rows += [None] * (num_rows - len(rows))
    width = max([8] + [len(r[2]) for r in rows if r is not None])
    return sampler.slot_params(rows, 1 << (width - 1).bit_length(), bitmask)
