"""vLLM's prompt lookup (its n-gram proposer) for every speculating row of a call at once, on the
host: one set of array operations over the rows' tokens, not a search per row. Per call it costs
rows x longest sequence x prompt_lookup_max comparisons: 2-5 ms at 256 rows of 512-2048 tokens
on this project's CPU, where a search per row, each from its Python token list, cost 28-68 ms,
time the device waits for (scripts/benchmark_proposals.py measures both)."""
from __future__ import annotations

import numpy as np

from paged_jax.core.sequence import Sequence


def propose(tokens: np.ndarray, lengths: np.ndarray, rooms: np.ndarray, min_n: int, max_n: int):
    """Each row's proposal: the longest n in [min_n, max_n] whose last n tokens occur earlier in the
    row, and the up to `rooms[r]` tokens that followed the occurrence: its latest that is followed by
    that many (the nearest context), else its earliest (the most that follow; in a loop the latest
    is followed by the loop's start only).

    tokens: i32[R, W], row r's tokens in its first lengths[r] columns (the rest is not read);
    lengths: i32[R]; rooms: i32[R] >= 1 -> (starts i32[R], counts i32[R]): the proposal of row r is
    tokens[r, starts[r]:starts[r] + counts[r]], counts[r] == 0 where nothing matched."""
    num_rows, width = tokens.shape
    rows = np.arange(num_rows)
    # run[r, e]: whether the i + 1 tokens ending at e equal the row's last i + 1 (e <= lengths - 2:
    # an occurrence ends before the last token); matched[r, e]: how many of the last tokens match.
    ends = np.arange(width)
    run = ends[None, :] <= lengths[:, None] - 2
    matched = np.zeros((num_rows, width), np.uint8)
    for i in range(min(max_n, width)):  # an occurrence ends at e >= i
        last = tokens[rows, np.maximum(lengths - 1 - i, 0)]
        run[:, :i] = False
        run[:, i:] &= tokens[:, : width - i] == last[:, None]
        matched += run
    n = matched.max(axis=1, initial=0)
    hits = (matched >= n[:, None]) & (n >= min_n)[:, None]
    followed = hits & (ends[None, :] + 1 + rooms[:, None] <= lengths[:, None])
    latest = width - 1 - np.argmax(followed[:, ::-1], axis=1)
    end = np.where(followed.any(axis=1), latest, np.argmax(hits, axis=1))
    starts = end + 1
    counts = np.where(hits.any(axis=1), np.minimum(rooms, lengths - starts), 0)
    return starts.astype(np.int32), counts.astype(np.int32)


class TokenHistory:
    """The speculating rows' tokens as int32 arrays, each extended by what its sequence gained since
    it was last read (the sequence's token list is the owner: a shorter list, or a changed last
    token read, starts the array over). Tokens the host does not know yet (PENDING) are not read."""

    def __init__(self):
        self._arrays: dict[Sequence, tuple[np.ndarray, int]] = {}

    def gather(self, seqs: list[Sequence], tails: list[list[int]] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """-> (tokens i32[R, max length], lengths i32[R]) of `seqs`, row r's in its first columns,
        followed by `tails[r]` if given (the tokens its PENDING ones are expected to be). Sequences
        not asked for are forgotten (they finished or rest)."""
        arrays = {seq: self._read(seq) for seq in seqs}
        self._arrays = arrays
        tails = tails or [[]] * len(seqs)
        lengths = np.array([known + len(tail) for (_, known), tail in zip(arrays.values(), tails)], np.int32)
        tokens = np.zeros((len(seqs), int(lengths.max(initial=1))), np.int32)
        for row, ((array, known), tail) in enumerate(zip(arrays.values(), tails)):
            tokens[row, :known] = array[:known]
            tokens[row, known:lengths[row]] = tail
        return tokens, lengths

    def _read(self, seq: Sequence) -> tuple[np.ndarray, int]:
        ids, (array, known) = seq.token_ids, self._arrays.get(seq, (np.zeros(0, np.int32), 0))
        end = len(ids) - seq.num_pending
        if end < known or (known and array[known - 1] != ids[known - 1]):
            known = 0
        if array.size < end:
            array = np.concatenate([array[:known], np.zeros(2 * end - known, np.int32)])
        array[known:end] = ids[known:end]
        return array, end


class PromptLookup:
    """The n-gram proposals of a call's rows, and what each proposing row is expected to hold next
    (`predicted`): its drafts, then what a lookup after them proposes (the target's next token, if
    it goes on as its context did). A call planned while the verification before it runs
    (overlapped scheduling) looks up a row whose tokens are PENDING in that prediction: where every
    draft is accepted and the next token is the predicted one, that is the lookup the row's true
    tokens would get; the device looks the drafts up again in the true tokens
    (worker/ngram_proposer.py), so a wrong prediction costs proposals, never tokens. A row whose
    PENDING tokens were not predicted is not looked up (`unseen`)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.history = TokenHistory()
        self.predicted: dict[Sequence, list[int]] = {}
        self.unseen: set[Sequence] = set()

    def predicts(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq`'s next `num_tokens` tokens (those its pending call samples) are predicted."""
        return len(self.predicted.get(seq, ())) == num_tokens

    def look_up(self, rooms: dict[Sequence, int]) -> dict[Sequence, list[int]]:
        """Each row's proposal (up to its room; [] where nothing matched or it is unseen), from its
        known tokens then the predicted ones for its PENDING tokens."""
        rows = [seq for seq in rooms if not seq.num_pending or self.predicts(seq, seq.num_pending)]
        self.unseen = set(rooms) - set(rows)
        tokens, lengths = self.history.gather(rows, [self.predicted[s] if s.num_pending else [] for s in rows])
        starts, counts = propose(tokens, lengths, np.array([rooms[s] for s in rows], np.int32), self.min_n, self.max_n)
        out, self.predicted = dict.fromkeys(rooms, []), {}
        for row, seq in enumerate(rows):
            out[seq] = tokens[row, starts[row]:starts[row] + counts[row]].tolist()
        # The next token of each proposing row: a lookup of 1 after its drafts.
        matched = [row for row in range(len(rows)) if counts[row]]
        if matched:
            grown = np.zeros((len(matched), tokens.shape[1] + int(counts.max())), np.int32)
            for i, row in enumerate(matched):
                grown[i, : lengths[row]] = tokens[row, : lengths[row]]
                grown[i, lengths[row]: lengths[row] + counts[row]] = out[rows[row]]
            ends = lengths[matched] + counts[matched]
            after, found = propose(grown, ends, np.ones(len(matched), np.int32), self.min_n, self.max_n)
            for i, row in enumerate(matched):
                if found[i]:
                    self.predicted[rows[row]] = out[rows[row]] + [int(grown[i, after[i]])]
        return out
