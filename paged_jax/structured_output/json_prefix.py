"""Where the values of a JSON object are, in text that may stop partway through it.

A streaming tool-call parser needs the function name as soon as it is complete and the raw text of
the arguments as it grows; `json.loads` answers only once the object is whole. This scanner finds
the top-level keys and each value's span in a prefix, and says when the object closes. It follows
strings and nesting only; whether the object is valid JSON is `json.loads`'s answer at the end.
"""
from __future__ import annotations

import dataclasses
import json

_WHITESPACE = " \t\n\r"


@dataclasses.dataclass
class ObjectScan:
    start: int  # index of "{" (or of the first non-space character when it is not "{")
    values: dict[str, tuple[int, int | None]]  # top-level key -> (value start, value end or None)
    end: int | None = None  # index just past the closing "}"; None while the object is open
    error: int | None = None  # index of the first character that cannot continue a JSON object


def skip_whitespace(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """text[i] is '"': the index past its closing quote, None if the text stops first."""
    i += 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return None


def _value_end(text: str, i: int) -> int | None:
    """The index past the JSON value starting at text[i]; None while the text may still extend it."""
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] in "{[":
        end = ValueEnd().feed(text[i:])
        return None if end is None else i + end
    # A number or literal ends at a delimiter; at the end of the text a number may still grow.
    while i < len(text) and text[i] not in ",}]" + _WHITESPACE:
        i += 1
    return i if i < len(text) else None


class ValueEnd:
    """Where a JSON object or array ends, read piece by piece: a stream's arguments are read once
    each, however many deltas they arrive in (rescanning the whole call per delta is quadratic)."""

    def __init__(self):
        self.depth, self.in_string, self.escaped = 0, False, False

    def feed(self, piece: str) -> int | None:
        """The index in `piece` just past the value's end, or None if it has not ended yet."""
        for i, ch in enumerate(piece):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


def scan_object(text: str, start: int = 0) -> ObjectScan:
    """Scan the JSON object that begins at text[start] (after optional whitespace)."""
    i = skip_whitespace(text, start)
    scan = ObjectScan(i, {})
    if i == len(text):
        return scan
    if text[i] != "{":
        scan.error = i
        return scan
    i += 1
    while True:
        i = skip_whitespace(text, i)
        if i == len(text):
            return scan
        if text[i] == "}":
            scan.end = i + 1
            return scan
        if text[i] != '"':
            scan.error = i
            return scan
        key_end = _string_end(text, i)
        if key_end is None:
            return scan
        try:
            key = json.loads(text[i:key_end])
        except ValueError:
            scan.error = i
            return scan
        i = skip_whitespace(text, key_end)
        if i == len(text):
            return scan
        if text[i] != ":":
            scan.error = i
            return scan
        i = skip_whitespace(text, i + 1)
        if i == len(text):
            return scan
        value_end = _value_end(text, i)
        scan.values[key] = (i, value_end)
        if value_end is None:
            return scan
        i = skip_whitespace(text, value_end)
        if i == len(text):
            return scan
        if text[i] == ",":
            i += 1
        elif text[i] != "}":
            scan.error = i
            return scan
