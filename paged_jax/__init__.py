"""paged-jax: PagedAttention (vLLM's KV-cache design) in JAX.

    from paged_jax import LLM, SamplingParams
    outputs = LLM("path/to/checkpoint").generate(["Hello"], SamplingParams(max_tokens=32))

Laid out as vLLM V1 is: `core/` the host bookkeeping and the pure block pool, `worker/` what runs
on the device, `engine/` the engine and its inputs and outputs, `entrypoints/` what users call;
`sampling_params.py` and `attention.py` (the dispatch the models call) sit below all of them.
The names below load on first use, so `import paged_jax.attention` (as `models` does) does not
load the engine.
"""
import importlib
import sys

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "paged_jax.entrypoints.llm",
    "LLMEngine": "paged_jax.engine.llm_engine",
    "BeamSearchOutput": "paged_jax.engine.beam_search",
    "BeamSearchSequence": "paged_jax.engine.beam_search",
    "CompletionOutput": "paged_jax.engine.outputs",
    "Logprob": "paged_jax.engine.outputs",
    "RequestOutput": "paged_jax.engine.outputs",
    "BeamSearchParams": "paged_jax.sampling_params",
    "RequestOutputKind": "paged_jax.sampling_params",
    "SamplingParams": "paged_jax.sampling_params",
    "LoRARequest": "paged_jax.lora.request",
}
from paged_jax.core import block_pool  # noqa: E402  (jax and numpy only)

# `import paged_jax.block_pool` (the pool's name before the layout above) keeps working.
sys.modules[__name__ + ".block_pool"] = block_pool

__all__ = [*_EXPORTS, "block_pool"]


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        raise AttributeError(f"module 'paged_jax' has no attribute {name!r}")
    globals()[name] = value
    return value
