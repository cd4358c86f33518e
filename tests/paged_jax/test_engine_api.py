"""The engine's vLLM behaviours on a small random Llama: scheduling, stops, parallel sampling with
forked blocks, seeds, penalties, logprobs, bad input, abort and streaming, compile counts."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers

from models.tokenizer import Tokenizer
from paged_jax import LLM, LLMEngine, SamplingParams
from paged_jax.core import block_pool as bp
from tests.models.model_testing import dense_logits, random_model, tiny_config

PROMPT = [5, 17, 99, 3, 42, 8, 61, 20, 7, 33, 90, 14]


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(max_position_embeddings=1024, eos_token_id=None))


_made = []


def make_llm(model, **kwargs):
    args = dict(block_size=8, num_blocks=96, max_num_seqs=4, log_stats=False)
    llm = LLM(model, **{**args, **kwargs})
    _made.append(llm)
    return llm


@pytest.fixture(autouse=True)
def no_leak():
    """After every test, each engine it made runs dry and has every block back."""
    _made.clear()
    yield
    for llm in _made:
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        assert drained(llm)


def greedy_reference(model, prompt, n, penalty=None):
    """Greedy continuation from the dense forward; `penalty` = (repetition, frequency, presence).
    Each forward is padded on the right to a power of two (inert: attention is causal), so a
    continuation compiles a few shapes, not one per length."""
    tokens = list(prompt)
    for _ in range(n):
        padded = tokens + [0] * (max(16, 1 << (len(tokens) - 1).bit_length()) - len(tokens))
        logits = np.asarray(dense_logits(model, jnp.array([padded]))[0, len(tokens) - 1], np.float64)
        if penalty:
            rep, freq, pres = penalty
            out = np.bincount(tokens[len(prompt):], minlength=logits.size)
            seen = (np.bincount(prompt, minlength=logits.size) > 0) | (out > 0)
            logits[seen] = np.where(logits[seen] > 0, logits[seen] / rep, logits[seen] * rep)
            logits -= freq * out + pres * (out > 0)
        tokens.append(int(np.argmax(logits)))
    return tokens[len(prompt):]


def drained(llm):
    pool = llm.engine.block_pool
    bp.check_invariants(pool)
    return int(bp.num_free(pool)) == llm.engine.config.num_blocks - 1


def test_concurrent_partial_prefills_follow_vllm(model):
    """vLLM's test_schedule_concurrent_partial_requests: budget 1024, threshold 400, 3 x 800 tokens."""
    llm = make_llm(model, block_size=16, num_blocks=200, max_num_batched_tokens=1024,
                   long_prefill_token_threshold=400, max_model_len=1024)
    engine, steps = llm.engine, []
    schedule = engine.scheduler.schedule

    def spy(*args, **kwargs):
        plan = schedule(*args, **kwargs)
        steps.append([n for _, n in sorted(plan.scheduled, key=lambda item: item[0].slot)])
        return plan

    engine.scheduler.schedule = spy
    rng = np.random.default_rng(0)
    for i in range(3):
        engine.add_request(str(i), rng.integers(0, 128, 800).tolist(), SamplingParams(max_tokens=2, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert steps == [[400, 400, 224], [400, 400, 224], [1, 1, 352]]


def test_stops_follow_vllms_check_stop(model):
    g = greedy_reference(model, PROMPT, 12)
    stop_token = g[3]
    assert stop_token not in g[:3]
    llm = make_llm(model)
    outs = llm.generate([PROMPT] * 4, [
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_token], min_tokens=6),
        SamplingParams(temperature=0.0, max_tokens=5),
        SamplingParams(temperature=0.0, max_tokens=12),
    ])
    first, masked, capped, full = (o.outputs[0] for o in outs)
    assert (first.token_ids, first.finish_reason, first.stop_reason) == (g[:4], "stop", stop_token)
    assert masked.token_ids[:3] == g[:3] and stop_token not in masked.token_ids[:5]  # masked below min_tokens
    assert len(masked.token_ids) >= 6
    assert (capped.token_ids, capped.finish_reason) == (g[:5], "length")
    assert (full.token_ids, full.finish_reason) == (g, "length")

    # EOS (the tokenizer's); ignore_eos runs past it.
    llm = make_llm(model, tokenizer=word_tokenizer(eos_token_ids=(stop_token,)))
    eos, ignored = llm.generate([PROMPT] * 2, [SamplingParams(temperature=0.0, max_tokens=12),
                                               SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)])
    assert (eos.outputs[0].token_ids, eos.outputs[0].finish_reason, eos.outputs[0].stop_reason) == (g[:4], "stop", None)
    assert ignored.outputs[0].token_ids == g


