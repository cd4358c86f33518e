"""`LLM.beam_search` (paged_jax/engine/beam_search.py) on stories260K, a real trained model: its
beams are transformers' `generate(num_beams=W)` (where torch is installed); they share their blocks
(exact counts); bad input raises and runs nothing; the pool is drained afterwards. The random-Llama
parity and the EOS rules: test_beam_search_parity.py."""
from pathlib import Path

import pytest

from paged_jax import LLM, BeamSearchParams
from tests.paged_jax.engine_testing import assert_pool_drained

STORIES = Path(__file__).resolve().parents[1] / "data" / "stories260K"
WIDTH, NEW_TOKENS = 4, 8
# 16 and 13 tokens with BOS; every test searches both together, so they share compiled programs
STORY_STARTS = ("Once upon a time, there was a little girl named Lily.", "One day, Tom went to the park")


def hf_beams(model, prompt, width, new_tokens):
    """transformers' beam search with the issue's flags -> (output token lists, cumulative logprobs), best first."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
                             length_penalty=1.0, early_stopping=False, max_new_tokens=new_tokens, pad_token_id=0,
                             return_dict_in_generate=True, output_scores=True)
    # sequences_scores = cum_logprob / output length ** length_penalty; every beam is new_tokens long here
    return [s[len(prompt):].tolist() for s in out.sequences], (out.sequences_scores * new_tokens).tolist()


def outputs_of(result, prompt):
    return [s.tokens[len(prompt):] for s in result.sequences]


def stories_engine(**kwargs):
    """stories260K in 4-token blocks, and its tokenized STORY_STARTS."""
    llm = LLM(str(STORIES), block_size=4, num_blocks=128, max_num_seqs=8, log_stats=False, **kwargs)
    return llm, [llm.get_tokenizer().encode(text) for text in STORY_STARTS]


def test_beams_on_stories260k_equal_transformers_generate():
    """EOS on in both: no beam ends in EOS within 10 tokens here, so the beams, their scores and
    their text are transformers' ("She loved to play outside", ...)."""
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(STORIES).eval()
    llm, prompts = stories_engine()
    results = llm.beam_search(prompts, BeamSearchParams(beam_width=WIDTH, max_tokens=10))
    for prompt, result in zip(prompts, results):
        tokens, cum_logprobs = hf_beams(model, prompt, WIDTH, 10)
        assert outputs_of(result, prompt) == tokens
        assert [s.cum_logprob for s in result.sequences] == pytest.approx(cum_logprobs, abs=1e-4)
        assert [s.finish_reason for s in result.sequences] == ["length"] * WIDTH
        assert [s.text for s in result.sequences] == [llm.get_tokenizer().decode(t) for t in tokens]
    assert [r.sequences[0].text for r in results] == ["She loved to play outside", "with his mom. They saw a big tre"]
    assert_pool_drained(llm)


