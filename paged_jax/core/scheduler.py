"""vLLM V1's scheduler (vllm/v1/core/sched/scheduler.py) on the host: no prefill or decode phase,
each sequence brings its computed tokens up to its tokens within a token budget, which covers
chunked prefill, prefix hits and resumption after preemption in one mechanism.

The device pool is mirrored from the snapshot that every device call returns (block tables and
their versions, free count); the scheduler plans the step's pool operations on that mirror, and
the runner replays them in the same order on the device, so they cannot fail there.
"""
from __future__ import annotations

import collections
import dataclasses

import numpy as np

from paged_jax.core.prefix_cache import PrefixCache, extend_block_hashes
from paged_jax.core.sequence import Sequence, Status


@dataclasses.dataclass
class Plan:
    scheduled: list[tuple[Sequence, int]] = dataclasses.field(default_factory=list)  # (seq, new tokens)
    admitted: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # slot -> prefix-hit blocks
    forks: list[tuple[Sequence, Sequence]] = dataclasses.field(default_factory=list)  # (child, parent)
    preempted: list[Sequence] = dataclasses.field(default_factory=list)
    free_slots: list[int] = dataclasses.field(default_factory=list)
    marks: list[int] = dataclasses.field(default_factory=list)

    @property
    def is_decode(self) -> bool:
        """Only running sequences with one pending token each: the device's K-step loop can run."""
        return (not self.admitted and not self.forks and not self.preempted
                and all(n == 1 for _, n in self.scheduled))


