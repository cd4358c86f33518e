"""paged-jax: PagedAttention (vLLM's KV-cache design) in JAX.

    from paged_jax import LLM, SamplingParams
    outputs = LLM("path/to/checkpoint").generate(["Hello"], SamplingParams(max_tokens=32))
"""
from paged_jax.engine import LLMEngine
from paged_jax.llm import LLM
from paged_jax.outputs import CompletionOutput, Logprob, RequestOutput
from paged_jax.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]
