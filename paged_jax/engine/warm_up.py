"""Compile an engine's programs before traffic comes, as vLLM captures its CUDA graphs at start.

Through the engine itself: for every row bucket r up to max_num_seqs, r requests at once whose
prompts fill each token bucket up to r x `prompt_len` (the prefill steps, sampled and greedy
alike), then r greedy ones (the greedy decode loop), each running two decode calls; the pool
operations come with them. Programs already in the persistent compilation cache are read from it.
Longer sequences compile their wider tables when they first need them. The engine is left as it
was: every block free, no prefix-cache entry, counters at zero.
"""
from __future__ import annotations

import itertools
import time

import jax
import numpy as np

from paged_jax.sampling_params import SamplingParams


def warm_up(engine, prompt_len: int = 32) -> dict:
    """-> {"programs": compiled or loaded, "cached": of those, loaded, "seconds": wall clock}."""
    c = engine.config
    if engine.requests or engine.has_unfinished_requests():
        raise ValueError(f"warm_up needs an idle engine; {len(engine.requests)} requests are in it")
    room = c.max_model_len - 2 * c.num_decode_steps - 1
    if not 1 <= prompt_len <= room:
        raise ValueError(f"prompt_len={prompt_len} must be in [1, {room}] (max_model_len="
                         f"{c.max_model_len} leaves room for two decode calls)")
    events, rng, ids, start = [], np.random.default_rng(0), itertools.count(), time.perf_counter()

    def listen(event, duration, **kwargs):
        events.append(event)

    def run(num_requests, length, temperature):
        params = SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=2 * c.num_decode_steps + 1)
        for _ in range(num_requests):
            prompt = rng.integers(0, engine.model_config.vocab_size, length).tolist()
            engine.add_request(f"warm-up-{next(ids)}", prompt, params)
        while engine.has_unfinished_requests():
            engine.step()

    rows = sorted({min(1 << i, c.max_num_seqs) for i in range(c.max_num_seqs.bit_length() + 1)})
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        for r in rows:
            tokens = 1 << max(4, (r - 1).bit_length())  # batching.MIN_TOKEN_BUCKET, or r rounded up
            while True:  # every token bucket up to the one holding r x prompt_len
                run(r, min(tokens // r, room), 1.0)
                if tokens >= min(r * prompt_len, c.max_num_batched_tokens):
                    break
                tokens *= 2
            run(r, min(prompt_len, room), 0.0)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    engine.reset_prefix_cache()
    engine.reset_counters()
    return {"programs": events.count("/jax/core/compile/backend_compile_duration"),
            "cached": events.count("/jax/compilation_cache/cache_retrieval_time_sec"),
            "seconds": time.perf_counter() - start}
