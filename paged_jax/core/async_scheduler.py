"""vLLM's AsyncScheduler (vllm/v1/core/sched/async_scheduler.py): overlapped scheduling. While the
device runs call N, the host plans call N+1 from what it can know of N before N's output, then
processes N's output while N+1 runs; the device never waits for the host's planning.

What the host cannot know yet, the device fills: the token a row samples in N is PENDING in the
row's tokens on the host, and N+1 reads it from the device state (`DeviceState.last_sampled`); a
decode call continued from a decode call builds its whole batch on the device from N's output
(`runner.continue_decode`). A row that finishes in N (a stop token, max_tokens, a stop string
found on the host, an abort) is found when N is processed: what N+1 computes for it is discarded
and its blocks go back to the pool then, before any later call can reuse them (the device runs
calls in order). Outputs are the serial scheduler's.
"""
from __future__ import annotations

from paged_jax.core.plan import Plan
from paged_jax.core.scheduler import Scheduler
from paged_jax.core.sequence import PENDING, Status


class AsyncScheduler(Scheduler):
    # Decode calls run every row to its reservation's end (or its finish) even with requests
    # waiting, so the call after one is planned knowing where each row stands; a row that stops on
    # a stop token frees its slot when its call is processed, one call late (vLLM's async
    # scheduling has the same trade, a step late), and one that reaches max_tokens frees it when
    # the next call is planned.
    stops_for_waiting = False

    def schedule_next(self, prev: Plan, propose=None) -> Plan | None:
        """The call after `prev`, planned while `prev` runs: a decode call with no request waiting
        is continued on the device (`_continue_decode`); otherwise what `prev` does that the host
        can know is applied first (`Plan.advanced`): after a ragged step each row holds its chunk's
        tokens, whose full blocks enter the prefix cache now (vLLM caches a block when it is
        scheduled: a call that reads it runs after the one writing it), and a row whose chunk
        completes what is known gets its sampled token as PENDING; after a decode call each row
        holds PENDING tokens up to its reservation's end; a row verifying drafts holds them and its
        next token as PENDING, as if all were accepted (vLLM's async scheduling assumes the same),
        and the device moves it back by what it rejects (`Plan.optimistic`). A row whose PENDING
        tokens reach its max_tokens or max_model_len ends now. `propose`: speculation's proposals
        for the next plan, from the advanced rows (a draft model's, which the device makes; None:
        no row proposes). None when the next call is planned from `prev`'s output: a row waits for
        the host between tokens (`Plan.one_step`), `prev` forks or verifies without `propose`, a
        verifying row could end inside its drafts or has a sliding window (its blocks out of the
        window would go by the assumed length), forks made between steps wait for their copies,
        or the plan would preempt (the victim may be one of `prev`'s rows)."""
        if prev.one_step or prev.forks or prev.stop_on_finish or self._copies_pending:
            return None
        if prev.drafts and (propose is None or self.sliding_window is not None or any(
                self._may_end(seq, n) for seq, n in prev.scheduled if seq in prev.drafts)):
            return None
        if prev.is_decode and not self.waiting and propose is None:
            return self._continue_decode(prev)
        ending, optimistic = [], set()
        for row, (seq, n) in enumerate(prev.scheduled):
            if seq.finished:
                continue
            if prev.is_decode:  # a row stops only where its reservation ends, or finishes
                n = int(prev.num_mapped[row]) - seq.num_computed
                seq.num_computed += n
                seq.token_ids += [PENDING] * n
            elif seq in prev.drafts:  # its last token and drafts computed, all accepted
                seq.num_computed += n
                seq.token_ids += [PENDING] * n
                optimistic.add(seq)
            else:
                seq.num_computed += n
                self.kv_manager.cache_full_blocks(seq)  # before PENDING: a block's hash reads its tokens
                if seq.num_computed < seq.num_tokens:
                    continue
                seq.token_ids.append(PENDING)
            if self._may_end(seq, 0):
                ending.append(seq)
        prev.advanced = True
        # Rows whose last PENDING token ends them end now, as the serial engine's do once `prev` is
        # processed, so this plan has their blocks and slots; processing `prev` fills the tokens in,
        # and makes the finish "stop" if one is a stop token.
        self.finish(ending, Status.FINISHED_LENGTH)
        plan = self.schedule(propose(self.running) if propose else None, overlapped=True)
        if plan is not None:
            plan.optimistic = {seq for seq, _ in plan.scheduled if seq in optimistic}
            plan.is_decode = plan.is_decode and not plan.optimistic  # a verifying call moves them back
        return plan

    def _may_end(self, seq, n: int) -> bool:
        """Whether `seq` reaches its max_tokens or max_model_len with `n` more tokens."""
        max_tokens = seq.request.params.max_tokens
        return (max_tokens is not None and seq.num_output + n >= max_tokens) or seq.num_tokens + n >= self.max_model_len

    def _continue_decode(self, prev: Plan) -> Plan | None:
        """The next decode call of a decode call's rows. A row of `prev` either finishes or runs to
        where `prev` paused it (`Plan.num_mapped`), so a row that does not finish starts this call
        with exactly those tokens. None when a row could not get a block for one more token."""
        kv = self.kv_manager
        rows = [(seq, int(prev.num_mapped[i])) for i, (seq, _) in enumerate(prev.scheduled) if not seq.finished]
        for seq, mapped in rows:  # `prev` reads them before this call, which may reuse them, runs
            kv.remove_skipped_blocks(seq, mapped)
        steps = self.num_decode_steps  # a row's outputs when this call starts: num_output + mapped - num_computed
        rows = [(seq, m, seq.num_output + m - seq.num_computed) for seq, m in rows]
        rows = [row for row in rows if kv.lookahead_len(*row, steps) > row[1]]
        if not rows:
            return None
        seqs, computed, outputs = (list(column) for column in zip(*rows))
        pauses = kv.reserve_lookahead(seqs, computed, outputs, steps)
        if pauses is None:
            return None
        plan = Plan(scheduled=list(prev.scheduled), is_decode=True, continues=True)
        plan.tier_out = self.host.take_tier_out()
        at = dict(zip(seqs, pauses))  # a row that cannot run (finished, or at its end) stays where it is
        self._set_tables(plan, [at.get(seq, int(m)) for (seq, _), m in zip(prev.scheduled, prev.num_mapped)])
        return plan
