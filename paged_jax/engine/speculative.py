"""Speculative decoding on the host: the configuration (vLLM's `speculative_config`), the n-gram
proposer (vLLM's prompt lookup), and the controller that decides which rows speculate.

A row's proposals ride in the scheduler's plan as extra tokens after its last sampled one, so the
verification is a ragged prefill row of 1 + k tokens (worker/rejection_sampler.py scores them and
keeps the accepted prefix); a rejected tail is rolled back by the scheduler's bookkeeping alone
(core/scheduler.py: only verified tokens count as computed). A draft model's proposals are made on
the device in the verifying call itself (worker/draft_proposer.py: k draft steps, then the target's
forward): the plan reserves their slots with a stand-in token, RESERVED_DRAFT.

Speculation turns itself down where it does not pay (vLLM's does not): each sequence keeps a
running acceptance rate; one whose proposals keep failing stops proposing and decodes in the K-step
loop, probing again as the rate recovers. And a call verifies only when its expected tokens per
second beat a plain decode step's, both timed on this device as the engine runs (a verification
of 1 + k tokens per row costs about one step where reading the weights dominates, a GPU at small
batch, but several on a CPU, whose cost follows the tokens computed).
"""
from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import numpy as np

from paged_jax.core.sequence import Sequence
from paged_jax.worker import batching