def word_tokenizer(eos_token_ids=()):
    """Token i is the word "w{i}"; decoding joins words with spaces."""
    inner = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    inner.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    inner.decoder = tokenizers.decoders.WordPiece(prefix="##")
    return Tokenizer(inner, eos_token_ids=eos_token_ids, bos_token_id=None)


def test_stop_strings_cut_the_text(model):
    g = greedy_reference(model, PROMPT, 10)
    llm = make_llm(model, tokenizer=word_tokenizer())
    stop = f"w{g[4]} w{g[5]}"
    out = llm.generate([" ".join(f"w{t}" for t in PROMPT)],
                       SamplingParams(temperature=0.0, max_tokens=10, stop=[stop]))[0].outputs[0]
    assert out.token_ids == g[:6] and out.stop_reason == stop and out.finish_reason == "stop"
    # Decoded after the prompt's words, the first word comes with the space before it (as in vLLM).
    assert out.text == "".join(f" w{t}" for t in g[:4]) + " "


def test_parallel_samples_fork_the_prompt_blocks(model):
    prompt = list(range(1, 21))  # 20 tokens: two full blocks of 8 and a partial one
    params = SamplingParams(n=4, temperature=1.0, max_tokens=4, ignore_eos=True, seed=7)
    llm = make_llm(model, enable_prefix_caching=False)
    out = llm.generate([prompt], params)[0]
    samples = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(samples)) == 4 and [c.index for c in out.outputs] == [0, 1, 2, 3]
    # 3 prompt blocks shared, 3 forked tails: 6 blocks, against 4 x 3 for separate requests.
    assert llm.stats()["peak_blocks_used"] == 6
    separate = make_llm(model, enable_prefix_caching=False)
    separate.generate([prompt] * 4, SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True))
    assert separate.stats()["peak_blocks_used"] == 12
    again = make_llm(model).generate([prompt, PROMPT], [params, SamplingParams(max_tokens=3)])[0]
    assert [tuple(c.token_ids) for c in again.outputs] == samples


def test_a_seed_gives_the_same_tokens_whatever_shares_the_batch(model):
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=10, seed=123, ignore_eos=True)
    alone = make_llm(model).generate([PROMPT], params)[0].outputs[0].token_ids
    others = [list(range(i, i + 9)) for i in (30, 50, 70)]
    crowd = make_llm(model).generate(others + [PROMPT], [SamplingParams(temperature=1.0, max_tokens=7)] * 3 + [params])
    assert crowd[3].outputs[0].token_ids == alone
    # Preempted and recomputed, a seeded request resumes the same stream.
    tight = make_llm(model, num_blocks=9)
    out = tight.generate(others + [PROMPT], [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)] * 3 + [params])
    assert tight.stats()["num_preemptions"] > 0 and out[3].outputs[0].token_ids == alone


def test_penalties_match_a_dense_reference(model):
    penalty = (1.4, 0.6, 0.3)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=penalty[0],
                            frequency_penalty=penalty[1], presence_penalty=penalty[2])
    outs = make_llm(model).generate([PROMPT, PROMPT], [params, SamplingParams(temperature=0.0, max_tokens=10)])
    assert outs[0].outputs[0].token_ids == greedy_reference(model, PROMPT, 10, penalty)
    assert outs[1].outputs[0].token_ids == greedy_reference(model, PROMPT, 10)


