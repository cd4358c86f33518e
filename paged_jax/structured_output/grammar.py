"""StructuredOutputsParams -> llguidance grammars: checked, compiled off the caller's thread, cached.

llguidance has no compile step apart from building an `LLMatcher` (about 1 ms for a nested schema
with the SmolLM2 tokenizer; its lexer is built lazily, on the first masks). A compiled grammar is
therefore one prototype matcher, built and given its first mask on a worker thread, and every
request gets a `deep_copy()` of it (a few microseconds), which also starts with that warm lexer.
The cache is keyed by `grammar_spec()`, the text llguidance compiles, so a schema repeated across
requests (vLLM's common case: one response_format per client) compiles once.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import threading
import time

import llguidance

from paged_jax.structured_output.params import StructuredOutputsParams

GrammarSpec = tuple  # (kind, text), StructuredOutputsParams.grammar_spec()
# How a failing grammar is named: the StructuredOutputsParams field it came from.
_WHAT = {"json": ("json", "JSON schema"), "regex": ("regex", "regex"),
         "choice": ("choice", "choice list"), "grammar": ("grammar", "grammar")}


def as_spec(spec: StructuredOutputsParams | GrammarSpec) -> GrammarSpec:
    if isinstance(spec, StructuredOutputsParams):
        return spec.grammar_spec()
    if not (isinstance(spec, tuple) and len(spec) == 2 and spec[0] in _WHAT and isinstance(spec[1], str)):
        raise ValueError(f"a grammar spec is (kind, text) with kind in {sorted(_WHAT)}, got {spec!r}")
    return spec


def choice_lark(choices) -> str:
    """Exactly one of `choices`, as a Lark alternation of string literals. JSON string escaping is
    Lark's (llguidance reads its literals as JSON strings), so quotes, backslashes, newlines and any
    Unicode come through verbatim; no regex metacharacter needs escaping."""
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def to_llguidance(spec: StructuredOutputsParams | GrammarSpec) -> str:
    """The llguidance grammar (its JSON text) of a spec. Cheap and unchecked: see `validate`."""
    kind, text = as_spec(spec)
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(text)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        if kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(choice_lark(json.loads(text)))
        # "grammar" accepts Lark and llama.cpp's GBNF (converted to Lark), as vLLM's guidance backend.
        return llguidance.grammar_from("grammar", text)
    except ValueError as e:
        field, what = _WHAT[kind]
        raise ValueError(f"{field}: invalid {what}: {e}") from None


def validate(spec: StructuredOutputsParams | GrammarSpec,
             tokenizer: llguidance.LLTokenizer | None = None) -> None:
    """Raise ValueError naming the field (json, regex, choice, grammar) whose grammar llguidance
    rejects, with llguidance's reason. Cheap (well under a millisecond): a server can call it while
    parsing a request, before the request reaches the engine."""
    kind, _ = spec = as_spec(spec)
    error = llguidance.LLMatcher.validate_grammar(to_llguidance(spec), tokenizer)
    if error:
        field, what = _WHAT[kind]
        raise ValueError(f"{field}: invalid {what}: {error.strip()}")


@dataclasses.dataclass(frozen=True)
class CompiledGrammar:
    spec: GrammarSpec
    grammar: str  # the llguidance grammar JSON
    tokenizer: llguidance.LLTokenizer
    prototype: llguidance.LLMatcher  # never advanced: only copied
    compile_seconds: float

    def new_ll_matcher(self) -> llguidance.LLMatcher:
        return self.prototype.deep_copy()


def compile_grammar(spec: StructuredOutputsParams | GrammarSpec,
                    tokenizer: llguidance.LLTokenizer) -> CompiledGrammar:
    """Build and check a grammar's prototype matcher, on the calling thread (GrammarCompiler calls
    this on its worker)."""
    start = time.perf_counter()
    kind, _ = spec = as_spec(spec)
    grammar = to_llguidance(spec)
    # log_level=0: errors reach the caller as ValueError / Matcher.error, not as stderr lines.
    prototype = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if prototype.is_error():
        field, what = _WHAT[kind]
        raise ValueError(f"{field}: invalid {what}: {prototype.get_error().strip()}")
    # The first mask builds the lexer states every request needs; copies share them.
    prototype.compute_bitmask()
    return CompiledGrammar(spec, grammar, tokenizer, prototype, time.perf_counter() - start)


class GrammarCompiler:
    """Compiles grammars on its own worker thread, never on the caller's, and caches them.

    `submit` returns at once with a Future; the engine keeps scheduling other requests while it
    resolves (vLLM's structured-output manager does the same with its executor). A failure is the
    Future's ValueError, and is cached too: the same bad schema fails the same way."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, *, max_workers: int = 1,
                 max_cache_size: int = 512):
        if max_cache_size < 1:
            raise ValueError(f"max_cache_size must be >= 1, got {max_cache_size}")
        self.tokenizer = tokenizer
        self.max_cache_size = max_cache_size
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="grammar-compile")
        self._cache: collections.OrderedDict[GrammarSpec, concurrent.futures.Future] = \
            collections.OrderedDict()
        self._lock = threading.Lock()
        self.num_compiles = 0
        self.num_cache_hits = 0
        self.compile_seconds = 0.0  # summed over compiles that finished, failed ones included

    def submit(self, spec: StructuredOutputsParams | GrammarSpec) -> concurrent.futures.Future:
        """A Future of the CompiledGrammar. A spec already compiled, or being compiled, is a hit
        and shares that Future."""
        key = as_spec(spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return future
            future = self._executor.submit(self._compile, key)
            self._cache[key] = future
            self.num_compiles += 1
            while len(self._cache) > self.max_cache_size:
                # LRU: holders of an evicted Future keep it; only later lookups miss.
                self._cache.popitem(last=False)
        return future

    def compile(self, spec: StructuredOutputsParams | GrammarSpec) -> CompiledGrammar:
        """submit(spec).result(): compiled on the worker, waited for here."""
        return self.submit(spec).result()

    def _compile(self, key: GrammarSpec) -> CompiledGrammar:
        start = time.perf_counter()
        try:
            return compile_grammar(key, self.tokenizer)
        finally:
            with self._lock:
                self.compile_seconds += time.perf_counter() - start

    def stats(self) -> dict:
        with self._lock:
            return {"num_compiles": self.num_compiles, "num_cache_hits": self.num_cache_hits,
                    "compile_seconds": self.compile_seconds, "cache_size": len(self._cache)}

    def shutdown(self, wait: bool = True) -> None:
        self._executor.shutdown(wait=wait)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
