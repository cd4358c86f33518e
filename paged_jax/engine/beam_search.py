"""Beam search on shared blocks (the PagedAttention paper's section 4.4; vLLM's `LLM.beam_search`,
vllm/beam_search.py). Every beam is a sequence slot. A beam kept with several continuations is
forked: they share every full block it holds and each gets a copy of its partial tail block only;
a beam that no continuation keeps is freed at once.

A step costs one wait on the device: a decode call in which every live beam feeds its newest token
and gets its top 2 x W logprobs (the engine's own decode program, left after one step through
max_tokens). The host ranks the candidates, frees the dropped beams and forks the kept ones
(dispatched before the next decode call, their pool changes fetched with its output).

vLLM's rules, and where transformers' `generate(num_beams=W, early_stopping=False)` differs:
- candidates are each beam's top 2W tokens (and, with a temperature, its sampled one); the W best
  that are not EOS continue. transformers ranks the top 2W over all beams together; without EOS
  both keep the same W beams, so with `ignore_eos` (or no EOS reached) the returned beams equal
  transformers' token for token;
- every EOS candidate is set aside as finished, and the W best of the finished and the live beams
  are returned. transformers keeps an EOS candidate only if it is among the step's W best, and
  keeps at most W finished;
- a score is cum_logprob / length ** length_penalty with length = prompt + output tokens, a final
  EOS not counted; transformers counts output tokens only, EOS included;
- the search always runs max_tokens steps (or to max_model_len); transformers' early_stopping=False
  stops once no live beam can beat the worst of W finished ones.
The search runs alone on an idle engine; it neither reads nor writes the prefix cache.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from paged_jax.core.scheduler import Plan
from paged_jax.core.sequence import Request, Sequence, Status
from paged_jax.engine.outputs import Logprob
from paged_jax.sampling_params import BeamSearchParams, SamplingParams

BEAM_KEYS = 1 << 30  # SeedSequence spawn keys of beam searches (requests' unseeded keys use 1 << 31)


@dataclasses.dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt, then output (vLLM's)
    logprobs: list[dict[int, Logprob]]  # per output token: its step's entry (sampled token, top 2W)
    cum_logprob: float = 0.0
    text: str | None = None  # the output's text, a final EOS left out
    finish_reason: str | None = None  # "stop" (EOS) | "length"
    stop_reason: int | None = None  # the EOS token that ended it


@dataclasses.dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first, at most beam_width


def beam_score(num_tokens: int, cum_logprob: float, length_penalty: float) -> float:
    """vLLM's get_beam_search_score; `num_tokens`: prompt and output, a final EOS not counted."""
    return cum_logprob / num_tokens ** length_penalty


@dataclasses.dataclass(eq=False)
class _Beam:
    seq: Sequence  # its slot holds the KV of every token but the newest
    cum_logprob: float
    logprobs: list[dict[int, Logprob]]


@dataclasses.dataclass(eq=False)
class _Search:
    """One prompt's search."""

    request: Request
    max_steps: int  # output tokens: max_tokens, or fewer to stay within max_model_len
    beams: list[_Beam]
    completed: list[BeamSearchSequence] = dataclasses.field(default_factory=list)
    forks: list[tuple[Sequence, Sequence]] = dataclasses.field(default_factory=list)  # (parent, child), next call


