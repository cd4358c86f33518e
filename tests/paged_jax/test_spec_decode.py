"""Speculative decoding (n-gram proposals and a draft model): the proposer's matches, the
configuration's checks, the rejection sampler's exactness (chi-square against the target's
distribution, one-hot q and a draft's q), the controller that turns speculation down, the engine's
greedy outputs equal to the plain engine's through preemption, prefix hits, stop strings and stop
tokens inside accepted runs, and a draft model's pages kept in step with the target's."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from paged_jax import LLM, SamplingParams
from paged_jax.core.async_scheduler import AsyncScheduler
from paged_jax.core.model_output import ModelOutput
from paged_jax.core.plan import Plan
from paged_jax.core.sequence import PENDING, Request, Sequence
from paged_jax.engine import ngram, speculative
from paged_jax.engine import stats as engine_stats
from paged_jax.engine.arg_utils import EngineArgs
from paged_jax.worker import batching, ngram_proposer, rejection_sampler
from tests.models.model_testing import random_model, tiny_config
from tests.paged_jax.engine_testing import assert_pool_drained
from tests.paged_jax.test_engine_api import greedy_reference, word_tokenizer

pytestmark = pytest.mark.usefixtures("drop_compiled_programs")
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _draft(model, k=3):
    """A draft model's speculative_config (a model object or a checkpoint path)."""
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(max_position_embeddings=1024, eos_token_id=None))


NGRAM_CASES = [
    ([1, 2, 3, 4, 1, 2, 3], (1, 3), 2, [4, 1]),  # the 3-gram [1, 2, 3] occurred at 0
    ([9, 1, 2, 5, 6, 1, 2, 7, 8, 1, 2], (2, 2), 2, [7, 8]),  # the latest occurrence k tokens follow
    ([2, 2, 5, 6, 2, 2, 2], (2, 2), 2, [5, 6]),  # the latest (at 4) has 1 token after it: the one at 0
    ([7, 7, 7, 7], (1, 2), 3, [7, 7]),  # a loop: [7, 7] first at 0, followed by two tokens
    ([1, 2, 3, 4], (2, 3), 2, []),  # no n-gram of 2 or 3 repeats
    ([5], (1, 1), 2, []),
    ([3, 1, 2, 3, 9, 1, 2, 3], (1, 3), 1, [9]),  # the 3-gram wins over the later 1-gram [3]
]


def _propose(rows, min_n, max_n, rooms):
    """ngram.propose over rows of unequal lengths, padded with tokens that would match if read."""
    lengths = np.array([len(r) for r in rows], np.int32)
    tokens = np.full((len(rows), lengths.max() + 3), rows[0][-1], np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
    starts, counts = ngram.propose(tokens, lengths, np.array(rooms, np.int32), min_n, max_n)
    return [tokens[i, s:s + c].tolist() for i, (s, c) in enumerate(zip(starts, counts))]


@pytest.mark.parametrize("tokens, n, k, expected", NGRAM_CASES)
def test_ngram_proposal_takes_the_longest_match(tokens, n, k, expected):
    assert _propose([tokens], *n, [k]) == [expected]


def _lookup_reference(tokens, min_n, max_n, k):
    """Prompt lookup by plain loops: the longest n with an earlier occurrence of the last n tokens,
    the latest occurrence followed by k tokens, else the earliest."""
    for n in range(max_n, min_n - 1, -1):
        starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == tokens[-n:]]
        if starts:
            whole = [s for s in starts if s + n + k <= len(tokens)]
            start = (whole[-1] if whole else starts[0]) + n
            return tokens[start:start + k]
    return []


