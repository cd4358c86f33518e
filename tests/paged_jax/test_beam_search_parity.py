"""`LLM.beam_search` on test_engine's random Llama against transformers: without EOS the beams
equal `generate(num_beams=W)` token for token; with EOS they follow vLLM's rules, checked against a
direct implementation of them over transformers' logits (paged_jax/engine/beam_search.py says
where the two differ)."""
import pytest

from paged_jax import LLM, BeamSearchParams
from tests.paged_jax.engine_testing import assert_pool_drained
from tests.paged_jax.test_beam_search import NEW_TOKENS, WIDTH, hf_beams, outputs_of
from tests.paged_jax.test_engine import hf_llama  # noqa: F401 (a fixture)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# test_engine's prompts 4 and 5 (27 and 33 tokens, a 24-token prefix in common): with EOS on, no beam
# of the first ends in EOS within 8 tokens and two of the second's do. Every test here searches these
# two together, so they share compiled programs.
PROMPTS = slice(4, 6)


@pytest.fixture(scope="module")
def random_llama(hf_llama):  # noqa: F811
    """test_engine's random Llama: its directory, the transformers model with EOS off, its prompts."""
    path, prompts, _ = hf_llama
    model = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    model.generation_config.eos_token_id = None
    return path, model, prompts


def engine_on(path, **kwargs):
    return LLM(str(path), block_size=4, num_blocks=128, max_num_seqs=8, enable_prefix_caching=False, log_stats=False,
               **kwargs)


def test_beams_equal_transformers_generate_token_for_token(random_llama):
    path, model, prompts = random_llama
    llm, prompts = engine_on(path), prompts[PROMPTS]
    results = llm.beam_search(prompts, BeamSearchParams(beam_width=WIDTH, max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        tokens, cum_logprobs = hf_beams(model, prompt, WIDTH, NEW_TOKENS)
        assert outputs_of(result, prompt) == tokens
        assert [s.tokens[: len(prompt)] for s in result.sequences] == [prompt] * WIDTH
        assert [s.cum_logprob for s in result.sequences] == pytest.approx(cum_logprobs, abs=1e-4)
        assert [s.finish_reason for s in result.sequences] == ["length"] * WIDTH
        assert all(len(s.logprobs) == NEW_TOKENS for s in result.sequences)
        # each step's entry holds the chosen token and its beam's top 2W
        assert all(t in entry and len(entry) >= 2 * WIDTH for s in result.sequences
                   for t, entry in zip(s.tokens[len(prompt):], s.logprobs))
    stats = llm.stats()
    assert stats["decode_calls"] == NEW_TOKENS - 1  # one decode call per step after the prefill's
    assert_pool_drained(llm)

def vllm_rules_reference(model, prompt, width, max_tokens, eos):
    """vLLM's beam search written directly over transformers' logits, one full forward per beam:
    each beam's top 2W tokens; EOS ones finish, the W best others continue; score = cum_logprob /
    (prompt + output tokens, a final EOS not counted) -> [(tokens, cum_logprob)], best first."""
    def score(beam):
        tokens, cum = beam
        return cum / (len(tokens) - (tokens[-1] == eos))

    beams, finished = [(prompt, 0.0)], []
    for _ in range(max_tokens):
        grown = []
        for tokens, cum in beams:
            with torch.no_grad():
                logprobs = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1], dim=-1)
            top = torch.topk(logprobs, 2 * width)
            for lp, token in zip(top.values.tolist(), top.indices.tolist()):
                (finished if token == eos else grown).append((tokens + [token], cum + lp))
        beams = sorted(grown, key=score, reverse=True)[:width]
    return sorted(finished + beams, key=score, reverse=True)[:width]

def test_with_eos_beams_follow_vllm_rules(random_llama):
    """The random Llama's own EOS (2), on the prompts whose candidates hold it: beams finished by
    EOS after 4 and 5 tokens ("stop") and two live ones ("length") ranked together as vLLM ranks
    them; the other prompt's beams all run to max_tokens."""
    path, model, prompts = random_llama
    llm, prompts = engine_on(path), prompts[PROMPTS]
    assert llm.engine.eos_token_ids == (2,)
    results = llm.beam_search(prompts, BeamSearchParams(beam_width=WIDTH, max_tokens=NEW_TOKENS))
    for prompt, result in zip(prompts, results):
        expected = vllm_rules_reference(model, prompt, WIDTH, NEW_TOKENS, eos=2)
        assert [s.tokens for s in result.sequences] == [t for t, _ in expected]
        assert [s.cum_logprob for s in result.sequences] == pytest.approx([c for _, c in expected], abs=1e-4)
        assert all(s.stop_reason == 2 for s in result.sequences if s.finish_reason == "stop")
    assert [[(s.finish_reason, len(s.tokens) - len(p)) for s in r.sequences] for p, r in zip(prompts, results)] == [
        [("length", NEW_TOKENS)] * WIDTH, [("stop", 4), ("stop", 5), ("length", NEW_TOKENS), ("length", NEW_TOKENS)]]
    assert_pool_drained(llm)
