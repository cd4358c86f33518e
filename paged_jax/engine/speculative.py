"""Speculative decoding on the host: the controller that decides which rows speculate, and the
n-gram proposals it asks for (engine/ngram.py: vLLM's prompt lookup, every row at once; the
configuration: engine/spec_config.py).

A row's proposals ride in the scheduler's plan as extra tokens after its last sampled one, so the
verification is a ragged prefill row of 1 + k tokens (worker/rejection_sampler.py scores them and
keeps the accepted prefix); a rejected tail is rolled back by the scheduler's bookkeeping alone
(core/scheduler.py: only verified tokens count as computed). A draft model's proposals are made on
the device in the verifying call itself (worker/draft_proposer.py: k draft steps, then the target's
forward): the plan reserves their slots with a stand-in token, RESERVED_DRAFT, so with async
scheduling its verifications are planned while the call before runs (`propose_ahead`), as if that
call accepted every draft (AsyncScheduler.schedule_next). n-gram verifications are planned ahead
too, their rows' next tokens predicted (ngram.PromptLookup) and their stand-ins looked up by the
device in the true tokens (worker/ngram_proposer.py).

Speculation turns itself down where it does not pay (vLLM's does not): each sequence keeps a
running acceptance rate, starting from the engine's own so far; one whose proposals keep failing
stops proposing and decodes in the K-step loop, probing again as the rate recovers. And a call
verifies only when its expected tokens per second beat a plain decode step's, both timed on this
device as the engine runs (a verification of 1 + k tokens per row costs about one step where
reading the weights dominates, a GPU at small batch, but several on a CPU, whose cost follows the
tokens computed).
With n-gram speculation, rows with a grammar (structured output) propose the tokens their grammar
forces next, each position verified under the grammar's mask there (engine/structured_outputs.py).
"""
from __future__ import annotations

import numpy as np

from paged_jax.core.sequence import Sequence
from paged_jax.engine import ngram, stats
from paged_jax.engine.spec_config import SpeculativeConfig
from paged_jax.worker import batching

RATE_WEIGHT = 0.5  # how much one verification moves a sequence's acceptance rate
RATE_RECOVERY = 0.02  # per call it rests: the rate moves this share back toward 1 (a probe every ~4 calls)
PRIOR_WEIGHT = 0.1  # how much one verification moves the rate a new sequence starts from
MIN_EXPECTED_PER_ROW = 0.5  # expected accepted drafts per running row for a call to verify
COST_WEIGHT = 0.2  # how much one timed call moves the running cost of its kind
PROBE_STEPS = 2  # decode steps of a call while speculating rows look for a match
RESERVED_DRAFT = 0  # stands in the plan for a draft model's proposal, which the device writes
MAX_QUIET_CALLS = 3  # calls planned ahead of their tokens after proposing found nothing (overlapped scheduling)
AHEAD_WEIGHT = 0.2  # how much one row of an n-gram call planned ahead after a verification moves `ahead_gain`


