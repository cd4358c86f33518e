"""Tool calls in a model's text, as vLLM's `--tool-call-parser` reads them: whole (`extract`) or
as a stream of OpenAI chat-completion deltas.

    hermes       <tool_call>{"name": "f", "arguments": {...}}</tool_call>, any number, with text
                 around them (Qwen 2.5 / 3, Hermes 2 Pro)
    llama3_json  {"name": "f", "parameters": {...}} at the start, optionally after <|python_tag|>,
                 several separated by ";" (Llama 3.1 / 3.2 / 3.3)

A call's `arguments` is the raw JSON text the model wrote for its arguments object, so streamed
argument deltas concatenate to exactly the string `extract` returns. `extract` is the stream fed
the whole text at once, so the two cannot drift apart. A malformed call is left in the content. One
difference remains, and vLLM's streaming parsers share it: a stream announces a call once its name
and the opening of its arguments have arrived, so a call that goes wrong after that (cut off by
max_tokens, broken JSON) stays announced, where `extract` would have kept it as content.
"""
from __future__ import annotations

import dataclasses

from paged_jax.structured_output.json_prefix import scan_object, skip_whitespace
from paged_jax.structured_output.tool_calls import (CallDeltas, ToolCall, ToolCallStream, make_tool_call_id, parse_call,
                                                    partial_suffix)

__all__ = ["ToolCall", "make_tool_call_id", "HermesStream", "Llama3JsonStream", "TOOL_PARSERS", "fold_deltas",
           "ToolParser", "get_tool_parser"]


class HermesStream(ToolCallStream):
    START, END, ARG_KEYS = "<tool_call>", "</tool_call>", ("arguments",)

    def __init__(self, incremental: bool = True):
        super().__init__(incremental)
        self._buf = ""
        self._call: CallDeltas | None = None  # set between <tool_call> and </tool_call>
        self._searched = 0  # where to look for </tool_call> next

    def feed(self, delta: str) -> list[dict]:
        self._buf += delta
        out = []
        while True:
            if self._call is None:
                at = self._buf.find(self.START)
                if at < 0:
                    cut = len(self._buf) - partial_suffix(self._buf, self.START)
                    out += self._content(self._buf[:cut])
                    self._buf = self._buf[cut:]
                    return out
                out += self._content(self._buf[:at])
                self._buf = self._buf[at + len(self.START):]
                self._call, self._searched = CallDeltas(self.num_calls, self.ARG_KEYS), 0
                continue
            at = self._buf.find(self.END, self._searched)
            if at < 0:
                self._searched = max(0, len(self._buf) - len(self.END) + 1)
                if self.incremental:
                    out += self._call.progress(self._buf, 0)
                return out
            out += self._close(self._buf[:at], closed=True)
            self._buf = self._buf[at + len(self.END):]

    def _close(self, body: str, closed: bool) -> list[dict]:
        scan = scan_object(body)
        call = parse_call(body, scan, self.ARG_KEYS)
        valid = call is not None and not body[scan.end:].strip()
        deltas, self._call = self._call, None
        if valid or deltas.id is not None:
            out = deltas.complete(*call) if valid else []
            self._call_done()
            return out
        return self._content(self.START + body + (self.END if closed else ""))

    def finish(self) -> list[dict]:
        # A block cut off before </tool_call> still counts when its JSON is whole (max_tokens can
        # stop a model right after the object).
        out = self._close(self._buf, closed=False) if self._call is not None else self._content(self._buf)
        self._buf = ""
        return out + self._flush()


