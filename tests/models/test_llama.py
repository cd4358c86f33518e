"""The paged forward against the dense one, config presets and round trips, and the layer scan."""
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model_testing import GEMMA2, LLAMA3_SCALING, MISTRAL_WINDOW, dense_logits, max_rel_err, random_model, tiny_config
from models.llama import Llama, LlamaConfig, PRESETS, forward, preset, rope_inv_freq
from paged_jax.attention import AttentionMetadata

BLOCK_SIZE = 4
NUM_BLOCKS = 24
MAX_BLOCKS_PER_SEQ = 6


def permuted_block_tables(num_seqs, seed):
    """Each sequence gets MAX_BLOCKS_PER_SEQ distinct blocks drawn from a random permutation of the
    non-null blocks, so neighbouring positions live in unrelated pages."""
    perm = np.random.default_rng(seed).permutation(np.arange(1, NUM_BLOCKS))
    return perm[:num_seqs * MAX_BLOCKS_PER_SEQ].reshape(num_seqs, MAX_BLOCKS_PER_SEQ).astype(np.int32)


def ragged_batch(seqs, chunks, tables, num_tokens):
    """One step's inputs: `chunks[s] = (start, end)` of sequence s's tokens, padded to num_tokens
    with tokens that write nowhere (slot -1). Returns tokens, positions, metadata."""
    tokens, positions, slots, qsl = [], [], [], [0]
    for s, (start, end) in enumerate(chunks):
        pos = np.arange(start, end)
        tokens += list(seqs[s][start:end])
        positions += list(pos)
        slots += list(tables[s, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        qsl.append(qsl[-1] + end - start)
    pad = num_tokens - len(tokens)
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(slots + [-1] * pad, jnp.int32),
        block_tables=jnp.asarray(tables),
        seq_lens=jnp.asarray([end for _, end in chunks], jnp.int32),
        query_start_loc=jnp.asarray(qsl, jnp.int32))
    return jnp.asarray(tokens + [0] * pad, jnp.int32), jnp.asarray(positions + [0] * pad, jnp.int32), md


class Setup(NamedTuple):
    model: Llama
    graphdef: nnx.GraphDef
    state: nnx.State
    seqs: list  # of i32[len]
    dense: list  # of f32[len, vocab]: dense_logits per sequence, the reference


def make_setup(config) -> Setup:
    model = random_model(config, seed=1)
    rng = np.random.default_rng(2)
    lens = [13, 7, 21]
    seqs = [rng.integers(0, config.vocab_size, n) for n in lens]
    padded = np.zeros((len(seqs), max(lens)), np.int32)
    for s, seq in enumerate(seqs):
        padded[s, :len(seq)] = seq
    dense = np.asarray(dense_logits(model, jnp.asarray(padded)))  # causal: right padding is inert
    graphdef, state = nnx.split(model)
    return Setup(model, graphdef, state, seqs, [dense[s, :len(seq)] for s, seq in enumerate(seqs)])


@pytest.fixture(scope="module")
def setup():
    return make_setup(tiny_config(rope_scaling=LLAMA3_SCALING))


def run_steps(setup, schedule, num_tokens, seed):
    """Feed each step's chunks through the jitted forward; collect every token's logits per sequence."""
    model, graphdef, state, seqs, _ = setup
    tables = permuted_block_tables(len(seqs), seed)
    cache = model.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    got = [[] for _ in seqs]
    for chunks in schedule:
        tokens, positions, md = ragged_batch(seqs, chunks, tables, num_tokens)
        logits, cache = forward(graphdef, state, tokens, positions, cache, md,
                                jnp.arange(num_tokens, dtype=jnp.int32))
        logits = np.asarray(logits)
        offset = 0
        for s, (start, end) in enumerate(chunks):
            got[s] += list(logits[offset:offset + end - start])
            offset += end - start
    return [np.stack(g) for g in got]


def assert_matches_dense(setup, got):
    for s, dense in enumerate(setup.dense):
        assert got[s].shape == dense.shape
        assert max_rel_err(got[s], dense) <= 1e-5, f"sequence {s}"


def test_prefill_in_one_step_matches_dense(setup):
    lens = [len(s) for s in setup.seqs]
    got = run_steps(setup, [[(0, n) for n in lens]], num_tokens=48, seed=0)
    assert_matches_dense(setup, got)


def test_chunked_prefill_matches_dense(setup):
    # Uneven chunks that start and end inside blocks and on block edges; sequences finish at
    # different steps, so later steps mix chunks with sequences that have no new tokens.
    bounds = [[0, 5, 8, 13, 13], [0, 4, 7, 7, 7], [0, 3, 11, 12, 21]]
    schedule = [[(b[i], b[i + 1]) for b in bounds] for i in range(4)]
    got = run_steps(setup, schedule, num_tokens=16, seed=1)
    assert_matches_dense(setup, got)


def decode_batch(seqs, positions, tables):
    """One decode step: sequence s feeds its token at positions[s]; None makes row s a padding row."""
    live = np.array([p is not None for p in positions])
    pos = np.array([p or 0 for p in positions])
    tokens = np.array([seqs[s][p] if live[s] else 0 for s, p in enumerate(pos)], np.int32)
    blocks = tables[np.arange(len(seqs)), pos // BLOCK_SIZE]
    slots = np.where(live, blocks * BLOCK_SIZE + pos % BLOCK_SIZE, -1)
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(slots, jnp.int32), block_tables=jnp.asarray(tables),
        seq_lens=jnp.asarray(np.where(live, pos + 1, 0), jnp.int32),
        query_start_loc=jnp.arange(len(seqs) + 1, dtype=jnp.int32), decode_only=True)
    return jnp.asarray(tokens), jnp.asarray(pos, jnp.int32), md


def test_decode_token_by_token_matches_dense(setup):
    model, graphdef, state, seqs, dense = setup
    lens, prompt = [len(s) for s in seqs], [3, 1, 6]
    tables = permuted_block_tables(len(seqs), 2)
    cache = model.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    tokens, positions, md = ragged_batch(seqs, [(0, p) for p in prompt], tables, 16)
    _, cache = forward(graphdef, state, tokens, positions, cache, md, jnp.zeros(1, jnp.int32))
    checked = 0
    for step in range(max(n - p for n, p in zip(lens, prompt))):
        # A sequence that has run out of tokens stays in the batch as a padding row (seq_lens 0).
        pos = [p + step if p + step < n else None for p, n in zip(prompt, lens)]
        tokens, positions, md = decode_batch(seqs, pos, tables)
        logits, cache = forward(graphdef, state, tokens, positions, cache, md,
                                jnp.arange(len(seqs), dtype=jnp.int32))
        for s, p in enumerate(pos):
            if p is not None:
                assert max_rel_err(logits[s], dense[s][p]) <= 1e-5, (s, p)
                checked += 1
    assert checked == sum(n - p for n, p in zip(lens, prompt))


@pytest.mark.parametrize("overrides", [MISTRAL_WINDOW, GEMMA2], ids=["mistral_window", "gemma2"])
def test_windowed_chunked_prefill_then_decode_matches_dense(overrides):
    """Windows of 12 (Mistral) and 16 (Gemma 2's sliding layers) over sequences of 13, 7 and 21
    tokens: a chunked prefill, then the decode path (decode_only) token by token, in permuted blocks."""
    windowed = make_setup(tiny_config(**overrides))
    lens, prompt = [len(s) for s in windowed.seqs], [9, 2, 14]
    got = run_steps(windowed, [[(0, 5), (0, 2), (0, 8)], [(5, 9), (2, 2), (8, 14)]], num_tokens=16, seed=5)
    for s, p in enumerate(prompt):
        assert max_rel_err(got[s], windowed.dense[s][:p]) <= 1e-5, s
    cache = windowed.model.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    tables = permuted_block_tables(3, 6)
    tokens, positions, md = ragged_batch(windowed.seqs, [(0, p) for p in prompt], tables, 32)
    _, cache = forward(windowed.graphdef, windowed.state, tokens, positions, cache, md, jnp.zeros(1, jnp.int32))
    for step in range(max(n - p for n, p in zip(lens, prompt))):
        pos = [p + step if p + step < n else None for p, n in zip(prompt, lens)]
        tokens, positions, md = decode_batch(windowed.seqs, pos, tables)
        logits, cache = forward(windowed.graphdef, windowed.state, tokens, positions, cache, md,
                                jnp.arange(3, dtype=jnp.int32))
        for s, p in enumerate(pos):
            if p is not None:
                assert max_rel_err(logits[s], windowed.dense[s][p]) <= 1e-5, (s, p)


def test_logits_only_for_requested_rows(setup):
    model, graphdef, state, seqs, dense = setup
    lens = [len(s) for s in seqs]
    tokens, positions, md = ragged_batch(seqs, [(0, n) for n in lens], permuted_block_tables(3, 3), 48)
    last = jnp.asarray(np.cumsum(lens) - 1, jnp.int32)
    logits, _ = forward(graphdef, state, tokens, positions, model.init_cache(NUM_BLOCKS, BLOCK_SIZE), md, last)
    assert logits.shape == (3, model.config.vocab_size) and logits.dtype == jnp.float32
    for s in range(3):
        assert max_rel_err(logits[s], dense[s][-1]) <= 1e-5


def test_bfloat16_model_keeps_dtype_and_tracks_float32(setup):
    model16 = random_model(tiny_config(rope_scaling=LLAMA3_SCALING, dtype="bfloat16"), seed=1)
    seq = setup.seqs[2]
    dense16 = dense_logits(model16, jnp.asarray(seq)[None])[0]
    assert model16.layers.wq[...].dtype == jnp.bfloat16 and dense16.dtype == jnp.float32
    assert 1e-4 < max_rel_err(dense16, setup.dense[2]) < 5e-2  # bf16 rounding: visible but small
    cache = model16.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    assert cache.k_pages.dtype == jnp.bfloat16
    tables = permuted_block_tables(1, 4)
    tokens, positions, md = ragged_batch([seq], [(0, len(seq))], tables, 24)
    paged16, _ = forward(*nnx.split(model16), tokens, positions, cache, md,
                         jnp.arange(len(seq), dtype=jnp.int32))
    assert max_rel_err(paged16, dense16) < 1e-2


def test_training_step_lowers_loss():
    optax = pytest.importorskip("optax")
    model = Llama(tiny_config(), rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (4, 16)), jnp.int32)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    def loss_fn(m):
        logits = m.dense_logits(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    @nnx.jit
    def train_step(m, opt):
        loss, grads = nnx.value_and_grad(loss_fn)(m)
        opt.update(m, grads)
        return loss

    losses = [float(train_step(model, optimizer)) for _ in range(5)]
    assert losses[0] == pytest.approx(np.log(128), rel=0.02)  # small init: near-uniform predictions
    assert losses[-1] < losses[0] - 0.5


def param_count(config):
    abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    return sum(x.size for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(abstract))))


