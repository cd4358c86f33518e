"""Structured output through llguidance with SmolLM2's real tokenizer: specs, request parsing,
compile cache and worker thread, matchers walked through real token ids, and the bitmask on logits
against a numpy reference."""
import json
import threading

import numpy as np
import pytest
import tokenizers

from paged_jax.structured_output import grammar, matcher, params, tokenizer, tool_grammar
from paged_jax.structured_output.params import StructuredOutputsParams as SOP

EOS = 2  # SmolLM2-Instruct's <|im_end|>
# The file's end-of-generation tokens: EOS, then <|endoftext|>, where llama.cpp also ends one.
END = [0, EOS]
TOKENIZER_VOCAB = 49152

PERSON = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                         "address": {"type": "object",
                                     "properties": {"city": {"type": "string"},
                                                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                     "required": ["city", "zip"]},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
          "required": ["name", "age", "address"]}
PERSON_TEXT = '{"name": "Ada", "age": 36, "address": {"city": "Paris", "zip": "75001"}, "tags": ["b"]}'


@pytest.fixture(scope="module")
def tok(smollm2_gguf):
    from models.tokenizer import load_tokenizer
    return load_tokenizer(smollm2_gguf)


@pytest.fixture(scope="module")
def ll(tok):
    return tokenizer.ll_tokenizer(tok)


@pytest.fixture(scope="module")
def compiler(ll):
    with grammar.GrammarCompiler(ll) as c:
        yield c


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def allowed(row, vocab):
    """Token ids whose bit is set, read bit by bit (independent of the numpy reference's unpackbits)."""
    return [t for t in range(vocab) if (int(row[t // 32]) >> (t % 32)) & 1]


def mask_of(m):
    row = np.zeros(tokenizer.bitmask_words(m.vocab_size), np.int32)
    m.fill_bitmask(row)
    return row


def bit(row, token):
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


# --- params -------------------------------------------------------------------------------------

def test_grammar_spec_of_each_kind():
    assert SOP(json={"type": "object", "properties": {"b": {}, "a": {}}}).grammar_spec() == (
        "json", '{"type":"object","properties":{"b":{},"a":{}},"x-guidance":{"whitespace_flexible":true}}')
    assert SOP(json='{"type": "integer"}', disable_any_whitespace=True).grammar_spec() == (
        "json", '{"type":"integer","x-guidance":{"whitespace_flexible":false}}')
    # A schema's own x-guidance wins over the request's default, as llguidance's defaults do.
    assert SOP(json={"x-guidance": {"whitespace_flexible": False}}).grammar_spec() == (
        "json", '{"x-guidance":{"whitespace_flexible":false}}')
    assert SOP(json_object=True).grammar_spec() == SOP(json={"type": "object"}).grammar_spec()
    assert SOP(regex=r"\d+").grammar_spec() == ("regex", r"\d+")
    assert SOP(choice=["yes", "nö"]).grammar_spec() == ("choice", '["yes", "nö"]')
    assert SOP(choice=["a"]).choice == ("a",)
    assert SOP(grammar="start: /x/").grammar_spec() == ("grammar", "start: /x/")


@pytest.mark.parametrize("kwargs, message", [
    ({"json": {}, "regex": "a"}, r"^json, regex: exactly one of .* got json, regex"),
    ({"choice": ["a"], "grammar": "start: /a/", "json_object": True}, r"^choice, grammar, json_object: exactly one"),
    ({}, r"exactly one of json, regex, choice, grammar, json_object must be set, got none"),
    ({"json_object": False}, r"got none"),
    ({"json": "{not json"}, r"^json: not valid JSON"),
    ({"json": [1]}, r"^json: must be a JSON schema object, got list"),
    ({"choice": []}, r"^choice: must be a non-empty list of strings"),
    ({"choice": "yes"}, r"^choice: must be a non-empty list of strings"),
    ({"choice": ["a", 1]}, r"^choice: must be a non-empty list of strings"),
    ({"regex": 5}, r"^regex: must be a string"),
    ({"grammar": "  "}, r"^grammar: must be a non-empty string"),
    ({"json_object": "yes"}, r"^json_object: must be a boolean"),
    ({"regex": "a", "disable_any_whitespace": 1}, r"^disable_any_whitespace: must be a boolean"),
])
def test_bad_params_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SOP(**kwargs)


SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}}


@pytest.mark.parametrize("body, expected", [
    ({"model": "m"}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": None}, None),
    ({"response_format": {"type": "json_object"}}, SOP(json_object=True)),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}}, SOP(json=SCHEMA)),
    ({"structured_outputs": {"json": SCHEMA}}, SOP(json=SCHEMA)),
    ({"structured_outputs": {"regex": "[ab]+", "disable_any_whitespace": True}},
     SOP(regex="[ab]+", disable_any_whitespace=True)),
    ({"structured_outputs": {"choice": ["x", "y"]}}, SOP(choice=("x", "y"))),
    ({"structured_outputs": {"grammar": "start: /a/"}}, SOP(grammar="start: /a/")),
    ({"structured_outputs": {"json_object": True}}, SOP(json_object=True)),
    ({"guided_json": SCHEMA}, SOP(json=SCHEMA)),
    ({"guided_json": json.dumps(SCHEMA)}, SOP(json=json.dumps(SCHEMA))),
    ({"guided_regex": "a+"}, SOP(regex="a+")),
    ({"guided_choice": ["p", "q"]}, SOP(choice=("p", "q"))),
    ({"guided_grammar": "start: /b/"}, SOP(grammar="start: /b/")),
    ({"response_format": {"type": "text"}, "guided_regex": "a"}, SOP(regex="a")),
])
def test_from_openai_request(body, expected):
    assert params.from_openai_request(body) == expected


