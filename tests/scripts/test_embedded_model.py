"""The embedded model (models/embedded, trained by scripts/train_tiny.py): it has learned its corpus,
and the paged engine decodes it exactly as the dense forward does."""
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from models import Llama, load_model, load_tokenizer
from paged_jax import LLM, SamplingParams
from scripts import train_tiny
from scripts.generate import DEFAULT_MODEL
from tests.models.model_testing import dense_logits

NUM_WINDOWS = 8  # of max_position_embeddings tokens, spread evenly over the held-out files


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def model():
    return load_model(DEFAULT_MODEL, dtype="float32")


def perplexity(model, tokens):  # tokens i32[num_windows, seq + 1] -> e^(mean next-token loss)
    logits = dense_logits(model, jnp.asarray(tokens[:, :-1]))
    return float(np.exp(optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()))


def test_held_out_perplexity_is_far_below_uniform(model, tokenizer):
    train_files, held_files = train_tiny.corpus_files()
    assert [f.name for f in held_files] == sorted(train_tiny.HELD_OUT)
    assert not set(held_files) & set(train_files)
    ids = train_tiny.encode_files(tokenizer.tokenizer, held_files)
    t, vocab = model.config.max_position_embeddings, model.config.vocab_size
    starts = np.linspace(0, ids.size - t - 1, NUM_WINDOWS).astype(int)
    windows = np.stack([ids[s: s + t + 1] for s in starts])
    # Uniform guessing scores `vocab`. The trained model must be 20x better; its initialisation
    # (where training starts) must not be, or the bound would not be measuring training.
    assert perplexity(model, windows) < vocab / 20
    assert perplexity(Llama(model.config, rngs=nnx.Rngs(0)), windows) > vocab / 20


def test_engine_greedy_equals_dense_greedy(model, tokenizer):
    prompts = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main():\n"]
    num_tokens, width = 8, 32
    # The engine's default sizes, as scripts/generate.py uses them (shared compilations).
    llm = LLM(model, tokenizer=tokenizer, log_stats=False)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = tokenizer.encode(prompt)
        # One width for every call (one compile); causal, so the zeros after position p cannot
        # change the logits at p.
        tokens = np.zeros((1, width), np.int32)
        tokens[0, : len(ids)] = ids
        for p in range(len(ids), len(ids) + num_tokens):
            tokens[0, p] = int(np.argmax(dense_logits(model, jnp.asarray(tokens))[0, p - 1]))
        assert out.outputs[0].token_ids == tokens[0, len(ids): len(ids) + num_tokens].tolist()
        assert out.outputs[0].text == tokenizer.decode(tokens[0, len(ids): len(ids) + num_tokens])
