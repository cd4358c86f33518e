"""A chat request's `tools` and `tool_choice` (vLLM's serving_chat.py): what they ask of the prompt,
of decoding and of the response.

    "none"       the tools reach the chat template; the output is plain content
    "auto"       the model writes calls in its own format, read by --tool-call-parser (hermes,
                 llama3_json); needs --enable-auto-tool-choice, as vLLM does
    "required"   a grammar (structured output) makes the output a JSON array of calls
    named        a grammar makes the output the named function's arguments object

A message with calls has `tool_calls` (ids "chatcmpl-tool-...", as vLLM's), no content unless the model wrote some
beside them, and finish_reason "tool_calls". With `parallel_tool_calls` false a message has one call
at most: "required" is a grammar for exactly one, "auto" keeps the model's first (vLLM's filter). Streamed, "auto" sends OpenAI's deltas as the parser
finds the calls, a named function its arguments as they are written, "required" its calls once the
array is complete (its end is only known then).
"""
from __future__ import annotations

import json

from paged_jax.entrypoints.openai.protocol import APIError
from paged_jax.structured_output import tool_grammar
from paged_jax.structured_output.tool_calls import CallDeltas
from paged_jax.structured_output.tool_parsers import ToolParser


class ToolCalling:
    def __init__(self, tools: list[dict], tool_choice, parser: ToolParser | None, *, parallel: bool = True):
        self.tools, self.tool_choice, self.parser, self.parallel = tools, tool_choice, parser, parallel
        try:
            self.structured_outputs = tool_grammar.tool_choice_structured_outputs(tools, tool_choice,
                                                                                 parallel=parallel)
        except ValueError as e:  # "tools[1].function.parameters: ..." or "tool_choice.function.name: ..."
            raise APIError(str(e), param=str(e).split(".", 1)[0].split(":", 1)[0].split("[", 1)[0]) from None

    @classmethod
    def from_request(cls, request, *, parser: ToolParser | None, auto: bool) -> ToolCalling | None:
        """None when the chat request has no tools (or asks for none to be called and gets plain text)."""
        tools, tool_choice = request.tools, request.tool_choice
        if tools is None:
            if tool_choice not in (None, "none"):
                raise APIError(f"tool_choice {tool_choice!r} needs tools", param="tool_choice")
            return None
        try:
            tool_grammar.validate_tools(tools)
        except ValueError as e:
            raise APIError(str(e), param="tools") from None
        tool_choice = "auto" if tool_choice is None else tool_choice  # OpenAI's default with tools
        if tool_choice == "auto" and not (auto and parser is not None):
            raise APIError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                           "to be set", param="tool_choice")
        return cls(tools, tool_choice, parser, parallel=request.parallel_tool_calls is not False)

    @property
    def calls_tools(self) -> bool:
        return self.tool_choice != "none"

    def message(self, text: str) -> tuple[str | None, list[dict]]:
        """The whole output -> (content, OpenAI tool_calls)."""
        if self.tool_choice == "none":
            return text, []
        if self.tool_choice == "auto":
            content, calls = self.parser.extract(text)
        else:
            content, calls = tool_grammar.parse_tool_choice_output(text, self.tool_choice)
        return content, [c.to_openai() for c in calls[:None if self.parallel else 1]]

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)


class ChoiceStream:
    """One choice's streamed deltas: `feed` each new piece of text, `finish` once at the end; each
    returns OpenAI delta dicts ({"content": ...} or {"tool_calls": [...]})."""

    def __init__(self, tools: ToolCalling):
        self.mode, self.parallel = tools.tool_choice, tools.parallel
        self.parser_stream = tools.parser.stream() if self.mode == "auto" else None
        self.named = CallDeltas(0, ()) if isinstance(self.mode, dict) else None
        self.text = ""
        self.made_calls = False

    def feed(self, new: str) -> list[dict]:
        self.text += new
        if self.mode == "none":
            return [{"content": new}] if new else []
        if self.mode == "auto":
            return self._seen(self.parser_stream.feed(new))
        if self.named is not None:  # the output is the arguments: a header, then the text as it comes
            return self._seen(self.named.complete(self.mode["function"]["name"], self.text))
        return []  # "required": the calls once the array is whole

    def finish(self) -> list[dict]:
        if self.mode == "auto":
            return self._seen(self.parser_stream.finish())
        if self.mode != "required":
            return []
        content, calls = tool_grammar.parse_tool_choice_output(self.text, "required")
        if not calls:
            return [{"content": content}] if content else []
        return self._seen([d for i, c in enumerate(calls) for d in CallDeltas(i, ()).complete(c.name, c.arguments)])

    def _seen(self, deltas: list[dict]) -> list[dict]:
        if not self.parallel:  # the first call's deltas only (index 0)
            deltas = [d for d in deltas if all(c.get("index") == 0 for c in d.get("tool_calls", ()))]
        self.made_calls = self.made_calls or any("tool_calls" in d for d in deltas)
        return deltas


def finish_reason(reason: str | None, made_calls: bool) -> str | None:
    """A choice that ended normally with tool calls ends with "tool_calls" (vLLM's and OpenAI's)."""
    return "tool_calls" if made_calls and reason == "stop" else reason


def template_messages(messages: list[dict]) -> list[dict]:
    """Assistant tool calls for the chat template: their `arguments` JSON text as an object, which
    Hugging Face templates iterate (vLLM does the same); other messages unchanged."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list):
            fixed = []
            for call in calls:
                function = (call or {}).get("function") or {}
                arguments = function.get("arguments")
                if isinstance(arguments, str):
                    try:
                        arguments = json.loads(arguments)
                    except ValueError:
                        pass
                fixed.append({**call, "function": {**function, "arguments": arguments}})
            message = {**message, "tool_calls": fixed}
        out.append(message)
    return out