def blocks_held(beams, block_size):
    """Blocks that beams (token lists, all in the cache) hold when they share the full blocks of
    their common prefixes: one per distinct full-block prefix, and each beam's partial tail block."""
    full = {tuple(t[: (i + 1) * block_size]) for t in beams for i in range(len(t) // block_size)}
    return len(full) + sum(len(t) % block_size != 0 for t in beams)


def test_beams_share_blocks_and_free_dropped_ones_at_once():
    """The pool's peak during a search is exactly what the beams of its fullest step hold when they
    share every common full block (so a dropped beam is freed before the next step), and fewer
    than W independent sequences of the same length hold."""
    llm, prompts = stories_engine()  # a fresh engine: the peak counter starts at zero
    llm.beam_search(prompts, BeamSearchParams(beam_width=WIDTH, max_tokens=NEW_TOKENS))
    peak = llm.stats()["peak_blocks_used"]
    # The beams a search with max_tokens=j keeps are those of step j of the longer search (no EOS
    # reached here); after the decode call of step j (j < NEW_TOKENS) all their tokens are in the cache.
    steps = [llm.beam_search(prompts, BeamSearchParams(beam_width=WIDTH, max_tokens=j)) for j in range(1, NEW_TOKENS)]
    assert all(s.finish_reason == "length" for step in steps for result in step for s in result.sequences)
    expected = max(sum(blocks_held([s.tokens for s in result.sequences], 4) for result in step) for step in steps)
    # W independent sequences per prompt of 16 + 7 and 13 + 7 tokens: 6 and 5 blocks each
    independent = WIDTH * sum(-(-(len(p) + NEW_TOKENS - 1) // 4) for p in prompts)
    assert (peak, expected, independent) == (19, 19, 44)
    assert_pool_drained(llm)


def test_bad_beam_search_input_raises_naming_it_and_runs_nothing():
    for kwargs, name in ((dict(beam_width=0, max_tokens=4), "beam_width"),
                         (dict(beam_width=2, max_tokens=0), "max_tokens"),
                         (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature")):
        with pytest.raises(ValueError, match=name):
            BeamSearchParams(**kwargs)
    llm, prompts = stories_engine()
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=NEW_TOKENS)
    before = llm.beam_search(prompts, params)
    with pytest.raises(ValueError, match="beam_width=9 exceeds max_num_seqs=8"):
        llm.beam_search(prompts, BeamSearchParams(beam_width=9, max_tokens=4))
    with pytest.raises(ValueError, match=r"outside \[0, 512\)"):
        llm.beam_search([*prompts, [1, 512]], params)
    assert llm.stats()["prefill_steps"] == 1  # neither ran a step
    assert_pool_drained(llm)
    after = llm.beam_search(prompts, params)
    assert [[(s.tokens, s.cum_logprob) for s in r.sequences] for r in after] == [
        [(s.tokens, s.cum_logprob) for s in r.sequences] for r in before]
    assert_pool_drained(llm)


def test_with_a_temperature_a_beams_sampled_token_joins_its_candidates():
    """vLLM: with a temperature, each beam's sampled token is a candidate besides its top 2W (here
    unlikely ones, outside the top 2W at some steps, that never make the cut: the beams are the
    greedy search's); scores stay the model's own logprobs; a seeded engine samples the same twice."""
    llm, prompts = stories_engine()
    greedy = llm.beam_search(prompts, BeamSearchParams(beam_width=WIDTH, max_tokens=NEW_TOKENS))
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=NEW_TOKENS, temperature=3.0)
    hot, again = llm.beam_search(prompts, params), llm.beam_search(prompts, params)
    assert [[s.tokens for s in r.sequences] for r in hot] == [[s.tokens for s in r.sequences] for r in greedy]
    assert [[s.logprobs for s in r.sequences] for r in hot] == [[s.logprobs for s in r.sequences] for r in again]
    entries = [e for r in hot for s in r.sequences for e in s.logprobs]
    assert {len(e) for e in entries} == {2 * WIDTH, 2 * WIDTH + 1}
    for prompt, result in zip(prompts, hot):
        for s in result.sequences:
            chosen = sum(e[t].logprob for t, e in zip(s.tokens[len(prompt):], s.logprobs))
            assert s.cum_logprob == pytest.approx(chosen, abs=1e-5)
    assert_pool_drained(llm)


@pytest.mark.triton
def test_pallas_kernels_in_interpret_mode_search_the_same_beams():
    """The forks' block copies and the attention through our Pallas kernels (interpret mode)."""
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=6)
    (reference, prompts), (pallas, _) = stories_engine(), stories_engine(attention_backend="pallas-interpret")
    want = [[s.tokens for s in r.sequences] for r in reference.beam_search(prompts, params)]
    assert [[s.tokens for s in r.sequences] for r in pallas.beam_search(prompts, params)] == want
    assert_pool_drained(pallas)


def test_a_search_whose_candidates_are_all_eos_ends_at_once_and_leaves_the_engine():
    """Every token an EOS: the first step's candidates all finish, the W best of them are the
    result (one token each, the EOS not in the text), and the request leaves the engine at once."""
    llm, prompts = stories_engine()
    greedy = llm.beam_search(prompts, BeamSearchParams(beam_width=WIDTH, max_tokens=1))
    llm.engine.eos_token_ids = tuple(range(llm.engine.model_config.vocab_size))
    results = llm.beam_search(prompts, BeamSearchParams(beam_width=WIDTH, max_tokens=NEW_TOKENS))
    for prompt, result, first in zip(prompts, results, greedy):
        assert [s.finish_reason for s in result.sequences] == ["stop"] * WIDTH
        assert [s.tokens for s in result.sequences] == [s.tokens for s in first.sequences]
        assert [s.stop_reason for s in result.sequences] == [s.tokens[-1] for s in result.sequences]
        assert [s.text for s in result.sequences] == [""] * WIDTH
    assert llm.engine.requests == {} and not llm.engine.has_unfinished_requests()
    assert_pool_drained(llm)


def test_serial_and_overlapped_engines_search_the_same_beams():
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=NEW_TOKENS)
    (overlapped, prompts), (serial, _) = stories_engine(), stories_engine(async_scheduling=False)
    want = [[(s.tokens, s.cum_logprob) for s in r.sequences] for r in overlapped.beam_search(prompts, params)]
    assert [[(s.tokens, s.cum_logprob) for s in r.sequences] for r in serial.beam_search(prompts, params)] == want
    assert serial.stats()["decode_calls"] == overlapped.stats()["decode_calls"] == NEW_TOKENS - 1
