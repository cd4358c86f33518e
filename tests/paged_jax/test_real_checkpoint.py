"""A real trained checkpoint through the engine: stories260K (tests/data/stories260K/README.md) must
print, greedy from BOS, the text llama2.c publishes for it (doc/stories260K.md), whichever attention
backend runs it, with prefix caching hits and with preemptions."""
from pathlib import Path

import pytest

from paged_jax import LLM, SamplingParams

MODEL = Path(__file__).resolve().parents[1] / "data" / "stories260K"
BOS = 1
# llama2.c's published greedy (-t 0.0) output from BOS.
PUBLISHED = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
             "One day, she saw a big, red ball. She wanted to play with it, but it was too high.\n"
             "Lily's mom said, \"Lily, let's go to the park.\" Lily was sad and didn't know what to do.")
GREEDY = SamplingParams(temperature=0.0, max_tokens=120)


@pytest.fixture(scope="module")
def reference():
    return LLM(str(MODEL), log_stats=False).generate([[BOS]], GREEDY)[0].outputs[0]


def test_greedy_from_bos_is_the_published_story(reference):
    assert reference.text.startswith(PUBLISHED)


@pytest.mark.triton
def test_pallas_kernels_in_interpret_mode_tell_the_same_story(reference):
    llm = LLM(str(MODEL), attention_backend="pallas-interpret", log_stats=False)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    assert llm.generate([[BOS]], params)[0].outputs[0].token_ids == reference.token_ids[:40]


def test_prefix_cache_hits_and_preemptions_keep_the_story(reference):
    """A prompt of BOS and the story's first 40 tokens continues as the story does; asked again it
    hits the prefix cache; six copies at once on 13 blocks of 16 preempt."""
    prompt = [BOS] + reference.token_ids[:40]
    want = reference.token_ids[40:80]
    llm = LLM(str(MODEL), num_blocks=14, max_num_seqs=6, log_stats=False)
    first, again = (llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40))[0] for _ in range(2))
    assert first.outputs[0].token_ids == want and first.num_cached_tokens == 0
    assert again.outputs[0].token_ids == want and again.num_cached_tokens == 32
    outs = llm.generate([prompt] * 6, SamplingParams(temperature=0.0, max_tokens=40))
    assert [o.outputs[0].token_ids for o in outs] == [want] * 6
    assert llm.stats()["num_preemptions"] > 0


def test_swapped_to_host_memory_and_back_the_story_goes_on(reference):
    """Six copies at once on 13 blocks of 16, preempted by swapping: each resumes from its own
    blocks brought back from host memory, and none is recomputed."""
    prompt = [BOS] + reference.token_ids[:40]
    llm = LLM(str(MODEL), num_blocks=14, max_num_seqs=6, log_stats=False, preemption_mode="swap", swap_space=0.01)
    outs = llm.generate([prompt] * 6, SamplingParams(temperature=0.0, max_tokens=40))
    assert [o.outputs[0].token_ids for o in outs] == [reference.token_ids[40:80]] * 6
    stats = llm.stats()
    assert stats["num_swap_preemptions"] == stats["num_preemptions"] > 0
    assert stats["num_swap_fallbacks"] == stats["num_recomputed_tokens"] == 0
