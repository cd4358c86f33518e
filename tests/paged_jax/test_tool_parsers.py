"""Tool-call parsers (whole text and streamed deltas) and the tool_choice schemas, checked against
hand-written expected calls and, for the schemas, against jsonschema."""
import random
import re

import jsonschema
import pytest

from paged_jax.structured_output import tool_grammar
from paged_jax.structured_output.json_prefix import scan_object
from paged_jax.structured_output.params import StructuredOutputsParams
from paged_jax.structured_output.tool_parsers import fold_deltas, get_tool_parser

ID = re.compile(r"^chatcmpl-tool-[0-9a-f]{32}$")


def calls_of(result):
    content, calls = result
    assert all(ID.match(c.id) and c.type == "function" for c in calls)
    assert len({c.id for c in calls}) == len(calls)
    return content, [(c.name, c.arguments) for c in calls]


def stream(parser, text, chunks):
    """Feed `text` in pieces of the given sizes (cycled); return all deltas."""
    s = get_tool_parser(parser).stream()
    deltas, i, k = [], 0, 0
    while i < len(text):
        n = chunks[k % len(chunks)]
        deltas += s.feed(text[i:i + n])
        i, k = i + n, k + 1
    return deltas + s.finish()


def random_chunks(seed, n=64):
    rng = random.Random(seed)
    return [rng.randint(1, 9) for _ in range(n)]


WEATHER = '{"city": "Paris", "units": ["c", "f"], "when": {"day": "mon}day"}}'

HERMES = [
    ('<tool_call>\n{"name": "get_weather", "arguments": ' + WEATHER + '}\n</tool_call>',
     (None, [("get_weather", WEATHER)])),
    ("I'll look both up.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n"
     '<tool_call>\n{"arguments": {"x": [1, {"y": "</tool"}]}, "name": "b"}\n</tool_call>',
     ("I'll look both up.", [("a", "{}"), ("b", '{"x": [1, {"y": "</tool"}]}')])),
    ('<tool_call>{"name": "ping"}</tool_call>', (None, [("ping", "{}")])),
    ("Just text, with a < sign and <tool_ but no call.  ", ("Just text, with a < sign and <tool_ but no call.  ", [])),
    ('<tool_call>{"name": "f", "arguments": {"q": "done"}}', (None, [("f", '{"q": "done"}')])),  # cut after the JSON
    ('Before <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call> after', ("Beforeafter", [("f", '{"a": 1}')])),
    # Malformed calls stay in the content: not JSON, arguments not an object, no name.
    ('Hi <tool_call>not json</tool_call>', ('Hi <tool_call>not json</tool_call>', [])),
    ('<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>',
     ('<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>', [])),
    ('<tool_call>{"arguments": {}}</tool_call>', ('<tool_call>{"arguments": {}}</tool_call>', [])),
    ('A <tool_call>{"name": 1}</tool_call>\n<tool_call>{"name": "ok", "arguments": {"b": true}}</tool_call>',
     ('A <tool_call>{"name": 1}</tool_call>', [("ok", '{"b": true}')])),
]

LLAMA = [
    ('<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "arguments": {"b": "x;y"}}',
     (None, [("f", '{"a": 1}'), ("g", '{"b": "x;y"}')])),
    ('{"name": "get_weather", "parameters": ' + WEATHER + "}", (None, [("get_weather", WEATHER)])),
    ('  {"name": "f", "parameters": {}} ;\n{"name": "g", "parameters": {"n": null}};  ',
     (None, [("f", "{}"), ("g", '{"n": null}')])),
    ("The weather is fine.", ("The weather is fine.", [])),
    ('<|python_tag|>{"foo": 1}', ('<|python_tag|>{"foo": 1}', [])),
    ('{"name": "f", "parameters": {"a": 1}} and then some', ("and then some", [("f", '{"a": 1}')])),
    ('{"name": "f", "parameters": {"a": 1}}; oops', ("oops", [("f", '{"a": 1}')])),
    ('Sure: {"name": "f", "parameters": {}}', ('Sure: {"name": "f", "parameters": {}}', [])),
    ("<|python", ("<|python", [])),
]


@pytest.mark.parametrize("text, expected", HERMES)
def test_hermes_extract(text, expected):
    assert calls_of(get_tool_parser("hermes").extract(text)) == expected


@pytest.mark.parametrize("text, expected", LLAMA)
def test_llama3_json_extract(text, expected):
    assert calls_of(get_tool_parser("llama3_json").extract(text)) == expected


@pytest.mark.parametrize("parser, text, expected",
                         [("hermes", t, e) for t, e in HERMES] + [("llama3_json", t, e) for t, e in LLAMA])
