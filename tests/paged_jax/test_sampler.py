"""The device sampler against plain numpy statements of vLLM's sampling rules."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.sampling_params import SamplingParams
from paged_jax.worker import sampler

VOCAB = 12


def params_for(*rows, stop=((),), max_len=100):
    keys = [np.asarray(jax.random.key_data(jax.random.PRNGKey(i)), np.uint32) for i in range(len(rows))]
    stops = list(stop) * len(rows) if len(stop) == 1 else list(stop)
    return sampler.slot_params([(p, k, list(s), max_len) for p, k, s in zip(rows, keys, stops)], 4)


def logits_rows(n, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((n, VOCAB)) * 2, jnp.float32)


def numpy_filter(row, top_k, top_p, min_p):
    """The allowed token set, by vLLM's definitions on one row of (temperature-scaled) logits."""
    order = np.argsort(-row, kind="stable")
    allowed = np.zeros(VOCAB, bool)
    k = top_k if top_k > 0 else VOCAB
    kept = order[:k]
    probs = np.exp(row[kept] - row[kept].max())
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    kept = kept[before < top_p]
    p_all = np.exp(row - row.max())
    p_all /= p_all.sum()
    kept = [t for t in kept if p_all[t] >= min_p * p_all.max()]
    allowed[kept] = True
    return allowed


@pytest.mark.parametrize("top_k, top_p, min_p", [(0, 1.0, 0.0), (3, 1.0, 0.0), (0, 0.6, 0.0),
                                                 (5, 0.8, 0.0), (0, 1.0, 0.2), (4, 0.9, 0.1), (1, 0.1, 0.5)])
def test_filters_keep_exactly_vllms_token_set(top_k, top_p, min_p):
    logits = logits_rows(3, seed=top_k)
    sp = params_for(*[SamplingParams(top_k=top_k, top_p=top_p, min_p=min_p)] * 3)
    kept = np.isfinite(np.asarray(sampler._filter(logits, sp)))
    for r in range(3):
        np.testing.assert_array_equal(kept[r], numpy_filter(np.asarray(logits[r], np.float64), top_k, top_p, min_p))


def test_penalties_follow_vllm():
    """Outputs that repeat tokens, counted with np.add.at (a fancy-index `+= 1` counts a repeated
    index once); the expected logits by loops over the tokens themselves, so a sampler that took
    presence for frequency (or the reverse) misses by the repeats."""
    logits = logits_rows(2)
    outputs, prompts = [[4, 1, 4, 4, 9, 1], [2, 2, 5, 2]], [[1, 7], [5, 3, 3]]
    counts = np.zeros((2, VOCAB), np.int32)
    prompt = np.zeros((2, VOCAB), bool)
    for r in range(2):
        np.add.at(counts[r], outputs[r], 1)
        prompt[r, prompts[r]] = True
    assert counts[0, [1, 4, 9]].tolist() == [2, 3, 1] and counts[1, [2, 5]].tolist() == [3, 1]
    penalties = [(1.3, 0.5, 0.25), (0.8, -0.5, 0.7)]
    sp = params_for(*[SamplingParams(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
                      for rep, freq, pres in penalties])
    got = np.asarray(sampler.apply_penalties(logits, sp, jnp.asarray(counts), jnp.asarray(prompt)))
    want = np.asarray(logits, np.float64).copy()
    for r, (rep, freq, pres) in enumerate(penalties):
        for t in set(prompts[r]) | set(outputs[r]):  # repetition: once per distinct token seen anywhere
            want[r, t] = want[r, t] / rep if want[r, t] > 0 else want[r, t] * rep
        for t in outputs[r]:  # frequency: once per occurrence in the output
            want[r, t] -= freq
        for t in set(outputs[r]):  # presence: once per distinct output token
            want[r, t] -= pres
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_greedy_min_tokens_and_logprobs():
    logits = logits_rows(3)
    best = np.argmax(np.asarray(logits), axis=-1)
    sp = params_for(SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, min_tokens=2),
                    SamplingParams(temperature=0.0, top_k=1), stop=((), (int(best[1]),), ()))
    tokens, logprob, rank, top_ids, top_lps = sampler.sample(
        logits, sp, jnp.array([0, 1, 0]), filters=True, num_logprobs=3)
    second = np.argsort(-np.asarray(logits[1]))[1]
    assert tokens.tolist() == [best[0], second, best[2]]  # row 1 cannot stop before 2 tokens
    ref = jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1)
    np.testing.assert_allclose(logprob, np.asarray(ref)[np.arange(3), np.asarray(tokens)], rtol=1e-6)
    assert rank.tolist() == [1, 2, 1]
    np.testing.assert_array_equal(top_ids, np.argsort(-np.asarray(ref), axis=-1)[:, :3])
    np.testing.assert_allclose(top_lps, np.sort(np.asarray(ref), axis=-1)[:, ::-1][:, :3], rtol=1e-6)


def test_a_rows_draw_depends_only_on_its_key_and_index():
    logits = logits_rows(4)
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(4)]
    sp = params_for(*params)
    idx = jnp.array([0, 3, 5, 7])
    tokens = sampler.sample(logits, sp, idx, filters=False, num_logprobs=0)[0]
    perm = np.array([2, 0, 3, 1])
    permuted = type(sp)(**{k: v if k == "allowed" else np.asarray(v)[perm] for k, v in vars(sp).items()})  # per row
    tokens_perm = sampler.sample(logits[perm], permuted, idx[perm], filters=False, num_logprobs=0)[0]
    assert np.asarray(tokens)[perm].tolist() == np.asarray(tokens_perm).tolist()
    # The empirical distribution of one row over many indices follows softmax(logits / T).
    many = jnp.arange(4000)
    sp_one = jax.tree.map(lambda a: np.repeat(np.asarray(a)[:1], 4000, axis=0), sp)
    draws = sampler.sample(jnp.repeat(logits[:1], 4000, axis=0), sp_one, many, filters=False, num_logprobs=0)[0]
    freq = np.bincount(np.asarray(draws), minlength=VOCAB) / 4000
    np.testing.assert_allclose(freq, np.asarray(jax.nn.softmax(logits[0])), atol=0.03)


def test_stop_check_order():
    sp = params_for(SamplingParams(max_tokens=5, min_tokens=2), SamplingParams(max_tokens=5),
                    SamplingParams(max_tokens=9), SamplingParams(max_tokens=3, ignore_eos=True),
                    stop=((7,), (7,), (7,), ()), max_len=20)
    codes = sampler.stop_check(jnp.array([7, 7, 1, 7]), sp, jnp.array([1, 2, 4, 3]), jnp.array([10, 10, 20, 12]))
    # below min_tokens nothing stops; a stop token; max_model_len; max_tokens (ignore_eos has no EOS)
    assert codes.tolist() == [0, 1, 2, 2]


@pytest.mark.parametrize("field, value", [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5),
                                          ("top_k", -2), ("n", 0), ("max_tokens", 0), ("min_p", 1.5),
                                          ("repetition_penalty", 0.0), ("presence_penalty", 2.5)])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"{field} must be .* got {value!r}"):
        SamplingParams(**{field: value})
