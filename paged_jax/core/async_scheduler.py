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

    def schedule_next(self, prev: Plan) -> Plan | None:
        """The call after `prev`, planned while `prev` runs: a decode call with no request waiting
        is continued on the device (`_continue_decode`); otherwise what `prev` does that the host
        can know is applied first (`Plan.advanced`): after a ragged step each row holds its chunk's
        tokens, whose full blocks enter the prefix cache now (vLLM caches a block when it is
        scheduled: a call that reads it runs after the one writing it), and a row whose chunk
        completes what is known gets its sampled token as PENDING; after a decode call each row
        holds PENDING tokens up to its reservation's end. A row whose PENDING tokens reach its
        max_tokens or max_model_len ends now. None when the next call is planned from `prev`'s
        output: a row waits for the host between tokens (`Plan.one_step`), `prev` forks or verifies
        proposals, forks made between steps wait for their copies, or the plan would preempt (the
        victim may be one of `prev`'s rows)."""
        if prev.one_step or prev.forks or prev.drafts or prev.stop_on_finish or self._copies_pending:
            return None
        if prev.is_decode and not self.waiting:
            return self._continue_decode(prev)
        ending = []
        for row, (seq, n) in enumerate(prev.scheduled):
            if seq.finished:
                continue
            if prev.is_decode:  # a row stops only where its reservation ends, or finishes
                n = int(prev.num_mapped[row]) - seq.num_computed
                seq.num_computed += n
                seq.token_ids += [PENDING] * n
            else:
                seq.num_computed += n
                self.kv_manager.cache_full_blocks(seq)  # before PENDING: a block's hash reads its tokens
                if seq.num_computed < seq.num_tokens:
                    continue
                seq.token_ids.append(PENDING)
            max_tokens = seq.request.params.max_tokens
            if (max_tokens is not None and seq.num_output >= max_tokens) or seq.num_tokens >= self.max_model_len:
                ending.append(seq)
        prev.advanced = True
        # Rows whose last PENDING token ends them end now, as the serial engine's do once `prev` is
        # processed, so this plan has their blocks and slots; processing `prev` fills the tokens in,
        # and makes the finish "stop" if one is a stop token.
        self.finish(ending, Status.FINISHED_LENGTH)
        return self.schedule(overlapped=True)

    def _continue_decode(self, prev: Plan) -> Plan | None:
        """The next decode call of a decode call's rows. A row of `prev` either finishes or runs to
        the end of its reservation, so a row that does not finish starts this call with exactly the
        tokens its table mapped. None when a row could not get a block for one more token."""
        kv = self.kv_manager
        rows = [(seq, kv.num_mapped(seq.slot)) for seq, _ in prev.scheduled if not seq.finished]
        for seq, mapped in rows:  # `prev` reads them before this call, which may reuse them, runs
            kv.remove_skipped_blocks(seq, mapped)
        steps = self.num_decode_steps  # a row's outputs when this call starts: num_output + mapped - num_computed
        rows = [(seq, m, seq.num_output + m - seq.num_computed) for seq, m in rows]
        rows = [row for row in rows if kv.lookahead_len(*row, steps) > row[1]]
        if not rows:
            return None
        seqs, computed, outputs = (list(column) for column in zip(*rows))
        if not kv.reserve_lookahead(seqs, computed, outputs, steps):
            return None
        plan = Plan(scheduled=list(prev.scheduled), is_decode=True, continues=True)
        plan.tier_out = self.host.take_tier_out()
        self._set_tables(plan)
        return plan
