"""The KV budget: vLLM's gpu_memory_utilization (weights, activation peak and KV within a fraction
of the device), kv_cache_memory_fraction when given, and the fixed budget on CPU."""
import pytest

from paged_jax import LLM
from paged_jax.engine import config
from paged_jax.worker.model_runner import activation_bytes
from tests.models.model_testing import random_model, tiny_config

GiB = 2**30
H200 = dict(bytes_limit=140 * GiB, bytes_in_use=16 * GiB)  # 16 GiB of weights on the device


def test_gpu_memory_utilization_counts_weights_and_activations():
    budget = config.kv_budget_bytes(gpu_memory_utilization=0.5, activation_bytes=lambda: 3 * GiB, memory_stats=H200)
    assert budget == 70 * GiB - 16 * GiB - 3 * GiB
    assert config.kv_budget_bytes(activation_bytes=lambda: 0, memory_stats=H200) == int(0.9 * 140 * GiB) - 16 * GiB


def test_kv_cache_memory_fraction_wins_when_given():
    measured = []
    budget = config.kv_budget_bytes(gpu_memory_utilization=0.5, kv_cache_memory_fraction=0.25,
                                    activation_bytes=lambda: measured.append(1) or GiB, memory_stats=H200)
    assert budget == (140 - 16) * GiB // 4 and measured == []  # and nothing compiled to measure


def test_cpu_has_a_fixed_device_budget():
    assert config.kv_budget_bytes(memory_stats=None) == int(0.9 * config.CPU_KV_CACHE_BYTES)
    assert config.kv_budget_bytes(gpu_memory_utilization=0.5) == config.CPU_KV_CACHE_BYTES // 2
    model = random_model(tiny_config())
    c = model.config
    per_block = 2 * c.num_layers * c.num_kv_heads * 16 * c.head_dim * 4
    llm = LLM(model, gpu_memory_utilization=0.01, max_num_seqs=64, log_stats=False)
    assert llm.engine.config.num_blocks == int(0.01 * config.CPU_KV_CACHE_BYTES) // per_block


def test_bad_memory_settings_name_the_value():
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\], got 1.5"):
        config.kv_budget_bytes(gpu_memory_utilization=1.5, memory_stats=H200)
    with pytest.raises(ValueError, match=r"kv_cache_memory_fraction must be in \(0, 1\], got 0"):
        config.kv_budget_bytes(kv_cache_memory_fraction=0, memory_stats=H200)
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.1 allows 14.00 GiB, but the weights take 16.00 GiB"):
        config.kv_budget_bytes(gpu_memory_utilization=0.1, activation_bytes=lambda: 0, memory_stats=H200)


def test_the_activation_peak_is_measured_from_the_compiled_step():
    model = random_model(tiny_config())
    small, large = (activation_bytes(model, n, 8, 256, backend="reference", block_size=16) for n in (64, 512))
    # At least the step's hidden states in f32 for every token, and more for more tokens.
    hidden = model.config.hidden_size * 4
    assert 64 * hidden < small < large and large >= 512 * hidden


def test_a_speculating_engines_activation_peak_is_its_largest_verifications():
    """Verifying k proposals scores every row's 1 + k positions: with a vocabulary of 4096, 8 rows
    x 8 positions of logits (and their probabilities) outweigh a 64-token prefill's 8 rows, and the
    pool is sized by the larger; a draft model's k steps and proposal distributions add more."""
    from paged_jax.worker import programs

    model = random_model(tiny_config(vocab_size=4096))
    kw = dict(backend="reference", block_size=16)
    plain = activation_bytes(model, 64, 8, 256, **kw)
    spec = activation_bytes(model, 64, 8, 256, num_speculative_tokens=7, **kw)
    sizing = programs.Sizing(num_blocks=2, block_size=16, max_num_seqs=8, max_model_len=256)
    verify = programs.prefill_program(model, sizing, num_tokens=64, num_rows=8, width=16, num_speculative_tokens=7)
    assert spec == verify.memory_analysis().temp_size_in_bytes > plain + 8 * 7 * 4096 * 4  # 56 more rows of logits
    draft = random_model(tiny_config(vocab_size=4096, num_layers=1), seed=3)
    assert activation_bytes(model, 64, 8, 256, num_speculative_tokens=7, draft_model=draft, **kw) > spec


def test_bad_preemption_settings_name_the_value():
    model = random_model(tiny_config())
    with pytest.raises(ValueError, match=r"preemption_mode must be one of \('recompute', 'swap'\), got 'offload'"):
        LLM(model, preemption_mode="offload", log_stats=False)
    with pytest.raises(ValueError, match="swap_space must be a number of GiB >= 0, got -1"):
        LLM(model, preemption_mode="swap", swap_space=-1, log_stats=False)
    with pytest.raises(ValueError, match="swap_space must be a number of GiB >= 0, got '4'"):
        LLM(model, swap_space="4", log_stats=False)
    # swap_space 0 is allowed: every preemption finds the host pool full and recomputes.
    llm = LLM(model, num_blocks=8, preemption_mode="swap", swap_space=0, log_stats=False)
    assert llm.engine.model_runner.num_host_blocks == 0 and llm.engine.scheduler.host_pool.num_blocks == 0
    for kwargs, message in (
            (dict(enable_prefix_caching=False), "enable_host_prefix_cache=True needs enable_prefix_caching=True"),
            (dict(swap_space=0), "enable_host_prefix_cache=True needs swap_space > 0 GiB to hold its blocks, "
                                 "got swap_space=0")):
        with pytest.raises(ValueError, match=message):
            LLM(model, enable_host_prefix_cache=True, log_stats=False, **kwargs)
    with pytest.raises(ValueError, match="enable_host_prefix_cache must be True or False, got 'yes'"):
        LLM(model, enable_host_prefix_cache="yes", log_stats=False)
