"""Host time of n-gram speculation's proposals per call (vLLM's prompt lookup): every speculating row
looked up at once (engine/ngram.py) against one search per row, each from its sequence's token list,
as the engine did before (`PerRowSpeculator`, below). The device waits for this time before each
call that may verify, so at a GPU's batch sizes it must stay well under a decode call.

    python scripts/benchmark_proposals.py [--batch-sizes 1 8 64 256 --lengths 128 512 2048]

Rows of `--length` tokens drawn from SmolLM2's vocabulary size, half of them quoting their own
first half (they match), half not; between calls each row gains the tokens of one verification
(three). Both controllers propose the same drafts (checked each call); per call the median over
`--calls` calls, and the ratio.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from paged_jax import SamplingParams  # noqa: E402
from paged_jax.core.sequence import Request, Sequence, Status  # noqa: E402
from paged_jax.engine.spec_config import SpeculativeConfig  # noqa: E402
from paged_jax.engine.speculative import RESERVED_DRAFT, Speculator  # noqa: E402
from scripts import benchlib  # noqa: E402

VOCAB_SIZE = 49152
GAINED_PER_CALL = 3


class PerRowSpeculator(Speculator):
    """The baseline: prompt lookup one row at a time, each from its token list converted anew."""

    def _look_up(self, rooms, found):
        c, unmatched = self.config, {}
        for seq, room in rooms.items():
            tokens = np.asarray(seq.token_ids, np.int32)
            drafts = tokens[:0]
            for n in range(min(c.prompt_lookup_max, tokens.size - 1), c.prompt_lookup_min - 1, -1):
                windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
                hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
                if hits.size:
                    whole = hits[hits + n + room <= tokens.size]
                    start = (whole[-1] if whole.size else hits[0]) + n
                    drafts = tokens[start:start + room]
                    break
            if drafts.size:
                found[seq] = drafts.tolist()
            else:
                unmatched[seq] = [RESERVED_DRAFT] * room
        return unmatched


def make_rows(rng, batch: int, length: int) -> list[Sequence]:
    params = SamplingParams(temperature=0.0, max_tokens=1 << 20)
    rows = []
    for i in range(batch):
        tokens = rng.integers(0, VOCAB_SIZE, length).tolist()
        if i % 2 == 0:  # quotes its first half
            tokens[length // 2:] = tokens[: length - length // 2]
        request = Request(str(i), None, tokens[:8], params, 0.0)
        rows.append(Sequence(request, 0, tokens, np.zeros(2, np.uint32), status=Status.RUNNING,
                             num_computed=length - 1))
    return rows


def time_calls(speculator: Speculator, rows: list[Sequence], calls: int, rng) -> tuple[float, list]:
    """Median seconds per `propose` over `calls` calls (each row gaining tokens between them) -> and
    the drafts each call proposed."""
    times, proposed = [], []
    state = rng.bit_generator.state
    for _ in range(calls):
        start = time.perf_counter()
        drafts = speculator.propose(rows)
        times.append(time.perf_counter() - start)
        proposed.append({int(seq.request.request_id): d for seq, d in drafts.items()})
        for seq in rows:
            seq.token_ids += rng.integers(0, VOCAB_SIZE, GAINED_PER_CALL).tolist()
            seq.num_computed = seq.num_tokens - 1
    rng.bit_generator.state = state  # the other controller's rows gain the same tokens
    return float(np.median(times)), proposed


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--num-speculative-tokens", type=int, default=7)
    ap.add_argument("--prompt-lookup", type=int, nargs=2, default=[2, 4], metavar=("MIN", "MAX"))
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args(argv)
    config = SpeculativeConfig("ngram", args.num_speculative_tokens, *args.prompt_lookup)
    table = []
    for batch in args.batch_sizes:
        for length in args.lengths:
            seconds = {}
            for name, kind in (("per_row", PerRowSpeculator), ("batched", Speculator)):
                speculator = kind(config, 1 << 30, max_num_seqs=batch, max_num_batched_tokens=1 << 20, timed=False)
                rng = np.random.default_rng(length)
                seconds[name], proposed = time_calls(speculator, make_rows(rng, batch, length), args.calls, rng)
                seconds.setdefault("proposed", proposed)
                if proposed != seconds["proposed"]:
                    raise RuntimeError(f"batch {batch}, length {length}: the proposals differ")
            table.append(dict(batch=batch, length=length, per_row=1e3 * seconds["per_row"],
                              batched=1e3 * seconds["batched"], ratio=seconds["per_row"] / seconds["batched"],
                              matched=sum(map(bool, seconds["proposed"][0].values()))))
    print(f"n-gram proposals, host ms per call: k {config.num_speculative_tokens}, prompt_lookup "
          f"{config.prompt_lookup_min}-{config.prompt_lookup_max}, median of {args.calls} calls")
    benchlib.print_table(table, [("batch", "rows", "d"), ("length", "tokens per row", "d"),
                                 ("matched", "rows proposing", "d"), ("per_row", "per row, ms", ".3f"),
                                 ("batched", "batched, ms", ".3f"), ("ratio", "x faster", ".1f")])
    return table


if __name__ == "__main__":
    main()