@pytest.mark.parametrize("body, message", [
    ({"response_format": "json"}, r"^response_format: must be an object"),
    ({"response_format": {"type": "xml"}},
     r"^response_format.type: must be 'text', 'json_object' or 'json_schema', got 'xml'"),
    ({"response_format": {"type": "json_schema"}}, r"^response_format.json_schema: must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     r"^response_format.json_schema.name: must be a non-empty string"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}},
     r"^response_format.json_schema.schema: must be a JSON schema object, got None"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": "{}"}}},
     r"^response_format.json_schema.schema: must be a JSON schema object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": "yes"}}},
     r"^response_format.json_schema.strict: must be a boolean"),
    ({"structured_outputs": "json"}, r"^structured_outputs: must be an object"),
    ({"structured_outputs": {"json": 3}}, r"^structured_outputs.json: must be a JSON schema object"),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}},
     r"^structured_outputs.json, structured_outputs.regex: exactly one"),
    ({"structured_outputs": {"regex": "a", "backend": "xgrammar"}}, r"^structured_outputs.backend: not supported"),
    ({"structured_outputs": {}}, r"^structured_outputs.json, .*structured_outputs.json_object: exactly one"),
    ({"guided_json": "{oops"}, r"^guided_json: not valid JSON"),
    ({"guided_choice": []}, r"^guided_choice: must be a non-empty list of strings"),
    ({"guided_regex": ["a"]}, r"^guided_regex: must be a string"),
    ({"guided_json": SCHEMA, "guided_regex": "a"}, r"^guided_json, guided_regex: exactly one"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"},
     r"^response_format, guided_regex: a request may ask for structured output one way only"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, r"^structured_outputs, guided_choice: "),
])
def test_from_openai_request_rejects_bad_forms(body, message):
    with pytest.raises(ValueError, match=message):
        params.from_openai_request(body)


# --- grammar validation and the compiler ---------------------------------------------------------

@pytest.mark.parametrize("spec, message", [
    (SOP(json={"type": "bogus"}), r"^json: invalid JSON schema: .*bogus"),
    (SOP(json={"properties": {"a": {"$ref": "#/$defs/missing"}}}), r"^json: invalid JSON schema: .*missing"),
    (SOP(regex="a(b"), r"^regex: invalid regex: .*unclosed group"),
    (SOP(grammar="start: undefined_rule"), r"^grammar: invalid grammar: .*undefined_rule"),
    (SOP(grammar="root ::= ("), r"^grammar: invalid grammar: .*GBNF"),
])
def test_validate_and_compile_name_the_bad_grammar(spec, message, ll, compiler):
    message = "(?s)" + message  # llguidance's reasons span lines
    with pytest.raises(ValueError, match=message):
        grammar.validate(spec, ll)
    with pytest.raises(ValueError, match=message):
        compiler.submit(spec).result()


