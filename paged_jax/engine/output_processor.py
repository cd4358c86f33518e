"""Host-side output processing (vLLM's OutputProcessor and detokenizer): sampled tokens into
sequences, incremental detokenization, stop strings, logprobs, and the `RequestOutput`s users read."""
from __future__ import annotations

import dataclasses
import time
import weakref

import numpy as np

from paged_jax.core.sequence import Request, Sequence, Status
from paged_jax.engine.detokenizer import decode_next, find_stop, prompt_context
from paged_jax.engine.outputs import CompletionOutput, Logprob, RequestOutput
from paged_jax.sampling_params import RequestOutputKind


@dataclasses.dataclass
class OutputState:
    """What the output side keeps of one sequence (vLLM's RequestState and IncrementalDetokenizer;
    the scheduler's `Sequence` holds none of it). Offsets count output tokens (a negative
    prefix_offset reaches into the prompt)."""

    output_text: str = ""  # the text of output tokens [0, read_offset), cut at a stop string
    prefix_offset: int = 0  # [prefix_offset, read_offset): the context the next token is decoded in
    read_offset: int = 0
    num_decoded: int = 0  # output tokens looked at; those past read_offset wait for a whole character
    stop_at: int | None = None  # output tokens kept once a stop string ended the sequence
    # RequestOutputKind.DELTA: how much of the output earlier outputs carried.
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    finish_sent: bool = False


