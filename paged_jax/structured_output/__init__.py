"""Structured output (JSON schema, regex, choice, grammar) through llguidance, and tool calling.

    params.py        StructuredOutputsParams (vLLM's) and from_openai_request
    grammar.py       specs -> llguidance grammars; validate; GrammarCompiler (worker thread, cache)
    tokenizer.py     the project's tokenizer as an llguidance.LLTokenizer; bitmask sizes
    matcher.py       a request's Matcher, fill_bitmasks for a batch, apply_token_bitmask (jax)
    tool_calls.py    a tool call, and the stream of OpenAI deltas every format builds on
    tool_parsers.py  hermes / llama3_json tool calls, whole or streamed as OpenAI deltas
    json_prefix.py   where a JSON object's values are in text that stops partway through it
    tool_grammar.py  tool_choice "required" / named as structured output, and back to calls

The names below load on first use: parsing requests (params) and tool calls (tool_parsers) does
not load llguidance.
"""
import importlib

_EXPORTS = {
    "StructuredOutputsParams": "params", "from_openai_request": "params",
    "GrammarCompiler": "grammar", "CompiledGrammar": "grammar", "validate": "grammar",
    "ll_tokenizer": "tokenizer", "allocate_bitmask": "tokenizer", "bitmask_words": "tokenizer",
    "Matcher": "matcher", "fill_bitmasks": "matcher", "apply_token_bitmask": "matcher",
    "ToolCall": "tool_calls", "get_tool_parser": "tool_parsers",
    "tool_choice_structured_outputs": "tool_grammar", "parse_tool_choice_output": "tool_grammar",
    "validate_tools": "tool_grammar",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