def test_streamed_deltas_add_up_to_the_same_calls(parser, text, expected):
    for chunks in [[1], [len(text)], *(random_chunks(seed) for seed in range(4))]:
        deltas = stream(parser, text, chunks)
        assert calls_of(fold_deltas(deltas)) == expected, chunks
        seen_call = set()
        for delta in deltas:
            assert set(delta) in ({"content"}, {"tool_calls"}) and delta[next(iter(delta))]
            for part in delta.get("tool_calls", ()):
                if part["index"] not in seen_call:  # the first delta of a call: its header
                    seen_call.add(part["index"])
                    assert set(part) == {"index", "id", "type", "function"} and part["type"] == "function"
                    assert part["function"]["arguments"] == "" and part["function"]["name"]
                else:
                    assert set(part) == {"index", "function"} and set(part["function"]) == {"arguments"}
        assert sorted(seen_call) == list(range(len(expected[1])))


def test_streaming_sends_arguments_as_they_arrive():
    text = '<tool_call>\n{"name": "get_weather", "arguments": ' + WEATHER + "}\n</tool_call>"
    s = get_tool_parser("hermes").stream()
    deltas = [s.feed(ch) for ch in text]
    header_at = next(i for i, d in enumerate(deltas) if d and "id" in d[0]["tool_calls"][0])
    # Announced as soon as the arguments object opens, not when the block closes.
    assert text[:header_at + 1].endswith('"arguments": {')
    args = [d[0]["tool_calls"][0]["function"]["arguments"] for d in deltas[header_at + 1:] if d]
    assert len(args) == len(WEATHER) - 1 and "{" + "".join(args) == WEATHER
    assert s.finish() == []


def test_content_is_streamed_before_the_call_and_a_tag_prefix_is_held_back():
    s = get_tool_parser("hermes").stream()
    assert s.feed("Let me check") == [{"content": "Let me check"}]
    assert s.feed(".\n<tool_") == [{"content": "."}]  # the newline and "<tool_" wait
    assert s.feed("call>") == []
    out = s.feed('{"name": "f", "arguments": {}}</tool_call>')
    assert [list(d) for d in out] == [["tool_calls"], ["tool_calls"]] and s.finish() == []


@pytest.mark.parametrize("parser, text, streamed", [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"city": "Par', (None, [("f", '{"city": "Par')])),
    ("hermes", 'A<tool_call>{"name": "f", "arguments": {}} extra</tool_call>', ("A", [("f", "{}")])),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1', (None, [("f", '{"a": 1')])),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}, ]', ("]", [("f", '{"a": 1}')])),
])
def test_a_call_broken_after_it_was_announced_stays_announced(parser, text, streamed):
    # The one way streaming and extract differ (vLLM's streaming parsers share it): the call went
    # wrong (max_tokens cut its arguments off, junk after them) after the stream had announced it.
    assert calls_of(fold_deltas(stream(parser, text, [1]))) == streamed
    assert calls_of(get_tool_parser(parser).extract(text)) == (text, [])


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown tool call parser 'mistral'; known: hermes, llama3_json"):
        get_tool_parser("mistral")


def test_json_prefix_scan():
    text = '{"a": "x}", "b": [1, {"c": 2}], "n": 12'
    scan = scan_object(text)
    assert scan.values == {"a": (6, 10), "b": (17, 30), "n": (37, None)} and scan.end is None
    assert text[6:10] == '"x}"' and text[17:30] == '[1, {"c": 2}]'
    closed = scan_object(text + "}  ")
    assert closed.values["n"] == (37, 39) and closed.end == 40 and closed.error is None
    assert scan_object('  {"a" 1}').error == 7 and scan_object("[1]").error == 0


# --- tool_choice as structured output ------------------------------------------------------------

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                                 "days": {"type": "integer"}},
                               "required": ["city"]}}}
PING_TOOL = {"type": "function", "function": {"name": "ping"}}