def test_ngram_proposals_of_a_batch_equal_each_rows_own_lookup():
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, vocab, length).tolist() for vocab, length in
            [(3, 1), (3, 2), (2, 9), (4, 40), (5, 17), (50, 30), (3, 64), (2, 5)] * 4]
    rows += [row + row[: len(row) // 2] for row in rows[:8]]  # quoting their own start
    rooms = rng.integers(1, 8, len(rows)).tolist()
    matched = []
    for min_n, max_n in [(1, 1), (1, 3), (2, 4), (3, 5)]:
        want = [_lookup_reference(r, min_n, max_n, k) for r, k in zip(rows, rooms)]
        assert _propose(rows, min_n, max_n, rooms) == want
        matched.append(sum(map(bool, want)))
    assert matched == [30, 30, 22, 11]  # of 40 rows: both kinds of row in each case
    # Rows no longer than prompt_lookup_max, in an array no wider than the longest.
    starts, counts = ngram.propose(np.array([[4, 4, 4], [4, 0, 0]], np.int32), np.array([3, 1], np.int32),
                                   np.array([2, 2], np.int32), 1, 5)
    assert starts[0] == 2 and counts.tolist() == [1, 0]


def test_token_history_follows_each_sequences_tokens():
    seqs = [Sequence(None, 0, [1, 2, 3], np.zeros(2, np.uint32)), Sequence(None, 0, [4], np.zeros(2, np.uint32))]
    history = ngram.TokenHistory()
    tokens, lengths = history.gather(seqs)
    assert tokens.tolist() == [[1, 2, 3], [4, 0, 0]] and lengths.tolist() == [3, 1]
    seqs[0].token_ids += list(range(10, 200))  # grows past its array
    seqs[1].token_ids[-1] = 5  # changed where it was last read: read again from the start
    tokens, lengths = history.gather(seqs[::-1])
    assert lengths.tolist() == [1, 193] and tokens[0, 0] == 5 and tokens[1].tolist() == seqs[0].token_ids
    del seqs[0].token_ids[2:]  # shorter (a stop string's truncation)
    seqs[0].token_ids.append(7)
    assert history.gather(seqs[:1])[0].tolist() == [[1, 2, 7]]


def test_the_devices_ngram_lookup_equals_the_hosts():
    """worker/ngram_proposer.lookup (jnp, jitted) finds each row's proposal as engine/ngram.propose
    does, over rows of unequal lengths in one array."""
    rng = np.random.default_rng(1)
    rows = [rng.integers(0, vocab, length).tolist() for vocab, length in [(3, 2), (2, 9), (4, 40), (50, 30), (3, 64)] * 4]
    rows += [row + row[: len(row) // 2] for row in rows[:5]]
    lengths = np.array([len(r) for r in rows], np.int32)
    tokens = np.full((len(rows), 128), 7, np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
    rooms = rng.integers(1, 8, len(rows)).astype(np.int32)
    device = jax.jit(ngram_proposer.lookup, static_argnums=(3, 4))
    for min_n, max_n in [(1, 1), (1, 3), (2, 4), (3, 5)]:
        want_starts, want_counts = ngram.propose(tokens, lengths, rooms, min_n, max_n)
        starts, counts = device(tokens, lengths, rooms, min_n, max_n)
        np.testing.assert_array_equal(counts, want_counts)
        np.testing.assert_array_equal(np.where(counts > 0, starts, 0), np.where(want_counts > 0, want_starts, 0))
        assert 0 < np.count_nonzero(counts) < len(rows)


def test_a_verifying_call_looks_up_drafts_through_its_own_first_token():
    """ngram_proposer.read_batch: an optimistic row's last token is the call's first of it (not yet
    in the pages); its drafts are found through it and written over the stand-ins, then every token
    of the call lands beside its K/V. A row the host proposed for (its drafts in the call's tokens)
    keeps them."""
    pages = ngram_proposer.TokenPages(jnp.asarray(np.arange(24, dtype=np.int32).reshape(6, 4) + 100))
    held = [5, 17, 99, 3, 42, 5]  # positions 0-5 in blocks 1 and 2; the call brings 17 at position 6
    pages = pages.write(jnp.array([4, 5, 6, 7, 8, 9]), jnp.array(held, jnp.int32))
    batch = batching.PrefillBatch(**{**{f: None for f in batching.PrefillBatch.__dataclass_fields__},
                                     "tokens": jnp.array([17, 0, 0, 0, 8, 9], jnp.int32),
                                     "positions": jnp.array([6, 7, 8, 9, 3, 4], jnp.int32),
                                     "slot_mapping": jnp.array([10, 11, 12, 13, 19, 20], jnp.int32),
                                     "block_tables": jnp.array([[1, 2, 3], [4, 5, 0]], jnp.int32),
                                     "spec_rows": jnp.array([[0, 1, 2, 3], [4, 5, -1, -1]], jnp.int32),
                                     "drafts": jnp.array([[-1, -1, -1], [9, -1, -1]], jnp.int32),
                                     "optimistic": jnp.array([True, False])})
    out, pages = ngram_proposer.read_batch(pages, batch, (2, 3))
    starts, counts = ngram.propose(np.array([held + [17]], np.int32), np.array([7]), np.array([3]), 2, 3)
    assert (starts.tolist(), counts.tolist()) == ([2], [3])  # the host's rule finds the same
    assert out.drafts.tolist() == [[99, 3, 42], [9, -1, -1]]  # held[2:5], found through "5 17"
    assert out.tokens.tolist() == [17, 99, 3, 42, 8, 9]
    assert np.asarray(pages.token_ids).reshape(-1).tolist()[4:14] == held + [17, 99, 3, 42]
    assert (int(pages.token_ids[4, 3]), int(pages.token_ids[5, 0])) == (8, 9)


def test_a_prompt_lookup_predicts_the_tokens_after_its_drafts():
    """ngram.PromptLookup: a row's drafts and the token a lookup after them proposes are what it is
    expected to hold next; a row whose tokens are PENDING is looked up in that prediction (where a
    verification accepts every draft and samples the predicted token, the lookup its true tokens
    get), and a row whose PENDING tokens were not predicted proposes nothing (unseen)."""
    lookup = ngram.PromptLookup(1, 3)
    seq = _sequence([1, 2, 3, 4, 5, 1, 2])  # [1, 2] occurred at 0: 3 4, then 5
    assert lookup.look_up({seq: 2}) == {seq: [3, 4]} and lookup.predicted == {seq: [3, 4, 5]}
    seq.token_ids += [PENDING] * 3
    assert lookup.predicts(seq, 3) and not lookup.predicts(seq, 2)
    # As if 1 2 3 4 5 1 2 3 4 5: [3, 4, 5] occurred at 2, followed by 1 2 (which reach the end), then 3.
    assert lookup.look_up({seq: 2}) == {seq: [1, 2]} and lookup.predicted == {seq: [1, 2, 3]}
    assert lookup.unseen == set()
    unknown = _sequence([7, 8, 7, 8, PENDING])
    seq.token_ids.append(PENDING)  # 4 PENDING tokens, 3 predicted
    assert lookup.look_up({unknown: 2, seq: 1}) == {unknown: [], seq: []} and lookup.predicted == {}
    assert lookup.unseen == {unknown, seq}


@pytest.mark.parametrize("config, message", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1, got 0"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of ('ngram', 'draft_model'), got 'eagle'"),
    ({"num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown keys ['lookahead']"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4 exceeds prompt_lookup_max=2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min must be an integer >= 1"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "'draft_model' needs \"model\""),
    ({"method": "draft_model", "model": "d", "num_speculative_tokens": 2, "prompt_lookup_max": 2},
     "['prompt_lookup_max'] apply to method 'ngram'"),
    ({"method": "ngram", "model": "d", "num_speculative_tokens": 2}, '"model" applies to method \'draft_model\''),
    ({"method": "draft_model", "model": 7, "num_speculative_tokens": 2}, '"model" must be a checkpoint directory'),
    ("{method: ngram}", "speculative_config is not JSON"),
])
def test_bad_speculative_configs_are_named(model, config, message):
    with pytest.raises(ValueError, match="speculative_config") as e:
        LLM(model, log_stats=False, speculative_config=config)
    assert message in str(e.value)


def test_speculative_config_from_the_command_line():
    import argparse
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])
    config = EngineArgs.from_cli_args(args).speculative_config
    assert config == speculative.SpeculativeConfig("ngram", 4, prompt_lookup_min=5, prompt_lookup_max=5)
    assert EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                          "prompt_lookup_max": 3}).speculative_config.prompt_lookup_min == 3
    # The fields as keyword arguments again (generate.py and the server build LLM so): the config as is.
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["--speculative-config", '{"method": "draft_model", "model": "d", "num_speculative_tokens": 2}']))
    assert EngineArgs(**args.kwargs()) == args and args.kwargs()["speculative_config"].model == "d"


def _verify(logits, drafts, temperature, top_k=0, seed=0, draft_probs=None, allowed=None, masked=None):
    """Rows of one logits table [J, V], each with its own key; `allowed`: the tokens a grammar allows
    at each position (J sets), or None; `masked`: the rows it constrains (default: every row);
    -> (tokens [B, J], num_accepted [B])."""
    rows = drafts.shape[0]
    params = SamplingParams(temperature=temperature, top_k=top_k)
    keys = np.random.SeedSequence(seed).generate_state(2 * rows, np.uint32).reshape(rows, 2)
    sp = batching.row_params([], rows, (), 1 << 20)
    sp = jax.tree.map(np.asarray, sp)
    sp = type(sp)(**{**sp.__dict__, "temperature": np.full(rows, temperature, np.float32),
                     "top_k": np.full(rows, params.top_k, np.int32), "key": keys,
                     "max_tokens": np.full(rows, 1 << 20, np.int32), "max_len": np.full(rows, 1 << 20, np.int32)})
    if allowed is not None:  # one mask, one i32 word per position: bit t allows token t
        words = np.array([[[sum(1 << t for t in tokens)] for tokens in allowed]], np.int32)
        mask_row = np.zeros(rows, np.int32) if masked is None else np.where(masked, 0, -1).astype(np.int32)
        sp = type(sp)(**{**sp.__dict__, "allowed": words, "mask_row": mask_row})
    out = jax.jit(rejection_sampler.verify, static_argnames=("filters", "num_logprobs", "random"))(
        jnp.broadcast_to(logits, (rows, *logits.shape)), jnp.asarray(drafts), sp, jnp.ones(rows, jnp.int32),
        jnp.full(rows, 8, jnp.int32), None, draft_probs, filters=top_k > 0, num_logprobs=0, random=temperature > 0)
    return np.asarray(out[0]), np.asarray(out[6])


