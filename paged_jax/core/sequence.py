"""Host-side request state: a `Request` (what the user asked for) holds `Sequence`s, one per sample
(`n` of them; vLLM's parallel sampling), each with its own tokens, slot and status."""
from __future__ import annotations

import dataclasses
import enum

import numpy as np

from paged_jax.lora.request import LoRARequest
from paged_jax.sampling_params import SamplingParams


# A token an overlapped call's predecessor samples, not yet known on the host (the device reads it
# from the predecessor's output; AsyncScheduler.schedule_next).
PENDING = -1


class Status(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2
    FINISHED_LENGTH = 3
    FINISHED_ABORTED = 4
    FINISHED_ERROR = 5

    @property
    def finish_reason(self) -> str | None:
        return {Status.FINISHED_STOPPED: "stop", Status.FINISHED_LENGTH: "length",
                Status.FINISHED_ABORTED: "abort", Status.FINISHED_ERROR: "error"}.get(self)


@dataclasses.dataclass(eq=False)
class Sequence:
    request: Request
    index: int  # which of the request's n samples
    token_ids: list[int]  # prompt, then output
    key: np.ndarray  # u32[2]; this sample's PRNG key
    status: Status = Status.WAITING
    slot: int = -1
    num_computed: int = 0  # tokens whose K/V are in the cache
    prefill_end: int = 0  # tokens known at the last admission: computing them is prefill
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)
    num_cached_blocks: int = 0  # leading full blocks already in the prefix cache
    host_blocks: list[int] = dataclasses.field(default_factory=list)  # swapped out: the K/V of its num_computed tokens
    num_lost: int = 0  # computed tokens a recompute preemption dropped (until it is admitted again)
    children: list[Sequence] = dataclasses.field(default_factory=list)  # forked once the prompt is in
    token_logprobs: list[float] = dataclasses.field(default_factory=list)  # of each output token
    logprobs: list[dict] | None = None  # top-N entries per output token, when asked for
    stop_reason: int | str | None = None
    spec_rate: float | None = None  # speculative decoding: its proposals' running acceptance rate, None
    # before it verified or rested (Speculator.rate: the engine's rate so far)
    # The output side's state of it (text, detokenizer offsets, what streaming sent) is the output
    # processor's (engine/output_processor.py: OutputState), not the scheduler's.
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status >= Status.FINISHED_STOPPED

    @property
    def num_pending(self) -> int:
        """PENDING tokens ending the list: sampled by calls whose output the host has not taken."""
        n = 0
        while n < len(self.token_ids) and self.token_ids[-1 - n] == PENDING:
            n += 1
        return n

    def drop_pending(self, taken: int, assumed: bool) -> None:
        """Remove the PENDING tokens an overlapped plan appended: their call's `taken` tokens follow.
        `assumed`: they counted as computed, all but the last: a decode row was taken to its
        reservation's end, and a verifying row as if every draft were accepted; where it stopped
        early (a stop token) or a draft was rejected, it computed fewer."""
        known = len(self.token_ids) - self.num_pending
        if assumed:
            self.num_computed -= len(self.token_ids) - known - taken
        del self.token_ids[known:]


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    cache_salt: str | None = None
    seqs: list[Sequence] = dataclasses.field(default_factory=list)
    num_cached_tokens: int | None = None  # recorded at first admission, as vLLM does
    error: str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # SamplingParams.prompt_logprobs: the entries of prompt tokens 1, 2, ... scored so far (one
    # owner: a prompt recomputed after a preemption is not scored twice); sent once in DELTA mode.
    prompt_logprobs: list[dict] = dataclasses.field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # The host reads each sampled token before the next is sampled (beam search ranks and forks
    # between tokens): a decode call runs one step for this request's rows and is never overlapped.
    one_step_per_call: bool = False
    # vLLM V1's: no prefix hit is read (its blocks still enter the cache): a request asking for
    # prompt_logprobs needs every prompt token's logits; a beam search's results do not depend on
    # what the cache holds.
    skip_reading_prefix_cache: bool = False
    lora_request: LoRARequest | None = None  # the adapter it runs with

    def __post_init__(self):
        if self.params.prompt_logprobs is not None:
            self.skip_reading_prefix_cache = True

    @property
    def lora_id(self) -> int:
        """Its adapter's lora_int_id, 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def block_hash_key(self) -> bytes | None:
        """The prefix cache's extra key (vLLM's extra_keys): the cache salt and the adapter, under
        which the same tokens have other K/V."""
        parts = ([self.cache_salt.encode()] if self.cache_salt else []) + (
            [b"lora:%d" % self.lora_id] if self.lora_id else [])
        return b"\0".join(parts) or None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)
