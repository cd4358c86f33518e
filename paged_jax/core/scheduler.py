"""vLLM V1's scheduler (vllm/v1/core/sched/scheduler.py) on the host: no prefill or decode phase,
each sequence brings its computed tokens up to its tokens within a token budget, which covers
chunked prefill, prefix hits and resumption after preemption in one mechanism.

The scheduler plans each step's pool operations on a host mirror of the device pool
(`PoolMirror`, updated from the rows each device call returns) and the runner replays them in the
same order on the device, so they cannot fail there. One step is `schedule()`, the device call,
then `update_from_output(plan, output)`, which owns every transition the output causes.
"""
from __future__ import annotations

import collections
import dataclasses
import heapq

import numpy as np

from paged_jax.core.host_pool import HostBlockPool
from paged_jax.core.model_output import ModelOutput, PoolDelta
from paged_jax.core.pool_mirror import PoolMirror
from paged_jax.core.prefix_cache import PrefixCache, extend_block_hashes
from paged_jax.core.sequence import Sequence, Status


@dataclasses.dataclass
class Plan:
    scheduled: list[tuple[Sequence, int]] = dataclasses.field(default_factory=list)  # (seq, new tokens)
    admitted: dict[int, tuple[list[int], list[int]]] = dataclasses.field(default_factory=dict)  # slot -> hits, versions
    forks: list[tuple[Sequence, Sequence]] = dataclasses.field(default_factory=list)  # (child, parent)
    preempted: list[Sequence] = dataclasses.field(default_factory=list)
    free_slots: list[int] = dataclasses.field(default_factory=list)
    # Host memory: device -> host copies (device block, host block) of swapped victims and of
    # cached blocks this step evicts (the prefix cache's host tier), and host -> device loads (slot,
    # host block ids, the table entry the first fills) of resuming swapped slots and tier hits.
    swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    tier_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    swap_in: list[tuple[int, list[int], int]] = dataclasses.field(default_factory=list)
    tier_in: list[tuple[int, list[int], int]] = dataclasses.field(default_factory=list)
    marks: list[int] = dataclasses.field(default_factory=list)
    skips: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (slot, entries out of the window)
    free_blocks: int = 0  # the most blocks any freed slot held (the device's table width for the frees)
    num_waiting: int = 0  # requests still waiting after this plan (the decode loop leaves early for them)

    # Decided when planned (the sequences move on after the call): only running sequences whose one
    # pending token is their last sampled one, so the device's K-step loop can run. A sequence still
    # in its prefill that the budget gives one token is not decoding: the loop would feed its last
    # token at the wrong position.
    is_decode: bool = False

    @property
    def host_loads(self) -> list[tuple[int, list[int], int]]:
        return self.swap_in + self.tier_in


