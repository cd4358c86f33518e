"""Host-side assembly of the device inputs for one step: numpy arrays of fixed (bucketed) shapes, so
a steady workload reuses a handful of compiled programs."""
from __future__ import annotations

import numpy as np

from paged_jax.worker import sampler
from paged_jax.worker.runner import HostOps
from paged_jax.core.scheduler import Plan
from paged_jax.core.sequence import Sequence

MIN_TOKEN_BUCKET = 16


def token_bucket(n: int, cap: int) -> int:
    """Pad a ragged batch of n tokens to a power of two (at least 16, at most `cap`)."""
    return min(max(MIN_TOKEN_BUCKET, 1 << (max(n, 1) - 1).bit_length()), cap)


def stop_ids(seq: Sequence, eos_token_ids) -> list[int]:
    params = seq.request.params
    return ([] if params.ignore_eos else list(eos_token_ids)) + params.stop_token_ids


def slot_params(seqs: list[Sequence], num_slots: int, eos_token_ids, max_model_len: int):
    rows = [None] * num_slots
    for seq in seqs:
        rows[seq.slot] = (seq.request.params, seq.key, stop_ids(seq, eos_token_ids), max_model_len)
    width = max([8] + [len(r[2]) for r in rows if r is not None])
    return sampler.slot_params(rows, 1 << (width - 1).bit_length())


def host_ops(plan: Plan, num_slots: int, max_blocks_per_seq: int) -> HostOps:
    marks = np.zeros(num_slots * max_blocks_per_seq, np.int32)
    marks[: len(plan.marks)] = plan.marks
    free_mask = np.zeros(num_slots, bool)
    free_mask[plan.free_slots] = True
    return HostOps(mark_ids=marks, free_mask=free_mask)


def prefill_batch(plan: Plan, num_slots: int, max_blocks_per_seq: int, token_cap: int) -> dict:
    """The ragged batch of `prefill_step`: each scheduled sequence's new tokens, laid out by slot."""
    chunks = sorted(plan.scheduled, key=lambda item: item[0].slot)
    total = sum(n for _, n in chunks)
    size = token_bucket(total, token_cap)
    b = dict(tokens=np.zeros(size, np.int32), positions=np.zeros(size, np.int32),
             token_slot=np.full(size, -1, np.int32), query_start_loc=np.zeros(num_slots + 1, np.int32),
             attn_seq_lens=np.zeros(num_slots, np.int32), new_lens=np.zeros(num_slots, np.int32),
             hits=np.zeros((num_slots, max_blocks_per_seq), np.int32), num_hits=np.zeros(num_slots, np.int32),
             logits_rows=np.full(num_slots, -1, np.int32), fork_parent=np.full(num_slots, -1, np.int32),
             num_output=np.zeros(num_slots, np.int32), total_len=np.zeros(num_slots, np.int32))
    n_by_slot = np.zeros(num_slots, np.int32)
    for seq, n in chunks:
        n_by_slot[seq.slot] = n
    b["query_start_loc"][1:] = np.cumsum(n_by_slot)
    for seq, n in chunks:
        s, start, end = seq.slot, seq.num_computed, seq.num_computed + n
        at = b["query_start_loc"][s]
        b["tokens"][at:at + n] = seq.token_ids[start:end]
        b["positions"][at:at + n] = np.arange(start, end)
        b["token_slot"][at:at + n] = s
        b["attn_seq_lens"][s] = b["new_lens"][s] = end
        if end == seq.num_tokens:  # the chunk completes what is known: sample the next token
            b["logits_rows"][s] = at + n - 1
            b["num_output"][s], b["total_len"][s] = seq.num_output + 1, seq.num_tokens + 1
    for slot, hits in plan.admitted.items():
        b["hits"][slot, : len(hits)] = hits
        b["num_hits"][slot] = len(hits)
    for child, parent in plan.forks:
        b["fork_parent"][child.slot] = parent.slot
        b["logits_rows"][child.slot] = b["logits_rows"][parent.slot]
        b["num_output"][child.slot], b["total_len"][child.slot] = 1, parent.num_tokens + 1
    return b


def decode_inputs(seqs: list[Sequence], num_slots: int) -> dict:
    last = np.zeros(num_slots, np.int32)
    active = np.zeros(num_slots, bool)
    num_output = np.zeros(num_slots, np.int32)
    total_len = np.zeros(num_slots, np.int32)
    for seq in seqs:
        last[seq.slot], active[seq.slot] = seq.token_ids[-1], True
        num_output[seq.slot], total_len[seq.slot] = seq.num_output, seq.num_tokens
    return dict(last_tokens=last, active=active, num_output=num_output, total_len=total_len)
