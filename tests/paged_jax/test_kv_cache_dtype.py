"""LLM(kv_cache_dtype=...): int8 and fp8 KV pages on real weights (stories260K) keep the greedy
answers of the unquantized cache, the pool counts the scales in its bytes per block, and a dtype
the backend cannot read is refused by name."""
import jax.numpy as jnp
import pytest

from paged_jax import LLM, SamplingParams
from paged_jax.attention import KVCache, check_kv_cache_dtype
from scripts.benchlib import forced_agreement
from scripts.kv_dtype_section import PROMPTS
from tests.paged_jax.test_real_checkpoint import MODEL

PARAMS = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def unquantized():
    return LLM(str(MODEL), log_stats=False).generate(PROMPTS, PARAMS)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_quantized_cache_keeps_the_greedy_answers(unquantized, kv_cache_dtype):
    """16 prompts x 64 greedy tokens of the unquantized cache, each scored in its own context
    under the quantized one: the same greedy choice at >= 95% of the positions, and the chosen
    tokens' logprobs move little on average (measured on jax 0.10: int8 99.0% and 0.019, fp8
    95.9% and 0.055; an unquantized cache scored so gives 100% and 8e-7)."""
    llm = LLM(str(MODEL), kv_cache_dtype=kv_cache_dtype, log_stats=False)
    agree, logprob_diff = forced_agreement(llm, unquantized)
    print(f"{kv_cache_dtype}: agreement {agree:.4f}, mean |logprob diff| {logprob_diff:.5f}")
    assert agree >= 0.95
    assert logprob_diff < {"int8": 0.03, "fp8_e4m3": 0.08}[kv_cache_dtype]


def test_blocks_count_the_scales():
    """stories260K: 5 layers, 4 KV heads, head_dim 8, f32. A block of 16 tokens holds
    2 * 5 * 4 * 16 * 8 * 4 = 20480 bytes unquantized; int8 stores each 8-value row in 8 bytes
    plus a 4-byte scale: 2 * 5 * 4 * 16 * (8 + 4) = 7680; the same budget holds 8/3 the blocks."""
    auto, int8 = (LLM(str(MODEL), kv_cache_dtype=d, kv_cache_memory_fraction=0.01,
                      log_stats=False).engine for d in ("auto", "int8"))
    assert (auto.config.bytes_per_block, int8.config.bytes_per_block) == (20480, 7680)
    cache = int8.model_runner.state.cache
    assert cache.bytes_per_block == 7680 and cache.k_pages.dtype == jnp.int8
    assert cache.k_scales.shape == cache.k_pages.shape[:3]  # [kv_heads, layers * blocks, block_size]
    # 1% of the CPU's 256 MiB: 2684354 bytes
    assert (auto.config.num_blocks, int8.config.num_blocks) == (2684354 // 20480, 2684354 // 7680)


def test_unknown_or_unreadable_kv_cache_dtype_is_named():
    with pytest.raises(ValueError, match=r"kv_cache_dtype 'fp8' is not supported; supported: "
                                         r"\['auto', 'int8', 'fp8_e4m3'\]"):
        LLM(str(MODEL), kv_cache_dtype="fp8", log_stats=False)
    with pytest.raises(ValueError, match=r"'int8' cannot be read by attention backend 'tpu'.*"
                                         r"supported here: \['auto'\]"):
        check_kv_cache_dtype("int8", "tpu", jnp.bfloat16)
    with pytest.raises(ValueError, match="has no 'tpu' layout"):
        KVCache.create(1, 2, 16, 1, 64, jnp.int8, layout="tpu")