class Llama3JsonStream(ToolCallStream):
    """Calls only when the message starts with them; then every call until the first part that is
    not one, which (and all after it) is content. A message that does not start with a call is
    all content."""

    TAG, ARG_KEYS = "<|python_tag|>", ("arguments", "parameters")

    def __init__(self, incremental: bool = True):
        super().__init__(incremental)
        self._buf = ""
        self._mode: str | None = None  # None until the start is read, then "calls" or "content"
        self._pos = 0  # where the next call object (or the separator before it) starts
        self._need_separator = False
        self._call: CallDeltas | None = None

    def feed(self, delta: str) -> list[dict]:
        self._buf += delta
        if self._mode is None:
            head = self._buf.lstrip()
            skipped = len(self._buf) - len(head)
            if head.startswith(self.TAG) or head.startswith("{"):
                self._mode = "calls"
                self._pos = skipped + (len(self.TAG) if head.startswith(self.TAG) else 0)
            elif not head or self.TAG.startswith(head):
                return []
            else:
                self._mode = "content"
        if self._mode == "content":
            out, self._buf = self._content(self._buf), ""
            return out
        return self._calls()

    def _calls(self) -> list[dict]:
        out = []
        while True:
            if self._need_separator:
                at = skip_whitespace(self._buf, self._pos)
                if at == len(self._buf):
                    return out
                if self._buf[at] != ";":
                    return out + self._fail(at)
                self._pos, self._need_separator = at + 1, False
            self._call = self._call or CallDeltas(self.num_calls, self.ARG_KEYS)
            if self._call.arguments_open:  # announced: read only what is new until its arguments end
                out += self._call.progress(self._buf, self._pos)
                if self._call.arguments_open:
                    return out
            scan = scan_object(self._buf, self._pos)
            if scan.error is not None:
                return out + self._fail(scan.error if self._call.id is not None else None)
            if scan.end is None:
                return out + (self._call.progress(self._buf, self._pos) if self.incremental else [])
            call = parse_call(self._buf, scan, self.ARG_KEYS)
            if call is None:
                return out + self._fail(scan.end if self._call.id is not None else None)
            out += self._call.complete(*call)
            self._call = None
            self._call_done()
            self._pos, self._need_separator = scan.end, True

    def _fail(self, at: int | None) -> list[dict]:
        """The rest is content: from `at`, or from the start of the failed part (the whole message
        when no call came before it)."""
        if at is None:
            at = self._pos if self.num_calls else 0
        self._mode, self._call = "content", None
        out, self._buf = self._content(self._buf[at:]), ""
        return out

    def finish(self) -> list[dict]:
        out = []
        if self._mode is None:
            out = self._content(self._buf)
        elif self._mode == "calls" and not self._need_separator and self._call is not None:
            scan = scan_object(self._buf, self._pos)
            # Only whitespace after a ";" ends the calls; a call cut off mid-object that was already
            # announced stays as streamed; one that was not is content.
            if scan.start < len(self._buf) and self._call.id is None:
                out = self._fail(None)
        self._buf = ""
        return out + self._flush()


TOOL_PARSERS = {"hermes": HermesStream, "llama3_json": Llama3JsonStream}


def fold_deltas(deltas) -> tuple[str | None, list[ToolCall]]:
    """The message a list of deltas adds up to: (content or None, calls in index order)."""
    content = "".join(d["content"] for d in deltas if "content" in d)
    calls: dict[int, dict] = {}
    for delta in deltas:
        for part in delta.get("tool_calls", ()):
            call = calls.setdefault(part["index"], {"arguments": ""})
            if "id" in part:
                call["id"], call["name"] = part["id"], part["function"]["name"]
            call["arguments"] += part["function"].get("arguments", "")
    return content or None, [ToolCall(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())]


@dataclasses.dataclass(frozen=True)
class ToolParser:
    name: str

    def __post_init__(self):
        if self.name not in TOOL_PARSERS:
            raise ValueError(f"unknown tool call parser {self.name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")

    def stream(self) -> ToolCallStream:
        return TOOL_PARSERS[self.name]()

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        stream = TOOL_PARSERS[self.name](incremental=False)
        return fold_deltas(stream.feed(text) + stream.finish())


def get_tool_parser(name: str) -> ToolParser:
    return ToolParser(name)
