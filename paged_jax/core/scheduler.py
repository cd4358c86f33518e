"""vLLM V1's scheduler (vllm/v1/core/sched/scheduler.py) on the host: no prefill or decode phase,
each sequence brings its computed tokens up to its tokens within a token budget, which covers
chunked prefill, prefix hits and resumption after preemption in one mechanism.

The scheduler owns the block pool (`KVCacheManager`, on the host): it allocates, shares, forks and
frees as it plans, and the device receives only the block tables of each call's rows. A decode call
runs up to `num_decode_steps` tokens per row, so before it the scheduler reserves the blocks those
tokens need (vLLM's lookahead slots); a row that finishes gives its blocks back at once. One step
is `schedule()`, the device call, then `update_from_output(plan, output)`, which owns every
transition the output causes.
"""
from __future__ import annotations

import collections
import dataclasses
import heapq

import numpy as np

from paged_jax.core.host_pool import HostBlockPool
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.model_output import ModelOutput
from paged_jax.core.prefix_cache import PrefixCache, extend_block_hashes
from paged_jax.core.sequence import Sequence, Status


@dataclasses.dataclass
class Plan:
    scheduled: list[tuple[Sequence, int]] = dataclasses.field(default_factory=list)  # (seq, new tokens)
    admitted: set[int] = dataclasses.field(default_factory=set)  # slots that joined the running batch
    forks: list[tuple[Sequence, Sequence]] = dataclasses.field(default_factory=list)  # (child, parent)
    copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (src, dst) tail blocks of forks
    preempted: list[Sequence] = dataclasses.field(default_factory=list)
    # i32[rows, width]: the block tables of the call's rows (scheduled, then forked children), as
    # wide as the widest row's mapped blocks (lookahead included); what the device reads of the pool.
    block_tables: np.ndarray | None = None
    num_mapped: np.ndarray | None = None  # i32[rows]: token slots each row's table maps
    # Host memory: device -> host copies (device block, host block) of swapped victims and of
    # cached blocks this step evicts (the prefix cache's host tier), and host -> device loads (slot,
    # host block ids, the table entry the first fills) of resuming swapped slots and tier hits.
    swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    tier_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    swap_in: list[tuple[int, list[int], int]] = dataclasses.field(default_factory=list)
    tier_in: list[tuple[int, list[int], int]] = dataclasses.field(default_factory=list)
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
        self.host_pool = host_pool
        self.swap_preemption = swap_preemption and host_pool is not None
        self.host_tier = host_tier and host_pool is not None
        self.num_decode_steps = num_decode_steps
        self.num_preemptions = 0
        self.num_swap_preemptions = 0  # of those, by swapping
        self.num_swap_fallbacks = 0  # swap preemptions the full host pool turned into recomputes
        self.num_recomputed_tokens = 0  # tokens computed again after a recompute preemption
        self.num_tier_hit_tokens = 0  # prompt tokens whose KV a prefix hit copied back from the host tier
        self.kv_manager = KVCacheManager(num_blocks, block_size, max_num_seqs, max_blocks_per_seq)
        self._tier_out_pending: list[tuple[int, int]] = []  # evictions since the last plan, to copy out

    @property
    def num_free(self) -> int:
        return self.kv_manager.num_free

    def _blocks(self, n):
        return -(-n // self.block_size)

    # -- requests ------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, seq.request.cache_salt)
        self.waiting.append(seq)

    def finish(self, seq: Sequence, status: Status) -> None:
        """End a sequence (and its unforked children); its blocks go back to the pool at once."""
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
            self.kv_manager.free([seq.slot])
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

    def _allocate(self, seqs: list[Sequence], new_lens: list[int]) -> None:
        """Grow the sequences' slots; the cached blocks handed out lose their prefix-cache entries
        (the host tier keeps a copy of each first)."""
        if self.host_tier:
            self._tier_out_pending += self._tier_copies(self.kv_manager.next_evictions(
                sum(max(0, self._blocks(n) - self.kv_manager.num_blocks_of(s.slot)) for s, n in zip(seqs, new_lens))))
        self.prefix_cache.evict(self.kv_manager.allocate([s.slot for s in seqs], new_lens))

    def _lookahead_len(self, seq: Sequence, computed: int, num_output: int) -> int:
        """Token slots a decoding row can use in one decode call that starts with `computed` tokens
        in the cache and `num_output` sampled: num_decode_steps more (fewer near its max_tokens),
        within the longest table."""
        steps = self.num_decode_steps
        if seq.request.params.max_tokens is not None:
            steps = min(steps, seq.request.params.max_tokens - num_output)
        return min(computed + max(steps, 0), self.kv_manager.pool.max_seq_len)

    def _reserve_lookahead(self, seqs: list[Sequence], computed: list[int], num_output: list[int]) -> bool:
        """vLLM's lookahead slots: before a decode call every row gets the blocks of the tokens the
        call may add: the most steps J (up to num_decode_steps) whose blocks all rows can have at
        once; each row pauses at its J-th token (the call stops it there). No row is preempted for
        lookahead: preemption happens exactly when a row cannot get its next token's block, and
        the call then stops where the pool ran dry, as the in-loop allocation it replaces did.
        -> whether every row that can still run got at least one step."""
        kv = self.kv_manager
        ends = [self._lookahead_len(seq, c, o) for seq, c, o in zip(seqs, computed, num_output)]
        mapped = [kv.num_mapped(seq.slot) for seq in seqs]
        have = [self._blocks(m) for m in mapped]

        def targets(steps):
            return [max(min(c + steps, end), m) for c, end, m in zip(computed, ends, mapped)]

        def need(steps):
            return sum(max(0, self._blocks(t) - h) for t, h in zip(targets(steps), have))

        if need(1) > kv.num_free:
            return False
        steps = 1
        while steps < self.num_decode_steps and need(steps + 1) <= kv.num_free:
            steps += 1
        self._allocate(seqs, targets(steps))
        return True

    def schedule_continuation(self, prev: Plan) -> Plan | None:
        """Overlapped scheduling (vLLM's async scheduling): the next decode call of `prev`'s rows,
        planned while `prev` runs, before its output is known. A row of `prev` either finishes or
        runs to the end of its reservation, so a row that does not finish starts this call with
        exactly the tokens its table mapped; one that finishes is found when `prev`'s output is
        processed, and what this call gave it is discarded. None when the next step should be
        planned from `prev`'s output instead: requests wait to be admitted, or a row could not get
        a block for one more token (preemption decides then)."""
        if not prev.is_decode or self.waiting:
            return None
        kv = self.kv_manager
        rows = [(seq, kv.num_mapped(seq.slot)) for seq, _ in prev.scheduled if not seq.finished]
        for seq, mapped in rows:  # `prev` reads them before this call, which may reuse them, runs
            self._remove_skipped_blocks(seq, mapped)
        rows = [(seq, mapped) for seq, mapped in rows
                if self._lookahead_len(seq, mapped, seq.num_output + mapped - seq.num_computed) > mapped]
        if not rows:
            return None
        seqs = [seq for seq, _ in rows]
        if not self._reserve_lookahead(seqs, [m for _, m in rows],
                                       [seq.num_output + m - seq.num_computed for seq, m in rows]):
            return None
        plan = Plan(scheduled=list(prev.scheduled), is_decode=True)
        plan.tier_out, self._tier_out_pending = self._tier_out_pending, []
        self._set_tables(plan)
        return plan

    def schedule(self) -> Plan:
        """Plan the next step and apply its pool operations: vLLM's two passes."""
        plan = Plan()
        budget = self.max_num_batched_tokens
        kv = self.kv_manager

        # Pass 1: running sequences in admission order; preempt from the back when blocks run out.
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            self._remove_skipped_blocks(seq)
            n = self._chunk(seq.num_tokens - seq.num_computed, budget)
            if n == 0:
                i += 1
                continue
            target = max(seq.num_computed + n, kv.num_mapped(seq.slot))
            need = self._blocks(target) - kv.num_blocks_of(seq.slot) + self._fork_blocks(seq, n)
            while need > kv.num_free and self.running:
                victim = self.running.pop()
                victim.host_blocks = self._swap_out(victim, plan)
                for s in [victim, *victim.children]:
                    self._release_slot(s)
                if not victim.host_blocks:  # recompute: its KV is dropped
                    victim.num_lost, victim.num_computed = victim.num_computed, 0
                victim.status, victim.num_cached_blocks = Status.WAITING, 0
                plan.preempted.append(victim)
                self.num_preemptions += 1
                if victim is seq:
                    break
            if seq.status == Status.WAITING:
                break
            self._allocate([seq], [target])
            self._fork_children(seq, n, plan)
            plan.scheduled.append((seq, n))
            budget -= n
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
            revived = sum(int(kv.ref(b) == 0) for b, _ in hits)  # taken back from the free queue
            need = self._blocks(cached + n) - len(hits) + revived + self._fork_blocks(seq, n, cached)
            if need > kv.num_free:
                break
            self.waiting.popleft()
            budget -= n
            seq.slot = heapq.heappop(self.free_slot_ids)
            for child in seq.children:
                child.slot = heapq.heappop(self.free_slot_ids)
            kv.share(seq.slot, [b for b, _ in hits], [v for _, v in hits])
            seq.status, seq.num_computed, seq.prefill_end = Status.RUNNING, cached, seq.num_tokens
            self._allocate([seq], [cached + n])
            self._fork_children(seq, n, plan)
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
            plan.admitted.add(seq.slot)
            plan.scheduled.append((seq, n))
            self.running.append(seq)

        if not plan.scheduled and self.waiting:  # nothing runs and nothing will free a block
            stuck = self.waiting[0].request.request_id
            raise RuntimeError(f"internal error: nothing can run, request {stuck!r} waits forever")
        plan.num_waiting = len(self.waiting)
        plan.is_decode = bool(plan.scheduled) and not (plan.admitted or plan.forks or plan.preempted) and all(
            n == 1 and seq.num_tokens - seq.num_computed == 1 for seq, n in plan.scheduled)
        if plan.is_decode:
            seqs = [seq for seq, _ in plan.scheduled]
            self._reserve_lookahead(seqs, [s.num_computed for s in seqs], [s.num_output for s in seqs])
        plan.tier_out, self._tier_out_pending = self._tier_out_pending, []
        self._set_tables(plan)
        return plan

    def _fork_children(self, seq: Sequence, n: int, plan: Plan) -> None:
        """When this chunk completes the prompt of `seq`, its parallel samples fork from it now (the
        blocks `_fork_blocks` counted), before a later admission can take them."""
        if not (seq.children and seq.num_computed + n == seq.num_tokens):
            return
        for child in seq.children:
            if seq.num_tokens % self.block_size:  # the child's copy of the tail takes a block
                if self.host_tier:
                    self._tier_out_pending += self._tier_copies(self.kv_manager.next_evictions(1))
                self.prefix_cache.evict(self.kv_manager.next_evictions(1))
            src, dst = self.kv_manager.fork(seq.slot, child.slot)
            plan.forks.append((child, seq))
            if src >= 0:
                plan.copies.append((src, dst))

    def reserve(self, plan: Plan) -> None:
        """For a caller that plans its own rows (beam search, whose pool is sized for its worst
        case): map what each scheduled row computes and set the plan's block tables."""
        seqs = [s for s, _ in plan.scheduled]
        self._allocate(seqs, [max(s.num_computed + n, self.kv_manager.num_mapped(s.slot)) for s, n in plan.scheduled])
        if plan.is_decode:
            self._reserve_lookahead(seqs, [s.num_computed for s in seqs], [s.num_output for s in seqs])
        self._set_tables(plan)

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int]:
        """Copy-on-write fork between steps (beam search) -> (copy_src, copy_dst) of the tail block."""
        if parent.num_tokens % self.block_size:
            self.prefix_cache.evict(self.kv_manager.next_evictions(1))
        return self.kv_manager.fork(parent.slot, child.slot)

    def _set_tables(self, plan: Plan) -> None:
        """What the device reads of the pool: the rows' tables, as wide as the most blocks one maps,
        and their mapped token slots (a decode row stops there)."""
        slots = np.array([s.slot for s, _ in plan.scheduled] + [c.slot for c, _ in plan.forks], np.int32)
        plan.num_mapped = np.where(slots >= 0, self.kv_manager.pool.seq_lens[slots], 0).astype(np.int32)  # -1: finished
        plan.block_tables = self.kv_manager.tables(slots, max(self._blocks(int(plan.num_mapped.max(initial=0))), 1))

    def _tier_copies(self, evicted: list[int]) -> list[tuple[int, int]]:
        """The host tier keeps the cached blocks a hand-out evicts: each is copied to a host block
        before the step writes it (one that a swap-out of this plan copies anyway is gathered once:
        the runner gathers each device block once) -> (device block, host block) pairs."""
        copies = []
        for block in evicted:
            block_hash = self.prefix_cache.hash_of.get(block)
            host = None if block_hash is None else self.host_pool.store(block_hash)
            if host is not None:
                copies.append((block, host))
        return copies

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
        blocks = self.kv_manager.blocks_of(victim.slot)[: self._blocks(victim.num_computed)]
        host = self.host_pool.swap_out(blocks, self.kv_manager.version(blocks), plan.swap_out)
        self.num_swap_preemptions += host is not None
        self.num_swap_fallbacks += host is None
        return host or []

    def reset_prefix_cache(self) -> bool:
        """Forget every prefix-cache entry, the host tier's too; False, changing nothing, while any
        block is held by a request."""
        if self.kv_manager.num_free != self.num_blocks - 1:
            return False
        self.prefix_cache.reset()
        self.kv_manager.uncache_all()
        if self.host_tier:
            self.host_pool.reset_tier()
        return True

    def stats(self) -> dict:
        """The pool's, the prefix cache's and the queues' numbers (LLMEngine.stats reports them)."""
        used, usable, cache = self.num_blocks - 1 - self.num_free, self.num_blocks - 1, self.prefix_cache
        return dict(kv_cache_usage=used / usable, num_blocks_used=used,
                    prefix_cache_queries=cache.queries, prefix_cache_hits=cache.hits,
                    prefix_cache_hit_rate=cache.hits / max(cache.queries, 1),
                    num_preemptions=self.num_preemptions, num_swap_preemptions=self.num_swap_preemptions,
                    num_swap_fallbacks=self.num_swap_fallbacks, num_recomputed_tokens=self.num_recomputed_tokens,
                    host_kv_usage=self.host_pool.usage() if self.host_pool else 0.0,
                    host_prefix_cache_hits=self.num_tier_hit_tokens,
                    num_requests_running=len(self.running), num_requests_waiting=len(self.waiting))

    def reset_counters(self) -> None:
        self.prefix_cache.queries = self.prefix_cache.hits = 0
        self.num_preemptions = self.num_swap_preemptions = self.num_swap_fallbacks = 0
        self.num_recomputed_tokens = self.num_tier_hit_tokens = 0

    def _remove_skipped_blocks(self, seq: Sequence, computed: int | None = None) -> None:
        """vLLM's SlidingWindowManager.remove_skipped_blocks: the next token (position num_computed)
        and every later one attend to positions > num_computed - window, so the blocks wholly before
        that go back to the pool (the table entry becomes the null block). A long generation then
        holds about window / block_size + 1 blocks, not its whole length. `computed`: the tokens it
        will have in the cache when the next call starts (an overlapped call), else num_computed."""
        if self.sliding_window is None:
            return
        computed = seq.num_computed if computed is None else computed
        skipped = max(0, computed - self.sliding_window + 1) // self.block_size
        if skipped > self.kv_manager.num_skipped(seq.slot):
            self.kv_manager.remove_skipped(seq.slot, skipped)

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
        drops one as soon as the pool hands its block out again. A request asking for
        prompt_logprobs reads none (it needs every prompt token's logits; vLLM V1), but its blocks
        still enter the cache."""
        if seq.request.params.prompt_logprobs is not None:
            return []
        return self.prefix_cache.candidates(seq.block_hashes, (seq.num_tokens - 1) // self.block_size)

    def update_from_output(self, plan: Plan, output: ModelOutput) -> list[tuple[Sequence, int, int]]:
        """Every transition one device call causes: forked children joining, computed tokens, the
        sampled tokens appended, device stops (stop token, length), and the newly full blocks
        entered in the prefix cache -> (seq, output row, new tokens) of each sequence that received
        tokens (finished ones included)."""
        rows = [(seq, n) for seq, n in plan.scheduled]
        for child, parent in plan.forks:
            child.status = Status.RUNNING
            self.running.append(child)
            parent.children = []
        progressed = []
        for row, (seq, n) in enumerate(rows + [(child, None) for child, _ in plan.forks]):
            if seq.finished:  # finished while this overlapped call ran: what it sampled is discarded
                continue
            taken = int(np.sum(output.tokens[row] >= 0))
            if n is None:  # a forked child: the parent's computed prompt
                seq.num_computed = seq.num_tokens
            else:
                seq.num_computed += taken if plan.is_decode else n
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

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Enter the sequence's computed full blocks in the prefix cache (prompt and output alike,
        so a follow-up turn that repeats the conversation hits)."""
        if not self.prefix_cache.enabled or seq.slot < 0:
            return
        extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, seq.request.cache_salt)
        full = min(seq.num_computed, seq.num_tokens) // self.block_size
        table = self.kv_manager.pool.block_tables[seq.slot]
        marks = []
        for i in range(seq.num_cached_blocks, full):
            block = int(table[i])
            if block > 0 and self.prefix_cache.insert(seq.block_hashes[i], block, int(self.kv_manager.version(block))):
                marks.append(block)
        self.kv_manager.mark_cached(marks)
        seq.num_cached_blocks = max(seq.num_cached_blocks, full)
