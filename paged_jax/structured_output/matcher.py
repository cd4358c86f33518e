"""A request's grammar state (one llguidance matcher), the batched bitmask fill, and the masking of
logits by a bitmask on the device (`apply_token_bitmask`, with its numpy reference).

The bitmask is vLLM's and llguidance's layout: i32[num_rows, ceil(vocab / 32)], bit t % 32 of word
t // 32 set when token t is allowed; a row of all -1 allows everything (a request without a grammar).
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from paged_jax.structured_output.grammar import CompiledGrammar
from paged_jax.structured_output.tokenizer import bitmask_words
from paged_jax.worker import sampler


class Matcher:
    """Where one request is in its grammar. Made from a CompiledGrammar (a copy of its prototype).

    EOS after the grammar has stopped is accepted without reaching llguidance: llguidance takes it
    but does not count it as a token, so rolling it back would undo the grammar's last real token
    instead (vLLM's guidance backend keeps a `rollback_lag` for the same reason)."""

    def __init__(self, compiled: CompiledGrammar):
        self.compiled = compiled
        self._ll = compiled.new_ll_matcher()
        self._eos = frozenset(compiled.tokenizer.eos_tokens)
        self.vocab_size = compiled.tokenizer.vocab_size
        self._num_consumed = 0  # tokens llguidance holds (what its rollback can undo)
        self._num_eos_after_stop = 0

    @property
    def num_tokens(self) -> int:
        return self._num_consumed + self._num_eos_after_stop

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and nothing but EOS may follow (a closed JSON object, a regex
        that cannot grow). The engine may end the request here."""
        return self._ll.is_stopped() and not self._ll.is_error()

    @property
    def is_accepting(self) -> bool:
        """EOS is allowed now (the output so far is a complete match, perhaps extensible)."""
        return self._ll.is_accepting()

    @property
    def is_error(self) -> bool:
        return self._ll.is_error()

    @property
    def error(self) -> str:
        return self._ll.get_error()

    def accept(self, token_ids: Sequence[int]) -> bool:
        """Advance through sampled tokens. False at the first token the grammar forbids; the matcher
        is then in an error state (its masks allow only EOS) and the tokens after it are not taken."""
        token_ids = [int(t) for t in token_ids]
        i = 0
        while i < len(token_ids):
            if self._ll.is_stopped() and not self._ll.is_error():
                if token_ids[i] not in self._eos:
                    return self._ll.consume_token(token_ids[i])  # False: records the error
                self._num_eos_after_stop += 1
                i += 1
                continue
            # try_consume_tokens takes the valid prefix without entering the error state, so the
            # count (and so rollback) stays exact; it stops early at a stop, handled above.
            n = self._ll.try_consume_tokens(token_ids[i:])
            if n == 0:  # the grammar forbids token i: consume_token records the error
                if not self._ll.consume_token(token_ids[i]):
                    return False
                n = 1
            self._num_consumed += n
            i += n
        return True

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens `accept` would take, without advancing (speculative drafts)."""
        token_ids = [int(t) for t in token_ids]
        if self._ll.is_error():
            return 0
        if self._ll.is_stopped():
            return next((i for i, t in enumerate(token_ids) if t not in self._eos), len(token_ids))
        return self._ll.validate_tokens(token_ids)

    def forced_tokens(self, limit: int) -> list[int]:
        """The tokens the grammar forces next (llguidance's fast-forward tokens: a JSON key, the
        punctuation around it), up to `limit`, as speculative drafts: cut before a token that
        completes the grammar (the request ends at that token, as without speculation, with no
        token sampled after it)."""
        if self._ll.is_stopped() or self._ll.is_error():
            return []
        tokens = [int(t) for t in self._ll.compute_ff_tokens()][:limit]
        tokens = tokens[: self._ll.validate_tokens(tokens)]
        for i, token in enumerate(tokens):
            self._ll.consume_token(token)
            if self._ll.is_stopped():
                self._ll.rollback(i + 1)
                return tokens[:i]
        self._ll.rollback(len(tokens))
        return tokens

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (rejected speculative tokens)."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"rollback of {num_tokens} tokens: the matcher holds {self.num_tokens}")
        if self._ll.is_error():
            raise ValueError(f"rollback of a matcher in an error state: {self.error}")
        from_eos = min(num_tokens, self._num_eos_after_stop)
        self._num_eos_after_stop -= from_eos
        rest = num_tokens - from_eos
        if rest:
            if not self._ll.rollback(rest):
                raise ValueError(f"llguidance refused a rollback of {rest} tokens: {self.error}")
            self._num_consumed -= rest

    def rebuild(self, output_token_ids: Sequence[int]) -> Matcher:
        """A fresh matcher advanced through `output_token_ids`: for a request recomputed after a
        preemption, whose output so far is replayed as prompt but whose grammar must not restart."""
        matcher = Matcher(self.compiled)
        matcher.accept(output_token_ids)
        return matcher

    def fill_bitmask(self, bitmask_row: np.ndarray) -> None:
        """bitmask_row: i32[bitmask_words(vocab_size)], C-contiguous (a row of a batch bitmask).
        A stopped or failed matcher allows only EOS."""
        if not isinstance(bitmask_row, np.ndarray) or bitmask_row.ndim != 1:
            raise ValueError(f"bitmask_row must be a 1-d array, got {getattr(bitmask_row, 'shape', bitmask_row)}")
        _check_bitmask(bitmask_row[None], self.vocab_size)
        self._ll.unsafe_compute_mask_ptr(bitmask_row.ctypes.data, bitmask_row.nbytes)


def _check_bitmask(bitmask: np.ndarray, vocab_size: int) -> None:
    """The pointer calls below write blindly: a wrong dtype, stride or width would corrupt memory."""
    words = bitmask_words(vocab_size)
    if (not isinstance(bitmask, np.ndarray) or bitmask.dtype != np.int32 or bitmask.ndim != 2
            or bitmask.shape[1] != words or not bitmask.flags["C_CONTIGUOUS"] or not bitmask.flags["WRITEABLE"]):
        raise ValueError(f"bitmask must be a writeable C-contiguous int32 array [rows, {words}] "
                         f"(vocab {vocab_size}), got {getattr(bitmask, 'dtype', type(bitmask))} "
                         f"{getattr(bitmask, 'shape', '')}")


_EXECUTOR: llguidance.LLExecutor | None = None


def fill_bitmasks(matchers: Sequence[Matcher | None], bitmask: np.ndarray, *,
                  drafts: Sequence[Sequence[int]] | None = None,
                  executor: llguidance.LLExecutor | None = None) -> None:
    """Row i of bitmask (i32[len(matchers), words]) <- matchers[i]'s mask; None -> all allowed.
    With `drafts` (speculative proposals that fit each grammar, as `Matcher.forced_tokens` makes
    them): bitmask i32[len(matchers), positions, words], position j of row i <- the mask after
    drafts[i][:j] (the positions past a row's drafts are left as they are); the matchers end where
    they were.

    Calls into llguidance's thread pool (`fill_next_token_bitmask_par`, and its
    `_with_draft_tokens` form for rows with drafts), which computes the rows in parallel with the GIL
    released."""
    positions = bitmask.shape[1] if drafts is not None and bitmask.ndim == 3 else 1
    if (bitmask.ndim != (2 if drafts is None else 3) or bitmask.shape[0] != len(matchers) or drafts is not None
            and (len(drafts) != len(matchers) or any(len(d) >= positions for d in drafts))):
        raise ValueError(f"bitmask must have one row per matcher ({len(matchers)})"
                         + ("" if drafts is None else ", a position per draft and one more")
                         + f", got shape {getattr(bitmask, 'shape', None)}")
    # The pointer calls write through a [rows * positions, words] view: a copy would lose them.
    flat = bitmask.reshape(-1, bitmask.shape[-1]) if bitmask.flags["C_CONTIGUOUS"] else bitmask
    vocab_sizes = {m.vocab_size for m in matchers if m is not None}
    if len(vocab_sizes) > 1:
        raise ValueError(f"matchers of different vocabularies in one batch: {sorted(vocab_sizes)}")
    if vocab_sizes:
        _check_bitmask(flat, vocab_sizes.pop())
    drafts = [[int(t) for t in d] for d in drafts] if drafts is not None else [[]] * len(matchers)
    for i, m in enumerate(matchers):
        if m is not None and drafts[i] and m.validate_tokens(drafts[i]) != len(drafts[i]):
            raise ValueError(f"drafts {drafts[i]} of row {i} do not fit its grammar past the first "
                             f"{m.validate_tokens(drafts[i])}")
    for i, m in enumerate(matchers):
        if m is None:
            bitmask[i] = -1
    plain = [(m._ll, i * positions) for i, m in enumerate(matchers) if m is not None and not drafts[i]]
    drafted = [(m._ll, i * positions, drafts[i]) for i, m in enumerate(matchers) if m is not None and drafts[i]]
    if plain or drafted:
        global _EXECUTOR
        if executor is None:
            _EXECUTOR = _EXECUTOR or llguidance.LLExecutor()
            executor = _EXECUTOR
        if plain:
            llg_numpy.fill_next_token_bitmask_par(executor, plain, flat)
        if drafted:  # llguidance takes only rows with drafts here
            llg_numpy.fill_next_token_bitmask_par_with_draft_tokens(executor, drafted, flat)


# The device side lives with the sampler, which applies it; jitted here for callers outside it.
apply_token_bitmask = jax.jit(sampler.apply_token_bitmask)


def apply_token_bitmask_reference(logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """apply_token_bitmask in numpy, by another route: little-endian bytes unpacked bit by bit."""
    vocab = logits.shape[-1]
    bits = np.unpackbits(np.ascontiguousarray(bitmask, "<i4").view(np.uint8), axis=-1, bitorder="little")
    return np.where(bits[:, :vocab].astype(bool), logits, np.array(-np.inf, logits.dtype))