@pytest.mark.parametrize("name, expected", [("llama-3.2-1b", 1_235_814_400),
                                            ("llama-3.2-3b", 3_212_749_824),
                                            ("llama-3.1-8b", 8_030_261_248)])
def test_presets_have_the_published_parameter_counts(name, expected):
    assert param_count(preset(name)) == expected


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_hf_config_round_trip(name):
    config = preset(name)
    assert LlamaConfig.from_hf_config(config.to_hf_config()) == config


def test_reads_the_published_llama_3_2_1b_config():
    # meta-llama/Llama-3.2-1B's config.json (transformers 4.45 style), less its unused fields.
    hf = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000,
          "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
          "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
          "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16,
          "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
          "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                           "original_max_position_embeddings": 8192, "rope_type": "llama3"},
          "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
          "use_cache": True, "vocab_size": 128256}
    assert LlamaConfig.from_hf_config(hf) == preset("llama-3.2-1b")
    assert LlamaConfig.from_hf_config(hf, dtype="float32").dtype == "float32"


def test_reads_transformers_5_rope_parameters():
    config = tiny_config(rope_scaling=LLAMA3_SCALING)
    hf = config.to_hf_config()
    hf["rope_parameters"] = dict(hf.pop("rope_scaling"), rope_theta=hf.pop("rope_theta"))
    assert LlamaConfig.from_hf_config(hf) == config
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    assert LlamaConfig.from_hf_config(hf) == tiny_config()


