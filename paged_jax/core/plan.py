"""`Plan`: what the scheduler decided for one device call (vLLM's SchedulerOutput): the rows and
their new tokens, the block tables the device reads, forks and copies, and host-memory traffic."""
from __future__ import annotations

import dataclasses

import numpy as np

from paged_jax.core.sequence import Sequence


@dataclasses.dataclass
class Plan:
    scheduled: list[tuple[Sequence, int]] = dataclasses.field(default_factory=list)  # (seq, new tokens)
    admitted: set[int] = dataclasses.field(default_factory=set)  # slots that joined the running batch
    forks: list[tuple[Sequence, Sequence]] = dataclasses.field(default_factory=list)  # (child, parent)
    copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (src, dst) tail blocks of forks
    # (src, dst) tail blocks of forks made between steps (Scheduler.fork), copied before the call
    copies_first: list[tuple[int, int]] = dataclasses.field(default_factory=list)
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
    # Speculative decoding: the proposals each decoding row verifies in this call (its scheduled
    # tokens are its last sampled one and these); empty in a call that verifies none.
    drafts: dict[Sequence, list[int]] = dataclasses.field(default_factory=dict)
    # Rows planned while the verification before ran, as if it accepted every draft they proposed
    # there (AsyncScheduler.schedule_next): the device moves them back by what it rejected, so the
    # call verifies (its program's shape) even where no row proposes.
    optimistic: set[Sequence] = dataclasses.field(default_factory=set)
    # A decode call leaves as soon as one row finishes, so that the requests waiting after this
    # plan are admitted then (serial scheduling only: AsyncScheduler plans from where rows end).
    stop_on_finish: bool = False

    # Decided when planned (the sequences move on after the call): only running sequences whose one
    # pending token is their last sampled one, so the device's K-step loop can run. A sequence still
    # in its prefill that the budget gives one token is not decoding: the loop would feed its last
    # token at the wrong position.
    is_decode: bool = False
    # A row's next token waits for the host (Request.one_step_per_call: beam search): the call runs
    # one step for it, and the engine processes its output before the next call is planned.
    one_step: bool = False
    # Overlapped scheduling: the rows' computed tokens and PENDING sampled ones were applied when
    # the next call was planned (AsyncScheduler.schedule_next); processing the output fills the rest.
    advanced: bool = False
    # A decode call that continues the decode call before it, its rows in the same order
    # (AsyncScheduler._continue_decode): the device builds its batch from that call's output.
    continues: bool = False

    @property
    def verifies(self) -> bool:
        return bool(self.drafts or self.optimistic)

    @property
    def host_loads(self) -> list[tuple[int, list[int], int]]:
        return self.swap_in + self.tier_in
