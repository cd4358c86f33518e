"""Serving LoRA adapters (EngineArgs.enable_lora): requests with different adapters in one batch,
against greedy decoding of the base model with each adapter folded into its weights; the max_loras
cap, slot reuse, the prefix cache kept apart per adapter, and bad input."""
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import LLM, LoRARequest, SamplingParams
from paged_jax.worker import lora_manager
from tests.models.model_testing import dense_logits, merged_model, random_model, save_peft_adapter, tiny_config
from tests.paged_jax.engine_testing import assert_pool_drained

CONFIG = tiny_config(max_position_embeddings=1024, eos_token_id=None)
PROMPTS = [[5, 17, 99, 3, 42, 8, 61, 20, 7, 33, 90, 14, 2, 77, 31, 9, 4],
           [11, 23, 5, 8, 120, 64, 3],
           [5, 17, 99, 3, 42, 8, 61, 20, 7, 33, 90, 14, 2, 77, 31, 9, 4],
           [100, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The model, two adapters (rank 4 on every projection; rank 8 with rsLoRA on q/v/down) and
    each adapter's merged model."""
    root = tmp_path_factory.mktemp("lora")
    model = random_model(CONFIG, seed=3)
    one = save_peft_adapter(root / "one", CONFIG, rank=4, alpha=8, seed=1)
    two = save_peft_adapter(root / "two", CONFIG, rank=8, alpha=4, seed=2, rslora=True,
                            targets=("q_proj", "v_proj", "down_proj"))
    requests = [LoRARequest("one", 1, str(root / "one")), LoRARequest("two", 2, str(root / "two"))]
    merged = {None: model, 1: merged_model(model, one, 2.0), 2: merged_model(model, two, 4 / np.sqrt(8))}
    return model, requests, merged


def greedy(model, prompt, n):
    tokens = list(prompt)
    for _ in range(n):
        padded = tokens + [0] * (32 - len(tokens))
        tokens.append(int(np.argmax(np.asarray(dense_logits(model, jnp.array([padded]))[0, len(tokens) - 1]))))
    return tokens[len(prompt):]


@pytest.fixture(scope="module")
def expected(setup):
    _, _, merged = setup
    return {key: [greedy(m, p, MAX_TOKENS) for p in PROMPTS] for key, m in merged.items()}


def make_llm(model, **kwargs):
    return LLM(model, **{**dict(block_size=4, num_blocks=64, max_num_seqs=4, enable_lora=True, max_lora_rank=8,
                                log_stats=False), **kwargs})


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_adapters_in_one_batch_give_their_merged_models_tokens(setup, expected, async_scheduling):
    """Base, adapter 1 and adapter 2 rows in the same calls (prefill and the K-step decode loop),
    on a pool small enough to preempt: each request's tokens are its merged model's."""
    model, (one, two), _ = setup
    llm = make_llm(model, max_loras=2, num_blocks=16, async_scheduling=async_scheduling)
    loras = [one, None, two, one]
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0), lora_request=loras)
    for i, (out, lora) in enumerate(zip(outs, loras)):
        key = lora and lora.lora_int_id
        assert out.outputs[0].token_ids == expected[key][i], (i, key)
        assert out.lora_request == lora
    assert expected[1][0] != expected[None][0] and expected[2][2] != expected[None][2]  # the adapters matter
    assert llm.stats()["num_preemptions"] > 0
    assert llm.engine.model_runner.lora.num_loads == 2
    assert_pool_drained(llm)


@pytest.mark.usefixtures("untimed_speculation")
def test_speculation_verifies_with_each_rows_adapter(setup, expected):
    """A draft model (the base model itself, which runs without adapters) proposes; the target
    verifies each row with its own adapter: the adapter rows reject drafts the base model would
    accept, and every row's greedy tokens stay its merged model's."""
    model, (one, two), _ = setup
    llm = make_llm(model, max_loras=2, speculative_config={"method": "draft_model", "model": model,
                                                           "num_speculative_tokens": 3})
    loras = [one, None, two, one]
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0), lora_request=loras)
    for i, (out, lora) in enumerate(zip(outs, loras)):
        assert out.outputs[0].token_ids == expected[lora and lora.lora_int_id][i], i
    stats = llm.stats()
    assert stats["spec_decode_num_drafts"] > 0
    assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert_pool_drained(llm)


def test_one_slot_runs_one_adapter_at_a_time(setup, expected, monkeypatch):
    """max_loras=1: no call mixes the two adapters (the scheduler sets a request aside while the
    other adapter runs, and admits base requests beside it); outputs stay exact."""
    model, (one, two), _ = setup
    seen = []
    inputs = lora_manager.LoRAManager.inputs

    def spy(self, seqs, num_rows):
        seen.append({s.request.lora_id for s in seqs})
        return inputs(self, seqs, num_rows)

    monkeypatch.setattr(lora_manager.LoRAManager, "inputs", spy)
    llm = make_llm(model, max_loras=1)
    loras = [one, two, one, None]
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0), lora_request=loras)
    for i, (out, lora) in enumerate(zip(outs, loras)):
        assert out.outputs[0].token_ids == expected[lora and lora.lora_int_id][i], i
    assert max(len(s - {0}) for s in seen) == 1 and {2} in seen
    assert seen[0] == {0, 1}  # adapter 2's request waits; the base request behind it is admitted
    assert llm.engine.model_runner.lora.slot_ids == [2]
    assert llm.engine.model_runner.lora.num_loads == 2  # one, then two into the same slot
    assert_pool_drained(llm)


def test_prefix_cache_is_kept_apart_per_adapter(setup):
    """The same prompt under another adapter (or none) hits nothing; under the same one, its blocks."""
    model, (one, two), _ = setup
    llm = make_llm(model, max_loras=2)
    params = SamplingParams(max_tokens=2, temperature=0)
    prompt = PROMPTS[0]  # 17 tokens: 4 full blocks of 4
    cached = [llm.generate([prompt], params, lora_request=lora)[0].num_cached_tokens
              for lora in (one, None, two, one, None)]
    assert cached == [0, 0, 0, 16, 16]


def test_bad_input(setup, tmp_path):
    model, (one, _), _ = setup
    plain = LLM(model, block_size=4, num_blocks=64, max_num_seqs=4, log_stats=False)
    with pytest.raises(ValueError, match="lora_request 'one' needs an engine built with enable_lora=True"):
        plain.generate([PROMPTS[0]], lora_request=one)
    llm = make_llm(model)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.generate([PROMPTS[1], PROMPTS[0]], lora_request=[None, LoRARequest("gone", 3, str(tmp_path / "gone"))])
    with pytest.raises(ValueError, match="lora_request must be a paged_jax.LoRARequest, got 'one'"):
        llm.generate([PROMPTS[0]], lora_request=["one"])
    with pytest.raises(ValueError, match="2 LoRA requests for 1 prompts"):
        llm.generate([PROMPTS[0]], lora_request=[one, one])
    assert not llm.engine.has_unfinished_requests()  # nothing was queued
    save_peft_adapter(tmp_path / "big", CONFIG, rank=16, alpha=16)
    with pytest.raises(ValueError, match="has rank 16, more than max_lora_rank=8"):
        llm.generate([PROMPTS[0]], lora_request=LoRARequest("big", 4, str(tmp_path / "big")))
    with pytest.raises(ValueError, match=r"lora_int_id must be an integer >= 1, got 0"):
        LoRARequest("zero", 0, "x")
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        make_llm(model, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="max_lora_rank must be a positive integer, got 0"):
        make_llm(model, max_lora_rank=0)