def test_choice_lark_escapes_quotes_backslashes_newlines_and_unicode(tok, compiler):
    choices = ['say "hi"', "back\\slash", "two\nlines", "😀 ok", "plain"]
    compiled = compiler.compile(SOP(choice=choices))
    for choice in choices:
        m = matcher.Matcher(compiled)
        assert m.accept(ids(tok, choice)) and m.is_finished, choice
    m = matcher.Matcher(compiled)
    assert not m.accept(ids(tok, "say hi"))


def test_cache_compiles_a_repeated_schema_once(ll):
    with grammar.GrammarCompiler(ll) as c:
        first = c.submit(SOP(json=PERSON))
        again = c.submit(SOP(json=json.dumps(PERSON)))  # the same schema as text: the same key
        assert again is first
        other = c.submit(SOP(json=PERSON, disable_any_whitespace=True))  # another grammar
        c.submit(SOP(json_object=True))
        c.submit(SOP(json={"type": "object"}))  # json_object's schema: a hit
        assert first.result() is not other.result()
        stats = c.stats()
        assert (stats["num_compiles"], stats["num_cache_hits"], stats["cache_size"]) == (3, 2, 3)
        assert stats["compile_seconds"] >= first.result().compile_seconds + other.result().compile_seconds > 0


def test_cache_evicts_least_recently_used(ll):
    with grammar.GrammarCompiler(ll, max_cache_size=2) as c:
        for spec in (SOP(regex="a"), SOP(regex="b"), SOP(regex="a"), SOP(regex="c"), SOP(regex="a"), SOP(regex="b")):
            c.submit(spec).result()
        # a, b, a (hit), c evicts b, a (hit), b again (compile)
        assert (c.num_compiles, c.num_cache_hits) == (4, 2)


def test_compile_runs_on_the_worker_thread_not_the_callers(ll, monkeypatch):
    seen, release = [], threading.Event()
    original = grammar.to_llguidance

    def recording(spec):
        seen.append((threading.get_ident(), threading.current_thread().name))
        release.wait(timeout=30)
        return original(spec)

    monkeypatch.setattr(grammar, "to_llguidance", recording)
    with grammar.GrammarCompiler(ll) as c:
        future = c.submit(SOP(regex="[0-9]+"))
        assert not future.done()  # submit returned while the compile was still blocked
        release.set()
        compiled = future.result(timeout=30)
    assert len(seen) == 1
    assert seen[0][0] != threading.get_ident() and seen[0][1].startswith("grammar-compile")
    assert compiled.spec == ("regex", "[0-9]+")


# --- matchers walked through real tokens ---------------------------------------------------------

def walk(tok, compiled, text):
    """Accept `text`'s tokens one at a time, checking each was allowed by the mask before it."""
    m = matcher.Matcher(compiled)
    for token in ids(tok, text):
        assert bit(mask_of(m), token), (text, token)
        assert m.accept([token]), (text, token, m.error)
    return m


@pytest.mark.parametrize("spec, text, forbidden_first", [
    (SOP(json=PERSON), PERSON_TEXT, "[ "),
    (SOP(json_object=True), '{"x": [1, 2], "y": null}', "["),
    (SOP(choice=["yes", "no", "maybe not"]), "maybe not", "ok"),
    (SOP(grammar='start: "(" num ("," num)* ")"\nnum: /[0-9]+/'), "(1,22,333)", "1"),
    (SOP(grammar='root ::= "v" [0-9]+ "."'), "v12.", "12"),
    (SOP(regex=r"(ab|cd)-[a-c]{3}!"), "cd-abc!", "ad"),
])
def test_each_kind_constrains_a_real_token_walk(tok, compiler, spec, text, forbidden_first):
    compiled = compiler.compile(spec)
    first = mask_of(matcher.Matcher(compiled))
    assert not bit(first, ids(tok, forbidden_first)[0])
    m = walk(tok, compiled, text)
    assert m.is_finished and m.is_accepting and not m.is_error
    assert allowed(mask_of(m), m.vocab_size) == END  # finished: only an end token may follow
    assert m.accept([EOS]) and m.is_finished