@pytest.mark.parametrize("field, value, message", [
    ("model_type", "gemma3", "unsupported model_type 'gemma3'"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "unsupported rope_scaling type 'yarn'"),
    ("rope_scaling", {"type": "linear", "factor": 2.0}, "unsupported rope_scaling type 'linear'"),
])
def test_unsupported_hf_configs_are_rejected(field, value, message):
    hf = dict(tiny_config().to_hf_config(), **{field: value})
    with pytest.raises(ValueError, match=message):
        LlamaConfig.from_hf_config(hf)


@pytest.mark.parametrize("overrides, message", [
    (dict(model_type="llama", sliding_window=8), "sliding_window=8 is for model_type 'mistral' or 'phi3' only, got 'llama'"),
    (dict(model_type="qwen2", sliding_window=8), "sliding_window=8 is for model_type 'mistral' or 'phi3' only, got 'qwen2'"),
    (dict(model_type="mistral", sliding_window=0), "sliding_window must be a positive int or None, got 0"),
    (dict(model_type="mistral", sliding_window=8.0), "sliding_window must be a positive int or None, got 8.0"),
])
def test_bad_sliding_windows_are_rejected(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny_config(**overrides)


def test_mistral_window_round_trips_and_is_every_layers():
    config = tiny_config(**MISTRAL_WINDOW)
    assert config.to_hf_config()["sliding_window"] == 12
    assert LlamaConfig.from_hf_config(config.to_hf_config()) == config
    assert config.layer_windows == (12, 12) and config.kv_window == 12
    assert tiny_config().kv_window is None
    # Qwen2's configs name a window they do not use (use_sliding_window false): it is not read.
    qwen2 = tiny_config(model_type="qwen2")
    assert LlamaConfig.from_hf_config(dict(qwen2.to_hf_config(), sliding_window=4096)) == qwen2


def test_llama3_rope_scaling_bands():
    # theta 1e4, head_dim 16: wavelengths 2*pi*1e4**(i/8). With original length 64, high/low
    # factors 4/1: below 16 kept, above 64 divided by 8, between blended.
    base = rope_inv_freq(tiny_config())
    scaled = rope_inv_freq(tiny_config(rope_scaling=LLAMA3_SCALING))
    wavelen = 2 * np.pi / base
    np.testing.assert_array_equal(scaled[wavelen < 16], base[wavelen < 16])
    np.testing.assert_allclose(scaled[wavelen > 64], base[wavelen > 64] / 8, rtol=1e-6)
    mid = (wavelen >= 16) & (wavelen <= 64)
    assert mid.sum() == 2 and np.all(scaled[mid] < base[mid]) and np.all(scaled[mid] > base[mid] / 8)


def count_equations(num_layers, paged):
    """Top-level equations of the traced forward, from shapes alone (no weights are built)."""
    config = tiny_config(num_layers=num_layers)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0))))
    tokens = jnp.zeros((8,), jnp.int32)
    md = AttentionMetadata(slot_mapping=jnp.arange(8, dtype=jnp.int32),
                           block_tables=jnp.ones((1, 2), jnp.int32), seq_lens=jnp.array([8], jnp.int32),
                           query_start_loc=jnp.array([0, 8], jnp.int32))

    def run(state):
        model = nnx.merge(graphdef, state)
        if not paged:
            return model.dense_logits(tokens[None])
        return model(tokens, tokens, model.init_cache(4, 4), md, jnp.zeros(1, jnp.int32))

    eqns = jax.make_jaxpr(run)(state).jaxpr.eqns
    assert [e.primitive.name for e in eqns].count("scan") == 1
    return len(eqns)


@pytest.mark.parametrize("paged", [False, True])
def test_traced_program_does_not_grow_with_depth(paged):
    assert count_equations(2, paged) == count_equations(6, paged)
