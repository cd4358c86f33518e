"""Seeded random workloads through every way the engine can run them: async scheduling, swap
preemption with the host prefix tier, n-gram speculation and no prefix caching give the serial
engine's tokens, finish reasons and logprob ids (speculation only on greedy rows: a sampled row
keeps its distribution, not its draws), and each pool drains. Prompts share prefixes and repeat
themselves (so n-gram drafts are found), the sampling parameters mix greedy and seeded rows, n > 1,
top-k/top-p, stop tokens, penalties and logprobs, and the pools hold a few blocks more than the
longest request, tight enough to preempt. A sweep: `pytest -m slow` (not in CI's run)."""
import numpy as np
import pytest

from paged_jax import LLM, SamplingParams
from tests.models.model_testing import random_model, tiny_config
from tests.paged_jax.engine_testing import assert_pool_drained

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("drop_compiled_programs")]
VARIANTS = {"async": {"async_scheduling": True},
            "swap": {"preemption_mode": "swap", "swap_space": 0.01, "enable_host_prefix_cache": True},
            "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                             "prompt_lookup_min": 1, "prompt_lookup_max": 3}},
            "no prefix caching": {"enable_prefix_caching": False}}


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(max_position_embeddings=512, eos_token_id=None))


def _params(rng) -> SamplingParams:
    greedy = rng.random() < 0.6
    kw = {"max_tokens": int(rng.integers(1, 60)), "ignore_eos": True,
          "temperature": 0.0 if greedy else float(rng.choice([0.5, 1.0]))}
    if not greedy:
        kw |= {"seed": int(rng.integers(0, 1000)), "n": 1 if rng.random() < 0.6 else int(rng.integers(2, 4))}
        kw |= {"top_k": int(rng.integers(1, 10))} if rng.random() < 0.5 else {}
        kw |= {"top_p": float(rng.choice([0.5, 0.9]))} if rng.random() < 0.5 else {}
    kw |= {"stop_token_ids": [int(rng.integers(1, 128))]} if rng.random() < 0.3 else {}
    kw |= {"logprobs": int(rng.integers(0, 3))} if rng.random() < 0.2 else {}
    kw |= {"presence_penalty": 0.5} if rng.random() < 0.2 else {}
    return SamplingParams(**kw)


def workload(seed: int):
    """-> (prompts, sampling parameters, engine sizes) of one seed."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(1, 128, int(rng.integers(3, 20))).tolist()
    prompts, params = [], []
    for _ in range(int(rng.integers(3, 12))):
        prompt = shared[: int(rng.integers(1, len(shared) + 1))] if rng.random() < 0.6 else []
        prompt += rng.integers(1, 128, int(rng.integers(1, 30))).tolist()
        prompts.append(prompt + prompt[-4:] * 3 if rng.random() < 0.3 else prompt)
        params.append(_params(rng))
    block_size = int(rng.choice([4, 8, 16]))
    longest = max(len(p) + s.max_tokens for p, s in zip(prompts, params))
    sizes = {"block_size": block_size, "num_blocks": -(-longest // block_size) + 2 + int(rng.integers(0, 8)),
             "max_num_seqs": int(rng.integers(1, 8)), "num_decode_steps": int(rng.choice([1, 2, 4, 8])),
             "max_num_batched_tokens": int(rng.choice([16, 32, 64, 512]))}
    return prompts, params, sizes


def outputs(model, prompts, params, **engine_args):
    """-> (each request's samples as (token ids, finish reason, logprob ids per token), preemptions)."""
    llm = LLM(model, log_stats=False, **engine_args)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert_pool_drained(llm)
    return ([[(c.token_ids, c.finish_reason, c.logprobs and [sorted(entry) for entry in c.logprobs])
              for c in o.outputs] for o in outs], llm.stats()["num_preemptions"])


@pytest.mark.parametrize("seed", range(8))
def test_every_variant_gives_the_serial_engines_outputs(model, seed):
    prompts, params, sizes = workload(seed)
    serial, _ = outputs(model, prompts, params, async_scheduling=False, **sizes)
    for name, extra in VARIANTS.items():
        got, preemptions = outputs(model, prompts, params, **sizes, **extra)
        rows = [i for i, p in enumerate(params) if name != "ngram" or p.temperature == 0]
        assert [got[i] for i in rows] == [serial[i] for i in rows], (name, sizes, preemptions)