def test_regex_that_may_grow_is_accepting_but_not_finished(tok, compiler):
    m = walk(tok, compiler.compile(SOP(regex="[0-9]+-[a-z]+")), "123-abc")
    assert m.is_accepting and not m.is_finished
    row = mask_of(m)
    assert bit(row, EOS) and bit(row, ids(tok, "x")[0]) and not bit(row, ids(tok, "1")[0])
    assert m.accept([EOS]) and m.is_finished


def test_disable_any_whitespace(tok, compiler):
    space = ids(tok, " ")[0]
    compact = walk(tok, compiler.compile(SOP(json=SCHEMA, disable_any_whitespace=True)), '{"x":1}')
    assert compact.is_finished
    m = walk(tok, compiler.compile(SOP(json=SCHEMA, disable_any_whitespace=True)), '{"x":')
    assert not bit(mask_of(m), space)
    m = walk(tok, compiler.compile(SOP(json=SCHEMA)), '{"x":')
    assert bit(mask_of(m), space)


def test_a_forbidden_token_is_refused_and_leaves_only_eos(tok, compiler):
    m = matcher.Matcher(compiler.compile(SOP(json=PERSON)))
    assert m.accept(ids(tok, '{"name": "A"'))
    n = m.num_tokens
    assert not m.accept(ids(tok, "}"))  # "age" and "address" are required
    assert m.is_error and not m.is_finished and "}" in m.error
    assert allowed(mask_of(m), m.vocab_size) == END
    assert m.num_tokens == n


def test_rebuild_after_preemption_matches_the_original(tok, compiler):
    compiled = compiler.compile(SOP(json=PERSON))
    tokens = ids(tok, PERSON_TEXT)
    for k in (0, 1, 7, len(tokens) - 1):
        original = matcher.Matcher(compiled)
        assert original.accept(tokens[:k])
        rebuilt = original.rebuild(tokens[:k])
        assert rebuilt is not original and rebuilt.num_tokens == k
        np.testing.assert_array_equal(mask_of(rebuilt), mask_of(original))
        assert original.accept(tokens[k:]) and rebuilt.accept(tokens[k:])
        assert rebuilt.is_finished and original.is_finished


def test_rollback(tok, compiler):
    compiled = compiler.compile(SOP(json=PERSON))
    tokens = ids(tok, PERSON_TEXT)
    m = matcher.Matcher(compiled)
    assert m.accept(tokens[:5])
    assert m.validate_tokens(tokens[5:9] + ids(tok, "[")) == 4  # drafts: four of five fit
    assert m.num_tokens == 5  # validate_tokens does not advance
    m.rollback(3)
    ref = matcher.Matcher(compiled)
    ref.accept(tokens[:2])
    np.testing.assert_array_equal(mask_of(m), mask_of(ref))
    # EOS after the grammar stopped: rolled back alone, the grammar stays finished.
    assert m.accept(tokens[2:] + [EOS, EOS]) and m.num_tokens == len(tokens) + 2
    m.rollback(2)
    assert m.is_finished and m.num_tokens == len(tokens)
    m.rollback(1)
    assert not m.is_finished and bit(mask_of(m), tokens[-1])
    with pytest.raises(ValueError, match="rollback of 99 tokens: the matcher holds"):
        m.rollback(99)


COMPACT_PERSON = '{"name":"Ada","age":36,"address":{"city":"Paris","zip":"75001"},"tags":["b"]}'


