"""The request bodies as pydantic models (vLLM's names and defaults), read into `SamplingParams`,
and OpenAI's error body.

A model checks each field's type and shape (strictly: `true` is not a number, `1.0` not an
integer); its errors reach the client as OpenAI's 400 naming the field (`{"error": {"message",
"type", "param", "code"}}`, api_server.py's RequestValidationError handler, as vLLM registers one).
What depends on several fields or on the server (ranges, stream_options without stream, logprobs
limits) is checked here and by `SamplingParams`, each error naming its field.
"""
from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

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


def validation_error(e: RequestValidationError) -> APIError:
    """OpenAI's 400 for a body its model refused: the first error's field as `param`, each error's
    path and reason in the message (a union, such as `prompt`, has one per form it could take)."""
    errors = e.errors()
    first = errors[0]
    param = first["loc"][0] if first["loc"] else None
    reasons = "; ".join(f"{'.'.join(str(x) for x in error['loc'])}: {error['msg']}" for error in errors[:4])
    more = f" (and {len(errors) - 4} more)" if len(errors) > 4 else ""
    return APIError(f"{reasons}{more}; got {first['input']!r}"[:500], param=param if isinstance(param, str) else None)


class RequestBody(BaseModel):
    """OpenAI lets a body carry fields this server does not read (vLLM too); the ones it reads are
    typed strictly."""

    model_config = ConfigDict(extra="allow", strict=True)

    @classmethod
    def parse(cls, body: dict):
        """The model of `body`, or RequestValidationError (FastAPI's own, handled as OpenAI's 400)."""
        try:
            return cls.model_validate(body)
        except ValidationError as e:
            raise RequestValidationError(e.errors(include_url=False)) from None


TokenIds = Annotated[list[int], Field(min_length=1)]


class StreamOptions(RequestBody):
    include_usage: bool = False


class _Sampling(RequestBody):
    """The fields completions and chat share (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    user: str | None = None
    logit_bias: dict | None = None
    response_format: dict | None = None
    # vLLM's extra sampling parameters
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    cache_salt: str | None = None
    return_tokens_as_token_ids: bool = False
    # Structured outputs: their contents are checked where they are compiled (structured_output/params.py).
    structured_outputs: dict | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None


class CompletionRequest(_Sampling):
    prompt: str | TokenIds | Annotated[list[str | TokenIds], Field(min_length=1)]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None


class TextPart(RequestBody):
    type: Literal["text"]
    text: str


class ChatMessage(RequestBody):
    """One message; `name`, `tool_calls`, `tool_call_id` and the rest reach the chat template as given."""

    role: str
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None  # OpenAI's default: true
    functions: list | None = None


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


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


def read_options(request: CompletionRequest | ChatCompletionRequest) -> Options:
    chat = isinstance(request, ChatCompletionRequest)
    if request.stream_options is not None and not request.stream:
        raise APIError("stream_options can only be given when stream is true", param="stream_options")
    include_usage = request.stream_options is not None and request.stream_options.include_usage
    if chat:
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        if logprobs is None and request.top_logprobs:
            raise APIError("top_logprobs needs logprobs to be true", param="top_logprobs")
        name = "top_logprobs"
    else:
        logprobs, name = request.logprobs, "logprobs"
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise APIError(f"{name} must be in [0, {MAX_LOGPROBS}], got {logprobs}", param=name)
    echo = not chat and request.echo
    prompt_logprobs = request.prompt_logprobs
    if prompt_logprobs is not None and request.stream:  # vLLM's rule: they would come only at the end
        raise APIError("prompt_logprobs are not available when stream is true", param="prompt_logprobs")
    if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_LOGPROBS:
        raise APIError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {prompt_logprobs}",
                       param="prompt_logprobs")
    if prompt_logprobs is None and echo and logprobs is not None:  # vLLM: echoed tokens get logprobs too
        prompt_logprobs = logprobs
    for unsupported in ("logit_bias", "suffix", "functions") + (() if chat else ("tools", "tool_choice")):
        if getattr(request, unsupported, None):
            raise APIError(f"{unsupported} is not supported by this server", param=unsupported)
    if request.best_of is not None and request.best_of != request.n:
        raise APIError(f"best_of={request.best_of} different from n is not supported", param="best_of")
    return Options(model=request.model, stream=request.stream, include_usage=include_usage, logprobs=logprobs,
                   prompt_logprobs=prompt_logprobs, echo=echo, cache_salt=request.cache_salt)


# The request's fields that are SamplingParams' own, under the same names.
SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
                   "include_stop_str_in_output", "skip_special_tokens")
STRUCTURED_FIELDS = ("response_format", "structured_outputs", *GUIDED_FIELDS)


def read_sampling_params(request: CompletionRequest | ChatCompletionRequest, *, max_tokens: int | None,
                         options: Options) -> SamplingParams:
    """`max_tokens`: what the request asked (already checked against the context), None: up to it."""
    try:
        structured = from_openai_request(structured_outputs_request(request))
    except ValueError as e:  # "response_format.json_schema.schema: must be ..."
        raise APIError(str(e), param=str(e).split(":", 1)[0].split(",", 1)[0]) from None
    try:
        return SamplingParams(max_tokens=max_tokens, logprobs=options.logprobs, prompt_logprobs=options.prompt_logprobs,
                              structured_outputs=structured, **{name: getattr(request, name) for name in SAMPLING_FIELDS})
    except ValueError as e:  # SamplingParams names the field first: "temperature must be >= 0, got -1"
        name = str(e).split(" ", 1)[0]
        raise APIError(str(e), param=name if name in SAMPLING_FIELDS or name == "max_tokens" else None)


def structured_outputs_request(request) -> dict:
    """The fields that may ask for a structured output, as `from_openai_request` reads them."""
    return {name: getattr(request, name) for name in STRUCTURED_FIELDS}


def structured_outputs_field(request) -> str:
    """The request field a structured output came from (the param of a 400 about its grammar)."""
    def asks(name):  # a response_format of type "text" asks for none
        value = getattr(request, name)
        return value is not None and not (name == "response_format" and value.get("type") == "text")

    return next(name for name in STRUCTURED_FIELDS if asks(name))


def requested_max_tokens(request: CompletionRequest | ChatCompletionRequest) -> int | None:
    """max_tokens (chat also takes max_completion_tokens); completions default to 16, chat to
    whatever the context leaves (OpenAI's and vLLM's defaults)."""
    chat = isinstance(request, ChatCompletionRequest)
    value = request.max_tokens
    if chat and value is None:
        value = request.max_completion_tokens
    if value is None:
        return None if chat else 16
    if value < 1:
        raise APIError(f"max_tokens must be >= 1, got {value}", param="max_tokens")
    return value


def read_prompts(request: CompletionRequest) -> list:
    """Completions' `prompt`: a string, a list of strings, token ids, or a list of token-id lists
    -> a list of prompts (each a string or a list of ints)."""
    prompt = request.prompt
    return [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else list(prompt)


def read_messages(messages: list[ChatMessage]) -> list[dict]:
    """Chat `messages` as the chat template takes them, each content a string (OpenAI's list of
    text parts joined)."""
    out = []
    for message in messages:
        content = message.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out.append({**message.model_dump(exclude_unset=True), "content": content})
    return out


def busy(message: str) -> APIError:
    """vLLM's 503 when the engine cannot take more now (the handler adds Retry-After)."""
    return APIError(message, status=503, type="ServiceUnavailableError")


def engine_dead(e: Exception) -> APIError:
    return APIError(str(e), status=500, type="InternalServerError")