def beam_search(engine, prompts: list[tuple[str | None, list[int]]],
                params: BeamSearchParams) -> list[BeamSearchOutput]:
    """One output per (text, token ids) prompt, in order. As many prompts search together as
    max_num_seqs // beam_width slots and the KV cache allow, the cache sized for their worst case
    (no block shared), so no step runs out of blocks."""
    c, width = engine.config, params.beam_width
    if width > c.max_num_seqs:
        raise ValueError(f"beam_width={width} exceeds max_num_seqs={c.max_num_seqs}")
    if engine.has_unfinished_requests() or engine.scheduler.has_work:
        raise ValueError(f"beam_search needs an idle engine; {len(engine.requests)} requests are in it")
    plans = []
    for text, ids in prompts:
        if len(ids) >= c.max_model_len:
            raise ValueError(f"a prompt has {len(ids)} tokens, max_model_len is {c.max_model_len}")
        steps = min(params.max_tokens, c.max_model_len - len(ids))
        need = width * -(-(len(ids) + steps) // c.block_size)
        if need > c.num_blocks - 1:
            raise ValueError(f"beam_width={width} beams of a {len(ids)}-token prompt and max_tokens="
                             f"{params.max_tokens} may need {need} blocks, the KV cache holds {c.num_blocks - 1}")
        plans.append((text, ids, steps, need))
    outputs, i = [], 0
    while i < len(plans):
        group, blocks = [], 0
        while i < len(plans) and len(group) < c.max_num_seqs // width and blocks + plans[i][3] <= c.num_blocks - 1:
            group.append((i, *plans[i][:3]))
            blocks += plans[i][3]
            i += 1
        outputs += _search_group(engine, group, params)
    return outputs


def _search_group(engine, group, params: BeamSearchParams) -> list[BeamSearchOutput]:
    sched, width = engine.scheduler, params.beam_width
    base = SamplingParams(temperature=params.temperature, logprobs=2 * width, ignore_eos=True, max_tokens=1)
    searches = []
    for index, text, ids, steps in group:
        request = Request(f"beam-{index}", text, list(ids), base, time.monotonic())
        key = np.random.SeedSequence(engine.seed, spawn_key=(BEAM_KEYS, index)).generate_state(2, np.uint32)
        seq = Sequence(request, 0, list(ids), key, status=Status.RUNNING)
        seq.slot = sched.take_slot()
        searches.append(_Search(request, steps, [_Beam(seq, 0.0, [])]))
    for search, (out, row) in zip(searches, _prefill(engine, searches)):
        _step(engine, search, out, [row], params)
    live = [s for s in searches if s.beams]
    while live:
        # Dropped beams were freed; a kept beam's other continuations fork from it (a parent holds
        # every token of its beam, one fewer than its continuations).
        engine.model_runner.copy_blocks([sched.fork(parent, child) for s in live for parent, child in s.forks])
        for s in live:  # all beams of a search hold n output tokens: the device stops after one more
            s.request.params = dataclasses.replace(base, max_tokens=s.beams[0].seq.num_output + 1)
        out = _call(engine, Plan(scheduled=[(b.seq, 1) for s in live for b in s.beams], is_decode=True))
        row = 0
        for s in live:
            rows, row = list(range(row, row + len(s.beams))), row + len(s.beams)
            _step(engine, s, out, rows, params)
        live = [s for s in live if s.beams]
    return [_finish(engine, s, params) for s in searches]


def _call(engine, plan: Plan):
    """Map the plan's tokens in the pool, then run it."""
    engine.scheduler.reserve(plan)
    out = engine.model_runner.execute(plan)
    k = engine.counters
    k["decode_calls" if plan.is_decode else "prefill_steps"] += 1
    k["peak_blocks_used"] = max(k["peak_blocks_used"], engine.config.num_blocks - 1 - engine.scheduler.num_free)
    return out


def _prefill(engine, searches: list[_Search]) -> list[tuple[object, int]]:
    """The prompts through prefill steps, in chunks of max_num_batched_tokens -> per search, the
    output and row of its last chunk (which scores its first output token)."""
    last, budget_cap = {}, engine.config.max_num_batched_tokens
    while len(last) < len(searches):
        plan, budget = Plan(), budget_cap
        for search in searches:
            seq = search.beams[0].seq
            n = min(seq.num_tokens - seq.num_computed, budget)
            if n > 0:
                plan.scheduled.append((seq, n))
                budget -= n
        out = _call(engine, plan)
        for row, (seq, n) in enumerate(plan.scheduled):
            seq.num_computed += n
            if seq.num_computed == seq.num_tokens:
                last[seq.request.request_id] = (out, row)
    return [last[s.request.request_id] for s in searches]


def _step(engine, search: _Search, out, rows: list[int], params: BeamSearchParams) -> None:
    """Rank the candidates of the search's beams (output rows `rows`); EOS ones are set aside as
    finished; the best `beam_width` others become the beams: a kept beam's first continuation
    takes over its slot, the others fork from it (`search.forks`, for the next call), a dropped
    beam is freed. At max_steps the kept ones are finished and every slot is freed."""
    width, eos = params.beam_width, () if params.ignore_eos else engine.eos_token_ids
    candidates = []
    for beam, row in zip(search.beams, rows):
        entry = engine.output_processor.logprob_entry(out.tokens[row, 0], out.logprob[row, 0], out.rank[row, 0],
                                                      out.top_ids[row, 0], out.top_logprobs[row, 0], 2 * width)
        length = beam.seq.num_tokens + 1
        for token, lp in entry.items():
            cum = beam.cum_logprob + lp.logprob
            if token in eos:
                search.completed.append(BeamSearchSequence(beam.seq.token_ids + [token], beam.logprobs + [entry], cum,
                                                           finish_reason="stop", stop_reason=token))
            else:
                candidates.append((beam_score(length, cum, params.length_penalty), beam, token, entry, cum))
    candidates.sort(key=lambda cand: cand[0], reverse=True)  # stable: ties keep the beams' order
    kept = candidates[:width]
    last = bool(kept) and search.beams[0].seq.num_output + 1 >= search.max_steps
    parents = set() if last else {id(beam) for _, beam, *_ in kept}
    for beam in search.beams:
        if id(beam) not in parents:
            engine.scheduler.finish(beam.seq, Status.FINISHED_LENGTH)
    beams, taken, search.forks = [], set(), []
    for _, parent, token, entry, cum in kept:
        seq = Sequence(search.request, 0, parent.seq.token_ids + [token], parent.seq.key, status=Status.RUNNING,
                       num_computed=parent.seq.num_tokens)
        beams.append(_Beam(seq, cum, parent.logprobs + [entry]))
        if last:
            continue
        if id(parent) in taken:
            seq.slot = engine.scheduler.take_slot()
            search.forks.append((parent.seq, seq))
        else:
            seq.slot = parent.seq.slot
            taken.add(id(parent))
    if last:
        search.completed += [_as_output(b) for b in beams]
        beams = []
    search.beams = beams


def _as_output(beam: _Beam) -> BeamSearchSequence:
    return BeamSearchSequence(list(beam.seq.token_ids), beam.logprobs, beam.cum_logprob, finish_reason="length")


def _finish(engine, search: _Search, params: BeamSearchParams) -> BeamSearchOutput:
    def score(s: BeamSearchSequence) -> float:
        return beam_score(len(s.tokens) - int(s.finish_reason == "stop"), s.cum_logprob, params.length_penalty)

    best = sorted(search.completed, key=score, reverse=True)[: params.beam_width]
    num_prompt = len(search.request.prompt_token_ids)
    for s in best:
        output = s.tokens[num_prompt: len(s.tokens) - int(s.finish_reason == "stop")]
        s.text = engine.tokenizer.decode(output) if engine.tokenizer is not None else ""
    return BeamSearchOutput(sequences=best)
