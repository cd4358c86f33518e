"""Host-side output processing (vLLM's OutputProcessor and detokenizer): sampled tokens into
sequences, stop strings, logprobs, and the `RequestOutput`s users read."""
from __future__ import annotations

from paged_jax.engine.outputs import CompletionOutput, Logprob, RequestOutput
from paged_jax.core.sequence import Request, Sequence, Status


class OutputProcessor:
    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer

    def process(self, seq: Sequence, output, row: int, n: int) -> bool:
        """The scheduler appended `n` new tokens to `seq` from row `row` of a `ModelOutput`: build their
        logprob entries and check stop strings -> True when a stop string ended the sequence (its
        status is then FINISHED_STOPPED; the engine frees it if the device had not stopped it)."""
        wanted = seq.request.params.logprobs
        if wanted is not None:
            for j, token in enumerate(seq.output_ids[seq.num_output - n:]):
                entry = {token: Logprob(float(output.logprob[row, j]), int(output.rank[row, j]), self._piece(token))}
                for r, (tid, lp) in enumerate(zip(output.top_ids[row, j][:wanted], output.top_logprobs[row, j][:wanted])):
                    entry.setdefault(int(tid), Logprob(float(lp), r + 1, self._piece(int(tid))))
                seq.logprobs = (seq.logprobs or []) + [entry]
        if not seq.request.params.stop or self.check_stop_strings(seq) is None:
            return False
        if seq.finished:  # the device stopped it on length in the same step: the stop string wins
            seq.status = Status.FINISHED_STOPPED
        return True

    def _piece(self, token):
        return self.tokenizer.decode([token], skip_special_tokens=False) if self.tokenizer else None

    def check_stop_strings(self, seq: Sequence) -> Status | None:
        """vLLM's detokenizer stop: scan the new output tokens one by one; on a match, drop the
        tokens after the one that completed the stop string and cut the text before it."""
        params = seq.request.params
        skip = params.skip_special_tokens
        seen = len(self.tokenizer.decode(seq.output_ids[: seq.num_stop_checked], skip_special_tokens=skip))
        for k in range(seq.num_stop_checked + 1, seq.num_output + 1):
            text = self.tokenizer.decode(seq.output_ids[:k], skip_special_tokens=skip)
            for stop in params.stop:
                at = text.find(stop, max(0, seen - len(stop) + 1))  # only matches this token completes
                if at >= 0:
                    del seq.token_ids[seq.num_prompt_tokens + k:]
                    del seq.token_logprobs[k:]
                    if seq.logprobs:
                        del seq.logprobs[k:]
                    seq.stop_reason = stop
                    seq.text_end = at + (len(stop) if params.include_stop_str_in_output else 0)
                    return Status.FINISHED_STOPPED
            seen = len(text)
        seq.num_stop_checked = seq.num_output
        return None

    def make_output(self, request: Request) -> RequestOutput:
        completions = []
        for seq in request.seqs:
            text = ""
            if self.tokenizer is not None:
                text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=request.params.skip_special_tokens)
                text = text[: seq.text_end]
            completions.append(CompletionOutput(
                index=seq.index, text=text, token_ids=list(seq.output_ids),
                cumulative_logprob=sum(seq.token_logprobs) if request.params.logprobs is not None else None,
                logprobs=seq.logprobs, finish_reason=seq.status.finish_reason, stop_reason=seq.stop_reason))
        metrics = dict(arrival_time=request.arrival_time, first_token_time=request.first_token_time,
                       finish_time=request.finish_time)
        return RequestOutput(request.request_id, request.prompt, list(request.prompt_token_ids), completions,
                             request.finished, request.num_cached_tokens or 0, request.error, metrics)