def _target(logits, temperature, top_k=0):
    z = np.asarray(logits, np.float64) / temperature
    if top_k:
        z = np.where(z >= np.sort(z)[-top_k], z, -np.inf)
    p = np.exp(z - z.max())
    return p / p.sum()


LOGITS = np.array([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0],
                   [0.0, 1.5, -0.5, 1.0, 0.2, -2.0],
                   [1.0, 0.0, 0.0, 2.0, -1.0, 0.5]], np.float32)


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 3)])
def test_rejection_sampling_keeps_the_target_distribution(temperature, top_k):
    """40,000 rows, one key each, on a 6-token vocabulary. Drafts that disagree with the target
    (token 4 first: p = 0.04 at temperature 1, outside the top 3) are mostly rejected and resampled
    from the residual; drafts it likes (token 0, then 4) are mostly accepted. Every emitted position
    is distributed as the target's own there (chi-square at a fixed seed, p > 0.001); a wrong
    residual (resampling from p itself, say) fails this by a wide margin."""
    rows = 40_000
    for drafts, position in (([4, 0], 0), ([0, 4], 1)):
        tokens, accepted = _verify(jnp.asarray(LOGITS), np.tile(np.array(drafts, np.int32), (rows, 1)),
                                   temperature, top_k)
        reached = np.all(tokens[:, :position] == np.array(drafts[:position]), axis=1)  # drafts before it accepted
        seen = tokens[reached, position]
        p = _target(LOGITS[position], temperature, top_k)
        counts = np.bincount(seen, minlength=6)
        assert counts[p == 0].sum() == 0
        support = p > 0
        assert stats.chisquare(counts[support], p[support] * seen.size).pvalue > 1e-3
        # A row emits its accepted drafts and one more token, then -1.
        assert np.all((tokens >= 0).sum(axis=1) == accepted + 1)
        assert np.all(tokens[np.arange(rows), accepted] != np.array(drafts + [-1])[accepted])


def test_rejection_sampling_with_a_draft_distribution_keeps_the_target_distribution():
    """A draft model's proposals: each row's two drafts drawn from q (its own distribution, far from
    the target's p), accepted with min(1, p/q) and resampled from norm(max(0, p - q)). The first
    emitted token, and the second where the first draft was accepted, are distributed as p
    (chi-square, p > 0.001), and the first draft is accepted with probability sum min(p, q) = 0.31
    (treating q as one-hot, exact too, would accept sum q p = 0.08 of them)."""
    rows, rng = 40_000, np.random.default_rng(1)
    q = np.array([[0.05, 0.05, 0.1, 0.1, 0.6, 0.1], [0.5, 0.1, 0.1, 0.1, 0.1, 0.1]])
    drafts = np.stack([rng.choice(6, rows, p=q[j]) for j in range(2)], axis=1).astype(np.int32)
    probs = jnp.broadcast_to(jnp.asarray(q, jnp.float32), (rows, 2, 6))
    tokens, accepted = _verify(jnp.asarray(LOGITS), drafts, 1.0, draft_probs=probs)
    for position, reached in ((0, np.ones(rows, bool)), (1, accepted >= 1)):
        seen = tokens[reached, position]
        p = _target(LOGITS[position], 1.0)
        assert stats.chisquare(np.bincount(seen, minlength=6), p * seen.size).pvalue > 1e-3
    assert abs(np.mean(accepted >= 1) - np.minimum(_target(LOGITS[0], 1.0), q[0]).sum()) < 0.01
    assert np.all((tokens >= 0).sum(axis=1) == accepted + 1)


def test_greedy_verification_accepts_the_argmax_prefix():
    drafts = np.array([[0, 1], [0, 3], [1, 1], [0, -1], [-1, -1]], np.int32)  # argmax: 0, 1, 3
    tokens, accepted = _verify(jnp.asarray(LOGITS), drafts, 0.0)
    assert accepted.tolist() == [2, 1, 0, 1, 0]
    assert tokens.tolist() == [[0, 1, 3], [0, 1, -1], [0, -1, -1], [0, 1, -1], [0, -1, -1]]


# A grammar's masks at three positions, each after the drafts before it (structured output).
GRAMMAR = [{1, 4}, {2, 3, 5}, {4, 5}]


def test_greedy_verification_under_a_grammar_takes_each_positions_own_mask():
    """The best allowed token at each position: 1 (of 1, 4), 3 (of 2, 3, 5), then 5 (of 4, 5); with
    position 0's mask at every position the second draft would lose to token 1. A row without a
    grammar in the same call takes the plain argmax (0, 1, 3)."""
    drafts = np.array([[1, 3], [1, 2], [4, 3], [0, 1]], np.int32)
    tokens, accepted = _verify(jnp.asarray(LOGITS), drafts, 0.0, allowed=GRAMMAR, masked=[True] * 3 + [False])
    assert accepted.tolist() == [2, 1, 0, 2]
    assert tokens.tolist() == [[1, 3, 5], [1, 3, -1], [1, -1, -1], [0, 1, 3]]


def test_rejection_sampling_under_a_grammar_keeps_the_masked_target_distribution():
    """A constrained row's n-gram drafts (each allowed where it stands) verified with a mask per
    position: every emitted token is distributed as the target restricted to that position's mask
    (chi-square, p > 0.001), as plain constrained sampling draws it."""
    rows = 40_000
    tokens, accepted = _verify(jnp.asarray(LOGITS), np.tile(np.array([4, 3], np.int32), (rows, 1)), 1.0,
                               allowed=GRAMMAR)
    for position in range(3):
        reached = np.all(tokens[:, :position] == np.array([4, 3][:position]), axis=1)
        seen = tokens[reached, position]
        p = np.where(np.isin(np.arange(6), list(GRAMMAR[position])), _target(LOGITS[position], 1.0), 0.0)
        counts = np.bincount(seen, minlength=6)
        assert counts[p == 0].sum() == 0 and seen.size > 500
        assert stats.chisquare(counts[p > 0], p[p > 0] / p.sum() * seen.size).pvalue > 1e-3


