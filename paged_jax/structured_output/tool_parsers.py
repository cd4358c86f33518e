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
import json
import uuid

from paged_jax.structured_output.json_prefix import ObjectScan, ValueEnd, scan_object, skip_whitespace


def make_tool_call_id() -> str:
    return "chatcmpl-tool-" + uuid.uuid4().hex  # vLLM's id form


@dataclasses.dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object
    type: str = "function"

    def to_openai(self) -> dict:
        return {"id": self.id, "type": self.type, "function": {"name": self.name, "arguments": self.arguments}}


def parse_call(text: str, scan: ObjectScan, arg_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments text) of a closed call object, or None when it is not a call: not JSON, no
    string name, or arguments that are not an object. No arguments key means no arguments ("{}")."""
    if scan.error is not None or scan.end is None:
        return None
    try:
        call = json.loads(text[scan.start:scan.end])
    except ValueError:
        return None
    key = next((k for k in arg_keys if k in call), None)
    if not isinstance(call.get("name"), str) or not call["name"] or (
            key is not None and not isinstance(call[key], dict)):
        return None
    if key is None:
        return call["name"], "{}"
    start, end = scan.values[key]
    return call["name"], text[start:end]


class _CallDeltas:
    """One call's deltas: a header (index, id, type, name, empty arguments) once the name is known,
    then the arguments' text as it arrives."""

    def __init__(self, index: int, arg_keys: tuple[str, ...]):
        self.index, self.arg_keys = index, arg_keys
        self.id: str | None = None
        self.sent = ""  # argument text sent so far
        self._args_start = 0
        self._args_end: ValueEnd | None = None  # set once announced
        self.args_done = False

    @property
    def arguments_open(self) -> bool:
        return self._args_end is not None and not self.args_done

    def _header(self, name: str) -> dict:
        self.id = make_tool_call_id()
        return {"tool_calls": [{"index": self.index, "id": self.id, "type": "function",
                                "function": {"name": name, "arguments": ""}}]}

    def _arguments(self, text: str) -> list[dict]:
        self.sent += text
        return [{"tool_calls": [{"index": self.index, "function": {"arguments": text}}]}] if text else []

    def progress(self, text: str, start: int) -> list[dict]:
        """Deltas for the call object at text[start:], still open: nothing until the name is
        complete and the arguments have begun as an object (so a string or number there is never
        announced as a call), then each new piece of the arguments."""
        if self.args_done:
            return []
        out = []
        if self._args_end is None:
            scan = scan_object(text, start)
            key = next((k for k in self.arg_keys if k in scan.values), None)
            if key is None or text[scan.values[key][0]] != "{" or scan.error is not None:
                return []
            name_start, name_end = scan.values.get("name", (0, None))
            try:
                name = json.loads(text[name_start:name_end]) if name_end is not None else None
            except ValueError:
                name = None
            if not isinstance(name, str) or not name:
                return []
            out.append(self._header(name))
            self._args_start, self._args_end = scan.values[key][0], ValueEnd()
        piece = text[self._args_start + len(self.sent):]
        end = self._args_end.feed(piece)
        if end is not None:
            piece, self.args_done = piece[:end], True
        return out + self._arguments(piece)

    def complete(self, name: str, arguments: str) -> list[dict]:
        out = [] if self.id is not None else [self._header(name)]
        if arguments.startswith(self.sent):
            out += self._arguments(arguments[len(self.sent):])
        return out


class ToolCallStream:
    """feed(text delta) -> deltas; finish() -> the last deltas. Deltas are OpenAI's
    `choices[i].delta` dicts: {"content": ...} or {"tool_calls": [...]}.

    Whitespace next to a call is not content (the newline a model writes before `<tool_call>`), so
    a message that is only calls has content None."""

    def __init__(self, incremental: bool = True):
        self.incremental = incremental  # False: a call is sent only once it is whole (extract)
        self._pending_space = ""  # trailing whitespace of the content, dropped if a call follows
        self._after_call = False  # whitespace right after a call is dropped too
        self.num_calls = 0

    def _content(self, text: str) -> list[dict]:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return []
            self._after_call = False
        text = self._pending_space + text
        body = text.rstrip()
        self._pending_space = text[len(body):]
        return [{"content": body}] if body else []

    def _call_done(self) -> None:
        self._pending_space, self._after_call = "", True
        self.num_calls += 1

    def _flush(self) -> list[dict]:
        out = [{"content": self._pending_space}] if self._pending_space else []
        self._pending_space = ""
        return out

    def feed(self, delta: str) -> list[dict]:
        raise NotImplementedError

    def finish(self) -> list[dict]:
        raise NotImplementedError


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag`."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)


class HermesStream(ToolCallStream):
    START, END, ARG_KEYS = "<tool_call>", "</tool_call>", ("arguments",)

    def __init__(self, incremental: bool = True):
        super().__init__(incremental)
        self._buf = ""
        self._call: _CallDeltas | None = None  # set between <tool_call> and </tool_call>
        self._searched = 0  # where to look for </tool_call> next

    def feed(self, delta: str) -> list[dict]:
        self._buf += delta
        out = []
        while True:
            if self._call is None:
                at = self._buf.find(self.START)
                if at < 0:
                    cut = len(self._buf) - _partial_suffix(self._buf, self.START)
                    out += self._content(self._buf[:cut])
                    self._buf = self._buf[cut:]
                    return out
                out += self._content(self._buf[:at])
                self._buf = self._buf[at + len(self.START):]
                self._call, self._searched = _CallDeltas(self.num_calls, self.ARG_KEYS), 0
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
        self._call: _CallDeltas | None = None

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
            self._call = self._call or _CallDeltas(self.num_calls, self.ARG_KEYS)
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
