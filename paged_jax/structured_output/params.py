"""vLLM's `StructuredOutputsParams` (vllm/sampling_params.py) and the ways an OpenAI-style request
asks for one: `response_format`, vLLM's `structured_outputs` field and the older `guided_*` fields.

Only shapes are checked here (no llguidance): whether a schema, regex or grammar compiles is
`grammar.validate`'s question, asked where the tokenizer lives.
"""
from __future__ import annotations

import dataclasses
import json as _json  # the dataclass has a field named `json`

KINDS = ("json", "regex", "choice", "grammar", "json_object")
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
_OPTIONS = ("disable_any_whitespace",)


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict | str | None = None  # a JSON schema, as a dict or its JSON text
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # a list is kept as a tuple: the params are frozen
    grammar: str | None = None  # Lark (llguidance's dialect); llama.cpp's GBNF is converted
    json_object: bool | None = None  # any JSON object (OpenAI's response_format json_object)
    disable_any_whitespace: bool = False  # JSON without free whitespace between tokens

    def __post_init__(self):
        chosen = [k for k in KINDS if _is_set(k, getattr(self, k))]
        if len(chosen) != 1:
            names = ", ".join(chosen) if chosen else "none"
            raise ValueError(f"{', '.join(chosen or KINDS)}: exactly one of {', '.join(KINDS)} "
                             f"must be set, got {names}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"disable_any_whitespace: must be a boolean, got "
                             f"{self.disable_any_whitespace!r}")
        kind = chosen[0]
        value = getattr(self, kind)
        if kind == "json":
            _schema(value, "json")
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or (kind == "grammar" and not value.strip()):
                raise ValueError(f"{kind}: must be a {'non-empty ' * (kind == 'grammar')}string, "
                                 f"got {value!r}")
        elif kind == "choice":
            if (isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or not value
                    or not all(isinstance(c, str) for c in value)):
                raise ValueError(f"choice: must be a non-empty list of strings, got {value!r}")
            object.__setattr__(self, "choice", tuple(value))
        elif value is not True:
            raise ValueError(f"json_object: must be a boolean, got {value!r}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if _is_set(k, getattr(self, k)))

    def grammar_spec(self) -> tuple[str, str]:
        """(kind, text): what llguidance compiles, and the compile cache's key.

        kind is "json", "regex", "choice" or "grammar". A JSON schema is written back compactly in
        its own key order (llguidance emits properties in schema order, so keys are never sorted),
        with the whitespace choice as llguidance's `x-guidance` option: vLLM passes it as a default
        a schema's own `x-guidance` overrides, and so does this. json_object is the schema
        {"type": "object"}, as in vLLM, so it shares a cache entry with that schema."""
        kind = self.kind
        if kind in ("json", "json_object"):
            schema = _schema(self.json, "json") if kind == "json" else {"type": "object"}
            options = schema.get("x-guidance")
            if options is None or isinstance(options, dict):
                schema = {**schema, "x-guidance": {"whitespace_flexible": not self.disable_any_whitespace,
                                                   **(options or {})}}
            return "json", _json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        if kind == "choice":
            return "choice", _json.dumps(list(self.choice), ensure_ascii=False)
        return kind, getattr(self, kind)


def _is_set(kind: str, value) -> bool:
    # json_object=False is vLLM's "not asked for", as None is.
    return value is not None and not (kind == "json_object" and value is False)


def _schema(value, where: str) -> dict:
    if isinstance(value, str):
        try:
            value = _json.loads(value)
        except ValueError as e:
            raise ValueError(f"{where}: not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where}: must be a JSON schema object, got {type(value).__name__}")
    try:
        _json.dumps(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: not JSON-serializable: {e}") from None
    return value


def _build(kwargs: dict, rename) -> StructuredOutputsParams:
    """StructuredOutputsParams(**kwargs), its error message naming the request's own fields."""
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as e:
        fields, _, rest = str(e).partition(": ")
        raise ValueError(f"{', '.join(rename(f) for f in fields.split(', '))}: {rest}") from None


def _from_response_format(value) -> StructuredOutputsParams | None:
    if not isinstance(value, dict):
        raise ValueError(f"response_format: must be an object, got {value!r}")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise ValueError(f"response_format.type: must be 'text', 'json_object' or 'json_schema', "
                         f"got {kind!r}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError(f"response_format.json_schema: must be an object, got {spec!r}")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise ValueError(f"response_format.json_schema.name: must be a non-empty string, "
                         f"got {spec.get('name')!r}")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise ValueError(f"response_format.json_schema.strict: must be a boolean, got {spec['strict']!r}")
    # OpenAI's field is `schema`; it is a JSON object (a string is not accepted there).
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise ValueError(f"response_format.json_schema.schema: must be a JSON schema object, got {schema!r}")
    return _build({"json": schema}, lambda f: "response_format.json_schema.schema")


def from_dict(value) -> StructuredOutputsParams:
    """vLLM's `structured_outputs` object (a request field, or a dict given to SamplingParams) ->
    StructuredOutputsParams; ValueError naming "structured_outputs.<field>"."""
    if not isinstance(value, dict):
        raise ValueError(f"structured_outputs: must be an object, got {value!r}")
    unknown = sorted(set(value) - set(KINDS) - set(_OPTIONS))
    if unknown:
        raise ValueError(f"{', '.join('structured_outputs.' + k for k in unknown)}: not supported "
                         f"(supported: {', '.join(KINDS + _OPTIONS)})")
    return _build(value, lambda f: f"structured_outputs.{f}")


def from_openai_request(body: dict) -> StructuredOutputsParams | None:
    """The structured output an OpenAI-style request body asks for, or None.

    One way per request: response_format (json_object, json_schema; text is None), vLLM's
    `structured_outputs` object, or one `guided_*` field. Two at once is a ValueError naming both,
    rather than vLLM's silent precedence, so a client learns which one was not applied."""
    sources = []
    if body.get("response_format") is not None:
        params = _from_response_format(body["response_format"])
        if params is not None:
            sources.append(("response_format", params))
    if body.get("structured_outputs") is not None:
        sources.append(("structured_outputs", from_dict(body["structured_outputs"])))
    guided = [name for name in GUIDED_FIELDS if body.get(name) is not None]
    if guided:
        kwargs = {GUIDED_FIELDS[name]: body[name] for name in guided}
        to_request = {v: k for k, v in GUIDED_FIELDS.items()}
        sources.append((", ".join(guided), _build(kwargs, lambda f: to_request.get(f, f))))
    if len(sources) > 1:
        raise ValueError(f"{', '.join(name for name, _ in sources)}: a request may ask for structured "
                         "output one way only")
    return sources[0][1] if sources else None