def test_forced_tokens_are_the_drafts_a_grammar_makes(tok, compiler):
    compiled = compiler.compile(SOP(json=PERSON, disable_any_whitespace=True))
    tokens = ids(tok, COMPACT_PERSON)
    m = matcher.Matcher(compiled)
    fresh = mask_of(m)
    assert tok.decode(m.forced_tokens(8)) == '{"name'  # the object's first required key
    assert tok.decode(m.forced_tokens(1)) == '{"'
    np.testing.assert_array_equal(mask_of(m), fresh)  # proposing does not advance
    assert m.accept(tokens[:11]) and tok.decode(tokens[:11]).endswith('"age":36,"')
    assert tok.decode(m.forced_tokens(8)) == 'address":{"city'
    assert m.accept(tokens[11:15]) and tok.decode(tokens[:15]).endswith('{"city')
    assert m.forced_tokens(8) == []  # a key's end may be tokenized several ways
    # The token that completes the grammar is never a draft: the request ends at it, with no
    # token sampled after it (EOS, where the grammar has stopped).
    whole = matcher.Matcher(compiler.compile(SOP(regex="abc-def")))  # every token forced
    assert tok.decode(whole.forced_tokens(8)) == "abc-"  # not "def", which completes it
    assert whole.accept(ids(tok, "abc-def")) and whole.is_finished and whole.forced_tokens(8) == []


def test_draft_bitmasks_are_the_masks_after_each_draft(tok, compiler):
    """A verification's masks, in one parallel fill: position j of a row is its grammar's mask after
    the row's first j drafts, as a matcher walked token by token has it; rows without drafts get
    position 0's alone, rows without a grammar allow everything."""
    compiled = compiler.compile(SOP(json=PERSON, disable_any_whitespace=True))
    tokens = ids(tok, COMPACT_PERSON)
    a, b = matcher.Matcher(compiled), matcher.Matcher(compiled)
    assert a.accept(tokens[:15]) and b.accept(tokens[:11])
    drafts = [ids(tok, '":"Paris"'), b.forced_tokens(8), []]  # a lookup's tokens, forced ones, none
    assert a.validate_tokens(drafts[0]) == len(drafts[0]) > 2 and len(drafts[1]) > 2
    width = 1 + max(map(len, drafts))
    masks = tokenizer.allocate_bitmask(4 * width, a.vocab_size).reshape(4, width, -1)
    masks[2, 1:] = 7  # past a row's drafts: left as they were
    matcher.fill_bitmasks([a, b, matcher.Matcher(compiled), None], masks, drafts=drafts + [[]])
    for row, (m, prefix) in enumerate([(a, tokens[:15]), (b, tokens[:11]), (None, [])]):
        walk = matcher.Matcher(compiled)
        assert walk.accept(prefix)
        for j in range(len(drafts[row]) + 1):
            np.testing.assert_array_equal(masks[row, j], mask_of(walk), err_msg=f"row {row}, position {j}")
            assert j == len(drafts[row]) or walk.accept([drafts[row][j]])
    assert np.all(masks[2, 1:] == 7) and np.all(masks[3] == -1)
    assert a.num_tokens == 15 and b.num_tokens == 11  # left where they were
    with pytest.raises(ValueError, match=r"drafts \[.*\] of row 0 do not fit its grammar past the first 0"):
        matcher.fill_bitmasks([a], masks[:1], drafts=[ids(tok, "}")])
    assert not a.is_error


def test_fill_bitmasks_matches_row_by_row(tok, compiler):
    specs = [SOP(json=PERSON), SOP(regex="[0-9]+-[a-z]+"), SOP(choice=["yes", "no"]), SOP(json_object=True)]
    texts = [PERSON_TEXT, "123-abc", "yes", '{"k": [true]}']
    rng = np.random.default_rng(0)
    matchers = []
    for row in range(32):
        if row % 5 == 4:
            matchers.append(None)
            continue
        which = row % 4
        m = matcher.Matcher(compiler.compile(specs[which]))
        tokens = ids(tok, texts[which])
        assert m.accept(tokens[:rng.integers(0, len(tokens) + 1)])
        matchers.append(m)
    words = tokenizer.bitmask_words(TOKENIZER_VOCAB)
    batch = np.zeros((32, words), np.int32)
    matcher.fill_bitmasks(matchers, batch)
    for row, m in enumerate(matchers):
        expected = np.full(words, -1, np.int32) if m is None else mask_of(m)
        np.testing.assert_array_equal(batch[row], expected)
    with pytest.raises(ValueError, match="bitmask must be a writeable C-contiguous int32"):
        matcher.fill_bitmasks(matchers, np.zeros((32, words), np.int64))