METHODS = ("ngram", "draft_model")
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model"}
RATE_WEIGHT = 0.5  # how much one verification moves a sequence's acceptance rate
RATE_RECOVERY = 0.02  # per call it rests: the rate moves this share back toward 1 (a probe every ~4 calls)
MIN_EXPECTED_PER_ROW = 0.5  # expected accepted drafts per running row for a call to verify
COST_WEIGHT = 0.2  # how much one timed call moves the running cost of its kind
PROBE_STEPS = 2  # decode steps of a call while speculating rows look for a match
RESERVED_DRAFT = 0  # stands in the plan for a draft model's proposal, which the device writes
# Text a draft's tokenizer must encode as the target's: words, digits, punctuation, accents, an emoji.
VOCABULARY_PROBE = "The quick brown fox, 42 times:\n\tdef naïve_café(x): return {'☕': x * 3.14}"


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    # draft_model: a checkpoint directory or GGUF file (vLLM's "model"), or a model object already
    # built (the engine's `model` argument takes either too); the engine loads a path.
    model: object = dataclasses.field(default=None, compare=False)

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """From vLLM's dict (or its JSON text, as `--speculative-config` takes it); None stays None.
        ValueError names what is wrong."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not JSON: {value!r} ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {value!r}")
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: {sorted(_KEYS)}")
        method = value.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {METHODS}, got {method!r}")
        k = value.get("num_speculative_tokens")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"speculative_config num_speculative_tokens must be an integer >= 1, got {k!r}")
        if method == "draft_model":
            lookup = sorted({"prompt_lookup_min", "prompt_lookup_max"} & set(value))
            if lookup:
                raise ValueError(f"speculative_config {lookup} apply to method 'ngram', not 'draft_model'")
            model = value.get("model")
            if model is None or isinstance(model, str) and not model:
                raise ValueError("speculative_config method 'draft_model' needs \"model\": a checkpoint "
                                 "directory or GGUF file of the draft")
            return cls(method, k, model=model)
        if value.get("model") is not None:
            raise ValueError("speculative_config \"model\" applies to method 'draft_model', not 'ngram'")
        # vLLM's defaults: both 5 when neither is given, else the one given for both.
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        low, high = (high if low is None else low), (low if high is None else high)
        low, high = (5 if low is None else low), (5 if high is None else high)
        for name, n in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"speculative_config {name} must be an integer >= 1, got {n!r}")
        if low > high:
            raise ValueError(f"speculative_config prompt_lookup_min={low} exceeds prompt_lookup_max={high}")
        return cls(method, k, low, high)


_NUM_COMPILES = [0]  # jax's traces and backend compiles in this process, once a Speculator listens
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration")


def _count_compiles(event, duration, **_):
    if event in _COMPILE_EVENTS:
        _NUM_COMPILES[0] += 1


@functools.cache
def _listen_for_compiles() -> None:  # once per process
    jax.monitoring.register_event_duration_secs_listener(_count_compiles)


def ngram_proposal(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """vLLM's prompt lookup: the longest n in [min_n, max_n] whose last n tokens occur earlier in
    `tokens` (i32[L], prompt and output) -> the up to k tokens that followed it: at its latest
    occurrence that k tokens follow (the nearest context), else its earliest (the most that
    follow; in a loop the latest is followed by the loop's start only); empty when none matches."""
    length = tokens.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # every earlier n-gram
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            whole = hits[hits + n + k <= length]  # occurrences followed by k tokens
            start = (whole[-1] if whole.size else hits[0]) + n
            return tokens[start:start + k]
    return tokens[:0]


class Speculator:
    """Which running rows propose, and what; fed back with each verification's acceptance."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, *, max_num_seqs: int,
                 max_num_batched_tokens: int):
        self.config = config
        self.max_model_len = max_model_len
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        # Seconds per decode step by padded rows, per verification call by padded tokens (the
        # programs' shapes); a call during which jax compiled is not timed.
        self.costs: dict[tuple[str, int], float] = {}
        self._compiles_at_propose = 0
        self._probing = False  # the last `propose` found rows to speculate but no match for any
        _listen_for_compiles()
        self.reset_counters()

    def reset_counters(self) -> None:
        k = self.config.num_speculative_tokens
        self.counters = dict(spec_decode_num_drafts=0, spec_decode_num_draft_tokens=0,
                             spec_decode_num_accepted_tokens=0, spec_decode_num_accepted_tokens_per_pos=[0] * k)

    def propose(self, running: list[Sequence]) -> dict[Sequence, list[int]]:
        """The drafts of the decoding rows worth a verification call, or {} for a plain decode call.
        Rows that verify nothing this call move their rate back toward 1, so a resting row probes
        again after a while."""
        c, found, rows, unmatched = self.config, {}, [], {}
        self._compiles_at_propose = _NUM_COMPILES[0]
        for seq in running:
            if seq.num_tokens - seq.num_computed != 1 or not self._may_speculate(seq):
                continue
            rows.append(seq)
            params = seq.request.params
            room = min(c.num_speculative_tokens, self.max_model_len - seq.num_tokens - 1,
                       (params.max_tokens if params.max_tokens is not None else 1 << 30) - seq.num_output - 1)
            if seq.spec_rate * c.num_speculative_tokens < MIN_EXPECTED_PER_ROW or room < 1:
                continue
            if c.method == "draft_model":  # the draft model fills them in on the device, in the call
                found[seq] = [RESERVED_DRAFT] * room
                continue
            drafts = ngram_proposal(np.asarray(seq.token_ids, np.int32), c.prompt_lookup_min, c.prompt_lookup_max, room)
            if drafts.size:
                found[seq] = drafts.tolist()
            else:
                unmatched[seq] = [RESERVED_DRAFT] * room
        chosen = found if found and self._worth_verifying(found, len(rows)) else {}
        for seq in rows:
            if seq not in chosen:
                seq.spec_rate += (1.0 - seq.spec_rate) * RATE_RECOVERY
        # No row matched, but if they all had, verifying would pay: look again soon.
        self._probing = bool(unmatched) and not found and self._worth_probing(unmatched, len(rows))
        return chosen

    def _worth_probing(self, unmatched: dict[Sequence, list[int]], num_rows: int) -> bool:
        """Whether the rows, had they all matched, would have verified by the timed costs (both
        timed: a guess from the rates alone would shorten calls that never verify)."""
        step = self.costs.get(self.step_key(num_rows))
        verify = self.costs.get(self.verify_key(num_rows + sum(len(d) for d in unmatched.values())))
        return step is not None and verify is not None and self._beats(unmatched, num_rows, step, verify)

    def limit_decode(self, plan) -> None:
        """A plain decode call planned while speculating rows found no match, though a match would
        have made a verification worth it, runs PROBE_STEPS steps (its rows' reservations cut
        there), not the K of the loop: an output that starts to repeat its context is verified a
        token or two later, not K."""
        if self._probing and plan.is_decode:
            ends = np.array([seq.num_tokens - 1 + PROBE_STEPS for seq, _ in plan.scheduled], np.int32)
            plan.num_mapped[: ends.size] = np.minimum(plan.num_mapped[: ends.size], ends)

    def _worth_verifying(self, found: dict[Sequence, list[int]], num_rows: int) -> bool:
        """Expected tokens per second of one verification call (each row's last token, its drafts
        times its rate) against a decode step's (one token per row), from the timed costs. Untimed
        yet: plain decode calls first (a step's cost is what speculation must beat), then a
        verification whenever the rows expect MIN_EXPECTED_PER_ROW accepted drafts each."""
        step = self.costs.get(self.step_key(num_rows))
        if step is None:
            return False
        verify = self.costs.get(self.verify_key(num_rows + sum(len(d) for d in found.values())))
        if verify is None:
            return self.expects_enough(found, num_rows)
        return self._beats(found, num_rows, step, verify)

    def _beats(self, found: dict[Sequence, list[int]], num_rows: int, step: float, verify: float) -> bool:
        """A verification's expected tokens per second against a decode step's."""
        return (num_rows + self._gain(found)) / verify >= num_rows / step

    @staticmethod
    def _gain(found: dict[Sequence, list[int]]) -> float:
        """Drafts the rows expect to have accepted: each row's rate times its drafts."""
        return sum(seq.spec_rate * len(d) for seq, d in found.items())

    def expects_enough(self, found: dict[Sequence, list[int]], num_rows: int) -> bool:
        """The rule without timed costs: MIN_EXPECTED_PER_ROW accepted drafts expected per row."""
        return self._gain(found) >= MIN_EXPECTED_PER_ROW * num_rows

    def step_key(self, num_rows: int) -> tuple[str, int]:
        return "step", batching.bucket(num_rows, self.max_num_seqs)

    def verify_key(self, num_tokens: int) -> tuple[str, int]:
        return "verify", batching.token_bucket(num_tokens, self.max_num_batched_tokens, verifying=True)

    def observe(self, key: tuple[str, int], seconds: float) -> None:
        """A timed call, planned by the last `propose`: a decode step (`step_key`) or a
        verification of decoding rows alone; left out if jax compiled meanwhile."""
        if _NUM_COMPILES[0] != self._compiles_at_propose:
            return
        old = self.costs.get(key)
        self.costs[key] = seconds if old is None else old + COST_WEIGHT * (seconds - old)

    @staticmethod
    def _may_speculate(seq: Sequence) -> bool:
        """Rows whose next token the host must see first (beam search) or whose grammar masks each
        token (structured output: the mask of a draft's successor needs the grammar advanced over
        the draft) decode one token at a time."""
        request = seq.request
        return not request.one_step_per_call and request.params.structured_outputs is None

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """One verification of `num_drafts` proposals of `seq`, the first `num_accepted` accepted."""
        k = self.counters
        k["spec_decode_num_drafts"] += 1
        k["spec_decode_num_draft_tokens"] += num_drafts
        k["spec_decode_num_accepted_tokens"] += num_accepted
        for pos in range(num_accepted):
            k["spec_decode_num_accepted_tokens_per_pos"][pos] += 1
        seq.spec_rate += RATE_WEIGHT * (num_accepted / num_drafts - seq.spec_rate)

    def stats(self) -> dict:
        k = self.counters
        drafts, tokens, accepted = (k["spec_decode_num_drafts"], k["spec_decode_num_draft_tokens"],
                                    k["spec_decode_num_accepted_tokens"])
        return dict(k, spec_decode_num_accepted_tokens_per_pos=list(k["spec_decode_num_accepted_tokens_per_pos"]),
                    spec_decode_acceptance_rate=accepted / max(tokens, 1),
                    # tokens each verification gave a row: its accepted drafts and the one sampled after
                    spec_decode_mean_accepted_length=1 + accepted / max(drafts, 1))


def load_draft_model(spec, *, dtype=None):
    """The draft model of a "draft_model" `spec` (a SpeculativeConfig) and its tokenizer (loaded in
    `dtype` if given as a path; None for a model object), or Nones; ValueError when it is not a
    model."""
    if spec is None or spec.method != "draft_model":
        return None, None
    if isinstance(spec.model, (str, Path)):
        from paged_jax.entrypoints.llm import load_model  # the entry point imports the engine

        return load_model(spec.model, dtype=dtype)
    if not hasattr(spec.model, "init_cache"):
        raise ValueError(f"speculative_config \"model\" must be a checkpoint directory, a GGUF file or a "
                         f"paged_jax model, got {type(spec.model).__name__}")
    return spec.model, None


def check_draft_vocabulary(spec, tokenizer, draft_tokenizer) -> None:
    """ValueError when the draft's tokenizer encodes text other than the target's does (the same
    vocabulary size may be another vocabulary)."""
    if tokenizer is None or draft_tokenizer is None:
        return
    ours, theirs = tokenizer.encode(VOCABULARY_PROBE), draft_tokenizer.encode(VOCABULARY_PROBE)
    if ours != theirs:
        raise ValueError(f"speculative_config draft model {spec.model} has another vocabulary: it encodes "
                         f"{VOCABULARY_PROBE!r} as {theirs[:12]}..., the target as {ours[:12]}...")