def test_a_call_verifies_when_its_tokens_per_second_beat_a_decode_step():
    """Timed costs decide: 1 row, 4 drafts at rate 1 expect 5 tokens, worth a verification
    costing up to 5 decode steps (its key: 5 tokens padded to 8)."""
    spec = speculative.Speculator(speculative.SpeculativeConfig("ngram", 4, 1, 2), max_model_len=100,
                                  max_num_seqs=8, max_num_batched_tokens=64)
    seq = _sequence([3, 4, 5, 6, 3, 4, 5, 6, 3])
    assert spec.verify_key(5) == ("verify", 8) and spec.step_key(3) == ("step", 4)
    spec.observe(spec.step_key(1), 0.010)
    spec.observe(spec.verify_key(5), 0.049)
    assert spec.costs == {("step", 1): 0.010, ("verify", 8): 0.049}
    compiles = engine_stats.num_compiles()
    engine_stats._NUM_COMPILES[0] += 1  # jax compiled during the call: its time is not a cost
    spec.observe_call(Plan(scheduled=[(seq, 5)], drafts={seq: [4, 5, 6, 3]}), 1, 1.0, compiles)
    assert spec.costs[("verify", 8)] == 0.049
    spec.observe_call(Plan(scheduled=[(seq, 1)], is_decode=True), 2, 0.024, compiles + 1)
    assert spec.costs[("step", 1)] == 0.010 + 0.2 * (0.012 - 0.010)
    spec.propose([])
    assert spec.propose([seq]) == {seq: [4, 5, 6, 3]}
    spec.observe(spec.verify_key(5), 0.054)  # the running cost moves a fifth of the way: 0.050
    assert spec.propose([seq]) == {seq: [4, 5, 6, 3]}
    spec.observe(spec.verify_key(5), 0.060)  # 0.052: five tokens no longer pay for it
    assert spec.propose([seq]) == {}


def test_a_decode_call_while_rows_wait_for_a_match_is_short():
    """No row matched, but by the timed costs a match would make a verification pay: the plain
    decode call runs PROBE_STEPS steps (its rows' mapped slots cut there), so a verification comes
    a token or two after the output starts repeating, not K. Untimed, timed too slow, or with the
    row resting, the call runs its K steps."""
    from paged_jax.core.plan import Plan

    spec = speculative.Speculator(speculative.SpeculativeConfig("ngram", 4, 1, 2), max_model_len=100,
                                  max_num_seqs=8, max_num_batched_tokens=64)
    seq = _sequence([3, 4, 5, 6, 7, 8, 9])  # nothing repeats: no proposal

    def mapped_after_propose():
        assert spec.propose([seq]) == {}
        plan = Plan(scheduled=[(seq, 1)], num_mapped=np.array([16], np.int32), is_decode=True)
        spec.limit_decode(plan)
        return plan.num_mapped.tolist()

    assert mapped_after_propose() == [16]  # no cost timed yet: nothing says a verification would pay
    spec.observe(spec.step_key(1), 0.010)
    assert mapped_after_propose() == [16]
    spec.observe(spec.verify_key(5), 0.030)  # 5 expected tokens in 30 ms beat 1 in 10 ms
    assert mapped_after_propose() == [6 + speculative.PROBE_STEPS]  # its last token is at position 6
    spec.costs[spec.verify_key(5)] = 0.060  # they cannot beat it in 60 ms
    assert mapped_after_propose() == [16]
    spec.costs[spec.verify_key(5)] = 0.030
    seq.spec_rate = 0.1  # resting: 0.4 expected drafts
    assert mapped_after_propose() == [16]


def _sequence(tokens, max_tokens=64):
    request = Request("r", None, list(tokens[:2]), SamplingParams(max_tokens=max_tokens), 0.0)
    seq = Sequence(request, 0, list(tokens), np.zeros(2, np.uint32), num_computed=len(tokens) - 1)
    request.seqs.append(seq)
    return seq


def test_speculation_rests_where_proposals_fail():
    """k = 4: each verification moves the rate half way to its acceptance; below 0.125 (0.5 expected
    tokens) the row rests, its rate recovering 2% toward 1 per call, then probes again."""
    spec = speculative.Speculator(speculative.SpeculativeConfig("ngram", 4, 1, 2), max_model_len=100,
                                  max_num_seqs=8, max_num_batched_tokens=64)
    seq = _sequence([3, 4, 5, 6, 3, 4, 5, 6, 3])
    assert spec.propose([seq]) == {}  # a decode step is timed first
    spec.observe(spec.step_key(1), 0.010)
    assert spec.propose([seq]) == {seq: [4, 5, 6, 3]}
    for rate in (0.5, 0.25, 0.125, 0.0625):
        spec.record(seq, 4, 0)
        assert seq.spec_rate == rate
    calls = 0
    while not spec.propose([seq]):
        calls += 1
    assert calls == 4 and 0.125 <= seq.spec_rate < 0.14
    spec.record(seq, 4, 4)
    assert spec.stats()["spec_decode_num_accepted_tokens_per_pos"] == [1, 1, 1, 1]
    assert spec.stats()["spec_decode_num_drafts"] == 5 and spec.stats()["spec_decode_acceptance_rate"] == 0.2
    # Proposals stop at max_tokens (7 outputs so far): 2 left is one draft and the token after it.
    assert list(spec.propose([_sequence(seq.token_ids, max_tokens=9)]).values()) == [[4]]
    assert spec.propose([_sequence(seq.token_ids, max_tokens=8)]) == {}


def test_a_new_sequence_starts_at_the_engines_acceptance_rate():
    """Each verification moves the rate new sequences start from 10% of the way to its acceptance:
    after chance matches in free text kept failing, a new request's match is not worth verifying
    (where a start at 1 verified it); the row rests toward 1 and probes, and what it accepts
    raises the rate the next ones start from."""
    spec = speculative.Speculator(speculative.SpeculativeConfig("ngram", 4, 1, 2), max_model_len=100,
                                  max_num_seqs=8, max_num_batched_tokens=64, timed=False)
    tokens = [3, 4, 5, 6, 3, 4, 5, 6, 3]
    first = _sequence(tokens)
    assert spec.rate(first) == 1.0 and spec.propose([first]) == {first: [4, 5, 6, 3]}
    for _ in range(20):
        spec.record(first, 4, 0)
    assert first.spec_rate == 0.5 ** 20 and spec.prior == pytest.approx(0.9 ** 20)  # 0.12: 0.49 drafts expected
    new = _sequence(tokens)
    assert new.spec_rate is None and spec.rate(new) == spec.prior
    assert spec.propose([new]) == {}
    assert new.spec_rate == pytest.approx(0.9 ** 20 + (1 - 0.9 ** 20) * speculative.RATE_RECOVERY)
    assert spec.propose([new]) == {new: [4, 5, 6, 3]}  # 0.139: a probe
    spec.record(new, 4, 4)
    assert spec.prior == pytest.approx(0.9 ** 21 + 0.1)


def test_calls_are_planned_ahead_only_while_proposing_finds_nothing():
    """After the n-th propose in a row that chose nothing (no verification, no probe), min(n,
    MAX_QUIET_CALLS) calls may be planned before the last call's tokens are known, each letting the
    rows' rates recover as a call without proposals does; a chosen proposal or a probe ends it. An
    untimed speculator (a multi-process engine's) verifies by the rows' acceptance alone."""
    def make(timed=True):
        return speculative.Speculator(speculative.SpeculativeConfig("ngram", 4, 1, 2), max_model_len=100,
                                      max_num_seqs=8, max_num_batched_tokens=64, timed=timed)

    spec, seq = make(), _sequence([3, 4, 5, 6, 7, 8, 9])  # nothing repeats: no proposal
    assert not spec.quiet
    for n in range(1, 6):
        assert spec.propose([seq]) == {}
        calls = 0
        while spec.quiet:
            rate = seq.spec_rate = 0.5
            spec.planned_ahead([seq])
            assert seq.spec_rate == rate + (1 - rate) * speculative.RATE_RECOVERY
            calls += 1
        assert calls == min(n, speculative.MAX_QUIET_CALLS)
    spec.observe(spec.step_key(1), 0.010)
    spec.observe(spec.verify_key(5), 0.030)  # a match would pay: the next calls probe, planned from tokens
    assert spec.propose([seq]) == {} and not spec.quiet
    repeating = _sequence([3, 4, 5, 6, 3, 4, 5, 6, 3])
    assert spec.propose([repeating]) == {repeating: [4, 5, 6, 3]} and not spec.quiet
    assert make().propose([repeating]) == {}  # no cost timed yet: a plain decode call first
    assert make(timed=False).propose([repeating]) == {repeating: [4, 5, 6, 3]}


