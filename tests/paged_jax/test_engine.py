"""The engine end to end on a small random Llama: greedy tokens against Hugging Face `generate`, in
the configurations that exercise each mechanism (plain, preemption, prefix caching, chunked
prefill), with the pool back to all blocks free afterwards."""
import numpy as np
import pytest

from paged_jax import LLM, SamplingParams
from paged_jax.core.prefix_cache import extend_block_hashes
from tests.models.model_testing import tiny_config
from tests.paged_jax.engine_testing import assert_pool_drained

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NEW_TOKENS = 32
SHARED = list(range(3, 27))  # a 24-token common prefix: three full blocks of 8


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A random HF LlamaForCausalLM saved to disk, its prompts and its greedy continuations."""
    config = tiny_config(max_position_embeddings=1024)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config.to_hf_config())).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            z = torch.randn(p.shape)
            p.copy_(z / p.shape[1] ** 0.5 if p.ndim == 2 else 1 + 0.1 * z if "norm" in name else 0.1 * z)
    path = tmp_path_factory.mktemp("hf") / "llama"
    model.save_pretrained(path)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (7, 19, 26, 33)]
    prompts += [SHARED + rng.integers(0, config.vocab_size, n).tolist() for n in (3, 9, 14)]
    model.generation_config.eos_token_id = None
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
            expected.append(out[0, len(prompt):].tolist())
    return path, prompts, expected


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("name, kwargs", [
    ("plain", dict(num_blocks=64, max_num_seqs=4)),
    ("preemption", dict(num_blocks=16, max_num_seqs=4)),
    ("chunked prefill", dict(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=8,
                             long_prefill_token_threshold=6)),
])
def test_greedy_matches_hugging_face(hf_llama, name, kwargs):
    path, prompts, expected = hf_llama
    llm = LLM(str(path), block_size=8, enable_prefix_caching=False, log_stats=False, **kwargs)
    outs = llm.generate(prompts[:4], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected[:4]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    stats = llm.stats()
    if name == "preemption":
        assert stats["num_preemptions"] > 0
    else:
        assert stats["num_preemptions"] == 0
    if name == "chunked prefill":  # 85 prompt tokens through a budget of 8 tokens a step
        assert stats["prefill_steps"] >= -(-sum(len(p) for p in prompts[:4]) // 8)
    assert_pool_drained(llm)


BLOCK_BYTES = 2 * 2 * 2 * 8 * 16 * 4  # K and V, tiny_config's 2 layers and 2 KV heads of 16, blocks of 8, f32


@pytest.mark.parametrize("host_blocks, swaps, fallbacks, recomputed", [
    (None, 6, 0, 0),  # swap_space 1 GiB: every preemption swaps
    # 5 host blocks: one victim finds the host pool full and is recomputed; the 48 tokens it had
    # computed (6 full blocks) are all prefix-cache hits (its own blocks, not yet handed out again).
    (5, 5, 1, 0),
])
def test_swap_preemption_matches_hugging_face(hf_llama, host_blocks, swaps, fallbacks, recomputed):
    """Seven requests (three sharing a prefix) on 11 usable blocks of 8 tokens: preempted requests
    go to host memory and come back into fresh blocks, token for token what HF generates."""
    path, prompts, expected = hf_llama
    space = 1 if host_blocks is None else host_blocks * BLOCK_BYTES / 2**30
    llm = LLM(str(path), block_size=8, num_blocks=12, max_num_seqs=7, log_stats=False,
              preemption_mode="swap", swap_space=space)
    assert llm.engine.model_runner.num_host_blocks == (host_blocks or 2**30 // BLOCK_BYTES)
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.stats()
    assert (stats["num_preemptions"], stats["num_swap_preemptions"], stats["num_swap_fallbacks"]) == (
        swaps + fallbacks, swaps, fallbacks)
    assert stats["num_recomputed_tokens"] == recomputed
    assert stats["num_blocks_swapped_in"] == stats["num_blocks_swapped_out"] > 0
    assert stats["swap_bytes_out"] == stats["swap_bytes_in"] == stats["num_blocks_swapped_out"] * BLOCK_BYTES
    host = llm.engine.scheduler.host_pool
    host.check_invariants()
    assert host.num_free == host.num_blocks and stats["host_kv_usage"] == 0.0
    assert_pool_drained(llm)


def test_prefix_caching_hits_and_matches_hugging_face(hf_llama):
    path, prompts, expected = hf_llama
    llm = LLM(str(path), block_size=8, num_blocks=64, max_num_seqs=4, log_stats=False)
    first = llm.generate([prompts[4]], GREEDY)
    assert first[0].num_cached_tokens == 0
    rest = llm.generate(prompts[5:], GREEDY)
    assert [o.outputs[0].token_ids for o in first + rest] == expected[4:]
    assert [o.num_cached_tokens for o in rest] == [24, 24]  # the shared three blocks, block-aligned
    stats = llm.stats()
    assert stats["prefix_cache_hits"] == 48
    assert stats["prefix_cache_queries"] == sum(len(p) for p in prompts[4:])
    # A repeated prompt hits its own prompt blocks and the output blocks its first run cached.
    again = llm.generate([prompts[4] + expected[4][:16]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert again[0].num_cached_tokens == 40
    assert again[0].outputs[0].token_ids == expected[4][16:20]
    assert_pool_drained(llm)


def run_with_arrivals(engine, arrivals, params):
    """arrivals: {step: [(request_id, prompt)]}; step the engine until all have finished ->
    {request_id: token ids}, and the number of requests running at each step."""
    done, running, step = {}, [], 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for request_id, prompt in arrivals.get(step, []):
            engine.add_request(request_id, prompt, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        running.append(len(engine.scheduler.running))
        step += 1
    return done, running


def test_a_one_token_prefill_chunk_is_not_run_as_a_decode(hf_llama):
    """The second request arrives while the first decodes; a budget of 2 tokens gives each one
    token a step, so the second's prompt goes in one token at a time beside the first's decode:
    a prefill, not a decode (the decode loop would feed the last prompt token at the wrong position)."""
    path, prompts, expected = hf_llama
    llm = LLM(str(path), block_size=8, num_blocks=64, max_num_seqs=2, max_num_batched_tokens=2,
              enable_prefix_caching=False, log_stats=False)
    steps = []  # (is_decode, pending tokens of each scheduled sequence) at planning time
    schedule = llm.engine.scheduler.schedule

    def spy(*args, **kwargs):
        plan = schedule(*args, **kwargs)
        if plan is not None:
            steps.append((plan.is_decode, [seq.num_tokens - seq.num_computed for seq, _ in plan.scheduled]))
        return plan

    llm.engine.scheduler.schedule = spy
    done, _ = run_with_arrivals(llm.engine, {0: [("a", prompts[0])], 5: [("b", prompts[1])]}, GREEDY)
    assert [done["a"], done["b"]] == expected[:2]
    mixed = [decode for decode, pending in steps if len(pending) == 2 and pending[1] > 1]
    assert len(mixed) >= 10 and not any(mixed)  # b's prompt, a token a step beside a's decode
    assert_pool_drained(llm)


def test_greedy_at_a_capacity_far_above_the_load(hf_llama):
    """max_num_seqs 64 and max_model_len 1024 (16x the longest request) for at most 4 running at once,
    requests arriving and finishing every few steps, and a pool small enough to preempt."""
    path, prompts, expected = hf_llama
    llm = LLM(str(path), block_size=8, num_blocks=18, max_num_seqs=64, max_model_len=1024,
              max_num_batched_tokens=64, num_decode_steps=4, log_stats=False)
    arrivals = {0: [("0", prompts[0]), ("1", prompts[1])], 3: [("2", prompts[2])], 4: [("4", prompts[4])],
                9: [("3", prompts[3]), ("5", prompts[5])], 14: [("6", prompts[6])]}
    done, running = run_with_arrivals(llm.engine, arrivals, GREEDY)
    assert [done[str(i)] for i in range(7)] == expected
    assert llm.stats()["num_preemptions"] > 0
    assert len(set(running)) >= 3  # concurrency rose and fell
    assert_pool_drained(llm)


def test_prompt_logprobs_are_transformers_log_softmax_in_chunks_and_skip_the_prefix_cache(hf_llama):
    """SamplingParams(prompt_logprobs=N): None for the first prompt token, then each token's logprob
    and rank and the top N, against transformers' logits; computed in chunks of 6 tokens; such a
    request reads no prefix-cache entry, even for a prompt the cache holds."""
    path, prompts, _ = hf_llama
    prompt = prompts[4]  # 27 tokens, the shared prefix first
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), -1).numpy()
    llm = LLM(str(path), block_size=8, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=8,
              long_prefill_token_threshold=6, log_stats=False)
    llm.generate([prompt], GREEDY)  # the prompt's blocks now sit in the prefix cache
    with pytest.raises(ValueError, match="prompt_logprobs must be >= 0, got -1"):
        SamplingParams(prompt_logprobs=-1)
    outs = llm.generate([prompt, prompts[0]], [SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3),
                                              SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0)])
    got = outs[0].prompt_logprobs
    assert outs[0].num_cached_tokens == 0 and got[0] is None and len(got) == len(prompt)
    for p in range(1, len(prompt)):
        row, entry = want[p - 1], got[p]
        top3 = np.argsort(-row)[:3].tolist()
        assert list(entry)[0] == prompt[p] and set(entry) == {prompt[p], *top3}
        assert entry[prompt[p]].rank == 1 + int(np.sum(row > row[prompt[p]]))
        for token, lp in entry.items():
            assert abs(lp.logprob - row[token]) < 1e-4
        assert [entry[t].rank for t in top3] == [1, 2, 3]
    assert [list(e) for e in outs[1].prompt_logprobs[1:]] == [[t] for t in prompts[0][1:]]
    assert outs[1].prompt_logprobs[0] is None
    assert_pool_drained(llm)


def test_host_prefix_cache_keeps_evicted_blocks_and_matches_hugging_face(hf_llama):
    """11 usable blocks of 8: the shared prefix's blocks, cached by a first request, are evicted by
    four others (which preempt each other); with the host prefix cache every cached block was copied
    to host memory as the device evicted it, and a later request on that prefix copies its three
    blocks back instead of computing them. Tokens stay HF's."""
    path, prompts, expected = hf_llama
    llm = LLM(str(path), block_size=8, num_blocks=12, max_num_seqs=4, log_stats=False,
              enable_host_prefix_cache=True, swap_space=1)
    sched, evicted = llm.engine.scheduler, []
    evict = sched.prefix_cache.evict

    def spy(block_ids):  # every entry the device drops must already be in the host tier
        hashes = [sched.prefix_cache.hash_of[b] for b in block_ids if b in sched.prefix_cache.hash_of]
        assert all(h in sched.host_pool.tier for h in hashes)
        evicted.extend(hashes)
        evict(block_ids)

    sched.prefix_cache.evict = spy
    first = llm.generate([prompts[4]], GREEDY)
    middle = llm.generate(prompts[:4], GREEDY)
    before = llm.stats()
    last = llm.generate([prompts[5]], GREEDY)
    stats = llm.stats()
    assert [o.outputs[0].token_ids for o in middle + first + last] == expected[:6]
    assert last[0].num_cached_tokens == 24
    chain = []  # the first request's 7 full blocks (27 prompt + 31 computed output tokens)
    extend_block_hashes(chain, prompts[4] + expected[4][:31], 8)
    assert len(chain) == 7 and set(chain) <= set(evicted)
    assert stats["prefix_cache_hits"] == before["prefix_cache_hits"]  # none from the device
    assert stats["host_prefix_cache_hits"] - before["host_prefix_cache_hits"] == 24
    assert stats["host_prefix_cache_blocks_in"] * 8 == stats["host_prefix_cache_hits"]
    for way in ("in", "out"):
        assert stats[f"host_prefix_cache_bytes_{way}"] == stats[f"host_prefix_cache_blocks_{way}"] * BLOCK_BYTES
    sched.host_pool.check_invariants()
    assert_pool_drained(llm)