def test_logprobs_are_the_models_log_softmax(model):
    out = make_llm(model).generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=3, logprobs=2))[0].outputs[0]
    tokens = PROMPT + out.token_ids
    logits = np.asarray(dense_logits(model, jnp.array([tokens]))[0], np.float64)
    ref = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    total = 0.0
    for j, entry in enumerate(out.logprobs):
        row = ref[len(PROMPT) - 1 + j]
        best = np.argsort(-row)[:2]
        assert set(entry) == {out.token_ids[j], *best.tolist()}
        assert entry[out.token_ids[j]].rank == 1
        for tid, lp in entry.items():
            assert lp.logprob == pytest.approx(row[tid], abs=1e-5)
        total += row[out.token_ids[j]]
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_bad_input_is_refused_and_the_rest_runs(model):
    llm = make_llm(model, max_model_len=40)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([PROMPT, []])
    with pytest.raises(ValueError, match=r"prompt token ids \[128\] are outside \[0, 128\)"):
        llm.generate([PROMPT, [1, 128]])
    assert not llm.engine.has_unfinished_requests()
    long, ok, capped = llm.generate([list(range(45)), PROMPT, PROMPT],
                                    [SamplingParams(max_tokens=4), SamplingParams(temperature=0.0, max_tokens=4),
                                     SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)])
    assert long.outputs[0].finish_reason == "error" and "45 tokens, max_model_len is 40" in long.error
    assert ok.outputs[0].token_ids == greedy_reference(model, PROMPT, 4)
    assert capped.outputs[0].finish_reason == "length" and len(capped.outputs[0].token_ids) == 40 - len(PROMPT)


@pytest.mark.parametrize("overlapped", [False, True])
def test_streaming_steps_and_abort(model, overlapped):
    """Two streamed outputs each, then b aborted. Overlapped, the step that dispatches the first
    decode call returns nothing (its tokens come with the next step), and b's row in the call
    running when it is aborted is discarded."""
    engine = LLMEngine(model, block_size=8, num_blocks=64, max_num_seqs=4, num_decode_steps=4, log_stats=False,
                       async_scheduling=overlapped)
    engine.add_request("a", PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    engine.add_request("b", PROMPT[:5], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    seen, steps = {"a": [], "b": []}, 0
    while min(map(len, seen.values())) < 2:
        for out in engine.step():
            seen[out.request_id].append(len(out.outputs[0].token_ids))
        steps += 1
    assert steps == 2 + overlapped
    engine.abort_request("b")
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0]
    assert seen["a"] == [1, 5] and seen["b"] == [1, 5]  # prefill step, then 4 decode steps at a time
    assert finals["b"].finish_reason == "abort" and len(finals["b"].token_ids) == 5
    assert finals["a"].token_ids == greedy_reference(model, PROMPT, 12)
    assert int(bp.num_free(engine.block_pool)) == 63


@contextlib.contextmanager
def counting_compiles():
    """-> a list that gets one entry per XLA compile while the block runs: the jitted function's name."""
    compiles = []

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(kwargs.get("fun_name", event))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def test_a_steady_workload_compiles_nothing_new(model):
    llm = make_llm(model, max_num_seqs=3)  # shapes no other test compiled
    rng = np.random.default_rng(0)

    def wave(lengths):
        prompts = [rng.integers(0, 128, n).tolist() for n in lengths]
        llm.generate(prompts, SamplingParams(temperature=0.7, max_tokens=int(rng.integers(5, 20))))

    with counting_compiles() as compiles:
        # Concurrency rises and falls (1, 2, 3 rows, then 6 requests through 3 slots): warm-up
        # compiles each (rows, width, tokens) bucket once.
        for lengths in ([14], [8] * 2, [14] * 3, [8] * 3, [3] * 3, [14, 3, 8, 5, 11, 2]):
            wave(lengths)
        warm = len(compiles)
        for _ in range(3):
            wave(rng.integers(2, 15, 6))
        # Compiled programs: the decode loop per row bucket (1, 2, 3 rows; tables 4 blocks wide at
        # these lengths), prefill steps per (rows, tokens) bucket, pool ops per free-list size, and
        # their helpers; a handful, and none after the warm-up.
        assert 0 < warm <= 24 and len(compiles) == warm


def test_the_decode_loop_compiles_once_whether_its_batch_comes_from_the_host_or_the_device(model):
    """Overlapped scheduling builds the next decode batch on the device (runner.continue_decode);
    the first call of a run sends the host's. jit compiles a program per placement of its inputs,
    so both are placed alike: one decode program per variant, not two."""
    llm = make_llm(model, max_num_seqs=5)  # a row bucket of 8: shapes no other test compiled
    with counting_compiles() as compiles:
        out, = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 17 and llm.stats()["decode_calls"] == 2  # tables 4 blocks wide throughout
    assert compiles.count("jit(decode_steps)") == 1, compiles


def test_warm_up_compiles_what_short_requests_need_and_leaves_the_engine_clean(model):
    llm = make_llm(model, max_num_seqs=6)  # shapes no other test compiled
    with pytest.raises(ValueError, match="prompt_len=1013 must be in"):
        llm.engine.warm_up(prompt_len=1013)
    report = llm.engine.warm_up(prompt_len=4)
    assert report["programs"] > 0
    stats = llm.stats()
    assert drained(llm) and stats["prompt_tokens"] == stats["generation_tokens"] == 0
    assert stats["prefix_cache_queries"] == stats["num_preemptions"] == stats["prefill_steps"] == 0
    rng = np.random.default_rng(3)
    firsts = []
    with counting_compiles() as compiles:
        for n in (1, 3, 6, 2, 5, 4):  # concurrency rises and falls; greedy and sampled
            prompts = [rng.integers(0, 128, int(rng.integers(2, 5))).tolist() for _ in range(n)]
            outs = llm.generate(prompts, [SamplingParams(temperature=0.8 * (i % 2), max_tokens=12, ignore_eos=True)
                                          for i in range(n)], use_tqdm=False)
            firsts.append((prompts[0], outs[0].outputs[0].token_ids))
    assert compiles == []
    for prompt, tokens in firsts:  # greedy, unharmed by the warm-up
        assert tokens == greedy_reference(model, prompt, 12)
    # It only compiles, so an engine may warm up while it holds requests: this one is untouched.
    llm.engine.add_request("busy", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    llm.engine.step()
    llm.engine.warm_up(prompt_len=8)
    busy = [out for _ in range(20) for out in llm.engine.step() if out.finished]
    assert busy[0].outputs[0].token_ids == greedy_reference(model, [1, 2, 3], 12)


def test_cache_salt_keeps_tenants_apart(model):
    llm = make_llm(model)
    prompt = list(range(1, 30))  # three full blocks of 8 can be cached
    params = SamplingParams(temperature=0.0, max_tokens=2)
    first, = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-a"}], params)
    other, same, bare = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-b"},
                                      {"prompt_token_ids": prompt, "cache_salt": "tenant-a"}, prompt], params)
    assert (first.num_cached_tokens, other.num_cached_tokens, bare.num_cached_tokens) == (0, 0, 0)
    assert same.num_cached_tokens == 24
    assert other.outputs[0].token_ids == same.outputs[0].token_ids == first.outputs[0].token_ids