def test_ngram_calls_are_planned_after_a_verification_only_while_they_pay():
    """Planned after a verification, a call assumes every draft accepted, so it verifies even where
    no drafts come (none looked up in the host's prediction, or none found by the device in the
    true tokens). Each of its rows moves `ahead_gain` AHEAD_WEIGHT of the way to the drafts it had
    accepted (0 without drafts). k = 4, a decode step 10 ms and a verification of 5 tokens 30 ms:
    planning ahead pays while the gain is >= 2 tokens a row; below, the call waits for the
    verification's tokens, and each time the gain rests RATE_RECOVERY toward k. A draft model's
    calls are planned ahead regardless; untimed, the gain must reach MIN_EXPECTED_PER_ROW."""
    def make(method="ngram", timed=True):
        spec = speculative.Speculator(speculative.SpeculativeConfig(method, 4, 1, 2), max_model_len=100,
                                      max_num_seqs=8, max_num_batched_tokens=64, timed=timed)
        spec.observe(spec.step_key(1), 0.010)
        spec.observe(spec.verify_key(5), 0.030)
        return spec

    spec, seq = make(), _sequence([3, 4, 5, 6, 3, 4, 5, 6, 3])
    verified = Plan(scheduled=[(seq, 5)], drafts={seq: [4, 5, 6, 3]})
    assert spec.ahead_gain == 4 and spec.plans_ahead(verified, [seq])
    assert not spec.plans_ahead(Plan(scheduled=[(seq, 1)], is_decode=True), [seq])  # after a decode call: quiet rules

    def planned_ahead(drafts, found, accepted):
        plan = Plan(scheduled=[(seq, 1 + len(drafts))], drafts={seq: drafts} if drafts else {}, optimistic={seq})
        output = types.SimpleNamespace(num_drafts=np.array([found]), num_accepted=np.array([accepted]))
        spec.record_call(plan, output, [(seq, 0, [])])

    planned_ahead([0] * 4, found=3, accepted=3)  # the device found 3 drafts, all accepted
    assert spec.ahead_gain == pytest.approx(3.8) and seq.spec_rate == 1.0
    planned_ahead([0] * 4, found=0, accepted=0)  # none found: the row's rate keeps
    planned_ahead([], found=0, accepted=0)  # none looked up: a call of 1 token
    assert spec.ahead_gain == pytest.approx(3.8 * 0.8 * 0.8) and seq.spec_rate == 1.0
    spec.record_call(Plan(scheduled=[(seq, 5)], drafts={seq: [4, 5, 6, 3]}),  # planned from its tokens: not counted
                     types.SimpleNamespace(num_drafts=np.array([4]), num_accepted=np.array([0])), [(seq, 0, [])])
    assert spec.ahead_gain == pytest.approx(3.8 * 0.8 * 0.8) and seq.spec_rate == 0.5
    assert spec.plans_ahead(verified, [seq])  # 2.43
    planned_ahead([0] * 4, found=4, accepted=0)
    assert spec.ahead_gain == pytest.approx(3.8 * 0.8 ** 3) and not spec.plans_ahead(verified, [seq])  # 1.95
    assert [spec.plans_ahead(verified, [seq]) for _ in range(2)] == [False, True]  # 1.99, 2.03
    assert spec.ahead_gain == pytest.approx(4 - (4 - 3.8 * 0.8 ** 3) * (1 - speculative.RATE_RECOVERY) ** 2)

    draft = make("draft_model")
    draft.ahead_gain = 0.0  # not kept for a draft model: its drafts are made on the device
    assert draft.plans_ahead(verified, [seq]) and draft.plans_ahead(Plan(scheduled=[(seq, 1)], is_decode=True), [seq])
    untimed = make(timed=False)
    untimed.ahead_gain = 0.5
    assert untimed.plans_ahead(verified, [seq])
    untimed.ahead_gain = 0.49
    assert not untimed.plans_ahead(verified, [seq])


def _output(tokens, accepted=None):
    """A call's output (core/model_output.py) of these tokens per row (-1 none)."""
    t = np.array(tokens, np.int32)
    zeros = np.zeros(t.shape, np.float32)
    return ModelOutput(tokens=t, logprob=zeros, rank=zeros.astype(np.int32), top_ids=np.zeros((*t.shape, 0), np.int32),
                       top_logprobs=np.zeros((*t.shape, 0), np.float32), finish=np.zeros(len(t), np.int32),
                       steps=np.int32(1), num_accepted=None if accepted is None else np.array(accepted, np.int32))


