"""The engine through the Pallas kernels: compiled on a GPU (marked `gpu`) against the CPU
reference backend, and in interpret mode on CPU against the reference backend, with a fork (the
copy kernel) and a chunked prefill mixed with decode rows in the batch."""
import contextlib

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import mosaic
from paged_jax import LLM, SamplingParams
from tests.models.model_testing import random_model, tiny_config

PROMPTS = [[5, 17, 99, 3, 42, 8, 61, 20, 7, 33, 90], [4, 8, 15, 16, 23, 42], list(range(40, 61))]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
          SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True),
          SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)]


def tokens(backend, config, **kwargs):
    llm = LLM(random_model(config), block_size=8, num_blocks=32, max_num_seqs=4, max_num_batched_tokens=16,
              attention_backend=backend, log_stats=False, **kwargs)
    return [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, PARAMS)]


@pytest.mark.triton
def test_pallas_interpret_matches_the_reference_backend():
    config = tiny_config(head_dim=64)
    assert tokens("pallas-interpret", config, num_decode_steps=3) == tokens("reference", config, num_decode_steps=3)


@pytest.mark.skipif(not mosaic.AVAILABLE, reason=str(mosaic.UNAVAILABLE))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_pallas_mosaic_interpret_matches_the_reference_backend(dtype):
    """Hopper's path, in the Mosaic GPU interpreter: its kernels (bf16 WGMMA inputs, f32 as f16
    halves), with the cache writes and the fork's block copy on XLA (no Pallas Triton)."""
    config = tiny_config(head_dim=64, dtype=dtype)
    assert (tokens("pallas_mosaic-interpret", config, num_decode_steps=3)
            == tokens("reference", config, num_decode_steps=3))


@pytest.mark.triton
@pytest.mark.gpu
def test_gpu_pallas_matches_the_cpu_reference():
    # f32: greedy tokens compare exactly only where rounding cannot flip a near tie.
    config = tiny_config(head_dim=128)
    on_gpu = tokens("pallas", config)
    try:  # JAX_PLATFORMS=cuda,cpu: the reference runs on the CPU; with cuda alone, on the GPU
        place = jax.default_device(jax.devices("cpu")[0])
    except RuntimeError:
        place = contextlib.nullcontext()
    with place:
        on_reference = tokens("reference", config)
    assert on_gpu == on_reference