class Speculator:
    """Which running rows propose, and what; fed back with each verification's acceptance."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, *, max_num_seqs: int,
                 max_num_batched_tokens: int, timed: bool = True):
        self.config, self.max_model_len = config, max_model_len
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        # Seconds per decode step by padded rows, per verification call by padded tokens (the
        # programs' shapes), from calls dispatched onto an idle device during which jax did not compile.
        self.costs: dict[tuple[str, int], float] = {}
        self._ahead = None  # (rows, `propose_ahead`'s proposals) until its plan runs or `propose` reads it
        self.prior = 1.0  # a new sequence's acceptance rate (`rate`): 1 until anything was verified
        # n-gram: drafts accepted per row in calls planned ahead after a verification, where rows
        # without drafts (none looked up in the host's prediction, or none found by the device in
        # the true tokens) count 0: such a call is never a K-step decode (`plans_ahead`).
        self.ahead_gain = float(config.num_speculative_tokens)
        self.lookup = ngram.PromptLookup(config.prompt_lookup_min, config.prompt_lookup_max)
        self._probing = False  # the last `propose` found rows to speculate but no match for any
        # Overlapped scheduling: proposing needs the last call's tokens, so a call is planned before
        # they are known only while speculation has nothing to verify: after each `propose` that
        # chose nothing, as many calls as such proposes in a row, up to MAX_QUIET_CALLS.
        self._num_quiet = self._quiet_calls = 0
        # Decide by the timed costs (else by the rows' acceptance alone): a multi-process engine's
        # processes must make the same calls, and their clocks differ.
        self.timed = timed
        self.constrain = None  # (seq, room) -> drafts: an n-gram engine's StructuredOutputManager.drafts
        stats.listen_for_compiles()
        self.reset_counters()

    def reset_counters(self) -> None:
        k = self.config.num_speculative_tokens
        self.counters = dict(spec_decode_num_drafts=0, spec_decode_num_draft_tokens=0,
                             spec_decode_num_accepted_tokens=0, spec_decode_num_accepted_tokens_per_pos=[0] * k)

    def propose(self, running: list[Sequence]) -> dict[Sequence, list[int]]:
        """The drafts of the decoding rows worth a verification call, or {} for a plain decode call.
        Rows that verify nothing this call move their rate back toward 1, so a resting row probes
        again after a while."""
        before, self._ahead = self._ahead, None
        # A draft model's proposal for a plan ahead that could not run holds for the same rows (its
        # rooms only grow); an n-gram one may have stand-ins, which only a call planned ahead fills.
        if before is not None and before[0] == set(running) and self.config.method == "draft_model":
            return before[1]
        c, found, rows, lookups = self.config, {}, [], {}
        for seq in running:
            if seq.num_tokens - seq.num_computed != 1 or not self._may_speculate(seq):
                continue
            rows.append(seq)
            params = seq.request.params
            room = min(c.num_speculative_tokens, self.max_model_len - seq.num_tokens - 1,
                       (params.max_tokens if params.max_tokens is not None else 1 << 30) - seq.num_output - 1)
            if not self._wants_to_propose(seq) or room < 1:
                continue
            if c.method == "draft_model":  # the draft model fills them in on the device, in the call
                found[seq] = [RESERVED_DRAFT] * room
            elif seq.request.params.structured_outputs is not None:  # what its grammar forces, if any
                drafts = self.constrain(seq, room)
                if drafts:
                    found[seq] = drafts
            else:
                lookups[seq] = room
        unmatched = self._look_up(lookups, found)
        chosen = found if found and self._worth_verifying(found, len(rows)) else {}
        self._rest([seq for seq in rows if seq not in chosen])
        # No row matched, but if they all had, verifying would pay: look again soon.
        self._probing = bool(unmatched) and not found and self._worth_probing(unmatched, len(rows))
        quiet = not chosen and not self._probing
        self._num_quiet = self._num_quiet + 1 if quiet else 0
        self._quiet_calls = min(self._num_quiet, MAX_QUIET_CALLS)
        return chosen

    def _look_up(self, rooms: dict[Sequence, int], found: dict[Sequence, list[int]]) -> dict[Sequence, list[int]]:
        """Prompt lookup for every row in `rooms` (up to its room of drafts) at once: the rows that
        matched go into `found` (as stand-ins where their tokens are PENDING: a call planned ahead,
        whose device looks them up in the true tokens) -> the rows that did not, each with its room
        of stand-in drafts."""
        unmatched = {}
        for seq, drafts in self.lookup.look_up(rooms).items():
            if drafts:
                found[seq] = [RESERVED_DRAFT] * len(drafts) if seq.num_pending else drafts
            else:
                unmatched[seq] = [RESERVED_DRAFT] * rooms[seq]
        return unmatched

    def rate(self, seq: Sequence) -> float:
        """A sequence's running acceptance rate; before its first verification, the rate of the
        engine's verifications so far (`prior`): requests of one workload propose alike, and a new
        one that starts at 1 verifies a free text's chance matches at a loss."""
        return self.prior if seq.spec_rate is None else seq.spec_rate

    def _rest(self, rows: list[Sequence]) -> None:
        for seq in rows:
            rate = self.rate(seq)
            seq.spec_rate = rate + (1.0 - rate) * RATE_RECOVERY

    @property
    def quiet(self) -> bool:
        """Whether the next call may be planned before the last one's tokens are known (overlapped
        scheduling): only after proposing chose nothing to verify and no probe, for as many calls as
        such proposes came in a row (at most MAX_QUIET_CALLS), so a row whose output starts to
        repeat is verified at most that many calls late."""
        return self._quiet_calls > 0

    def plans_ahead(self, prev, running: list[Sequence]) -> bool:
        """Whether the call after `prev` (dispatched, its tokens unknown) can be planned now though
        it may verify (`propose_ahead`), once a decode step and a verification of the running rows
        were timed (a call planned ahead is not: the device was busy when it was dispatched). A
        draft model's proposals are made on the device. n-gram: after a verification, unless a row
        that may propose was not looked up for it either (ngram.PromptLookup.unseen: its tokens
        were PENDING and not predicted), so no row goes two calls without a lookup; and only while
        such calls pay (`ahead_gain`): the rows' tokens assumed all accepted, the call is a
        verification even where the drafts do not come, and planned from the true tokens it may be
        a K-step decode. Declined, `ahead_gain` rests toward k as the rows' rates rest toward 1."""
        k, num_rows = self.config.num_speculative_tokens, len(running)
        step, verify = self.costs.get(self.step_key(num_rows)), self.costs.get(self.verify_key(num_rows * (1 + k)))
        if self.timed and (step is None or verify is None):
            return False
        if self.config.method != "ngram":
            return True
        if not prev.drafts or any(seq in self.lookup.unseen and self._wants_to_propose(seq) for seq in running):
            return False
        gain = self.ahead_gain * sum(map(self._may_speculate, running))
        pays = self._beats(gain, num_rows, step, verify) if self.timed else gain >= MIN_EXPECTED_PER_ROW * num_rows
        if not pays:
            self.ahead_gain += (k - self.ahead_gain) * RATE_RECOVERY
        return pays

    def _wants_to_propose(self, seq: Sequence) -> bool:
        return self._may_speculate(seq) and self.rate(seq) * self.config.num_speculative_tokens >= MIN_EXPECTED_PER_ROW

    def propose_ahead(self, running: list[Sequence]) -> dict[Sequence, list[int]]:
        """`propose` for a call planned before the last one's tokens are known (the rows hold them
        as PENDING, as if every draft was accepted: their rooms are no larger than they will be);
        a draft model's is kept for the next `propose` of the same rows unless `planned_ahead`
        says its plan ran."""
        chosen = self.propose(running)
        self._ahead = (set(running), chosen)
        return chosen

    def planned_ahead(self, running: list[Sequence]) -> None:
        """A call was planned ahead. Proposed for (`propose_ahead`): the proposal is used. Else it
        verifies nothing, so the rows' rates recover as in a call `propose` made without them."""
        if self._ahead is not None:
            self._ahead = None
            return
        self._quiet_calls -= 1
        self._rest([seq for seq in running if self._may_speculate(seq)])

    def _worth_probing(self, unmatched: dict[Sequence, list[int]], num_rows: int) -> bool:
        """Whether the rows, had they all matched, would have verified by the timed costs (both
        timed: a guess from the rates alone would shorten calls that never verify)."""
        if not self.timed:
            return self.expects_enough(unmatched, num_rows)
        step = self.costs.get(self.step_key(num_rows))
        verify = self.costs.get(self.verify_key(num_rows + sum(len(d) for d in unmatched.values())))
        return step is not None and verify is not None and self._beats(self._gain(unmatched), num_rows, step, verify)

    def limit_decode(self, plan) -> None:
        """A plain decode call planned while speculating rows found no match, though a match would
        have made a verification worth it, runs PROBE_STEPS steps (its rows' reservations cut
        there), not the K of the loop: an output that starts to repeat its context is verified a
        token or two later, not K."""
        if self._probing and plan.is_decode:
            ends = np.array([seq.num_tokens - 1 + PROBE_STEPS for seq, _ in plan.scheduled], np.int32)
            plan.num_mapped[: ends.size] = np.minimum(plan.num_mapped[: ends.size], ends)

    def _worth_verifying(self, found: dict[Sequence, list[int]], num_rows: int) -> bool:
        """Expected tokens per second of one verification call (each row's last token, its drafts
        times its rate) against a decode step's (one token per row), from the timed costs. Untimed
        yet: plain decode calls first (a step's cost is what speculation must beat), then a
        verification whenever the rows expect MIN_EXPECTED_PER_ROW accepted drafts each."""
        if not self.timed:
            return self.expects_enough(found, num_rows)
        step = self.costs.get(self.step_key(num_rows))
        if step is None:
            return False
        verify = self.costs.get(self.verify_key(num_rows + sum(len(d) for d in found.values())))
        if verify is None:
            return self.expects_enough(found, num_rows)
        return self._beats(self._gain(found), num_rows, step, verify)

    @staticmethod
    def _beats(gain: float, num_rows: int, step: float, verify: float) -> bool:
        """Whether a verification's expected tokens per second (`gain`: drafts accepted) beat a step's."""
        return (num_rows + gain) / verify >= num_rows / step

    def _gain(self, found: dict[Sequence, list[int]]) -> float:
        """Drafts the rows expect to have accepted: each row's rate times its drafts."""
        return sum(self.rate(seq) * len(d) for seq, d in found.items())

    def expects_enough(self, found: dict[Sequence, list[int]], num_rows: int) -> bool:
        """The rule without timed costs: MIN_EXPECTED_PER_ROW accepted drafts expected per row."""
        return self._gain(found) >= MIN_EXPECTED_PER_ROW * num_rows

    def step_key(self, num_rows: int) -> tuple[str, int]:
        return "step", batching.bucket(num_rows, self.max_num_seqs)

    def verify_key(self, num_tokens: int) -> tuple[str, int]:
        return "verify", batching.token_bucket(num_tokens, self.max_num_batched_tokens, verifying=True)

    def observe(self, key: tuple[str, int], seconds: float) -> None:
        """A timed call: a decode step (`step_key`) or a verification of decoding rows alone."""
        old = self.costs.get(key)
        self.costs[key] = seconds if old is None else old + COST_WEIGHT * (seconds - old)

    def _may_speculate(self, seq: Sequence) -> bool:
        """Not rows whose next token the host must see first (beam search), nor rows with a grammar
        unless `constrain` is set (n-gram: the host masks each position past their forced tokens)."""
        request = seq.request
        return self.constrain is not None if request.params.structured_outputs else not request.one_step_per_call

    def observe_call(self, plan, steps: int, seconds: float, compiles: int) -> None:
        """A call timed from its start on an idle device to its output, `compiles` jax's count when
        it started (none since, else its time is not a cost): a decode call's seconds per step, or a
        verification of decoding rows alone (a prefill chunk in the call would price it as well)."""
        if compiles != stats.num_compiles():
            return
        if plan.is_decode and steps:
            self.observe(self.step_key(len(plan.scheduled)), seconds / steps)
        elif plan.drafts and not (plan.admitted or plan.forks or plan.preempted) and all(
                n == 1 + len(plan.drafts.get(seq, ())) for seq, n in plan.scheduled):
            self.observe(self.verify_key(sum(n for _, n in plan.scheduled)), seconds)

    def record_call(self, plan, output, progressed) -> None:
        """A call's verifications: the rows that took its output (`progressed`: (seq, row, new
        tokens); a row finished while the call ran verified nothing) and had proposals; and an
        n-gram call's rows planned ahead after a verification (`ahead_gain`)."""
        for seq, row, _ in progressed:
            num_drafts = int(output.num_drafts[row]) if seq in plan.drafts else 0  # the device may find fewer
            accepted = int(output.num_accepted[row]) if num_drafts else 0
            if num_drafts:
                self.record(seq, num_drafts, accepted)
            if seq in plan.optimistic and self.config.method == "ngram" and self._may_speculate(seq):
                self.ahead_gain += AHEAD_WEIGHT * (accepted - self.ahead_gain)

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """One verification of `num_drafts` proposals of `seq`, the first `num_accepted` accepted."""
        k = self.counters
        k["spec_decode_num_drafts"] += 1
        k["spec_decode_num_draft_tokens"] += num_drafts
        k["spec_decode_num_accepted_tokens"] += num_accepted
        for pos in range(num_accepted):
            k["spec_decode_num_accepted_tokens_per_pos"][pos] += 1
        rate = self.rate(seq)
        seq.spec_rate = rate + RATE_WEIGHT * (num_accepted / num_drafts - rate)
        self.prior += PRIOR_WEIGHT * (num_accepted / num_drafts - self.prior)

    def stats(self) -> dict:
        k = self.counters
        drafts, tokens, accepted = (k["spec_decode_num_drafts"], k["spec_decode_num_draft_tokens"],
                                    k["spec_decode_num_accepted_tokens"])
        return dict(k, spec_decode_num_accepted_tokens_per_pos=list(k["spec_decode_num_accepted_tokens_per_pos"]),
                    spec_decode_acceptance_rate=accepted / max(tokens, 1),
                    # tokens each verification gave a row: its accepted drafts and the one sampled after
                    spec_decode_mean_accepted_length=1 + accepted / max(drafts, 1))