def test_a_verification_planned_ahead_assumes_every_draft_accepted_and_moves_back():
    """AsyncScheduler.schedule_next after a call verifying 3 drafts of rows a and b: each holds them
    and its next token as PENDING, computed, as if all were accepted; the next plan (a proposes
    again, b does not) verifies, both rows optimistic, the batch's positions from the assumed
    lengths. b accepted all 3: it stays; a accepted 1: processing the call moves it back by 2, as
    the device moves the planned call's row. A decode call after that pauses a at its K steps,
    not at the end of its table (which maps the longest outcome). Not planned ahead: without
    proposals for the next call, or where a row's drafts could reach its max_tokens."""
    def make(max_tokens=(64, 64)):
        sched = AsyncScheduler(max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_blocks=32,
                               max_blocks_per_seq=16, num_decode_steps=4, max_model_len=64)
        seqs = []
        for i, m in enumerate(max_tokens):
            request = Request(str(i), None, [1 + i, 2, 3, 4, 5, 6], SamplingParams(max_tokens=m), 0.0)
            request.seqs.append(Sequence(request, 0, list(request.prompt_token_ids), np.zeros(2, np.uint32)))
            sched.add(request.seqs[0])
            seqs.append(request.seqs[0])
        sched.update_from_output(sched.schedule(), _output([[7], [8]]))
        verify = sched.schedule({seq: [9, 9, 9] for seq in seqs})
        assert verify.scheduled == [(seqs[0], 4), (seqs[1], 4)] and not verify.is_decode
        return sched, seqs, verify

    sched, (a, b), verify = make()
    plan = sched.schedule_next(verify, lambda running: {a: [0, 0, 0]})
    assert (a.num_computed, a.token_ids[6:]) == (10, [7] + [PENDING] * 4) and b.num_computed == 10
    assert plan.scheduled == [(a, 4), (b, 1)] and plan.drafts == {a: [0, 0, 0]} and plan.optimistic == {a, b}
    assert plan.verifies and not plan.is_decode and list(plan.num_mapped) == [14, 11]
    batch = batching.prefill_batch(plan, block_size=4, max_num_seqs=4, max_blocks_per_seq=16, token_cap=64,
                                   num_speculative_tokens=3)
    assert batch.positions[:5].tolist() == [10, 11, 12, 13, 10] and batch.optimistic.tolist() == [True, True]
    assert batch.tokens[:5].tolist() == [PENDING, 0, 0, 0, PENDING] and batch.spec_rows.shape == (2, 4)
    sched.update_from_output(verify, _output([[9, 30, -1, -1], [9, 9, 9, 40]], accepted=[1, 3]))
    assert (a.num_computed, a.token_ids[6:]) == (8, [7, 9, 30])
    assert (b.num_computed, b.token_ids[6:]) == (10, [8, 9, 9, 9, 40])
    sched.update_from_output(plan, _output([[50, -1, -1, -1], [60, -1, -1, -1]], accepted=[0, 0]))
    assert (a.num_computed, a.num_tokens, sched.kv_manager.num_mapped(a.slot)) == (9, 10, 14)
    decode = sched.schedule()  # a's table maps 14 (the longest outcome): its K = 4 steps end at 13
    assert decode.is_decode and list(decode.num_mapped) == [13, 15]

    sched, (a, b), verify = make()
    assert sched.schedule_next(verify) is None and a.num_computed == 6  # no proposals: planned from the output
    sched, (a, b), verify = make(max_tokens=(64, 5))  # b's 4 new tokens would give it 5
    assert sched.schedule_next(verify, lambda running: {}) is None and b.num_computed == 6


def test_greedy_outputs_equal_the_plain_engines(model, untimed_speculation):
    """Twelve greedy requests on a pool small enough to preempt, sharing prompt prefixes, each
    stopping its own way (a stop string, a stop token, max_tokens, EOS) at points inside accepted
    runs: the speculative engine's tokens, texts, finish and stop reasons and logprobs equal the
    plain engine's, and its pool drains."""
    prompt = [5, 17, 99, 3, 42, 8, 5, 17, 99, 3]
    g = greedy_reference(model, prompt, 40)
    tokenizer = word_tokenizer(eos_token_ids=(g[31],))
    rng = np.random.default_rng(5)
    prompts = [" ".join(f"w{t}" for t in ([*prompt, *rng.integers(1, 128, int(n)).tolist()] if i else prompt))
               for i, n in enumerate(rng.integers(0, 12, 12))]
    params = [SamplingParams(temperature=0.0, max_tokens=int(m), logprobs=2,
                             stop=[f"w{g[7]}"] if i % 4 == 1 else [], stop_token_ids=[g[12]] if i % 4 == 2 else [],
                             ignore_eos=i % 4 == 3)
              for i, m in enumerate(rng.integers(8, 40, 12))]
    results = {}
    for config in (None, NGRAM):
        llm = LLM(model, tokenizer=tokenizer, block_size=4, num_blocks=28, max_num_seqs=6, num_decode_steps=4,
                  log_stats=False, speculative_config=config)
        outs = llm.generate(prompts, params)
        results[config is not None] = [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
                                        o.outputs[0].stop_reason) for o in outs]
        results[(config is not None, "logprobs")] = [
            [(t, lp.logprob) for entry in o.outputs[0].logprobs for t, lp in entry.items()] for o in outs]
        s = llm.stats()
        assert s["num_preemptions"] > 0 and s["prefix_cache_hits"] > 0
        assert_pool_drained(llm)
    assert results[True] == results[False]
    for spec, plain in zip(results[(True, "logprobs")], results[(False, "logprobs")]):  # f32, other programs
        assert [t for t, _ in spec] == [t for t, _ in plain]
        np.testing.assert_allclose([lp for _, lp in spec], [lp for _, lp in plain], atol=1e-4)
    assert results[True][0][0] == g[: len(results[True][0][0])]
    assert {r[2] for r in results[True]} == {"stop", "length"}
    assert s["spec_decode_num_drafts"] > 10 and s["spec_decode_num_accepted_tokens"] >= 10


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_stops_inside_an_accepted_run_end_where_plain_decoding_does(model, method, untimed_speculation):
    """This prompt's greedy answer falls into a loop of one token, whose proposals (n-gram, or the
    target drafting for itself) are accepted 3 at a time: a stop string spanning three of them and
    a max_tokens ending inside such a run cut the output exactly where the plain engine's ends."""
    prompt = [5, 17, 99, 3, 42, 8, 5, 17, 99, 3, 42, 8]
    g = greedy_reference(model, prompt, 24)
    loop = g[-1]
    assert g[-18:] == [loop] * 18 and g[:6].count(loop) == 0
    tokenizer = word_tokenizer()
    text = " ".join(f"w{t}" for t in prompt)
    params = [SamplingParams(temperature=0.0, max_tokens=24, stop=[f"w{loop} w{loop} w{loop}"]),
              SamplingParams(temperature=0.0, max_tokens=13), SamplingParams(temperature=0.0, max_tokens=24)]
    outs = {}
    for config in (None, NGRAM if method == "ngram" else _draft(model)):
        llm = LLM(model, tokenizer=tokenizer, block_size=4, num_blocks=64, max_num_seqs=4, num_decode_steps=2,
                  log_stats=False, speculative_config=config)
        outs[config is None] = [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
                                for o in [llm.generate(text, p)[0] for p in params]]
    assert outs[True] == outs[False]
    assert [len(ids) for ids, _, _ in outs[False]] == [len(g) - 18 + 3, 13, 24]
    assert llm.stats()["spec_decode_num_accepted_tokens_per_pos"][2] >= 2


def test_seeded_sampling_with_speculation_is_reproducible(model, untimed_speculation):
    """n = 2 sampled answers with seeds: the same tokens on every run, and the pool drains."""
    params = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=30)
    runs = []
    for _ in range(2):
        llm = LLM(model, block_size=4, num_blocks=64, max_num_seqs=4, num_decode_steps=4, log_stats=False,
                  speculative_config=NGRAM)
        out = llm.generate([[5, 17, 99, 3, 42, 8, 5, 17, 99, 3]], params)[0]
        runs.append([c.token_ids for c in out.outputs])
        assert llm.stats()["spec_decode_num_drafts"] > 0
        assert_pool_drained(llm)
    assert runs[0] == runs[1] and runs[0][0] != runs[0][1] and all(len(r) == 30 for r in runs[0])


