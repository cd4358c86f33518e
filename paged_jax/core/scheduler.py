"""vLLM V1's scheduler (vllm/v1/core/sched/scheduler.py) on the host: no prefill or decode phase,
each sequence brings its computed tokens up to its tokens within a token budget, which covers
chunked prefill, prefix hits and resumption after preemption in one mechanism.

It owns the block pool (through `KVCacheManager`): it allocates, shares, forks and frees as it
plans, reserving the blocks of a decode call's K tokens before the call (vLLM's lookahead slots),
and the device receives only the block tables of each call's rows. One step is `schedule()`, the
device call, then `update_from_output(plan, output)`, which owns every transition the output causes.
"""
from __future__ import annotations

import collections
import heapq

import numpy as np

from paged_jax.core.host_memory import HostMemory
from paged_jax.core.host_pool import HostBlockPool
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.model_output import ModelOutput
from paged_jax.core.plan import Plan
from paged_jax.core.prefix_cache import PrefixCache, extend_block_hashes
from paged_jax.core.sequence import PENDING, Sequence, Status


class Scheduler:
    stops_for_waiting = True  # a decode call with requests waiting leaves at its first finish for them

    def __init__(self, *, max_num_seqs, max_num_batched_tokens, block_size, num_blocks,
                 max_blocks_per_seq, long_prefill_token_threshold=0, prefix_cache=None, sliding_window=None,
                 host_pool: HostBlockPool | None = None, swap_preemption=False, host_tier=False,
                 num_decode_steps=1, max_model_len=None, max_loras=0):
        """`sliding_window`: every layer's attention window (tokens), or None. With a `host_pool`:
        `swap_preemption` (vLLM V0's preemption_mode="swap") and `host_tier` (core/host_memory.py).
        `num_decode_steps`: the most tokens one decode call adds to a sequence; `max_model_len`: the
        tokens at which the device ends a sequence (default: what its table maps); `max_loras`: the
        LoRA adapters the running sequences may use at once (EngineConfig.lora)."""
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_model_len = max_model_len or max_blocks_per_seq * block_size
        self.block_size, self.sliding_window = block_size, sliding_window
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.prefix_cache = prefix_cache or PrefixCache(enabled=False)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.free_slot_ids = list(range(max_num_seqs))  # a heap: the lowest free slot first
        self.host = HostMemory(host_pool, swap_preemption=swap_preemption, tier=host_tier, block_size=block_size)
        self.num_decode_steps, self.max_loras = num_decode_steps, max_loras
        self.num_preemptions = self.num_recomputed_tokens = 0  # the latter: computed again after a recompute preemption
        self.kv_manager = KVCacheManager(num_blocks, block_size, max_num_seqs, max_blocks_per_seq,
                                         prefix_cache=self.prefix_cache, host=self.host, sliding_window=sliding_window)
        self._copies_pending: list[tuple[int, int]] = []  # tail-block copies of forks made between steps

    @property
    def host_pool(self) -> HostBlockPool | None:
        return self.host.pool

    @property
    def num_free(self) -> int:
        return self.kv_manager.num_free

    # -- requests ------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, seq.request.block_hash_key)
        self.waiting.append(seq)

    def finish(self, seqs: list[Sequence], status: Status) -> None:
        """End the sequences (and their unforked children); their blocks go back in one pool operation."""
        ending = []
        for seq in seqs:
            ending += [s for s in [seq, *seq.children] if not s.finished]
            seq.children = []
        if not ending:
            return
        for s in ending:
            s.status = status
            self.host.release(s)
        self.running = [s for s in self.running if not s.finished]
        if any(s.finished for s in self.waiting):
            self.waiting = collections.deque(s for s in self.waiting if not s.finished)
        self._release_slots(ending)

    def _release_slots(self, seqs: list[Sequence]) -> None:
        held = [seq for seq in seqs if seq.slot >= 0]
        if held:
            self.kv_manager.free([seq.slot for seq in held])
        for seq in held:
            heapq.heappush(self.free_slot_ids, seq.slot)
            seq.slot = -1

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # -- one step ------------------------------------------------------------------------------

    def schedule(self, drafts: dict[Sequence, list[int]] | None = None, *, overlapped: bool = False) -> Plan | None:
        """Plan the next step and apply its pool operations: vLLM's two passes. `drafts`: speculative
        proposals of decoding rows, scheduled after their last sampled token (as the token budget
        allows) and verified by the call; blocks are mapped for them like any token, and only the
        verified ones count as computed (`update_from_output`), so a rejected tail is rolled back by
        the row's length alone: its blocks stay mapped for the row's next calls to write over (as
        vLLM's). `overlapped` (AsyncScheduler.schedule_next): None, changing nothing, where it would
        preempt or schedule nothing."""
        plan, self._copies_pending = Plan(copies_first=self._copies_pending), []
        drafts = drafts or {}
        budget, kv = self.max_num_batched_tokens, self.kv_manager

        # Pass 1: running sequences in admission order; preempt from the back when blocks run out.
        # The pool grows once for the plan, at the end: `pending` counts the blocks promised so far.
        grows, pending, i = [], 0, 0
        while i < len(self.running):
            seq = self.running[i]
            kv.remove_skipped_blocks(seq)
            spec = drafts.get(seq, []) if seq.num_tokens - seq.num_computed == 1 else []
            for extra in ([len(spec)] if spec else []) + [0]:  # proposals never preempt: dropped first
                n = self._chunk(seq.num_tokens - seq.num_computed + extra, budget)
                target = max(seq.num_computed + n, kv.num_mapped(seq.slot))
                need = kv.num_blocks_for(target) - kv.num_blocks_of(seq.slot) + self._fork_blocks(seq, n)
                if need + pending <= kv.num_free:
                    break
            if n == 0:
                i += 1
                continue
            if overlapped and need + pending > kv.num_free:
                return None
            while need + pending > kv.num_free and self.running:
                victim = self.running.pop()
                victim.host_blocks = self.host.swap_out(victim, kv, plan.swap_out, sliding_window=self.sliding_window)
                self._release_slots([victim, *victim.children])
                if not victim.host_blocks:  # recompute: its KV is dropped
                    victim.num_lost, victim.num_computed = victim.num_computed, 0
                victim.status, victim.num_cached_blocks = Status.WAITING, 0
                plan.preempted.append(victim)
                self.num_preemptions += 1
                if victim is seq:
                    break
            if seq.status == Status.WAITING:
                break
            grows.append((seq, n, target))
            pending += need
            plan.scheduled.append((seq, n))
            if spec and n > 1:
                plan.drafts[seq] = spec[: n - 1]
            budget -= n
            i += 1
        for victim in plan.preempted:  # the last preempted is first in line, as vLLM's prepend
            self.waiting.appendleft(victim)

        # Pass 2: waiting sequences in order, only if nothing was preempted this step. One whose
        # adapter would be one too many beside the running ones' is set aside (vLLM's LoRA cap).
        loras, skipped = {s.request.lora_id for s in self.running} | {0}, []
        while self.waiting and budget > 0 and not plan.preempted:
            seq = self.waiting[0]
            if seq.request.lora_id not in loras and len(loras) > self.max_loras:
                skipped.append(self.waiting.popleft())
                continue
            if len(self.free_slot_ids) < 1 + len(seq.children):
                break
            swapped = bool(seq.host_blocks)  # resumes with the tokens its host blocks hold
            hits = kv.prefix_hits(seq) if seq.num_computed == 0 else []
            tier = self.host.tier_hits(seq, len(hits)) if seq.num_computed == 0 else []
            cached = seq.num_computed if swapped else (len(hits) + len(tier)) * self.block_size
            n = self._chunk(seq.num_tokens - cached, budget)
            revived = sum(int(kv.ref(b) == 0) for b, _ in hits)  # taken back from the free queue
            need = kv.num_blocks_for(cached + n) - len(hits) + revived + self._fork_blocks(seq, n, cached)
            if need + pending > kv.num_free:
                break
            self.waiting.popleft()
            budget -= n
            seq.slot = heapq.heappop(self.free_slot_ids)
            for child in seq.children:
                child.slot = heapq.heappop(self.free_slot_ids)
            kv.share(seq.slot, [b for b, _ in hits], [v for _, v in hits])  # the revived ones leave the queue now
            seq.status, seq.num_computed, seq.prefill_end = Status.RUNNING, cached, seq.num_tokens
            grows.append((seq, n, cached + n))
            pending += need - revived
            if swapped:
                plan.swap_in.append((seq.slot, seq.host_blocks, 0))
                self.host.release(seq)
            else:
                if tier:
                    plan.tier_in.append((seq.slot, tier, len(hits)))
                    self.host.count_tier_hit(len(tier))
                self.prefix_cache.record(seq.num_tokens, len(hits) * self.block_size)
                self.num_recomputed_tokens += max(0, seq.num_lost - cached)
                seq.num_lost = 0
            if seq.request.num_cached_tokens is None:
                seq.request.num_cached_tokens = cached
            plan.admitted.add(seq.slot)
            plan.scheduled.append((seq, n))
            self.running.append(seq)
            loras.add(seq.request.lora_id)
        self.waiting.extendleft(reversed(skipped))

        if overlapped and not plan.scheduled:  # blocks the call before frees may be what is missing
            return None
        kv.grow([seq for seq, _, _ in grows], [target for _, _, target in grows])
        for seq, n, _ in grows:
            self._fork_children(seq, n, plan)
        if not plan.scheduled and self.waiting:  # nothing runs and nothing will free a block
            stuck = self.waiting[0].request.request_id
            raise RuntimeError(f"internal error: nothing can run, request {stuck!r} waits forever")
        plan.stop_on_finish = bool(self.waiting) and self.stops_for_waiting
        plan.is_decode = bool(plan.scheduled) and not (plan.admitted or plan.forks or plan.preempted) and all(
            n == 1 and seq.num_tokens - seq.num_computed == 1 for seq, n in plan.scheduled)
        seqs = [seq for seq, _ in plan.scheduled] if plan.is_decode else []
        pauses = seqs and kv.reserve_lookahead(seqs, [s.num_computed for s in seqs], [s.num_output for s in seqs],
                                               self.num_decode_steps)
        plan.one_step = any(seq.request.one_step_per_call for seq, _ in plan.scheduled)
        plan.tier_out = self.host.take_tier_out()
        self._set_tables(plan, pauses or None)
        return plan

    def _fork_children(self, seq: Sequence, n: int, plan: Plan) -> None:
        """When this chunk completes `seq`'s prompt, its samples fork from it (blocks: `_fork_blocks`)."""
        if not (seq.children and seq.num_computed + n == seq.num_tokens):
            return
        for child in seq.children:
            src, dst = self.kv_manager.fork(seq.slot, child.slot)
            plan.forks.append((child, seq))
            if src >= 0:
                plan.copies.append((src, dst))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Copy-on-write fork between steps (beam search; the paper's section 4.4): `child` takes a
        free slot, shares the parent's full blocks, gets its own copy of the partial tail block (the
        next plan carries the copy) and joins the running batch behind the parent."""
        child.slot = heapq.heappop(self.free_slot_ids)
        src, dst = self.kv_manager.fork(parent.slot, child.slot)
        if src >= 0:
            self._copies_pending.append((src, dst))
        child.status = Status.RUNNING
        self.running.insert(self.running.index(parent) + 1, child)

    def _set_tables(self, plan: Plan, pauses=None) -> None:
        """What the device reads of the pool: the rows' tables and mapped slots (a decode call's cut to `pauses`)."""
        slots = [s.slot for s, _ in plan.scheduled] + [c.slot for c, _ in plan.forks]
        plan.block_tables, plan.num_mapped = self.kv_manager.tables_for(slots, pauses)

    def reset_prefix_cache(self) -> bool:
        """KVCacheManager.reset_prefix_cache: False, changing nothing, while a request holds a block."""
        return self.kv_manager.reset_prefix_cache()

    def stats(self) -> dict:
        return dict(**self.kv_manager.stats(), num_preemptions=self.num_preemptions,
                    num_recomputed_tokens=self.num_recomputed_tokens,
                    num_requests_running=len(self.running), num_requests_waiting=len(self.waiting))

    def reset_counters(self) -> None:
        self.num_preemptions = self.num_recomputed_tokens = 0
        self.kv_manager.reset_counters()

    def _chunk(self, n, budget):
        return max(0, min(n, budget, self.long_prefill_token_threshold or n))

    def _fork_blocks(self, seq, n, computed=None):
        """Blocks the forks of `seq` take if this chunk completes its prompt: one each for a tail."""
        done = (seq.num_computed if computed is None else computed) + n == seq.num_tokens
        return len(seq.children) if (seq.children and done and seq.num_tokens % self.block_size) else 0

    def update_from_output(self, plan: Plan, output: ModelOutput) -> list[tuple[Sequence, int, int]]:
        """Every transition one device call causes: forked children joining, computed tokens, the
        sampled tokens appended, device stops (stop token, length), newly full blocks cached ->
        (seq, output row, new tokens) of each sequence that received tokens (finished ones too)."""
        for child, parent in plan.forks:
            child.status = Status.RUNNING
            self.running.append(child)
            parent.children = []
        progressed, ends = [], {1: [], 2: []}
        for row, (seq, n) in enumerate(plan.scheduled + [(child, None) for child, _ in plan.forks]):
            # Ended (max_tokens, max_model_len) when the next call was planned (AsyncScheduler).
            ended = seq.finished and plan.advanced and seq.token_ids[-1] == PENDING
            if seq.finished and not ended:  # finished while this call ran: what it sampled is discarded
                continue
            taken = int(np.sum(output.tokens[row] >= 0))
            if n is None:  # a forked child: the parent's computed prompt
                seq.num_computed = seq.num_tokens
            elif plan.advanced:  # applied when the next call was planned (AsyncScheduler)
                seq.drop_pending(taken, plan.is_decode or seq in plan.drafts)
            else:  # a decoding row's cache holds its last token and the drafts it accepted
                seq.num_computed += taken if plan.is_decode or seq in plan.drafts else n
            seq.token_ids += output.tokens[row, :taken].tolist()
            seq.token_logprobs += output.logprob[row, :taken].tolist()
            # Prompt chunks too (a request admitted next step can hit them), and after the new
            # tokens: a block the call filled with tokens it sampled is cached before a finish.
            self.kv_manager.cache_full_blocks(seq)
            if taken == 0:
                continue
            progressed.append((seq, row, taken))
            code = int(output.finish[row])
            if code == 1 and seq.token_ids[-1] in seq.request.params.stop_token_ids:
                seq.stop_reason = seq.token_ids[-1]
            if code == 1 and ended:
                seq.status = Status.FINISHED_STOPPED
            elif code:
                ends[code].append(seq)
        self.finish(ends[1], Status.FINISHED_STOPPED)
        self.finish(ends[2], Status.FINISHED_LENGTH)
        return progressed
