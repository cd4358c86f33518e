"""OpenAI's Responses API request (`POST /v1/responses`) and its translation into a chat request.

A response is a chat completion with other names: `input` items are messages, `instructions` a
system message, flat function tools the chat's nested ones, `text.format` a `response_format`,
`max_output_tokens` `max_tokens`. So the request is checked here (strictly typed, as the chat
request is) and becomes a `ChatCompletionRequest` that runs through the chat path unchanged
(vLLM's serving_responses.py does the same over its chat machinery). Items translate as:

    {"role", "content"} (or type "message")   a message; "developer" becomes "system", content
                                              parts (input_text, output_text) joined
    {"type": "function_call", ...}            an assistant message's tool_calls (consecutive calls,
                                              or calls after an assistant message, join it)
    {"type": "function_call_output", ...}     a "tool" message answering call_id

What the chat path has no way to honour is refused by name: `background`, a stored `prompt`
template, `truncation: "auto"`, tools other than functions, images and files.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Discriminator, Field, Tag

from paged_jax.entrypoints.openai.protocol import APIError, ChatCompletionRequest, RequestBody

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# vLLM's extra sampling fields, passed through to the chat request under the same names.
EXTRA_FIELDS = ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop",
                "stop_token_ids", "ignore_eos", "min_tokens", "include_stop_str_in_output", "skip_special_tokens",
                "cache_salt", "structured_outputs")
# A chat request's field -> the Responses field a 400 about it names.
PARAMS = {"messages": "input", "prompt": "input", "max_tokens": "max_output_tokens", "response_format": "text",
          "logprobs": "include"}


class TextPart(RequestBody):
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(RequestBody):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]


class FunctionCallItem(RequestBody):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(RequestBody):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]


def _item_type(item) -> str:
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")], Discriminator(_item_type)]


class FunctionTool(RequestBody):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class FunctionChoice(RequestBody):
    type: Literal["function"]
    name: str


class TextFormat(RequestBody):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(RequestBody):
    format: TextFormat = TextFormat(type="text")


class ResponsesRequest(RequestBody):
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    model: str | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    tools: list[FunctionTool] = []
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig = TextConfig()
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled", "auto"] = "disabled"
    background: bool = False
    prompt: dict | None = None

    def check(self) -> None:
        """What a well-typed request may still ask that this server cannot do: a 400 naming it."""
        if self.background:
            raise APIError("background responses are not supported by this server", param="background")
        if self.prompt is not None:
            raise APIError("stored prompt templates are not supported by this server", param="prompt")
        if self.truncation != "disabled":
            raise APIError('truncation "auto" is not supported by this server: a conversation past the context '
                           "is a 400", param="truncation")
        fmt = self.text.format
        if fmt.type == "json_schema" and (fmt.schema_ is None or not fmt.name):
            raise APIError("text.format of type json_schema needs a name and a schema", param="text.format")
        if isinstance(self.tool_choice, FunctionChoice) and self.tool_choice.name not in {t.name for t in self.tools}:
            raise APIError(f"tool_choice names the function {self.tool_choice.name!r}, which is not in tools",
                           param="tool_choice")
        if self.tool_choice == "required" and not self.tools:
            raise APIError('tool_choice "required" needs tools', param="tool_choice")


def input_messages(request: ResponsesRequest) -> list[dict]:
    """The request's `input` as chat messages (without its instructions)."""
    if isinstance(request.input, str):
        return [{"role": "user", "content": request.input}]
    messages: list[dict] = []
    for item in request.input:
        if isinstance(item, MessageItem):
            messages.append({"role": "system" if item.role == "developer" else item.role,
                             "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # one turn: its text, then its calls
                messages[-1] = {**last, "tool_calls": [*last.get("tool_calls", ()), call]}
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    return messages


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def chat_request(request: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    """The chat request that asks what `request` asks, over `messages` (the whole conversation)."""
    body = {"messages": messages, "model": request.model, "stream": request.stream, "user": request.user,
            "max_tokens": request.max_output_tokens,
            **{name: value for name in EXTRA_FIELDS if (value := (request.model_extra or {}).get(name)) is not None}}
    if request.temperature is not None:
        body["temperature"] = request.temperature
    if request.top_p is not None:
        body["top_p"] = request.top_p
    if LOGPROBS_INCLUDE in (request.include or ()):
        body.update(logprobs=True, top_logprobs=request.top_logprobs or 0)
    if request.tools:
        body["parallel_tool_calls"] = request.parallel_tool_calls
        body["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                         for tool in request.tools]
        choice = request.tool_choice
        body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}}
                               if isinstance(choice, FunctionChoice) else choice)
    fmt = request.text.format
    if fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt.type == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "schema": fmt.schema_, **({"strict": fmt.strict} if fmt.strict is not None else {})}}
    return ChatCompletionRequest.parse(body)


def renamed(e: APIError) -> APIError:
    """A 400 the chat path raised, naming the Responses field it came from."""
    if e.param is None:
        return e
    head, _, rest = e.param.partition(".")
    if head in PARAMS:
        e.param = PARAMS[head] + ("." + rest if rest else "")
    return e
