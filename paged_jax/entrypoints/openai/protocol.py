"""OpenAI's request fields (with vLLM's extras) read into `SamplingParams`, and OpenAI's error body.

Fields are read by hand rather than through a pydantic model: a bad value must come back as
OpenAI's 400 naming the parameter (`{"error": {"message", "type", "param", "code"}}`, as vLLM
sends it), not as a framework's 422 in another shape.
"""
from __future__ import annotations

import dataclasses

from paged_jax.sampling_params import SamplingParams
from paged_jax.structured_output.params import GUIDED_FIELDS, from_openai_request

MAX_LOGPROBS = 20  # vLLM's default max_logprobs


class APIError(Exception):
    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 type: str = "BadRequestError"):  # noqa: A002  OpenAI's field name
        super().__init__(message)
        self.message, self.status, self.param, self.type = message, status, param, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


def not_found(message: str) -> APIError:
    return APIError(message, status=404, type="NotFoundError")


_NUMBER = (int, float)
# field -> (accepted types, default); bool is excluded from numbers below (True is an int in Python).
SAMPLING_FIELDS = {
    "n": (int, 1), "temperature": (_NUMBER, 1.0), "top_p": (_NUMBER, 1.0), "top_k": (int, 0),
    "min_p": (_NUMBER, 0.0), "presence_penalty": (_NUMBER, 0.0), "frequency_penalty": (_NUMBER, 0.0),
    "repetition_penalty": (_NUMBER, 1.0), "seed": (int, None), "stop_token_ids": (list, None),
    "ignore_eos": (bool, False), "min_tokens": (int, 0), "include_stop_str_in_output": (bool, False),
    "skip_special_tokens": (bool, True),
}


def field(body: dict, name: str, types, default=None):
    """body[name] (None or absent -> default), or a 400 naming the field when it has the wrong type."""
    value = body.get(name)
    if value is None:
        return default
    wanted = types if isinstance(types, tuple) else (types,)
    if (isinstance(value, bool) and bool not in wanted) or not isinstance(value, wanted):
        names = " or ".join(t.__name__ for t in wanted)
        raise APIError(f"{name} must be {names}, got {value!r}", param=name)
    return value


@dataclasses.dataclass
class Options:
    """What a request asks of the server beyond sampling."""
    model: str | None
    stream: bool
    include_usage: bool
    logprobs: int | None  # top-N per token (completions' `logprobs`, chat's `top_logprobs`), None: none
    # top-N per prompt token (vLLM's extra field; completions' echo with logprobs asks for it too)
    prompt_logprobs: int | None
    echo: bool  # completions: the prompt leads each choice's text (and its logprobs)
    cache_salt: str | None


def read_options(body: dict, *, chat: bool) -> Options:
    stream = field(body, "stream", bool, False)
    stream_options = field(body, "stream_options", dict)
    if stream_options is not None and not stream:
        raise APIError("stream_options can only be given when stream is true", param="stream_options")
    include_usage = field(stream_options or {}, "include_usage", bool, False)
    if chat:
        logprobs = field(body, "top_logprobs", int, 0) if field(body, "logprobs", bool, False) else None
        if logprobs is None and body.get("top_logprobs"):
            raise APIError("top_logprobs needs logprobs to be true", param="top_logprobs")
        name = "top_logprobs"
    else:
        logprobs, name = field(body, "logprobs", int), "logprobs"
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise APIError(f"{name} must be in [0, {MAX_LOGPROBS}], got {logprobs}", param=name)
    echo = not chat and field(body, "echo", bool, False)
    prompt_logprobs = field(body, "prompt_logprobs", int)
    if prompt_logprobs is not None and stream:  # vLLM's rule: they would come only at the end
        raise APIError("prompt_logprobs are not available when stream is true", param="prompt_logprobs")
    if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_LOGPROBS:
        raise APIError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {prompt_logprobs}",
                       param="prompt_logprobs")
    if prompt_logprobs is None and echo and logprobs is not None:  # vLLM: echoed tokens get logprobs too
        prompt_logprobs = logprobs
    for unsupported in ("logit_bias", "suffix", "functions") + (() if chat else ("tools", "tool_choice")):
        if body.get(unsupported):
            raise APIError(f"{unsupported} is not supported by this server", param=unsupported)
    best_of = field(body, "best_of", int)
    if best_of is not None and best_of != field(body, "n", int, 1):
        raise APIError(f"best_of={best_of} different from n is not supported", param="best_of")
    return Options(model=field(body, "model", str), stream=stream, include_usage=include_usage,
                   logprobs=logprobs, prompt_logprobs=prompt_logprobs, echo=echo,
                   cache_salt=field(body, "cache_salt", str))


