"""paged-jax: PagedAttention (vLLM's KV-cache design) in JAX.

    from paged_jax import LLM, SamplingParams
    outputs = LLM("path/to/checkpoint").generate(["Hello"], SamplingParams(max_tokens=32))

Laid out as vLLM V1 is: `core/` the host bookkeeping and the pure block pool, `worker/` what runs
on the device, `engine/` the engine and its inputs and outputs, `entrypoints/` what users call.
"""
import sys

__version__ = "0.1.0"

from paged_jax.core import block_pool
from paged_jax.engine.beam_search import BeamSearchOutput, BeamSearchSequence
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.engine.outputs import CompletionOutput, Logprob, RequestOutput
from paged_jax.engine.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from paged_jax.entrypoints.llm import LLM

# `import paged_jax.block_pool` (the pool's name before the layout above) keeps working.
sys.modules[__name__ + ".block_pool"] = block_pool

__all__ = ["LLM", "LLMEngine", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "CompletionOutput",
           "Logprob", "RequestOutput", "RequestOutputKind", "SamplingParams", "block_pool"]
