"""vLLM's `speculative_config` (vllm/config/speculative.py): the method and its knobs, checked when
the engine's arguments are, and the draft model it names, loaded and checked against the target's
vocabulary."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

METHODS = ("ngram", "draft_model")
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model"}
# Text a draft's tokenizer must encode as the target's: words, digits, punctuation, accents, an emoji.
VOCABULARY_PROBE = "The quick brown fox, 42 times:\n\tdef naïve_café(x): return {'☕': x * 3.14}"


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    # draft_model: a checkpoint directory or GGUF file (vLLM's "model"), or a model object already
    # built (the engine's `model` argument takes either too); the engine loads a path.
    model: object = dataclasses.field(default=None, compare=False)

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """From vLLM's dict (or its JSON text, as `--speculative-config` takes it); None stays None.
        ValueError names what is wrong."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not JSON: {value!r} ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {value!r}")
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: {sorted(_KEYS)}")
        method = value.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {METHODS}, got {method!r}")
        k = value.get("num_speculative_tokens")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"speculative_config num_speculative_tokens must be an integer >= 1, got {k!r}")
        if method == "draft_model":
            lookup = sorted({"prompt_lookup_min", "prompt_lookup_max"} & set(value))
            if lookup:
                raise ValueError(f"speculative_config {lookup} apply to method 'ngram', not 'draft_model'")
            model = value.get("model")
            if model is None or isinstance(model, str) and not model:
                raise ValueError("speculative_config method 'draft_model' needs \"model\": a checkpoint "
                                 "directory or GGUF file of the draft")
            return cls(method, k, model=model)
        if value.get("model") is not None:
            raise ValueError("speculative_config \"model\" applies to method 'draft_model', not 'ngram'")
        # vLLM's defaults: both 5 when neither is given, else the one given for both.
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        low, high = (high if low is None else low), (low if high is None else high)
        low, high = (5 if low is None else low), (5 if high is None else high)
        for name, n in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"speculative_config {name} must be an integer >= 1, got {n!r}")
        if low > high:
            raise ValueError(f"speculative_config prompt_lookup_min={low} exceeds prompt_lookup_max={high}")
        return cls(method, k, low, high)


def engine_fields(spec: SpeculativeConfig | None) -> dict:
    """What EngineConfig keeps of `spec`: num_speculative_tokens (0: off) and, for n-gram, the
    device lookup's (prompt_lookup_min, prompt_lookup_max) as prompt_lookup (else None)."""
    lookup = (spec.prompt_lookup_min, spec.prompt_lookup_max) if spec and spec.method == "ngram" else None
    return dict(num_speculative_tokens=spec.num_speculative_tokens if spec else 0, prompt_lookup=lookup)


def load_draft_model(spec, *, dtype=None):
    """The draft model of a "draft_model" `spec` (a SpeculativeConfig) and its tokenizer (loaded in
    `dtype` if given as a path; None for a model object), or Nones; ValueError when it is not a
    model."""
    if spec is None or spec.method != "draft_model":
        return None, None
    if isinstance(spec.model, (str, Path)):
        from paged_jax.entrypoints.llm import load_model  # the entry point imports the engine

        return load_model(spec.model, dtype=dtype)
    if not hasattr(spec.model, "init_cache"):
        raise ValueError(f"speculative_config \"model\" must be a checkpoint directory, a GGUF file or a "
                         f"paged_jax model, got {type(spec.model).__name__}")
    return spec.model, None


def check_draft_vocabulary(spec, tokenizer, draft_tokenizer) -> None:
    """ValueError when the draft's tokenizer encodes text other than the target's does (the same
    vocabulary size may be another vocabulary)."""
    if tokenizer is None or draft_tokenizer is None:
        return
    ours, theirs = tokenizer.encode(VOCABULARY_PROBE), draft_tokenizer.encode(VOCABULARY_PROBE)
    if ours != theirs:
        raise ValueError(f"speculative_config draft model {spec.model} has another vocabulary: it encodes "
                         f"{VOCABULARY_PROBE!r} as {theirs[:12]}..., the target as {ours[:12]}...")
