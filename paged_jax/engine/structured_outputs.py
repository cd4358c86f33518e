"""Structured output in the engine (vLLM V1's StructuredOutputManager).

A request with `SamplingParams.structured_outputs` has its grammar checked when it is added (a bad
one is a ValueError naming the field, and nothing is queued) and compiled on the GrammarCompiler's
worker thread; the engine hands it to the scheduler once compiled, so other requests run meanwhile.
Each of its sequences gets a Matcher. Before every device call the host fills the token bitmask of
the call's constrained rows (the sampler masks their logits); after it the matchers take the
sampled tokens, and a sequence whose grammar is complete finishes with "stop". A constrained
request decodes one token per call (`Request.one_step_per_call`): the next mask needs the token
before it. With n-gram speculation it proposes what its grammar forces (`drafts`), and a
verification gets one mask per position, the grammar advanced over the drafts before it, so it
keeps what the masked target would sample.

llguidance loads with the first constrained request: an engine that never sees one never imports it.
"""
from __future__ import annotations

import concurrent.futures
import threading
import weakref

import numpy as np

from paged_jax.core.sequence import Request, Sequence
from paged_jax.worker import batching


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler = None
        self._lock = threading.Lock()  # a server checks grammars on its request threads
        self._pending: dict[str, tuple[Request, concurrent.futures.Future]] = {}  # arrival order
        self._matchers: weakref.WeakKeyDictionary[Sequence, object] = weakref.WeakKeyDictionary()

    def _grammar_compiler(self):
        with self._lock:
            if self._compiler is None:
                from paged_jax.structured_output import GrammarCompiler, ll_tokenizer

                self._compiler = GrammarCompiler(ll_tokenizer(self.tokenizer, self.vocab_size))
            return self._compiler

    def validate(self, spec) -> None:
        """ValueError naming the field (json, regex, choice, grammar) when llguidance rejects the
        StructuredOutputsParams' grammar for this model's tokenizer; well under a millisecond."""
        from paged_jax.structured_output import validate

        if self.tokenizer is None:
            raise ValueError(f"structured_outputs ({spec.kind}) needs the model's tokenizer")
        validate(spec, self._grammar_compiler().tokenizer)

    def add(self, request: Request) -> None:
        """Check the request's grammar (ValueError naming its field) and start compiling it."""
        spec = request.params.structured_outputs
        self.validate(spec)
        request.one_step_per_call = True
        self._pending[request.request_id] = (request, self._grammar_compiler().submit(spec))

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def ready(self, wait: float = 0.0) -> list[Request]:
        """The pending requests whose grammar is compiled (each sequence then has its Matcher) or
        failed (`request.error` set), in arrival order. `wait`: seconds to wait for one when none
        is ready (an engine with nothing else to run)."""
        if not self._pending:  # every step of an unconstrained workload
            return []
        if wait and self._pending and not any(f.done() for _, f in self._pending.values()):
            concurrent.futures.wait([f for _, f in self._pending.values()], timeout=wait,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        from paged_jax.structured_output import Matcher

        done = []
        for request_id, (request, future) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[request_id]
            try:
                compiled = future.result()
            except ValueError as e:
                request.error = str(e)
            else:
                for seq in request.seqs:
                    self._matchers[seq] = Matcher(compiled)
            done.append(request)
        return done

    def abort(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def bitmask(self, seqs: list[Sequence], num_rows: int, drafts: dict | None = None,
                width: int = 1) -> tuple[np.ndarray, np.ndarray] | None:
        """The masks of the rows with a grammar alone (SlotParams.allowed, mask_row): i32[masks,
        words], mask i what its row's grammar allows next, their count padded to a power of two,
        and i32[num_rows], each row's mask or -1 (no grammar, or a padding row); None when no row
        has one. A verification whose constrained rows have drafts (`drafts`: seq -> its
        proposals; `width`: the call's positions per row, 1 + the most drafts): i32[masks, width,
        words], position j the mask after the row's first j drafts (those past its drafts are
        never read). A batch of 256 rows with one grammar sends one row, not 256 (vocab 128k: 16
        KB, not 4 MB)."""
        if not self._matchers:  # every call of an unconstrained workload: no per-row lookups
            return None
        rows = [(i, m) for i, m in enumerate(map(self._matchers.get, seqs)) if m is not None]
        if not rows:
            return None
        from paged_jax.structured_output import allocate_bitmask, fill_bitmasks

        mask_row = np.full(num_rows, -1, np.int32)
        mask_row[[i for i, _ in rows]] = np.arange(len(rows))
        matchers = [m for _, m in rows]
        count = batching.bucket(len(rows), num_rows)
        padded = matchers + [None] * (count - len(rows))
        vocab_size = self._grammar_compiler().tokenizer.vocab_size
        if not any(drafts and drafts.get(seqs[i]) for i, _ in rows):
            mask = allocate_bitmask(count, vocab_size)
            fill_bitmasks(padded, mask)
            return mask, mask_row
        mask = allocate_bitmask(count * width, vocab_size).reshape(count, width, -1)
        fill_bitmasks(padded, mask, drafts=[drafts.get(seqs[i], []) for i, _ in rows] + [[]] * (count - len(rows)))
        return mask, mask_row

    def drafts(self, seq: Sequence, room: int) -> list[int]:
        """A constrained sequence's speculative proposals: what its grammar forces next, up to
        `room` (Matcher.forced_tokens)."""
        matcher = self._matchers.get(seq)
        return [] if matcher is None else matcher.forced_tokens(room)

    def advance(self, progressed) -> tuple[list[Sequence], list[Sequence]]:
        """The matchers take each sequence's new tokens (`progressed`: the scheduler's (seq, row,
        new tokens)) -> (sequences whose grammar is complete, sequences that sampled a token their
        grammar refused: `request.error` says which)."""
        complete, refused = [], []
        if not self._matchers:
            return complete, refused
        for seq, _, n in progressed:
            matcher = self._matchers.get(seq)
            if matcher is None or n == 0:
                continue
            tokens = seq.token_ids[seq.num_tokens - n:]
            if not matcher.accept(tokens):
                seq.request.error = (f"structured output: the grammar refused a sampled token of "
                                     f"{tokens}: {matcher.error}")
                refused.append(seq)
            elif matcher.is_finished and not seq.finished:
                complete.append(seq)
        return complete, refused

    def stats(self) -> dict:
        return {} if self._compiler is None else self._compiler.stats()

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown(wait=False)
