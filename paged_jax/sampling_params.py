"""vLLM's `SamplingParams`: the same field names, defaults and checks (vllm/sampling_params.py)."""
from __future__ import annotations

import dataclasses
import enum

from paged_jax.structured_output.params import StructuredOutputsParams
from paged_jax.structured_output.params import from_dict as structured_outputs_from_dict

# Below this temperature a request is greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5


class RequestOutputKind(enum.Enum):
    """vLLM's: which `RequestOutput`s `LLMEngine.step` returns for a request."""

    CUMULATIVE = 0  # every step it progressed in, with everything so far
    DELTA = 1  # every step it progressed in, with only what is new (streaming: O(new tokens) a step)
    FINAL_ONLY = 2  # only when it finished (LLM.generate's: no per-step copies of long outputs)


def _check(checks) -> None:
    """checks: (field name, value, ok, what it must be) -> ValueError naming the first bad field."""
    for name, value, ok, want in checks:
        if not ok:
            raise ValueError(f"{name} must be {want}, got {value!r}")


@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # top-N logprobs per output token, besides the sampled one
    prompt_logprobs: int | None = None  # top-N per prompt token, besides the prompt's own
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # A JSON schema, regex, choice or grammar the output must match (vLLM's field); a dict of
    # StructuredOutputsParams' fields is taken too.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        checks = (
            ("n", self.n, isinstance(self.n, int) and self.n >= 1, "an integer >= 1"),
            ("presence_penalty", self.presence_penalty, -2.0 <= self.presence_penalty <= 2.0, "in [-2, 2]"),
            ("frequency_penalty", self.frequency_penalty, -2.0 <= self.frequency_penalty <= 2.0, "in [-2, 2]"),
            ("repetition_penalty", self.repetition_penalty, self.repetition_penalty > 0.0, "> 0"),
            ("temperature", self.temperature, self.temperature >= 0.0, ">= 0"),
            ("top_p", self.top_p, 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("top_k", self.top_k, isinstance(self.top_k, int) and self.top_k >= -1, "-1, 0 (off) or >= 1"),
            ("min_p", self.min_p, 0.0 <= self.min_p <= 1.0, "in [0, 1]"),
            ("max_tokens", self.max_tokens, self.max_tokens is None or self.max_tokens >= 1, ">= 1"),
            ("min_tokens", self.min_tokens, self.min_tokens >= 0, ">= 0"),
            ("logprobs", self.logprobs, self.logprobs is None or self.logprobs >= 0, ">= 0"),
            ("prompt_logprobs", self.prompt_logprobs, self.prompt_logprobs is None or self.prompt_logprobs >= 0,
             ">= 0"),
            # numpy's SeedSequence, which draws a request's sampling keys, takes no negative seed
            ("seed", self.seed, self.seed is None or self.seed >= 0, "None or >= 0"),
        )
        _check(checks)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        if any(not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty, got {self.stop!r}")
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = structured_outputs_from_dict(self.structured_outputs)
        if not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                             f"{self.structured_outputs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def uses_filters(self) -> bool:
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's `BeamSearchParams` (vllm/sampling_params.py), for `LLM.beam_search`: each step keeps
    the `beam_width` best of every beam's top 2 x beam_width continuations, for up to `max_tokens`
    tokens. `temperature` 0 ranks the top tokens only; above 0 a beam's sampled token joins its
    candidates (vLLM). Scores divide the cumulative logprob by length ** `length_penalty`."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self):
        checks = (
            ("beam_width", self.beam_width, isinstance(self.beam_width, int) and self.beam_width >= 1,
             "an integer >= 1"),
            ("max_tokens", self.max_tokens, isinstance(self.max_tokens, int) and self.max_tokens >= 1,
             "an integer >= 1"),
            ("temperature", self.temperature, self.temperature >= 0.0, ">= 0"),
        )
        _check(checks)