def test_tool_choice_required_schema_constrains_generation(tok, compiler):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
             {"type": "function", "function": {"name": "ping"}}]
    compiled = compiler.compile(tool_grammar.tool_choice_structured_outputs(tools, "required"))
    text = '[{"name":"get_weather","parameters":{"city":"Oslo"}},{"name":"ping","parameters":{}}]'
    assert walk(tok, compiled, text).is_finished
    assert not matcher.Matcher(compiled).accept(ids(tok, '[{"name":"get_time"'))
    # compact JSON: no whitespace between tokens (tool_grammar: a small model would pad with it)
    assert not matcher.Matcher(compiled).accept(ids(tok, '[{"name": "get_weather"'))


# --- vocabulary sizes and the device-side mask ---------------------------------------------------

def test_model_vocab_past_the_tokenizer_is_masked(tok):
    vocab = TOKENIZER_VOCAB + 100  # a model whose embedding is padded past its tokenizer
    big = tokenizer.ll_tokenizer(tok, vocab_size=vocab)
    assert big.vocab_size == vocab and big.eos_tokens == [EOS, 0]
    m = matcher.Matcher(grammar.compile_grammar(SOP(regex="(.|\n)*"), big))
    row = mask_of(m)
    assert row.shape == (tokenizer.bitmask_words(vocab),) == (1540,)
    ok = allowed(row, 1540 * 32)
    assert ok[-1] < TOKENIZER_VOCAB and len(ok) > 40000  # ordinary tokens allowed, no id past 49151
    logits = np.zeros((1, vocab), np.float32)
    masked = np.asarray(matcher.apply_token_bitmask(logits, row[None]))
    assert np.all(masked[0, TOKENIZER_VOCAB:] == -np.inf) and masked[0, ids(tok, "a")[0]] == 0


def test_padding_and_truncation_do_not_reach_llguidance(tok, ll):
    padded = tokenizers.Tokenizer.from_str(tok.tokenizer.to_str())
    padded.enable_padding(length=64)
    padded.enable_truncation(3)
    text = "a text of more than three tokens"
    assert ll.tokenize_str(text) == tokenizer.ll_tokenizer(padded).tokenize_str(text) == ids(tok, text)
    assert len(ids(tok, text)) > 3


def test_apply_token_bitmask_matches_the_numpy_reference():
    rng = np.random.default_rng(0)
    rows, vocab = 6, 100  # 4 words; the last 28 bits of each row's last word name no token
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    bitmask = rng.integers(-2**31, 2**31, size=(rows, 4), dtype=np.int64).astype(np.int32)
    bitmask[2] = -1  # a request without a grammar
    bitmask[3] = 0
    bitmask[4] = [1 << 5, 0, 0, 1 << 3]  # tokens 5 and 99 only
    out = np.asarray(matcher.apply_token_bitmask(logits, bitmask))
    ref = matcher.apply_token_bitmask_reference(logits, bitmask)
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(out[2], logits[2])
    assert np.all(out[3] == -np.inf)
    assert [t for t in range(vocab) if out[4, t] != -np.inf] == [5, 99]
    for r in range(rows):  # the reference against a bit-by-bit reading
        keep = allowed(bitmask[r], vocab)
        assert [t for t in range(vocab) if ref[r, t] != -np.inf] == keep
        np.testing.assert_array_equal(ref[r, keep], logits[r, keep])


def test_apply_token_bitmask_rejects_a_narrow_bitmask():
    with pytest.raises(ValueError, match="does not cover logits"):
        matcher.apply_token_bitmask(np.zeros((2, 65), np.float32), np.zeros((2, 2), np.int32))
