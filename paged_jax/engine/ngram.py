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
    token read, starts the array over)."""

    def __init__(self):
        self._arrays: dict[Sequence, tuple[np.ndarray, int]] = {}

    def gather(self, seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray]:
        """-> (tokens i32[R, max length], lengths i32[R]) of `seqs`, row r's in its first columns.
        Sequences not asked for are forgotten (they finished or rest)."""
        arrays = {seq: self._read(seq) for seq in seqs}
        self._arrays = arrays
        lengths = np.array([known for _, known in arrays.values()], np.int32)
        tokens = np.zeros((len(seqs), int(lengths.max(initial=1))), np.int32)
        for row, (array, known) in enumerate(arrays.values()):
            tokens[row, :known] = array[:known]
        return tokens, lengths

    def _read(self, seq: Sequence) -> tuple[np.ndarray, int]:
        ids, (array, known) = seq.token_ids, self._arrays.get(seq, (np.zeros(0, np.int32), 0))
        if len(ids) < known or (known and array[known - 1] != ids[known - 1]):
            known = 0
        if array.size < len(ids):
            array = np.concatenate([array[:known], np.zeros(2 * len(ids) - known, np.int32)])
        array[known:len(ids)] = ids[known:]
        return array, len(ids)
