"""vLLM's output objects (vllm/outputs.py, vllm/sequence.py): what `generate` and `step` return."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None  # why a request finished with finish_reason "error"
    metrics: dict | None = None  # arrival, first-token and finish times (seconds, time.monotonic)
    # SamplingParams.prompt_logprobs: None for the first prompt token, then one dict per token (the
    # prompt's own token and the top N), once the whole prompt has been computed.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    lora_request: object = None  # the paged_jax.LoRARequest it ran with