class Scheduler:
    def __init__(self, *, max_num_seqs, max_num_batched_tokens, block_size, num_blocks,
                 max_blocks_per_seq, long_prefill_token_threshold=0, prefix_cache=None):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.prefix_cache = prefix_cache or PrefixCache(enabled=False)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.free_slot_ids = list(range(max_num_seqs))
        self.pending_free: list[int] = []  # slots of finished sequences, freed on the next call
        self.pending_marks: list[int] = []  # blocks newly entered in the prefix cache
        self.num_preemptions = 0
        self.observe(dict(block_tables=np.zeros((max_num_seqs, max_blocks_per_seq), np.int32),
                          seq_lens=np.zeros(max_num_seqs, np.int32),
                          table_versions=np.zeros((max_num_seqs, max_blocks_per_seq), np.int32),
                          num_free=num_blocks - 1))

    # -- the mirror of the device pool ---------------------------------------------------------

    def observe(self, snapshot) -> None:
        """Take the pool state a device call returned."""
        self.tables = np.asarray(snapshot["block_tables"])
        self.lens = np.asarray(snapshot["seq_lens"])
        self.table_versions = np.asarray(snapshot["table_versions"])
        self.num_free = int(snapshot["num_free"])

    def _blocks(self, n):
        return -(-n // self.block_size)

    def slot_blocks(self, slot) -> np.ndarray:
        return self.tables[slot, : self._blocks(int(self.lens[slot]))]

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
            self._release_slot(s)
        seq.children = []

    def _release_slot(self, seq: Sequence) -> None:
        if seq.slot >= 0:
            self.pending_free.append(seq.slot)
            self.free_slot_ids.append(seq.slot)
            self.free_slot_ids.sort()
            seq.slot = -1

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # -- one step ------------------------------------------------------------------------------

    def schedule(self, block_versions) -> Plan:
        """Plan the next step. `block_versions(ids) -> versions` reads the pool's block versions
        (a small device gather) to check prefix-cache entries."""
        plan = Plan(marks=self.pending_marks, free_slots=self.pending_free)
        self.pending_marks, self.pending_free = [], []
        mapped = np.arange(self.tables.shape[1])[None, :] < self._blocks(self.lens)[:, None]
        ref = np.bincount(self.tables[mapped], minlength=self.num_blocks)
        free = self.num_free

        def release(slot):
            nonlocal free
            for b in self.slot_blocks(slot):
                ref[b] -= 1
                free += int(ref[b] == 0)

        for slot in plan.free_slots:
            release(slot)
        budget = self.max_num_batched_tokens

        # Pass 1: running sequences in admission order; preempt from the back when blocks run out.
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            n = self._chunk(seq.num_tokens - seq.num_computed, budget)
            if n == 0:
                i += 1
                continue
            need = self._blocks(seq.num_computed + n) - self._blocks(int(self.lens[seq.slot]))
            need += self._fork_blocks(seq, n)
            while need > free and self.running:
                victim = self.running.pop()
                for s in [victim, *victim.children]:
                    if s.slot >= 0:
                        release(s.slot)
                        plan.free_slots.append(s.slot)
                        self.free_slot_ids.append(s.slot)
                        s.slot = -1
                self.free_slot_ids.sort()
                victim.status, victim.num_computed, victim.num_cached_blocks = Status.WAITING, 0, 0
                plan.preempted.append(victim)
                self.num_preemptions += 1
                if victim is seq:
                    break
            if seq.status == Status.WAITING:
                break
            plan.scheduled.append((seq, n))
            budget -= n
            free -= need
            i += 1
        for victim in plan.preempted:  # the last preempted is first in line, as vLLM's prepend
            self.waiting.appendleft(victim)

        # Pass 2: waiting sequences in order, only if nothing was preempted this step.
        while self.waiting and budget > 0 and not plan.preempted:
            seq = self.waiting[0]
            if len(self.free_slot_ids) < 1 + len(seq.children):
                break
            hits = self._prefix_hits(seq, block_versions) if seq.num_computed == 0 else []
            cached = len(hits) * self.block_size
            n = self._chunk(seq.num_tokens - cached, budget)
            need = self._blocks(cached + n) - len(hits) + sum(int(ref[b] == 0) for b in hits)
            need += self._fork_blocks(seq, n, cached)
            if need > free:
                break
            self.waiting.popleft()
            for b in hits:
                ref[b] += 1
            free -= need
            budget -= n
            seq.slot = self.free_slot_ids.pop(0)
            for child in seq.children:
                child.slot = self.free_slot_ids.pop(0)
            seq.status, seq.num_computed, seq.prefill_end = Status.RUNNING, cached, seq.num_tokens
            self.prefix_cache.record(seq.num_tokens, cached)
            if seq.request.num_cached_tokens is None:
                seq.request.num_cached_tokens = cached
            plan.admitted[seq.slot] = hits
            plan.scheduled.append((seq, n))
            self.running.append(seq)

        for seq, n in plan.scheduled:
            if seq.children and seq.num_computed + n == seq.num_tokens:
                plan.forks += [(child, seq) for child in seq.children]
        return plan

    def _chunk(self, n, budget):
        if self.long_prefill_token_threshold > 0:
            n = min(n, self.long_prefill_token_threshold)
        return max(0, min(n, budget))

    def _fork_blocks(self, seq, n, computed=None):
        """Blocks the forks of `seq` take if this chunk completes its prompt: one each for a
        partial tail block."""
        done = (seq.num_computed if computed is None else computed) + n == seq.num_tokens
        return len(seq.children) if (seq.children and done and seq.num_tokens % self.block_size) else 0

    def _prefix_hits(self, seq, block_versions) -> list[int]:
        """Leading cached blocks whose entries are still current; at most (num_tokens - 1) // bs,
        so a fully cached prompt still computes its last token for logits (vLLM)."""
        entries = self.prefix_cache.candidates(seq.block_hashes, (seq.num_tokens - 1) // self.block_size)
        if not entries:
            return []
        ids = np.array([b for b, _ in entries], np.int32)
        current = np.asarray(block_versions(ids)) == np.array([v for _, v in entries])
        count = len(entries) if current.all() else int(np.argmin(current))
        return ids[:count].tolist()

    def after_step(self, plan: Plan) -> None:
        """Forked children join the running sequences; every running sequence's computed tokens
        are what the device pool now maps for its slot."""
        for child, parent in plan.forks:
            child.status = Status.RUNNING
            self.running.append(child)
            parent.children = []
        for seq in self.running:
            seq.num_computed = int(self.lens[seq.slot])

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Enter the sequence's computed full blocks in the prefix cache (prompt and output alike,
        so a follow-up turn that repeats the conversation hits)."""
        if not self.prefix_cache.enabled or seq.slot < 0:
            return
        extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, seq.request.cache_salt)
        full = min(seq.num_computed, seq.num_tokens) // self.block_size
        for i in range(seq.num_cached_blocks, full):
            block, version = int(self.tables[seq.slot, i]), int(self.table_versions[seq.slot, i])
            if self.prefix_cache.insert(seq.block_hashes[i], block, version):
                self.pending_marks.append(block)
        seq.num_cached_blocks = max(seq.num_cached_blocks, full)