def test_speculation_overlaps_the_output_side_and_plans_ahead_while_it_rests(model, untimed_speculation):
    """Async scheduling with n-gram speculation: every call's output side (text, stop strings)
    runs after the next call was dispatched, verifications included, so the device never waits for
    it; while no row has a proposal worth verifying, calls are planned before the last one's tokens
    are known (`overlapped_calls`). The tokens, texts and finishes equal the serial plain engine's
    and the serial speculative engine's; each pool drains."""
    rng = np.random.default_rng(3)
    ids = [rng.integers(1, 128, int(n)).tolist() for n in rng.integers(4, 20, 6)]
    g = greedy_reference(model, ids[3], 12)  # it repeats 67 113 30 74 110 from its 7th token
    prompts = [" ".join(f"w{t}" for t in prompt) for prompt in ids]
    params = [SamplingParams(temperature=0.0, max_tokens=int(m), stop=[f"w{g[9]} w{g[10]} w{g[11]}"] if i == 3 else [])
              for i, m in enumerate(rng.integers(20, 48, 6))]
    spec = {**NGRAM, "prompt_lookup_min": 2}
    results = {}
    for config, overlap in ((None, False), (spec, False), (spec, True)):
        llm = LLM(model, tokenizer=word_tokenizer(), block_size=4, num_blocks=64, max_num_seqs=4,
                  num_decode_steps=4, log_stats=False, speculative_config=config, async_scheduling=overlap)
        engine, events = llm.engine, []
        dispatch, report = engine.model_runner.dispatch, engine.output_processor.process_outputs

        def dispatched(plan, *args, **kwargs):
            events.append(("dispatch", plan))
            return dispatch(plan, *args, **kwargs)

        def reported(plan, *args):
            events.append(("report", plan))
            return report(plan, *args)

        engine.model_runner.dispatch, engine.output_processor.process_outputs = dispatched, reported
        outs = llm.generate(prompts, params)
        results[(config is not None, overlap)] = [(o.outputs[0].token_ids, o.outputs[0].text,
                                                   o.outputs[0].finish_reason) for o in outs]
        assert_pool_drained(llm)
        s = llm.stats()
        if not overlap:
            assert s["overlapped_calls"] == 0
            continue
        assert s["spec_decode_num_drafts"] > 0 and s["overlapped_calls"] >= 2
        dispatched_at = [at for at, (kind, _) in enumerate(events) if kind == "dispatch"]
        order = {id(events[at][1]): i for i, at in enumerate(dispatched_at)}
        for at, (kind, plan) in enumerate(events):
            i = order[id(plan)]
            if kind == "report" and i + 1 < len(dispatched_at):  # the next call was dispatched first
                assert dispatched_at[i + 1] < at, (i, len(dispatched_at))
        assert any(kind == "report" and plan.drafts for kind, plan in events)
    assert results[(True, True)] == results[(True, False)] == results[(False, False)]
    assert results[(False, False)][3][2] == "stop" and results[(False, False)][3][0] == g


def test_metrics_count_drafts_and_accepted_tokens_per_position(model, untimed_speculation):
    """/metrics's vLLM counters (prometheus text) equal llm.stats(), per position included."""
    from prometheus_client import generate_latest

    from paged_jax.entrypoints.openai.metrics import Metrics

    llm = LLM(model, block_size=4, num_blocks=64, max_num_seqs=4, num_decode_steps=4, log_stats=False,
              speculative_config=NGRAM)
    metrics = Metrics("m", num_speculative_tokens=3)
    llm.generate([[5, 17, 99, 3, 42, 8, 5, 17, 99, 3, 42, 8]], SamplingParams(temperature=0.0, max_tokens=24))
    metrics.on_step(llm.engine, [])
    text = generate_latest(metrics.registry).decode()
    s = llm.stats()
    labels = 'engine="0",model_name="m"'
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert f"vllm:spec_decode_{name}_total{{{labels}}} {float(s['spec_decode_' + name])}" in text
    for i, n in enumerate(s["spec_decode_num_accepted_tokens_per_pos"]):
        assert f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{i}"}} {float(n)}' in text
    assert s["spec_decode_num_accepted_tokens"] == sum(s["spec_decode_num_accepted_tokens_per_pos"]) > 0
    assert "spec_decode" not in generate_latest(Metrics("m").registry).decode()


# -- draft model ------------------------------------------------------------------------------


