"""Weight-only int8 quantization (models/quantize.py, `quantization="int8"`): each weight within
half a step of its channel's scale, the caller's model untouched, and the engine's int8 products
equal to the same engine on the dequantized weights (q * scale in f32) for every family's layers:
Llama with an untied head, Qwen2's biases and tied head, Qwen3's q/k norms, Gemma 2's windows and
caps; a bf16 model too. Bad methods are named."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import quantize as quantize_lib
from models.quantize import LAYER_INPUTS, SCALE, dequantize, head_logits, int8, quantize
from paged_jax import LLM, SamplingParams
from paged_jax.engine.arg_utils import EngineArgs
from tests.models.model_testing import GEMMA2, random_model, tiny_config
from tests.paged_jax.engine_testing import assert_pool_drained


def test_int8_keeps_each_weight_within_half_a_step_of_its_channel():
    w = np.random.default_rng(0).standard_normal((3, 8, 5)).astype(np.float32)
    w[:, :, 4] = 0.0  # an all-zero output channel
    q, scale = int8(w, (1,))
    assert q.dtype == jnp.int8 and scale.shape == (3, 5) and scale.dtype == jnp.float32
    expected = np.abs(w).max(axis=1) / 127
    np.testing.assert_allclose(np.asarray(scale)[:, :4], expected[:, :4], rtol=1e-6)
    assert np.all(np.asarray(scale)[:, 4] == 1.0) and np.all(np.asarray(q)[:, :, 4] == 0)
    error = np.abs(np.asarray(q, np.float32) * np.asarray(scale)[:, None, :] - w)
    assert np.all(error <= np.asarray(scale)[:, None, :] / 2 + 1e-7)
    assert np.abs(np.asarray(q)).max() == 127  # each channel's largest weight is +-127


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("vocab", [1000, 1024, 300])
def test_the_int8_head_reads_its_vocabulary_in_chunks_and_equals_float64(monkeypatch, tied, vocab):
    """Chunks of 256 entries (the least) with a rest (1000 = 3 x 256 + 232), without one (1024), and
    a head read at once (300): the logits of q * scale in float64."""
    monkeypatch.setattr(quantize_lib, "HEAD_CHUNK_BYTES", 1024)
    rng = np.random.default_rng(1)
    h = rng.standard_normal((2, 3, 16)).astype(np.float32)
    w = rng.standard_normal((vocab, 16) if tied else (16, vocab)).astype(np.float32)
    q, scale = int8(w, (1,) if tied else (0,))
    got = jax.jit(lambda h, q, s: head_logits(h, q, s, tied=tied))(h, q, scale)
    dequantized = np.asarray(q, np.float64) * (np.asarray(scale, np.float64)[:, None] if tied else np.asarray(scale))
    want = np.einsum("bsd,vd->bsv" if tied else "bsd,dv->bsv", h.astype(np.float64), dequantized)
    assert got.shape == (2, 3, vocab) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_quantize_copies_the_model_and_names_a_bad_method():
    model = random_model(tiny_config(tie_word_embeddings=False))
    q = quantize(model, "int8")
    assert model.layers.wq[...].dtype == jnp.float32 and not hasattr(model, "embed_scale")  # untouched
    for name in LAYER_INPUTS:
        assert getattr(q.layers, name)[...].dtype == jnp.int8 and name + SCALE in q.layers.names
    assert q.embed[...].dtype == q.lm_head[...].dtype == jnp.int8
    assert q.embed_scale[...].shape == q.lm_head_scale[...].shape == (model.config.vocab_size,)
    assert quantize(q, "int8") is q and quantize(model, None) is model
    int8_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(q)))
    assert int8_bytes < 0.3 * sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    with pytest.raises(ValueError, match=r"quantization 'int4' is not supported; supported: \['int8'\]"):
        quantize(model, "int4")
    with pytest.raises(ValueError, match=r"quantization 'fp8' is not supported"):
        EngineArgs(quantization="fp8")


@pytest.mark.parametrize("overrides", [
    dict(tie_word_embeddings=False),
    dict(model_type="qwen2", tie_word_embeddings=True),
    dict(model_type="qwen3", head_dim=32),
    GEMMA2,
    dict(dtype="bfloat16"),
], ids=["llama", "qwen2", "qwen3", "gemma2", "llama-bf16"])
def test_int8_engine_equals_the_engine_on_the_dequantized_weights(overrides):
    """Greedy tokens equal and logprobs within the dtype's rounding: the int8 products compute what
    f32 products of q * scale do, in the layers, the embedding lookup and the head."""
    model = random_model(tiny_config(max_position_embeddings=1024, eos_token_id=None, **overrides))
    reference = dequantize(quantize(model, "int8"))
    if overrides.get("dtype") == "bfloat16":  # the reference in the model's dtype, as its products run
        reference = nnx.merge(nnx.graphdef(reference),
                              jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(reference)))
    prompts = [[5, 17, 99, 3, 42, 8], [1, 2, 3], list(range(30, 50))]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True)
    results = {}
    for name, kwargs in (("int8", dict(model=model, quantization="int8")), ("dequantized", dict(model=reference))):
        llm = LLM(kwargs.pop("model"), block_size=4, num_blocks=64, max_num_seqs=4, num_decode_steps=4,
                  log_stats=False, **kwargs)
        outs = llm.generate(prompts, params)
        results[name] = ([o.outputs[0].token_ids for o in outs],
                         [lp.logprob for o in outs for entry in o.outputs[0].logprobs for lp in entry.values()])
        assert_pool_drained(llm)
    assert results["int8"][0] == results["dequantized"][0]
    # bf16: two roundings of the value (its unit roundoff is 2^-8; measured up to 1.6 of them, jax
    # 0.12.1), and one of 1 for a logprob near 0
    tolerance = dict(rtol=2**-7, atol=2**-8) if overrides.get("dtype") == "bfloat16" else dict(rtol=0, atol=1e-4)
    np.testing.assert_allclose(results["int8"][1], results["dequantized"][1], **tolerance)