def test_the_prefix_cache_map_forgets_blocks_handed_out_again(model):
    """The host map drops an entry when the device reuses its block (vLLM's _maybe_evict_cached_block):
    many distinct prompts through a small pool leave it no larger than the pool, every entry current."""
    llm = make_llm(model, num_blocks=12)
    rng = np.random.default_rng(3)
    for _ in range(6):
        llm.generate([rng.integers(3, 128, 20).tolist() for _ in range(2)],
                     SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    cache = llm.engine.prefix_cache
    versions = np.asarray(llm.engine.block_pool.version)
    assert 0 < len(cache.entries) <= 11 and len(cache.hash_of) == len(cache.entries)
    assert all(versions[block] == version for block, version in cache.entries.values())


def test_reset_prefix_cache(model):
    llm = make_llm(model)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = llm.generate([PROMPT * 2], params)[0]
    engine = llm.engine
    engine.add_request("busy", PROMPT, SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    assert llm.reset_prefix_cache() is False and engine.prefix_cache.entries  # blocks in use: nothing changes
    engine.abort_request("busy")
    engine.step()
    assert llm.reset_prefix_cache() is True
    assert not engine.prefix_cache.entries and not np.asarray(engine.block_pool.cached).any()
    again = llm.generate([PROMPT * 2], params)[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.generate([PROMPT * 2], params)[0].num_cached_tokens == 16


def test_copies_and_penalty_work_run_only_in_the_steps_that_need_them(model, monkeypatch):
    """copy_blocks is traced only into a prefill step that forks; the penalty rows are read only by
    steps whose batch has a request with penalties."""
    from paged_jax.worker import runner

    copies, flags = [], []
    copy_blocks, prefill, decode = runner.copy_blocks, runner.prefill_step, runner.decode_steps
    monkeypatch.setattr(runner, "copy_blocks", lambda *a, **k: copies.append(1) or copy_blocks(*a, **k))
    monkeypatch.setattr(runner, "prefill_step", lambda *a, **k: flags.append(k["flags"]) or prefill(*a, **k))
    monkeypatch.setattr(runner, "decode_steps", lambda *a, **k: flags.append(k["flags"]) or decode(*a, **k))
    llm = make_llm(model, max_num_seqs=5)  # shapes no other test compiled, so every program is traced here
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm.generate([PROMPT, PROMPT[:7]], plain)
    assert copies == [] and not any(f.forks or f.penalties for f in flags)
    llm.generate([PROMPT[:9]], SamplingParams(n=2, temperature=1.0, max_tokens=3, seed=1))
    assert copies == [1] and [f.forks for f in flags].count(True) == 1
    flags.clear()
    penalised = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, frequency_penalty=0.5)
    llm.generate([PROMPT], penalised)
    assert flags and all(f.penalties for f in flags)
    flags.clear()
    llm.generate([PROMPT, PROMPT[:7]], plain)
    assert flags and not any(f.penalties for f in flags)


def test_gpu_default_capacity_serves_what_a_small_engine_does():
    """max_num_seqs 256 and a 131072-token max_model_len (Llama 3's) for 3 short requests: each step is
    sized by the batch (its rows, its longest table), so this runs as the small engine does; sized by
    the capacity, one prefill step once asked XLA for 68.8 GB."""
    big = random_model(tiny_config(max_position_embeddings=131072, eos_token_id=None))
    prompts = [PROMPT, PROMPT[:5], list(range(30, 50))]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    small = make_llm(big, max_num_seqs=4, max_model_len=256).generate(prompts, params)
    llm = make_llm(big, max_num_seqs=256, max_model_len=131072, num_blocks=64)
    assert llm.engine.config.max_blocks_per_seq == 16384
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == [o.outputs[0].token_ids for o in small]


def test_final_only_outputs_come_once(model):
    """vLLM's RequestOutputKind.FINAL_ONLY (what LLM.generate asks for): no output until it finishes."""
    from paged_jax import RequestOutputKind

    engine = make_llm(model, num_decode_steps=4).engine
    engine.add_request("f", PROMPT, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                                   output_kind=RequestOutputKind.FINAL_ONLY))
    engine.add_request("c", PROMPT[:6], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    seen = {"f": [], "c": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(len(out.outputs[0].token_ids))
    assert seen["f"] == [10] and seen["c"] == [1, 5, 9, 10]


def test_delta_outputs_join_to_the_final_output(model):
    """vLLM's RequestOutputKind.DELTA (what the server streams): each output carries only what is new,
    text that a stop string may yet cut is held back, and each sample's finish comes once."""
    from paged_jax import RequestOutputKind

    g = greedy_reference(model, PROMPT, 10)
    stop = f"w{g[4]} w{g[5]}"
    prompt = " ".join(f"w{t}" for t in PROMPT)
    params = dict(temperature=0.0, max_tokens=10, stop=[stop], logprobs=1)
    final = make_llm(model, tokenizer=word_tokenizer()).generate([prompt], SamplingParams(**params))[0].outputs[0]
    engine = make_llm(model, tokenizer=word_tokenizer(), num_decode_steps=1).engine
    engine.add_request("d", prompt, SamplingParams(**params, output_kind=RequestOutputKind.DELTA))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += [c for out in engine.step() for c in out.outputs]
    assert "".join(c.text for c in deltas) == final.text == "".join(f" w{t}" for t in g[:4]) + " "
    assert [t for c in deltas for t in c.token_ids] == final.token_ids == g[:6]
    assert [lp for c in deltas for lp in c.logprobs] == final.logprobs
    assert [c.finish_reason for c in deltas if c.finish_reason] == ["stop"] and deltas[-1].finish_reason == "stop"
    # Held back: the text of w{g[4]} (which the stop string began) never went out before the cut.
    assert all(f"w{g[4]}" not in c.text for c in deltas)