class Scheduler:
    def __init__(self, *, max_num_seqs, max_num_batched_tokens, block_size, num_blocks,
                 max_blocks_per_seq, long_prefill_token_threshold=0, prefix_cache=None, sliding_window=None,
                 host_pool: HostBlockPool | None = None, swap_preemption=False, host_tier=False,
                 num_decode_steps=1):
        """`sliding_window`: every layer's attention window (tokens), or None; with one, blocks that
        fall out of a sequence's window go back to the pool. With a `host_pool`: `swap_preemption`
        preempts by swapping the victim's blocks to it (vLLM V0's preemption_mode="swap"; else by
        recompute), and `host_tier` keeps the cached blocks the device evicts there, for prefix hits.
        `num_decode_steps`: the most tokens one decode call adds to a sequence."""
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.sliding_window = sliding_window
        self.prefix_cache = prefix_cache or PrefixCache(enabled=False)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.free_slot_ids = list(range(max_num_seqs))  # a heap: the lowest free slot first
        self.pending_free: list[int] = []  # slots of finished sequences, freed on the next call
        self.pending_free_blocks = 0
        self.pending_marks: list[int] = []  # blocks newly entered in the prefix cache
        self.host_pool = host_pool
        self.swap_preemption = swap_preemption and host_pool is not None
        self.host_tier = host_tier and host_pool is not None
        self.num_decode_steps = num_decode_steps
        self.num_preemptions = 0
        self.num_swap_preemptions = 0  # of those, by swapping
        self.num_swap_fallbacks = 0  # swap preemptions the full host pool turned into recomputes
        self.num_recomputed_tokens = 0  # tokens computed again after a recompute preemption
        self.num_tier_hit_tokens = 0  # prompt tokens whose KV a prefix hit copied back from the host tier
        self.pool = PoolMirror(num_blocks, block_size, max_num_seqs, max_blocks_per_seq)

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    def _blocks(self, n):
        return -(-n // self.block_size)

    # -- requests ------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, seq.request.cache_salt)
        self.waiting.append(seq)

    def finish(self, seq: Sequence, status: Status) -> None:
        """End a sequence (and its unforked children); its slot is freed on the next device call."""
        for s in [seq, *seq.children]:
            if s.finished:
                continue
            s.status = status
            if s in self.running:
                self.running.remove(s)
            if s in self.waiting:
                self.waiting.remove(s)
            if s.host_blocks:
                self.host_pool.free(s.host_blocks)
                s.host_blocks = []
            self._release_slot(s)
        seq.children = []

    def _release_slot(self, seq: Sequence) -> None:
        if seq.slot >= 0:
            self.pending_free_blocks = max(self.pending_free_blocks, self.pool.num_blocks_of(seq.slot))
            self.pool.release(seq.slot)
            self.pending_free.append(seq.slot)
            heapq.heappush(self.free_slot_ids, seq.slot)
            seq.slot = -1

    def take_slot(self) -> int:
        """The lowest free sequence slot, for a sequence that its caller runs outside the running
        list (beam search's beams); `finish` gives it back."""
        return heapq.heappop(self.free_slot_ids)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # -- one step ------------------------------------------------------------------------------

    def schedule(self) -> Plan:
        """Plan the next step on the mirror: frees since the last call, then vLLM's two passes."""
        plan = Plan(marks=self.pending_marks, free_slots=self.pending_free)
        self.pending_marks, self.pending_free = [], []
        ref, free = self.pool.ref, self.pool.num_free  # planned on, never written
        hit_refs: dict[int, int] = {}  # references this plan adds to prefix-hit blocks
        budget = self.max_num_batched_tokens
        num_new = 0  # blocks this step's call hands out from the free queue

        # Pass 1: running sequences in admission order; preempt from the back when blocks run out.
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            free += self._remove_skipped_blocks(seq, plan)
            n = self._chunk(seq.num_tokens - seq.num_computed, budget)
            if n == 0:
                i += 1
                continue
            need = self._blocks(seq.num_computed + n) - self.pool.num_blocks_of(seq.slot)
            need += self._fork_blocks(seq, n)
            while need > free and self.running:
                victim = self.running.pop()
                victim.host_blocks = self._swap_out(victim, plan)
                for s in [victim, *victim.children]:
                    if s.slot >= 0:
                        freed = self.pool.blocks_freed_by(s.slot)
                        self._release_slot(s)
                        plan.free_slots.append(self.pending_free.pop())
                        free += freed
                if not victim.host_blocks:  # recompute: its KV is dropped
                    victim.num_lost, victim.num_computed = victim.num_computed, 0
                victim.status, victim.num_cached_blocks = Status.WAITING, 0
                plan.preempted.append(victim)
                self.num_preemptions += 1
                if victim is seq:
                    break
            if seq.status == Status.WAITING:
                break
            plan.scheduled.append((seq, n))
            budget -= n
            free -= need
            num_new += need
            i += 1
        for victim in plan.preempted:  # the last preempted is first in line, as vLLM's prepend
            self.waiting.appendleft(victim)

        # Pass 2: waiting sequences in order, only if nothing was preempted this step.
        while self.waiting and budget > 0 and not plan.preempted:
            seq = self.waiting[0]
            if len(self.free_slot_ids) < 1 + len(seq.children):
                break
            swapped = bool(seq.host_blocks)  # resumes with the tokens its host blocks hold
            hits = self._prefix_hits(seq) if seq.num_computed == 0 else []
            tier = self._tier_hits(seq, len(hits)) if seq.num_computed == 0 else []
            cached = seq.num_computed if swapped else (len(hits) + len(tier)) * self.block_size
            n = self._chunk(seq.num_tokens - cached, budget)
            revived = sum(int(ref[b] + hit_refs.get(b, 0) == 0) for b, _ in hits)  # taken back from the free queue
            need = self._blocks(cached + n) - len(hits) + revived
            need += self._fork_blocks(seq, n, cached)
            if need > free:
                break
            self.waiting.popleft()
            for b, _ in hits:
                hit_refs[b] = hit_refs.get(b, 0) + 1
            free -= need
            num_new += need - revived
            budget -= n
            seq.slot = heapq.heappop(self.free_slot_ids)
            for child in seq.children:
                child.slot = heapq.heappop(self.free_slot_ids)
            seq.status, seq.num_computed, seq.prefill_end = Status.RUNNING, cached, seq.num_tokens
            if swapped:
                plan.swap_in.append((seq.slot, seq.host_blocks, 0))
                self.host_pool.free(seq.host_blocks)  # read by the runner before any later swap-out
                seq.host_blocks = []
            else:
                if tier:
                    plan.tier_in.append((seq.slot, tier, len(hits)))
                    self.num_tier_hit_tokens += len(tier) * self.block_size
                self.prefix_cache.record(seq.num_tokens, len(hits) * self.block_size)
                self.num_recomputed_tokens += max(0, seq.num_lost - cached)
                seq.num_lost = 0
            if seq.request.num_cached_tokens is None:
                seq.request.num_cached_tokens = cached
            plan.admitted[seq.slot] = ([b for b, _ in hits], [v for _, v in hits])
            plan.scheduled.append((seq, n))
            self.running.append(seq)

        for seq, n in plan.scheduled:
            if seq.children and seq.num_computed + n == seq.num_tokens:
                plan.forks += [(child, seq) for child in seq.children]
        plan.num_waiting = len(self.waiting)
        plan.is_decode = bool(plan.scheduled) and not (plan.admitted or plan.forks or plan.preempted) and all(
            n == 1 and seq.num_tokens - seq.num_computed == 1 for seq, n in plan.scheduled)
        plan.free_blocks, self.pending_free_blocks = self.pending_free_blocks, 0
        self.pool.settle()
        if self.host_tier:
            if plan.is_decode:  # the decode loop may run num_decode_steps tokens
                num_new = sum(self._blocks(seq.num_computed + self.num_decode_steps) - self.pool.num_blocks_of(seq.slot)
                              for seq, _ in plan.scheduled)
            self._tier_out(plan, num_new, {b for b in hit_refs if ref[b] == 0})
        return plan

    def _tier_out(self, plan: Plan, num_new: int, revived: set[int]) -> None:
        """The host tier keeps the cached blocks this step's hand-outs evict: each is copied to a
        host block before the step writes it (one that a swap-out of this plan copies anyway is
        gathered once: the runner gathers each device block once)."""
        for block in self.pool.next_evictions(num_new, revived):
            block_hash = self.prefix_cache.hash_of.get(block)
            host = None if block_hash is None else self.host_pool.store(block_hash)
            if host is not None:
                plan.tier_out.append((block, host))

    def _tier_hits(self, seq, num_device_hits: int) -> list[int]:
        """Host tier blocks continuing a prefix hit past the device's run (the tail of a chain is
        evicted first, so the device keeps the start); at most (num_tokens - 1) // bs in all."""
        if not self.host_tier or seq.request.params.prompt_logprobs is not None:
            return []
        end = (seq.num_tokens - 1) // self.block_size
        return self.host_pool.lookup(seq.block_hashes[num_device_hits:end])

    def _swap_out(self, victim: Sequence, plan: Plan) -> list[int]:
        """The victim's host blocks when it is preempted by swapping (its device -> host copies
        join the plan), or [] to recompute it: in recompute mode, when it has unforked children
        or a sliding window unmapped some of its blocks, and when the host pool is full (counted)."""
        if not self.swap_preemption or victim.children or self.sliding_window is not None or victim.num_computed == 0:
            return []
        blocks = self.pool.slot_blocks(victim.slot)
        host = self.host_pool.swap_out(blocks, self.pool.version[blocks], plan.swap_out)
        self.num_swap_preemptions += host is not None
        self.num_swap_fallbacks += host is None
        return host or []

    def reset_prefix_cache(self) -> None:
        """Every prefix-cache entry is gone, the host tier's too (no block may be held)."""
        self.prefix_cache.reset()
        self.pool.uncache_all()
        if self.host_tier:
            self.host_pool.reset_tier()

    def take_pool_ops(self) -> Plan:
        """Going idle: a plan of just the pending frees and cache marks."""
        plan = Plan(marks=self.pending_marks, free_slots=self.pending_free, free_blocks=self.pending_free_blocks)
        self.pending_marks, self.pending_free, self.pending_free_blocks = [], [], 0
        self.pool.settle()
        return plan

    def _remove_skipped_blocks(self, seq: Sequence, plan: Plan) -> int:
        """vLLM's SlidingWindowManager.remove_skipped_blocks: the next token (position num_computed)
        and every later one attend to positions > num_computed - window, so the blocks wholly before
        that go back to the pool (the table entry becomes the null block) -> blocks freed. A long
        generation then holds about window / block_size + 1 blocks, not its whole length."""
        if self.sliding_window is None:
            return 0
        skipped = max(0, seq.num_computed - self.sliding_window + 1) // self.block_size
        if skipped <= self.pool.skipped[seq.slot]:
            return 0
        plan.skips.append((seq.slot, skipped))
        return self.pool.remove_skipped(seq.slot, skipped)

    def _chunk(self, n, budget):
        if self.long_prefill_token_threshold > 0:
            n = min(n, self.long_prefill_token_threshold)
        return max(0, min(n, budget))

    def _fork_blocks(self, seq, n, computed=None):
        """Blocks the forks of `seq` take if this chunk completes its prompt: one each for a
        partial tail block."""
        done = (seq.num_computed if computed is None else computed) + n == seq.num_tokens
        return len(seq.children) if (seq.children and done and seq.num_tokens % self.block_size) else 0

    def _prefix_hits(self, seq) -> list[tuple[int, int]]:
        """Leading cached blocks (block, version); at most (num_tokens - 1) // bs, so a fully cached
        prompt still computes its last token for logits (vLLM). Every entry is current: the map
        drops one as soon as the device hands its block out again. A request asking for
        prompt_logprobs reads none (it needs every prompt token's logits; vLLM V1), but its blocks
        still enter the cache."""
        if seq.request.params.prompt_logprobs is not None:
            return []
        return self.prefix_cache.candidates(seq.block_hashes, (seq.num_tokens - 1) // self.block_size)

    def update_from_output(self, plan: Plan, output: ModelOutput) -> list[tuple[Sequence, int, int]]:
        """Every transition one device call causes: the pool mirror, forked children joining,
        computed tokens, the sampled tokens appended, device stops (stop token, length), and the
        newly full blocks entered in the prefix cache -> (seq, output row, new tokens) of each
        sequence that received tokens (finished ones included)."""
        self.apply_pool_delta(output.delta)
        for child, parent in plan.forks:
            child.status = Status.RUNNING
            self.running.append(child)
            parent.children = []
        row_of = {int(slot): i for i, slot in enumerate(output.delta.slots) if slot >= 0}
        progressed = []
        for seq in list(self.running):
            seq.num_computed = int(self.pool.lens[seq.slot])
            row = row_of.get(seq.slot)
            if row is None:
                continue
            taken = int(np.sum(output.tokens[row] >= 0))
            seq.token_ids += output.tokens[row, :taken].tolist()
            seq.token_logprobs += output.logprob[row, :taken].tolist()
            # Prompt chunks too (a request admitted next step can hit them), and after the new
            # tokens: a block the call filled with tokens it sampled is cached before a finish.
            self.cache_full_blocks(seq)
            if taken == 0:
                continue
            progressed.append((seq, row, taken))
            code = int(output.finish[row])
            if code == 1:
                if seq.token_ids[-1] in seq.request.params.stop_token_ids:
                    seq.stop_reason = seq.token_ids[-1]
                self.finish(seq, Status.FINISHED_STOPPED)
            elif code == 2:
                self.finish(seq, Status.FINISHED_LENGTH)
        return progressed

    def apply_pool_delta(self, delta: PoolDelta) -> None:
        """Mirror a device call's pool changes; the prefix cache forgets the blocks it handed out
        again (vLLM's `_maybe_evict_cached_block`)."""
        self.prefix_cache.evict(self.pool.apply(delta))

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Enter the sequence's computed full blocks in the prefix cache (prompt and output alike,
        so a follow-up turn that repeats the conversation hits)."""
        if not self.prefix_cache.enabled or seq.slot < 0:
            return
        extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, seq.request.cache_salt)
        full = min(seq.num_computed, seq.num_tokens) // self.block_size
        for i in range(seq.num_cached_blocks, full):
            block = int(self.pool.tables[seq.slot, i])
            if block > 0 and self.prefix_cache.insert(seq.block_hashes[i], block, int(self.pool.version[block])):
                self.pending_marks.append(block)
                self.pool.cached[block] = True
        seq.num_cached_blocks = max(seq.num_cached_blocks, full)
