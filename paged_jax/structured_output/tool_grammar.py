"""`tool_choice="required"` and a named function, as structured output: the JSON schemas vLLM
constrains them with (vllm/entrypoints/openai/protocol.py), and that output read back as tool calls.

    required  [{"name": <one tool's name>, "parameters": <that tool's arguments>}, ...], at least one
    named     the named function's arguments object itself

"auto" and "none" need no grammar: the model writes calls (or not) in its own format, which a tool
parser reads (tool_parsers.py).
"""
from __future__ import annotations

import copy
import json

from paged_jax.structured_output import grammar
from paged_jax.structured_output.params import StructuredOutputsParams
from paged_jax.structured_output.tool_calls import ToolCall, make_tool_call_id

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
_DEFS_KEYS = ("$defs", "definitions")  # draft 2019+ and draft-07 homes of "$ref": "#/..." targets


def validate_tools(tools) -> list[dict]:
    """OpenAI's `tools` -> [{"name", "parameters", "description"}]; ValueError naming the bad field
    (e.g. "tools[1].function.name"). Missing parameters mean a function without arguments."""
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"tools: must be a non-empty list of tools, got {tools!r}")
    seen: dict[str, int] = {}
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ValueError(f"{where}: must be an object, got {tool!r}")
        if tool.get("type") != "function":
            raise ValueError(f"{where}.type: must be 'function', got {tool.get('type')!r}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ValueError(f"{where}.function: must be an object, got {function!r}")
        name = function.get("name")
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{where}.function.name: must be a non-empty string, got {name!r}")
        if name in seen:
            # Two tools of one name would make a call ambiguous.
            raise ValueError(f"{where}.function.name: {name!r} is also the name of tools[{seen[name]}]")
        seen[name] = i
        parameters = function.get("parameters")
        if parameters is None:
            parameters = _EMPTY_PARAMETERS
        elif not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise ValueError(f"{where}.function.parameters: must be a JSON schema of type 'object', "
                             f"got {parameters!r}")
        out.append({"name": name, "parameters": parameters, "description": function.get("description")})
    return out


def required_schema(tools: list[dict], *, parallel: bool = True) -> dict:
    """The array schema of tool_choice="required" over validated tools: one call or more, exactly
    one when not `parallel` (OpenAI's parallel_tool_calls false). Each tool's $defs move to the root,
    where the "#/$defs/..." references inside its parameters now resolve (as vLLM does); two tools
    defining one name differently is a ValueError."""
    defs: dict[str, dict] = {}
    alternatives = []
    for i, tool in enumerate(tools):
        parameters = copy.deepcopy(tool["parameters"])
        for key in _DEFS_KEYS:
            for name, definition in (parameters.pop(key, None) or {}).items():
                if defs.setdefault(key, {}).setdefault(name, definition) != definition:
                    raise ValueError(f"tools[{i}].function.parameters.{key}.{name}: differs from "
                                     "another tool's definition of the same name")
        alternatives.append({"properties": {"name": {"type": "string", "enum": [tool["name"]]},
                                            "parameters": parameters},
                             "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}),
              "items": {"type": "object", "anyOf": alternatives}}
    return {**schema, **defs}


def _named_function(tool_choice, tools: list[dict]) -> dict:
    function = tool_choice.get("function")
    if tool_choice.get("type") != "function":
        raise ValueError(f"tool_choice.type: must be 'function', got {tool_choice.get('type')!r}")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(f"tool_choice.function.name: must be a string, got {tool_choice!r}")
    tool = next((t for t in tools if t["name"] == function["name"]), None)
    if tool is None:
        raise ValueError(f"tool_choice.function.name: {function['name']!r} is not one of the tools "
                         f"({', '.join(t['name'] for t in tools)})")
    return tool


def _check_parameters(tools: list[dict], names) -> None:
    """A schema llguidance rejects, named by its tool rather than by the combined schema."""
    for i, tool in enumerate(tools):
        if tool["name"] in names:
            try:
                grammar.validate(StructuredOutputsParams(json=tool["parameters"]))
            except ValueError as e:
                raise ValueError(f"tools[{i}].function.parameters: {str(e).partition(': ')[2]}") from None


def tool_choice_structured_outputs(tools, tool_choice, *, parallel: bool = True) -> StructuredOutputsParams | None:
    """The structured output that enforces `tool_choice` (a single call when not `parallel`), or
    None for "auto" / "none" / absent.
    The schemas of the tools it may call are checked here, so an error names the tool. Calls are
    compact JSON (no free whitespace): a program reads them, and a small model left free to pad
    them can spend its whole max_tokens on whitespace."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    if tool_choice == "required":
        tools = validate_tools(tools)
        _check_parameters(tools, {t["name"] for t in tools})
        return StructuredOutputsParams(json=required_schema(tools, parallel=parallel), disable_any_whitespace=True)
    if isinstance(tool_choice, dict):
        tools = validate_tools(tools)
        tool = _named_function(tool_choice, tools)
        _check_parameters(tools, {tool["name"]})
        return StructuredOutputsParams(json=tool["parameters"], disable_any_whitespace=True)
    raise ValueError(f"tool_choice: must be 'none', 'auto', 'required' or "
                     f'{{"type": "function", "function": {{"name": ...}}}}, got {tool_choice!r}')


def parse_tool_choice_output(text: str, tool_choice) -> tuple[str | None, list[ToolCall]]:
    """Output constrained by tool_choice_structured_outputs -> (content, calls). Output that is not
    whole (cut off by max_tokens) comes back as content, with no calls, as the tool parsers do."""
    try:
        value = json.loads(text)
    except ValueError:
        return text, []
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if not isinstance(value, dict) or not isinstance(name, str):
            return text, []
        return None, [ToolCall(make_tool_call_id(), name, text.strip())]
    if tool_choice != "required":
        raise ValueError(f"tool_choice: {tool_choice!r} constrains no output")
    if not isinstance(value, list) or not value or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("parameters"), dict)
            for c in value):
        return text, []
    # Arguments as vLLM writes them for "required": the parameters object re-serialised.
    return None, [ToolCall(make_tool_call_id(), c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                  for c in value]
