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
