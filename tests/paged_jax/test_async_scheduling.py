"""The host-owned pool's lookahead and overlapped (async) scheduling: a decode call's blocks are
reserved before it, a finished row's blocks come back at once, and the overlapped engine gives the
serial engine's outputs when rows stop (EOS, a stop string, max_tokens) inside an overlapped call."""
import numpy as np
import pytest

from paged_jax import LLM, SamplingParams
from paged_jax.core import block_pool as bp
from tests.models.model_testing import random_model, tiny_config
from tests.paged_jax.engine_testing import assert_pool_drained
from tests.paged_jax.test_engine_api import greedy_reference, word_tokenizer

PROMPT = [5, 17, 99, 3, 42, 8]


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(max_position_embeddings=1024, eos_token_id=None))


def row(llm, slot):
    pool = llm.engine.block_pool
    return pool.block_tables[slot, : -(-int(pool.seq_lens[slot]) // pool.block_size)].tolist()


def test_a_decode_call_runs_on_blocks_reserved_before_it(model):
    """Block size 4, 5 decode steps a call. The 6-token prompt takes blocks 1 and 2; the decode call
    after it writes positions 6..10, so block 3 is reserved before it (11 slots mapped), and the
    call's 5 tokens fill it. max_tokens=8 leaves 2 more: the next call reserves 2 slots (12, 13:
    block 4), not 5. The finished row's 4 blocks are free as soon as its output is processed."""
    llm = LLM(model, block_size=4, num_blocks=16, max_num_seqs=2, num_decode_steps=5, log_stats=False,
              async_scheduling=False)
    engine = llm.engine
    engine.add_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    engine.step()  # prefill: 6 tokens, the first output token sampled
    assert row(llm, 0) == [1, 2] and int(engine.block_pool.seq_lens[0]) == 6
    plan = engine.scheduler.schedule()
    assert plan.is_decode and row(llm, 0) == [1, 2, 3] and plan.num_mapped.tolist() == [11]
    engine.scheduler.update_from_output(plan, engine.model_runner.execute(plan))
    seq = plan.scheduled[0][0]
    assert seq.num_output == 6 and seq.num_computed == 11
    plan = engine.scheduler.schedule()
    assert row(llm, 0) == [1, 2, 3, 4] and plan.num_mapped.tolist() == [13]
    engine.scheduler.update_from_output(plan, engine.model_runner.execute(plan))
    assert seq.finished and seq.num_output == 8
    assert int(bp.num_free(engine.block_pool)) == 15  # every block back, before any later call
    assert seq.token_ids[len(PROMPT):] == greedy_reference(model, PROMPT, 8)


def test_lookahead_is_cut_to_the_steps_every_row_can_have(model):
    """Two rows, 5 usable blocks of 4 tokens: after their 6-token prompts (2 blocks each) one block
    is free, and each row would need another at position 8. A 5-step call would need 2 blocks, so
    it is cut to the 2 steps (positions 6 and 7) inside the blocks the rows hold, and nobody is
    preempted for lookahead; the tokens are the greedy reference's."""
    llm = LLM(model, block_size=4, num_blocks=6, max_num_seqs=2, num_decode_steps=5, log_stats=False,
              async_scheduling=False)
    engine = llm.engine
    for i in range(2):
        engine.add_request(str(i), PROMPT, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    engine.step()
    plan = engine.scheduler.schedule()
    assert plan.is_decode and plan.num_mapped.tolist() == [8, 8] and not plan.preempted
    assert int(bp.num_free(engine.block_pool)) == 1
    engine.scheduler.update_from_output(plan, engine.model_runner.execute(plan))
    seqs = [seq for seq, _ in plan.scheduled]
    assert [s.num_output for s in seqs] == [3, 3]
    while engine.has_unfinished_requests():
        engine.step()
    want = greedy_reference(model, PROMPT, 10)
    assert [s.token_ids[len(PROMPT):] for s in seqs] == [want, want]
    assert int(bp.num_free(engine.block_pool)) == 5


def test_rows_stopping_inside_overlapped_calls_give_the_serial_outputs(model):
    """Twelve requests on a pool small enough to preempt, each stopping its own way (EOS, a stop
    string, max_tokens, a stop token) at various points inside 4-step calls: the overlapped engine
    dispatches calls before processing the one before, and its outputs, finish reasons and pool
    equal the serial engine's."""
    g = greedy_reference(model, PROMPT, 24)
    tokenizer = word_tokenizer(eos_token_ids=(g[9],))
    rng = np.random.default_rng(3)
    prompts = [" ".join(f"w{t}" for t in ([*PROMPT, *rng.integers(1, 128, int(n)).tolist()] if i else PROMPT))
               for i, n in enumerate(rng.integers(0, 20, 12))]
    params = [SamplingParams(temperature=0.0 if i % 3 else 0.9, seed=i, max_tokens=int(m),
                             stop=[f"w{g[5]}"] if i % 4 == 1 else [], stop_token_ids=[g[13]] if i % 4 == 2 else [],
                             ignore_eos=i % 4 == 3)
              for i, m in enumerate(rng.integers(3, 40, 12))]
    results, calls = {}, {}
    for overlapped in (False, True):
        llm = LLM(model, tokenizer=tokenizer, block_size=4, num_blocks=40, max_num_seqs=6, num_decode_steps=4,
                  log_stats=False, async_scheduling=overlapped)
        outs = llm.generate(prompts, params)
        results[overlapped] = [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
                                o.outputs[0].stop_reason) for o in outs]
        calls[overlapped] = llm.stats()["overlapped_calls"]
        assert_pool_drained(llm)
    assert results[True] == results[False]
    assert calls[False] == 0 and calls[True] >= 5
    reasons = {r[2] for r in results[True]}
    assert reasons == {"stop", "length"}


def record_schedule_next(llm, record):
    """Spy on the engine's AsyncScheduler: record(prev, plan, whether requests waited) per call."""
    scheduler = llm.engine.scheduler
    schedule_next = scheduler.schedule_next

    def spy(prev):
        waiting = bool(scheduler.waiting)
        plan = schedule_next(prev)
        record(prev, plan, waiting)
        return plan

    scheduler.schedule_next = spy


def run_arrivals(llm, arrivals):
    """arrivals: one list of (request_id, prompt, params) per step; step until all finish ->
    {request_id: its final RequestOutput}."""
    engine, done, step = llm.engine, {}, 0
    while step < len(arrivals) or engine.has_unfinished_requests():
        for request_id, prompt, params in arrivals[step] if step < len(arrivals) else []:
            engine.add_request(request_id, prompt, params)
        done.update((out.request_id, out) for out in engine.step() if out.finished)
        step += 1
    return done


def test_prefill_steps_overlap_and_give_the_serial_outputs(model):
    """Two requests arrive every step on a 16-token budget and 8 rows, so most calls are ragged
    steps (prompt chunks beside decoding rows) planned while the call before runs: a decoding row's
    last token is PENDING on the host and read on the device from the call before. Rows stop inside
    those steps on their first token (max_tokens=1, EOS), on a stop string, a stop token and at
    max_tokens (ended when the next call is planned, so it gets their blocks); some sample with a seed, use penalties, ask for logprobs or prompt logprobs, or
    fork n=2. Tokens, text, finish and stop reasons equal the serial engine's, logprobs to f32
    rounding, and the pool drains."""
    g = greedy_reference(model, PROMPT, 12)
    assert g[0] not in g[1:5]
    tokenizer = word_tokenizer(eos_token_ids=(g[0],))  # PROMPT's first token ends it unless ignore_eos
    rng = np.random.default_rng(7)
    arrivals = []
    for step in range(10):
        arrivals.append([])
        for j in range(2):
            i = 2 * step + j
            prompt = PROMPT if i % 2 == 0 else rng.integers(1, 128, int(rng.integers(3, 21))).tolist()
            params = SamplingParams(
                temperature=0.8 if i % 5 == 4 else 0.0, seed=i,
                max_tokens=1 if i % 7 == 3 else 5 if i % 8 == 4 else int(rng.integers(2, 14)),
                ignore_eos=i % 8 in (2, 4, 6),
                stop=[f"w{g[2]}"] if i % 8 == 2 else [], stop_token_ids=[g[4]] if i % 8 == 4 else [],
                logprobs=2 if i % 5 == 0 else None, prompt_logprobs=1 if i == 9 else None,
                repetition_penalty=1.3 if i % 5 == 2 else 1.0, frequency_penalty=0.5 if i % 5 == 2 else 0.0,
                n=2 if i == 13 else 1)
            arrivals[-1].append((str(i), " ".join(f"w{t}" for t in prompt), params))
    results, overlapped_steps = {}, []
    for overlapped in (False, True):
        llm = LLM(model, tokenizer=tokenizer, block_size=4, num_blocks=96, max_num_seqs=8, max_num_batched_tokens=16,
                  num_decode_steps=4, log_stats=False, async_scheduling=overlapped)
        if overlapped:
            record_schedule_next(llm, lambda prev, plan, waiting: overlapped_steps.append(
                plan is not None and not plan.is_decode))
        done = run_arrivals(llm, arrivals)
        results[overlapped] = {
            request_id: [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in out.outputs]
            + [out.prompt_logprobs] for request_id, out in done.items()}
        assert_pool_drained(llm)
    serial, overlapped = results[False], results[True]
    assert sorted(serial) == sorted(overlapped) == sorted(str(i) for i in range(20))
    for request_id, outputs in serial.items():
        for want, got in zip(outputs[:-1], overlapped[request_id][:-1]):
            assert got[:4] == want[:4], request_id
            if want[4] is not None:
                assert [sorted(e) for e in got[4]] == [sorted(e) for e in want[4]]
                np.testing.assert_allclose([lp.logprob for e in got[4] for lp in e.values()],
                                           [lp.logprob for e in want[4] for lp in e.values()], atol=1e-5)
    assert [e and sorted(e) for e in overlapped["9"][-1]] == [e and sorted(e) for e in serial["9"][-1]]
    reasons = {c[2] for outputs in overlapped.values() for c in outputs[:-1]}
    assert reasons == {"stop", "length"} and sum(overlapped_steps) >= 10
    assert any(len(o[0][0]) == 1 for o in overlapped.values())  # some stop on their first token
    # Its 5th token is both its max_tokens-th and a stop token: ended when the call after the one
    # sampling it was planned, it still finishes with "stop".
    assert overlapped["12"][0][0] == g[:5] and overlapped["12"][0][2:4] == ("stop", g[4])


def test_an_overlapped_plan_that_would_preempt_is_not_made(model):
    """Block size 4, 4 usable blocks: two 8-token prompts fill them, and each row's next token needs
    a block. Planning the call after the prefill while it runs would preempt a row whose token is
    still PENDING, so no call is planned then: the prefill's output is applied first, and the plan
    made from it preempts as usual, before that output is reported; the tokens are the greedy
    reference's."""
    llm = LLM(model, block_size=4, num_blocks=5, max_num_seqs=2, num_decode_steps=4, log_stats=False)
    engine = llm.engine
    prompts = [PROMPT + [1, 2], PROMPT + [3, 4]]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert engine.step() == []  # the prefill, in flight
    seqs = list(engine.scheduler.running)
    assert engine.scheduler.num_free == 0 and engine._in_flight is not None
    outputs = engine.step()  # nothing planned while it ran: the next call is planned from its output
    assert engine.counters["overlapped_calls"] == 0
    assert engine._in_flight is not None and engine.scheduler.num_preemptions == 1
    assert {o.request_id: o.outputs[0].token_ids for o in outputs} == {
        str(i): greedy_reference(model, p, 1) for i, p in enumerate(prompts)}
    assert {s.request.request_id: s.token_ids[8:] for s in seqs} == {o.request_id: o.outputs[0].token_ids
                                                                      for o in outputs}
    done = run_arrivals(llm, [])
    assert engine.stats()["num_preemptions"] >= 1
    assert [done[str(i)].outputs[0].token_ids for i in range(2)] == [greedy_reference(model, p, 4) for p in prompts]
    assert_pool_drained(llm)


def test_decode_calls_with_requests_waiting_overlap_and_give_the_serial_outputs(model):
    """Ten requests on 3 rows, so most decode calls run with requests waiting: the call after one is
    planned while it runs, each row taken to its reservation's end as PENDING tokens, and it admits
    the waiting requests into the slots of rows that reach max_tokens or max_model_len (36) in it.
    Rows stop inside those calls on EOS, a stop string, a stop token (found when the call is
    processed, one call late), max_tokens and max_model_len; some sample with a seed, use penalties
    or ask for logprobs. Tokens, text, finish and stop reasons equal the serial engine's (which
    leaves each such call at its first finish), logprobs to f32 rounding, and the pool drains."""
    g = greedy_reference(model, PROMPT, 24)
    tokenizer = word_tokenizer(eos_token_ids=(g[8],))
    rng = np.random.default_rng(5)
    prompts = [PROMPT] * 3 + [rng.integers(1, 128, int(n)).tolist() for n in rng.integers(4, 16, 7)]
    prompts = [" ".join(f"w{t}" for t in prompt) for prompt in prompts]
    greedy = dict(temperature=0.0)
    params = [SamplingParams(**greedy, max_tokens=None),  # EOS: g[8]
              SamplingParams(**greedy, max_tokens=None, stop=[f"w{g[7]}"]),
              SamplingParams(**greedy, max_tokens=None, stop_token_ids=[g[9]], ignore_eos=True, logprobs=1),
              SamplingParams(**greedy, max_tokens=None, ignore_eos=True)]  # max_model_len
    params += [SamplingParams(temperature=0.8 if i % 2 else 0.0, seed=i, max_tokens=None if i % 2 == 0 else 5 + 3 * i,
                              ignore_eos=i % 2 == 0,
                              logprobs=1 if i % 3 == 1 else None, repetition_penalty=1.2 if i == 5 else 1.0)
               for i in range(4, 10)]
    results, kinds, hits = {}, [], {}
    for overlapped in (False, True):
        llm = LLM(model, tokenizer=tokenizer, block_size=4, num_blocks=64, max_num_seqs=3, num_decode_steps=4,
                  max_model_len=36, log_stats=False, async_scheduling=overlapped)
        if overlapped:
            def record(prev, plan, waiting):
                if prev.is_decode and waiting:
                    kinds.append("none" if plan is None else "admits" if plan.admitted else "decode")

            record_schedule_next(llm, record)
        outs = llm.generate(prompts, params)
        # A prompt extending request 2's 16 tokens hits its blocks: only those whose K/V was computed.
        follow = llm.generate([" ".join(f"w{t}" for t in [*PROMPT, *g[:11]])], SamplingParams(temperature=0.0))[0]
        results[overlapped] = [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs)
                               for o in [*outs, follow] for c in o.outputs]
        hits[overlapped] = follow.num_cached_tokens
        assert_pool_drained(llm)
    for want, got in zip(results[False], results[True]):
        assert got[:4] == want[:4]
        if want[4] is not None:
            np.testing.assert_allclose([lp.logprob for e in got[4] for lp in e.values()],
                                       [lp.logprob for e in want[4] for lp in e.values()], atol=1e-5)
    serial = results[False]
    assert serial[0][0] == g[:9] and serial[0][2:4] == ("stop", None)
    assert serial[1][0][-1] == g[7] and serial[1][2:4] == ("stop", f"w{g[7]}")
    assert serial[2][0] == g[:10] and serial[2][2:4] == ("stop", g[9])
    assert hits == {False: 12, True: 12} and serial[-1][0] == greedy_reference(model, [*PROMPT, *g[:11]], 16)
    assert serial[3][2] == "length" and len(prompts[3].split()) + len(serial[3][0]) == 36
    assert kinds.count("admits") >= 3 and kinds.count("decode") >= 1