def test_required_schema():
    schema = tool_grammar.required_schema(tool_grammar.validate_tools([WEATHER_TOOL, PING_TOOL]))
    assert schema == {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": ["get_weather"]},
                        "parameters": WEATHER_TOOL["function"]["parameters"]},
         "required": ["name", "parameters"]},
        {"properties": {"name": {"type": "string", "enum": ["ping"]},
                        "parameters": {"type": "object", "properties": {}}},
         "required": ["name", "parameters"]}]}}
    params = tool_grammar.tool_choice_structured_outputs([WEATHER_TOOL, PING_TOOL], "required")
    assert params == StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}},
                         {"name": "ping", "parameters": {}}], schema)
    for bad in ([], [{"name": "get_time", "parameters": {}}],
                [{"name": "get_weather", "parameters": {"days": 2}}],
                [{"name": "get_weather", "parameters": {"city": "Oslo", "days": "two"}}],
                [{"name": "ping"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_required_schema_moves_defs_to_the_root():
    unit = {"enum": ["c", "f"]}
    tools = [{"type": "function", "function": {"name": "t", "parameters": {
        "type": "object", "properties": {"u": {"$ref": "#/$defs/Unit"}}, "$defs": {"Unit": unit}}}},
             {"type": "function", "function": {"name": "s", "parameters": {
                 "type": "object", "properties": {"v": {"$ref": "#/$defs/Unit"}}, "$defs": {"Unit": unit}}}}]
    schema = tool_grammar.required_schema(tool_grammar.validate_tools(tools))
    assert schema["$defs"] == {"Unit": unit} and "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert "$defs" in tools[0]["function"]["parameters"]  # the request is not modified
    jsonschema.validate([{"name": "t", "parameters": {"u": "c"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "s", "parameters": {"v": "k"}}], schema)
    tools[1]["function"]["parameters"]["$defs"] = {"Unit": {"enum": ["k"]}}
    with pytest.raises(ValueError, match=r"^tools\[1\].function.parameters.\$defs.Unit: differs"):
        tool_grammar.required_schema(tool_grammar.validate_tools(tools))


def test_named_function_schema_is_its_parameters():
    choice = {"type": "function", "function": {"name": "get_weather"}}
    params = tool_grammar.tool_choice_structured_outputs([PING_TOOL, WEATHER_TOOL], choice)
    assert params == StructuredOutputsParams(json=WEATHER_TOOL["function"]["parameters"],
                                             disable_any_whitespace=True)
    jsonschema.validate({"city": "Oslo"}, params.json)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"days": 1}, params.json)
    for choice in ("auto", "none", None):
        assert tool_grammar.tool_choice_structured_outputs([WEATHER_TOOL], choice) is None


def test_constrained_output_back_to_calls():
    content, calls = calls_of(tool_grammar.parse_tool_choice_output(
        '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "ping", "parameters": {}}]', "required"))
    assert content is None and calls == [("get_weather", '{"city": "Oslo"}'), ("ping", "{}")]
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert calls_of(tool_grammar.parse_tool_choice_output(' {"city": "Oslo"}\n', named)) == (
        None, [("get_weather", '{"city": "Oslo"}')])
    cut = '[{"name": "get_weather", "parameters": {"ci'
    assert tool_grammar.parse_tool_choice_output(cut, "required") == (cut, [])
    assert tool_grammar.parse_tool_choice_output("[]", "required") == ("[]", [])


@pytest.mark.parametrize("tools, choice, message", [
    (None, "required", r"^tools: must be a non-empty list"),
    ([], "required", r"^tools: must be a non-empty list"),
    (["get_weather"], "required", r"^tools\[0\]: must be an object"),
    ([{"type": "retrieval"}], "required", r"^tools\[0\].type: must be 'function', got 'retrieval'"),
    ([WEATHER_TOOL, {"type": "function"}], "required", r"^tools\[1\].function: must be an object"),
    ([WEATHER_TOOL, {"type": "function", "function": {"name": ""}}], "required",
     r"^tools\[1\].function.name: must be a non-empty string"),
    ([WEATHER_TOOL, {"type": "function", "function": {"parameters": {}}}], "required", r"^tools\[1\].function.name: "),
    ([WEATHER_TOOL, WEATHER_TOOL], "required",
     r"^tools\[1\].function.name: 'get_weather' is also the name of tools\[0\]"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "required",
     r"^tools\[0\].function.parameters: must be a JSON schema of type 'object'"),
    ([PING_TOOL, {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "bogus"}}}}}], "required",
     r"^tools\[1\].function.parameters: invalid JSON schema: .*bogus"),
    ([WEATHER_TOOL], {"type": "function", "function": {"name": "get_time"}},
     r"^tool_choice.function.name: 'get_time' is not one of the tools \(get_weather\)"),
    ([WEATHER_TOOL], {"type": "function"}, r"^tool_choice.function.name: must be a string"),
    ([WEATHER_TOOL], {"type": "tool", "function": {"name": "get_weather"}}, r"^tool_choice.type: must be 'function'"),
    ([WEATHER_TOOL], "sometimes", r"^tool_choice: must be 'none', 'auto', 'required'"),
])
def test_bad_tools_name_the_field(tools, choice, message):
    with pytest.raises(ValueError, match=message):
        tool_grammar.tool_choice_structured_outputs(tools, choice)


def test_parallel_tool_calls_false_makes_one_call():
    """OpenAI's parallel_tool_calls false: "required" is a grammar for exactly one call; "auto"
    keeps the model's first, whole and streamed (vLLM's filter), with the text around it."""
    from paged_jax.entrypoints.openai.tool_calling import ToolCalling

    schema = tool_grammar.required_schema(tool_grammar.validate_tools([WEATHER_TOOL, PING_TOOL]), parallel=False)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    jsonschema.validate([{"name": "ping", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "ping", "parameters": {}}, {"name": "ping", "parameters": {}}], schema)
    assert "maxItems" not in tool_grammar.required_schema(tool_grammar.validate_tools([PING_TOOL]))
    text = ('Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
            '<tool_call>{"name": "ping", "arguments": {}}</tool_call>')
    for parallel, names in ((True, ["get_weather", "ping"]), (False, ["get_weather"])):
        tools = ToolCalling([WEATHER_TOOL, PING_TOOL], "auto", get_tool_parser("hermes"), parallel=parallel)
        content, calls = tools.message(text)
        assert (content, [c["function"]["name"] for c in calls]) == ("Sure.", names)
        s = tools.stream()
        deltas = [d for i in range(len(text)) for d in s.feed(text[i])] + s.finish()
        content, streamed = fold_deltas(deltas)
        assert (content.strip(), [c.name for c in streamed]) == ("Sure.", names) and s.made_calls