class OutputProcessor:
    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        # Per live sequence, dropped with it (a finished request's sequences go with the request).
        self._states: weakref.WeakKeyDictionary[Sequence, OutputState] = weakref.WeakKeyDictionary()

    def _state(self, seq: Sequence) -> OutputState:
        state = self._states.get(seq)
        if state is None:
            context = 0 if self.tokenizer is None else prompt_context(
                self.tokenizer, seq.token_ids, seq.num_prompt_tokens,
                skip_special_tokens=seq.request.params.skip_special_tokens)
            state = self._states[seq] = OutputState(prefix_offset=-context)
        return state

    def process_outputs(self, plan, output, progressed) -> tuple[list[Sequence], int]:
        """One call's output after the scheduler took it (`progressed`: its (seq, row, new tokens)):
        prompt logprobs, each sequence's logprobs and stop strings, first-token times -> (the
        sequences a stop string ended, for the scheduler to finish; output tokens kept)."""
        if output.prompt_logprobs is not None:
            self.process_prompt_logprobs(plan, output.prompt_logprobs)
        stopped, num_new, now = [], 0, time.monotonic()
        for seq, row, n in progressed:
            before = seq.num_output - n
            if self.process(seq, output, row, n):
                stopped.append(seq)
            num_new += seq.num_output - before
            seq.request.first_token_time = seq.request.first_token_time or now
        return stopped, num_new

    def process(self, seq: Sequence, output, row: int, n: int) -> bool:
        """The scheduler appended `n` new tokens to `seq` from row `row` of a `ModelOutput`: build their
        logprob entries and check stop strings -> True when a stop string ended the sequence (its
        status is then FINISHED_STOPPED; the engine frees it if the device had not stopped it)."""
        if seq.request.params.logprobs is not None:
            for j, token in enumerate(seq.token_ids[seq.num_tokens - n:]):
                self._add_logprobs(seq, token, output.logprob[row, j], output.rank[row, j],
                                   output.top_ids[row, j], output.top_logprobs[row, j])
        if not seq.request.params.stop or self.check_stop_strings(seq) is None:
            return False
        if seq.finished:  # the device stopped it on length in the same step: the stop string wins
            seq.status = Status.FINISHED_STOPPED
        return True

    def _add_logprobs(self, seq, token, logprob, rank, top_ids, top_logprobs):
        if seq.logprobs is None:
            seq.logprobs = []
        # In place: a copy per token would cost O(L^2) over an output.
        seq.logprobs.append(self.logprob_entry(token, logprob, rank, top_ids, top_logprobs, seq.request.params.logprobs))

    def logprob_entry(self, token, logprob, rank, top_ids, top_logprobs, wanted) -> dict[int, Logprob]:
        """vLLM's logprobs dict: the token's own entry, then the top `wanted` (ranks 1..wanted)."""
        entry = {int(token): Logprob(float(logprob), int(rank), self._piece(int(token)))}
        for r, (tid, lp) in enumerate(zip(top_ids[:wanted], top_logprobs[:wanted])):
            entry.setdefault(int(tid), Logprob(float(lp), r + 1, self._piece(int(tid))))
        return entry

    def process_prompt_logprobs(self, plan, out) -> None:
        """Record a prefill step's prompt-token scores (`PromptLogprobs`) on their requests."""
        for i in np.flatnonzero(out.rows >= 0):
            request = plan.scheduled[int(out.rows[i])][0].request
            position = int(out.positions[i])
            if position != len(request.prompt_logprobs) + 1:  # scored before a preemption
                continue
            request.prompt_logprobs.append(self.logprob_entry(
                request.prompt_token_ids[position], out.logprob[i], out.rank[i], out.top_ids[i],
                out.top_logprobs[i], request.params.prompt_logprobs))

    @staticmethod
    def _prompt_logprobs(request: Request, delta: bool):
        """[None, entry, ...] once every prompt token is scored (in DELTA mode, in one output only)."""
        complete = len(request.prompt_logprobs) == len(request.prompt_token_ids) - 1
        if request.params.prompt_logprobs is None or not complete or (delta and request.prompt_logprobs_sent):
            return None
        request.prompt_logprobs_sent = True
        return [None, *request.prompt_logprobs]

    def _piece(self, token):
        return self.tokenizer.decode([token], skip_special_tokens=False) if self.tokenizer else None

    def _detokenize(self, seq: Sequence) -> None:
        """Bring the sequence's text up to its newest output token, one token at a time so that a stop
        string is found at the token that completed it (vLLM's detokenizer stop: stop strings
        complete only after min_tokens output tokens; the first in the list wins)."""
        st = self._state(seq)
        if self.tokenizer is None or st.stop_at is not None:
            return
        params, base, text = seq.request.params, seq.num_prompt_tokens, st.output_text
        for k in range(max(st.num_decoded, st.read_offset) + 1, seq.num_output + 1):
            st.num_decoded = k
            new = decode_next(self.tokenizer, seq.token_ids[base + st.prefix_offset: base + k],
                              st.read_offset - st.prefix_offset, skip_special_tokens=params.skip_special_tokens)
            if new is None:
                continue
            text += new  # a local: CPython appends in place where it would copy an attribute's string
            st.prefix_offset, st.read_offset = st.read_offset, k
            hit = find_stop(text, len(new), params.stop) if params.stop and k > params.min_tokens else None
            if hit is not None:
                stop, at = hit
                seq.stop_reason, st.stop_at = stop, k
                text = text[: at + (len(stop) if params.include_stop_str_in_output else 0)]
                break
        st.output_text = text

    def check_stop_strings(self, seq: Sequence) -> Status | None:
        """Detokenize the new output tokens; when one of them completed a stop string, drop the tokens
        after it (the text is already cut before the stop string, or after it with
        include_stop_str_in_output)."""
        st = self._state(seq)
        self._detokenize(seq)
        if st.stop_at is None:
            return None
        del seq.token_ids[seq.num_prompt_tokens + st.stop_at:]
        del seq.token_logprobs[st.stop_at:]
        if seq.logprobs:
            del seq.logprobs[st.stop_at:]
        return Status.FINISHED_STOPPED

    def _finish_text(self, seq: Sequence) -> None:
        """A finished sequence's last tokens that never made a whole character: decoded as they are
        (U+FFFD, as a full decode shows them); never searched for stop strings, as in vLLM."""
        st = self._state(seq)
        if self.tokenizer is None or st.stop_at is not None or st.read_offset == seq.num_output:
            return
        base = seq.num_prompt_tokens
        st.output_text += decode_next(self.tokenizer, seq.token_ids[base + st.prefix_offset:],
                                      st.read_offset - st.prefix_offset, final=True,
                                      skip_special_tokens=seq.request.params.skip_special_tokens)
        st.prefix_offset, st.read_offset = st.read_offset, seq.num_output

    def make_outputs(self, requests: list[Request]) -> list[RequestOutput]:
        """The outputs of requests a step touched: each finished one, and each unfinished one that
        streams (not FINAL_ONLY); a finished one's finish time is set here if it has none."""
        outputs, now = [], time.monotonic()
        for request in requests:
            if request.finished:
                request.finish_time = request.finish_time or now
            elif request.params.output_kind is RequestOutputKind.FINAL_ONLY:
                continue
            outputs.append(self.make_output(request))
        return outputs

    def make_output(self, request: Request) -> RequestOutput:
        delta = request.params.output_kind is RequestOutputKind.DELTA
        completions = []
        for seq in request.seqs:
            self._detokenize(seq)
            if seq.finished:
                self._finish_text(seq)
            if delta:
                completion = self._delta(seq)
                if completion is not None:
                    completions.append(completion)
                continue
            completions.append(CompletionOutput(
                index=seq.index, text=self._state(seq).output_text, token_ids=list(seq.output_ids),
                cumulative_logprob=self._cumulative_logprob(seq), logprobs=seq.logprobs,
                finish_reason=seq.status.finish_reason, stop_reason=seq.stop_reason))
        metrics = dict(arrival_time=request.arrival_time, first_token_time=request.first_token_time,
                       finish_time=request.finish_time)
        return RequestOutput(request.request_id, request.prompt, list(request.prompt_token_ids), completions,
                             request.finished, request.num_cached_tokens or 0, request.error, metrics,
                             self._prompt_logprobs(request, delta), request.lora_request)

    @staticmethod
    def _cumulative_logprob(seq: Sequence) -> float | None:
        return sum(seq.token_logprobs) if seq.request.params.logprobs is not None else None

    def _delta(self, seq: Sequence) -> CompletionOutput | None:
        """What `seq` has that no earlier output carried, or None when nothing. A running sequence
        keeps back its last max(len(stop)) - 1 characters, as vLLM's streaming does: a stop string
        they may begin would cut them from the text, and a chunk cannot be taken back."""
        st = self._state(seq)
        params, text = seq.request.params, st.output_text
        end = len(text)
        if not seq.finished and params.stop and not params.include_stop_str_in_output:
            end = max(st.num_sent_chars, end - max(len(s) for s in params.stop) + 1)
        finish = seq.status.finish_reason if seq.finished and not st.finish_sent else None
        if end == st.num_sent_chars and st.num_sent_tokens == seq.num_output and finish is None:
            return None
        tokens = seq.token_ids[seq.num_prompt_tokens + st.num_sent_tokens:]
        logprobs = seq.logprobs[st.num_sent_tokens:] if seq.logprobs is not None else None
        completion = CompletionOutput(
            index=seq.index, text=text[st.num_sent_chars:end], token_ids=tokens,
            cumulative_logprob=self._cumulative_logprob(seq), logprobs=logprobs,
            finish_reason=finish, stop_reason=seq.stop_reason if finish else None)
        st.num_sent_chars, st.num_sent_tokens = end, seq.num_output
        st.finish_sent = seq.finished
        return completion