def read_sampling_params(body: dict, *, max_tokens: int | None, options: Options) -> SamplingParams:
    """`max_tokens`: what the request asked (already checked against the context), None: up to it."""
    kwargs = {name: field(body, name, types, default) for name, (types, default) in SAMPLING_FIELDS.items()}
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or
                                 (isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
        raise APIError(f"stop must be a string or a list of strings, got {stop!r}", param="stop")
    if kwargs["stop_token_ids"] is not None and not all(
            isinstance(t, int) and not isinstance(t, bool) for t in kwargs["stop_token_ids"]):
        raise APIError(f"stop_token_ids must be a list of integers, got {kwargs['stop_token_ids']!r}",
                       param="stop_token_ids")
    try:
        structured = from_openai_request(body)
    except ValueError as e:  # "response_format.json_schema.schema: must be ..."
        raise APIError(str(e), param=str(e).split(":", 1)[0].split(",", 1)[0]) from None
    try:
        return SamplingParams(stop=stop, max_tokens=max_tokens, logprobs=options.logprobs,
                              prompt_logprobs=options.prompt_logprobs, structured_outputs=structured, **kwargs)
    except ValueError as e:  # SamplingParams names the field first: "temperature must be >= 0, got -1"
        name = str(e).split(" ", 1)[0]
        raise APIError(str(e), param=name if name in SAMPLING_FIELDS or name in ("max_tokens", "stop") else None)


def structured_outputs_field(body: dict) -> str:
    """The request field a structured output came from (the param of a 400 about its grammar)."""
    def asks(name):  # a response_format of type "text" asks for none
        value = body.get(name)
        return value is not None and not (name == "response_format" and value.get("type") == "text")

    return next(name for name in ("response_format", "structured_outputs", *GUIDED_FIELDS) if asks(name))


def requested_max_tokens(body: dict, *, chat: bool) -> int | None:
    """max_tokens (chat also takes max_completion_tokens); completions default to 16, chat to
    whatever the context leaves (OpenAI's and vLLM's defaults)."""
    value = field(body, "max_tokens", int)
    if chat and value is None:
        value = field(body, "max_completion_tokens", int)
    if value is None:
        return None if chat else 16
    if value < 1:
        raise APIError(f"max_tokens must be >= 1, got {value}", param="max_tokens")
    return value


def read_prompts(body: dict) -> list:
    """Completions' `prompt`: a string, a list of strings, token ids, or a list of token-id lists
    -> a list of prompts (each a string or a list of ints)."""
    prompt = body.get("prompt")

    def is_ids(value):
        return isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value)

    if isinstance(prompt, str):
        return [prompt]
    if is_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
        return list(prompt)
    raise APIError(f"prompt must be a string, a list of strings, or token ids, got {prompt!r}"[:300], param="prompt")


def read_messages(body: dict) -> list[dict]:
    """Chat `messages` with each content as a string (OpenAI's list of text parts joined)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("messages must be a non-empty list", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise APIError(f"messages[{i}] must be an object with a role, got {message!r}"[:300], param="messages")
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise APIError(f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(p["text"] for p in content)
        elif content is not None and not isinstance(content, str):
            raise APIError(f"messages[{i}].content must be a string or a list of text parts", param="messages")
        out.append({**message, "content": content})
    return out


def busy(message: str) -> APIError:
    """vLLM's 503 when the engine cannot take more now (the handler adds Retry-After)."""
    return APIError(message, status=503, type="ServiceUnavailableError")


def engine_dead(e: Exception) -> APIError:
    return APIError(str(e), status=500, type="InternalServerError")
