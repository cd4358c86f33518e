"""Beam search on shared blocks (the PagedAttention paper's section 4.4; vLLM's `LLM.beam_search`,
vllm/beam_search.py). Each prompt is one request that runs through the scheduler like every other:
its beams are the request's sequences, each in a sequence slot. A beam kept with several
continuations is forked (`Scheduler.fork`): they share every full block it holds and each gets a
copy of its partial tail block only; a beam that no continuation keeps is finished, its blocks
freed at once.

A step costs one engine step: the request asks for its top 2 x W logprobs and for one token per
decode call (`Request.one_step_per_call`), so the host ranks the candidates of each token before
the next is sampled; the newest token of a beam is not in the cache yet, so the host may replace it
with the candidate it keeps.

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
The search runs alone on an idle engine; its prompts fill the prefix cache but never read it.
"""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from paged_jax.core.sequence import Request, Sequence, Status
from paged_jax.engine.outputs import Logprob
from paged_jax.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

BEAM_KEYS = 1 << 30  # the SeedSequence spawn key a search's seed is drawn under (unseeded requests: 1 << 31)


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


def beam_search(engine, prompts: list[tuple[str | None, list[int]]],
                params: BeamSearchParams) -> list[BeamSearchOutput]:
    """One output per (text, token ids) prompt, in order. As many prompts search together as
    max_num_seqs // beam_width slots and the KV cache allow, the cache sized for their worst case
    (no block shared), so no step runs out of blocks."""
    c, width = engine.config, params.beam_width
    if width > c.max_num_seqs:
        raise ValueError(f"beam_width={width} exceeds max_num_seqs={c.max_num_seqs}")
    if engine.has_unfinished_requests():
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
    requests = []
    for index, _, ids, steps in group:
        # Seeded per search (the device derives each step's key), so a search samples the same twice.
        seed = int(np.random.SeedSequence(engine.seed, spawn_key=(BEAM_KEYS, index)).generate_state(1)[0])
        sp = SamplingParams(temperature=params.temperature, logprobs=2 * params.beam_width, ignore_eos=True,
                            max_tokens=steps, seed=seed, output_kind=RequestOutputKind.FINAL_ONLY)
        error = engine.unservable(ids, sp)
        if error:
            raise ValueError(error)
        requests.append((f"beam-search-{next(_SEARCH_IDS)}", ids, sp, steps))
    searches = []
    for request_id, ids, sp, steps in requests:
        engine.add_request(request_id, list(ids), sp)
        request = engine.requests[request_id]
        request.one_step_per_call = request.skip_reading_prefix_cache = True
        searches.append(_Search(request, steps, [_Beam(request.seqs[0], 0.0, [])]))
    live = list(searches)
    while live:
        if not engine.has_unfinished_requests():
            raise RuntimeError("internal error: a beam search's requests ended with beams still live")
        engine.step()
        for search in live:
            if all(b.seq.num_output == len(b.logprobs) + 1 for b in search.beams):  # each has its new token
                _step(engine, search, params)
        live = [s for s in live if s.beams]
    while any(s.request.request_id in engine.requests for s in searches):  # report what ended early
        engine.step()
    return [_finish(engine, s, params) for s in searches]


_SEARCH_IDS = itertools.count()


def _step(engine, search: _Search, params: BeamSearchParams) -> None:
    """Rank the candidates of the search's beams, each holding its newest token's logprob entry;
    EOS ones are set aside as finished; the best `beam_width` others become the beams: a kept
    beam's first continuation takes over its sequence (its newest token replaced), the others fork
    from it, a dropped beam is finished. At max_steps the kept ones are finished (the device
    stopped them on length)."""
    width, eos, scheduler = params.beam_width, () if params.ignore_eos else engine.eos_token_ids, engine.scheduler
    # Every fork needs a slot and at most one block: the group was sized for its worst case.
    candidates = []
    for beam in search.beams:
        entry, length = beam.seq.logprobs[-1], beam.seq.num_tokens
        for token, lp in entry.items():
            cum = beam.cum_logprob + lp.logprob
            if token in eos:
                search.completed.append(BeamSearchSequence(beam.seq.token_ids[:-1] + [token], beam.logprobs + [entry],
                                                           cum, finish_reason="stop", stop_reason=token))
            else:
                candidates.append((beam_score(length, cum, params.length_penalty), beam, token, entry, cum))
    candidates.sort(key=lambda cand: cand[0], reverse=True)  # stable: ties keep the beams' order
    kept = candidates[:width]
    if not kept:  # every candidate is an EOS: the search ends, its beams freed now, reported next step
        engine.abort_request(search.request.request_id)
        search.beams = []
        return
    if search.beams[0].seq.num_output >= search.max_steps:
        search.completed += [BeamSearchSequence(beam.seq.token_ids[:-1] + [token], beam.logprobs + [entry], cum,
                                                finish_reason="length") for _, beam, token, entry, cum in kept]
        search.beams = []
        return
    parents = {id(beam) for _, beam, *_ in kept}
    for beam in search.beams:
        if id(beam) not in parents:
            scheduler.finish([beam.seq], Status.FINISHED_LENGTH)
    beams, tokens = [], {id(beam): beam.seq.token_ids[:-1] for beam in search.beams}
    for _, parent, token, entry, cum in kept:
        if any(b.seq is parent.seq for b in beams):  # another continuation of a kept beam: a fork
            full = len(tokens[id(parent)]) // engine.config.block_size  # blocks whose hashes hold
            seq = Sequence(search.request, 0, tokens[id(parent)] + [token], parent.seq.key,
                           num_computed=parent.seq.num_computed, block_hashes=parent.seq.block_hashes[:full],
                           num_cached_blocks=min(parent.seq.num_cached_blocks, full), logprobs=[entry])
            scheduler.fork(parent.seq, seq)
        else:
            seq = parent.seq
            seq.token_ids[-1] = token
            del seq.block_hashes[(seq.num_tokens - 1) // engine.config.block_size:]  # hashed the replaced token
        beams.append(_Beam(seq, cum, parent.logprobs + [entry]))
    search.beams = beams
    search.request.seqs = [b.seq for b in beams]


def _finish(engine, search: _Search, params: BeamSearchParams) -> BeamSearchOutput:
    def score(s: BeamSearchSequence) -> float:
        return beam_score(len(s.tokens) - int(s.finish_reason == "stop"), s.cum_logprob, params.length_penalty)

    best = sorted(search.completed, key=score, reverse=True)[: params.beam_width]
    num_prompt = len(search.request.prompt_token_ids)
    for s in best:
        output = s.tokens[num_prompt: len(s.tokens) - int(s.finish_reason == "stop")]
        s.text = engine.tokenizer.decode(output) if engine.tokenizer is not None else ""
    return BeamSearchOutput(sequences=best)