def _noisy(model, scale, seed):
    """The model's weights plus noise: a draft that agrees with it often, not always."""
    from flax import nnx

    graphdef, state = nnx.split(model)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [x + scale * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return nnx.merge(graphdef, jax.tree.unflatten(tree, noisy))


def test_draft_model_greedy_outputs_equal_the_plain_engines(model, untimed_speculation):
    """Greedy requests sharing prefixes on a pool small enough to preempt, a draft model proposing
    in every call: with a noisy copy of the target as draft, the plain engine's tokens, some drafts
    rejected; with a random one-layer draft too, few accepted; with the target itself as draft,
    every draft accepted, through recompute and swap preemption, prefix hits and the host prefix
    tier's, so the draft's pages (under the target's block ids) were in step with the target's
    wherever the target's were; each pool drains. Most verifications were planned while the one
    before ran, as if it accepted every draft, and moved back on the device where it did not."""
    prompt = [5, 17, 99, 3, 42, 8, 5, 17, 99, 3]
    rng = np.random.default_rng(7)
    prompts = [[*prompt, *rng.integers(1, 128, int(n)).tolist()] for n in rng.integers(0, 12, 8)]
    params = [SamplingParams(temperature=0.0, max_tokens=int(m), ignore_eos=True) for m in rng.integers(12, 40, 8)]
    runs = {"plain": (None, "recompute"), "noisy": (_draft(_noisy(model, 0.1, 1)), "recompute"),
            "random": (_draft(random_model(tiny_config(max_position_embeddings=1024, num_layers=1), seed=3)),
                       "recompute"),
            "self": (_draft(model), "swap")}
    outputs = {}
    for name, (config, mode) in runs.items():
        llm = LLM(model, block_size=4, num_blocks=44, max_num_seqs=6, num_decode_steps=4, log_stats=False,
                  speculative_config=config, preemption_mode=mode, swap_space=0.001,
                  enable_host_prefix_cache=name == "self")
        outputs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        outputs[name] += [o.outputs[0].token_ids for o in llm.generate(prompts[:3], params[:3])]  # evicted prefixes
        s = llm.stats()
        assert s["num_preemptions"] > 0 and s["prefix_cache_hits"] > 0, name
        assert_pool_drained(llm)
        if name == "noisy":
            assert s["spec_decode_num_drafts"] > 10 and 0.1 < s["spec_decode_acceptance_rate"] < 0.95
        if name in ("noisy", "self"):  # verifications planned while the one before ran, moved back on the device
            assert s["overlapped_verifications"] >= 8, s["overlapped_verifications"]
        if name == "random":  # it rests soon: a few verifications, few drafts accepted, calls planned ahead
            assert s["spec_decode_num_drafts"] > 0 and s["spec_decode_acceptance_rate"] < 0.1
            assert s["overlapped_calls"] > 0
        if name == "self":
            assert s["num_blocks_swapped_in"] > 0 and s["host_prefix_cache_blocks_in"] > 0, s
            assert s["spec_decode_num_drafts"] > 10 and s["spec_decode_acceptance_rate"] == 1.0
    assert outputs["noisy"] == outputs["random"] == outputs["self"] == outputs["plain"]


def test_ngram_verifications_planned_ahead_look_their_drafts_up_on_the_device(model, untimed_speculation):
    """n-gram speculation with async scheduling: most verifications are planned while the one
    before runs, their drafts reserved from the host's prediction and looked up by the device in
    the tokens it keeps beside each KV slot (worker/ngram_proposer.py). Every running row's blocks
    hold its tokens after each call (prompt chunks, decode steps, drafts, prefix hits, swapped-in
    and forked rows), and the greedy tokens equal the plain engine's, through recompute and swap
    preemption and the host prefix tier; each pool drains."""
    loop = [5, 17, 99, 3, 42, 8]
    rng = np.random.default_rng(11)
    prompts = [[*loop, *loop, *rng.integers(1, 128, int(n)).tolist(), *loop[:3]] for n in rng.integers(0, 12, 8)]
    params = [SamplingParams(temperature=0.0, max_tokens=int(m), ignore_eos=True, n=1 + (i == 2))
              for i, m in enumerate(rng.integers(12, 40, 8))]
    runs = {"plain": (None, "recompute", True), "serial": (NGRAM, "swap", False), "ahead": (NGRAM, "recompute", True),
            "ahead, swapped": (NGRAM, "swap", True)}
    outputs = {}
    for name, (config, mode, overlap) in runs.items():
        llm = LLM(model, block_size=4, num_blocks=44, max_num_seqs=6, num_decode_steps=4, log_stats=False,
                  speculative_config=config, preemption_mode=mode, swap_space=0.001, async_scheduling=overlap,
                  enable_host_prefix_cache=mode == "swap")
        engine, checked = llm.engine, [0]
        if name == "serial":  # no call in flight after a step: the device's tokens can be read
            step = engine.step

            def step_and_check():
                out = step()
                pages = np.asarray(engine.model_runner.state.token_pages.token_ids)
                for seq in engine.scheduler.running:
                    held = pages[engine.scheduler.kv_manager.blocks_of(seq.slot)].reshape(-1)
                    assert held[:seq.num_computed].tolist() == seq.token_ids[:seq.num_computed]
                    checked[0] += 1
                return out

            engine.step = step_and_check
        outputs[name] = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
        outputs[name] += [[c.token_ids for c in o.outputs] for o in llm.generate(prompts[:3], params[:3])]
        s = llm.stats()
        assert s["num_preemptions"] > 0 and s["prefix_cache_hits"] > 0, name
        assert_pool_drained(llm)
        if config is not None:
            assert s["spec_decode_num_drafts"] > 10 and s["spec_decode_num_accepted_tokens"] > 10, (name, s)
        if name == "serial":
            assert checked[0] > 50 and s["num_blocks_swapped_in"] > 0 and s["host_prefix_cache_blocks_in"] > 0
        if name.startswith("ahead"):
            assert s["overlapped_verifications"] >= 8, (name, s["overlapped_verifications"])
    assert outputs["serial"] == outputs["ahead"] == outputs["ahead, swapped"] == outputs["plain"]


def test_draft_model_samples_reproducibly_and_forks_its_pages(model, untimed_speculation):
    """n = 2 seeded samples with the target as its own draft (q = p: each draft is accepted): the
    forked child's draft pages were copied with the target's, the same tokens on every run."""
    params = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=30)
    runs = []
    for _ in range(2):
        llm = LLM(model, block_size=4, num_blocks=64, max_num_seqs=4, num_decode_steps=4, log_stats=False,
                  speculative_config=_draft(model))
        out = llm.generate([[5, 17, 99, 3, 42, 8, 5, 17, 99]], params)[0]
        runs.append([c.token_ids for c in out.outputs])
        s = llm.stats()
        assert s["spec_decode_num_drafts"] > 5 and s["spec_decode_acceptance_rate"] > 0.97
        assert_pool_drained(llm)
    assert runs[0] == runs[1] and runs[0][0] != runs[0][1] and all(len(r) == 30 for r in runs[0])


def test_draft_model_from_a_checkpoint_directory(untimed_speculation):
    """vLLM's form, a path: the embedded model drafting for itself gives its plain greedy answer
    with every draft accepted, each block holding both models' K/V (twice the bytes); a draft of
    another vocabulary (stories260K's 512 tokens) is refused by name."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    embedded, stories = str(root / "models" / "embedded"), str(root / "tests" / "data" / "stories260K")
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kw = dict(num_blocks=40, max_num_seqs=2, log_stats=False)
    plain = LLM(embedded, **kw)
    spec = LLM(embedded, speculative_config=_draft(embedded, 4), **kw)
    prompt = "def main():\n    "
    assert spec.generate(prompt, greedy)[0].outputs[0].token_ids == plain.generate(prompt, greedy)[0].outputs[0].token_ids
    assert spec.stats()["spec_decode_acceptance_rate"] == 1.0 and spec.stats()["spec_decode_num_drafts"] > 0
    assert spec.engine.config.bytes_per_block == 2 * plain.engine.config.bytes_per_block
    with pytest.raises(ValueError, match="draft model's vocab_size 512 differs from the target's 4096"):
        LLM(embedded, speculative_config=_draft(stories), **kw)


def test_a_draft_with_another_vocabulary_of_the_same_size_is_refused(tmp_path):
    """The embedded model with two of its tokens' ids swapped in tokenizer.json: the same 4096
    tokens, another vocabulary, so its proposals would mean other tokens."""
    import json
    import shutil
    from pathlib import Path

    embedded = Path(__file__).resolve().parents[2] / "models" / "embedded"
    other = tmp_path / "other"
    shutil.copytree(embedded, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["The"], vocab["def"] = vocab["def"], vocab["The"]
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="draft model .*other has another vocabulary: it encodes .The quick"):
        LLM(str(embedded), num_blocks=40, max_num_seqs=2, log_stats=False, speculative_config=_draft(str(other)))


def test_warm_up_compiles_the_verifications(model, untimed_speculation):
    """With speculation the warm-up also compiles every verification a short request makes (each
    token bucket of 1 + up to k tokens per row): a workload whose rows verify full and partial
    proposals, alone and two at a time, compiles nothing after it."""
    from tests.paged_jax.test_engine_api import counting_compiles

    llm = LLM(model, block_size=8, num_blocks=64, max_num_seqs=2, num_decode_steps=4, log_stats=False,
              speculative_config=NGRAM)
    report = llm.engine.warm_up(prompt_len=8)
    assert report["programs"] > 0
    prompt = [5, 17, 99, 3, 42, 8, 5, 17, 99, 3]
    reference, answers = greedy_reference(model, prompt, 17), []
    with counting_compiles() as compiles:
        for n in (1, 2, 1):
            outs = llm.generate([prompt] * n, SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True))
            answers += [o.outputs[0].token_ids for o in outs]
    assert answers == [reference] * 4
    s = llm.stats()
    assert compiles == [], compiles
    assert s["spec_decode_num_drafts"] > 0
    assert s["spec_decode_num_draft_tokens"] < 3 * s["spec_decode_num_drafts"]  # some partial proposals
