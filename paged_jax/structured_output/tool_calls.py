"""The machinery every tool-call format shares (tool_parsers.py holds the formats): a call
(`ToolCall`, its id), parsing one call's JSON object, and a stream that turns text deltas into
OpenAI's chat-completion tool-call deltas (`ToolCallStream`, `CallDeltas`)."""
from __future__ import annotations

import abc
import dataclasses
import json
import uuid

from paged_jax.structured_output.json_prefix import ObjectScan, ValueEnd, scan_object


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


class CallDeltas:
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


class ToolCallStream(abc.ABC):
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

    @abc.abstractmethod
    def feed(self, delta: str) -> list[dict]:
        """The deltas this text delta completes."""

    @abc.abstractmethod
    def finish(self) -> list[dict]:
        """The deltas held back until the text ended."""


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag`."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)
