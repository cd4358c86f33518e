"""Structured output through the engine (paged_jax/engine/structured_outputs.py): requests with
SamplingParams.structured_outputs beside unconstrained ones, on the embedded model and on
SmolLM2-135M-Instruct.

The greedy check is independent of the engine's masking: the same model scores the output
unconstrained (prompt_logprobs over the whole vocabulary), a fresh matcher walks the output, and each
token must be the model's most likely among the tokens the grammar allowed at that point."""
import json
import re

import jsonschema
import numpy as np
import pytest

from paged_jax import LLM, SamplingParams
from paged_jax.structured_output import StructuredOutputsParams as Spec
from paged_jax.structured_output import allocate_bitmask
from paged_jax.structured_output.grammar import compile_grammar
from paged_jax.structured_output.matcher import Matcher

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"},
                                           "tag": {"type": "string", "maxLength": 6}},
          "required": ["id", "tag"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm():
    return LLM("models/embedded", max_num_seqs=8, max_model_len=160, log_stats=False)


def allowed_ids(matcher, vocab):
    row = allocate_bitmask(1, matcher.vocab_size)[0]
    matcher.fill_bitmask(row)
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


@pytest.mark.parametrize("spec,check", [
    (Spec(regex=r"[0-9]{3}-[a-z]{2,5}"), lambda text: re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", text)),
    (Spec(choice=["alpha", "beta", "gamma delta"]), lambda text: text in ("alpha", "beta", "gamma delta")),
    (Spec(json=SCHEMA, disable_any_whitespace=True),
     lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
], ids=["regex", "choice", "json"])
def test_greedy_tokens_are_the_models_best_allowed_ones(llm, spec, check):
    engine = llm.engine
    prompt = engine.tokenizer.encode("def parse(x):\n    return ")
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=spec))
    completion = out[0].outputs[0]
    assert completion.finish_reason == "stop"  # the grammar completed before max_tokens
    assert check(completion.text)
    tokens = list(completion.token_ids)
    # Unconstrained scores of every output position: the prompt is prompt + output.
    vocab = engine.model_config.vocab_size
    scored = llm.generate([prompt + tokens], SamplingParams(max_tokens=1, prompt_logprobs=vocab))
    positions = scored[0].prompt_logprobs[len(prompt):]
    walk = Matcher(compile_grammar(spec, engine.structured_outputs._grammar_compiler().tokenizer))
    for i, (token, entries) in enumerate(zip(tokens, positions)):
        allowed = allowed_ids(walk, vocab)
        best = max(allowed, key=lambda t: entries[int(t)].logprob)
        assert token == best, f"token {i}: {token} where the model's best allowed is {best}"
        assert walk.accept([token])
    assert walk.is_finished


def test_logprobs_are_of_the_masked_distribution_and_prefix_hits_keep_the_grammar(llm):
    """vLLM reports a constrained row's logprobs after the grammar's mask: every token the choice
    list forbids at the first step has -inf, and the allowed ones carry the whole probability. The
    same request again reads its prompt from the prefix cache and gives the same output."""
    choices = ["alpha", "beta"]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, structured_outputs=Spec(choice=choices))
    prompt = "def parse(x):\n    \"\"\"Read a value from the text and say which kind it is.\"\"\"\n    return "
    first = llm.generate([prompt], params)[0]
    again = llm.generate([prompt], params)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].text == first.outputs[0].text in choices
    entries = first.outputs[0].logprobs[0]
    finite = {t: e for t, e in entries.items() if e.logprob > float("-inf")}
    assert finite and all(any(c.startswith(e.decoded_token) for c in choices) for e in finite.values())
    assert sum(np.exp(e.logprob) for e in finite.values()) <= 1 + 1e-5


def test_constrained_and_unconstrained_requests_share_a_batch(llm, monkeypatch):
    """The device gets the constrained rows' masks alone, and each row's index into them."""
    prompts = ["import os\n", "class A:\n", "x = "]
    free = SamplingParams(temperature=0.0, max_tokens=24)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, free)]
    choice = Spec(choice=["yes", "no"])
    sampled = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=8, structured_outputs=choice)
    runner, sent = llm.engine.model_runner, []
    bitmask = runner.bitmask
    monkeypatch.setattr(runner, "bitmask", lambda seqs, *a: sent.append((seqs, bitmask(seqs, *a))) or sent[-1][1])
    mixed = llm.generate(prompts + ["y = "], [free] * 3 + [sampled])
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone  # their rows were not masked
    mixed_calls = 0
    for seqs, got in sent:
        grammar = [s.request.params.structured_outputs is not None for s in seqs]
        if not any(grammar):
            assert got is None
            continue
        masks, mask_row = got
        count = sum(grammar)
        mixed_calls += count < len(seqs)
        assert masks.shape[0] == 1 << (count - 1).bit_length()  # 3 constrained rows: 4 masks, not 8
        assert mask_row.tolist() == list(np.cumsum(grammar) * grammar - 1) + [-1] * (mask_row.size - len(seqs))
    assert mixed_calls > 0
    assert [c.text in ("yes", "no") and c.finish_reason == "stop" for c in mixed[3].outputs] == [True] * 3
    before = llm.engine.structured_outputs.stats()
    again = llm.generate(["z = "], SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=choice))
    assert again[0].outputs[0].text in ("yes", "no")
    after = llm.engine.structured_outputs.stats()  # the same choice list: compiled once, then a hit
    assert (after["num_compiles"], after["num_cache_hits"]) == (before["num_compiles"],
                                                               before["num_cache_hits"] + 1)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_constrained_requests_resume_their_grammar(llm, mode):
    """A pool too small for the batch: constrained requests are preempted (their blocks dropped,
    or swapped to host memory) and resume with their matchers where they were; each output is
    the unpressed engine's, and parses."""
    spec = Spec(json={"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
                      "minItems": 12, "maxItems": 12}, disable_any_whitespace=True)
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=spec)
    prompts = [f"data_{i} = " for i in range(8)]
    want = [o.outputs[0].text for o in llm.generate(prompts, params)]
    tight = LLM("models/embedded", max_num_seqs=8, max_model_len=160, num_blocks=14, preemption_mode=mode,
                swap_space=0.01, log_stats=False)
    got = [o.outputs[0] for o in tight.generate(prompts, params)]
    assert tight.engine.stats()["num_preemptions"] > 0
    assert [o.text for o in got] == want
    assert all(len(json.loads(o.text)) == 12 and o.finish_reason == "stop" for o in got)


def test_ngram_speculation_drafts_what_the_grammar_forces_and_keeps_the_outputs(llm, untimed_speculation):
    """With n-gram speculation, constrained rows propose the tokens their grammar forces (a JSON
    key, the punctuation around it), each position verified under its own mask. On a pool small
    enough to preempt, greedy outputs are the plain engine's, constrained or not; seeded sampled
    rows parse; every draft of the constrained rows is accepted; every block comes back."""
    from tests.paged_jax.engine_testing import assert_pool_drained

    record = {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99}, "kind": {"enum": ["point", "line"]},
        "label": {"type": "string", "maxLength": 4},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 2}},
        "required": ["id", "kind", "label", "tags"], "additionalProperties": False}
    schema = Spec(json=record, disable_any_whitespace=True)
    greedy = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=s)
              for s in (schema, Spec(regex=r"(abc|abd)-[0-9]{2}-(red|green)"), Spec(choice=["alpha", "beta"]))]
    free = SamplingParams(temperature=0.0, max_tokens=40)
    sampled = SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=60, structured_outputs=schema)
    prompts = ["def parse(x):\n    return ", "key = ", "kind = ", "import os\n", "record = "]
    params = greedy + [free, sampled]
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    spec_llm = LLM("models/embedded", max_num_seqs=8, max_model_len=160, num_blocks=7, log_stats=False,
                   speculative_config=ngram)
    constrained = spec_llm.generate(prompts[:3], greedy)  # constrained rows alone: their drafts
    counts = spec_llm.stats()  # 23 of the 42 tokens: the keys, quotes, colons and commas
    assert counts["spec_decode_num_draft_tokens"] >= 20
    assert counts["spec_decode_num_accepted_tokens"] == counts["spec_decode_num_draft_tokens"]
    want = llm.generate(prompts, params)
    got = spec_llm.generate(prompts, params)
    assert spec_llm.stats()["num_preemptions"] > 0
    for w, g in zip(want[:4] + want[:3], got[:4] + constrained):
        assert [(c.token_ids, c.finish_reason) for c in g.outputs] == [(c.token_ids, c.finish_reason)
                                                                      for c in w.outputs]
    for c in got[4].outputs:
        assert c.finish_reason == "stop" and jsonschema.validate(json.loads(c.text), record) is None
    assert_pool_drained(spec_llm)


def test_a_bad_grammar_is_refused_before_anything_is_queued(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match=r"^regex: invalid regex"):
        engine.add_request("bad", "x = ", SamplingParams(structured_outputs=Spec(regex="(")))
    with pytest.raises(ValueError, match="json: invalid JSON schema"):
        engine.add_request("bad", "x = ", SamplingParams(structured_outputs=Spec(json={"type": "nonsense"})))
    assert not engine.has_unfinished_requests() and "bad" not in engine.requests
    assert engine.counters["prompt_tokens"] == 0 or engine.structured_outputs.num_pending == 0


def test_abort_while_its_grammar_compiles(llm, monkeypatch):
    import concurrent.futures

    engine = llm.engine
    never = concurrent.futures.Future()  # a compile that has not finished
    monkeypatch.setattr(engine.structured_outputs._grammar_compiler(), "submit", lambda spec: never)
    engine.add_request("slow", "x = ", SamplingParams(structured_outputs=Spec(regex="[0-9]+")))
    engine.add_request("free", "x = ", SamplingParams(temperature=0.0, max_tokens=4))
    outputs = engine.step()  # runs the free request; the constrained one waits for its grammar
    assert engine.structured_outputs.num_pending == 1 and "slow" in engine.requests
    engine.abort_request("slow")
    while engine.has_unfinished_requests():
        outputs += engine.step()
    finished = {o.request_id: o.outputs[0].finish_reason for o in outputs if o.finished}
    assert finished == {"slow": "abort", "free": "length"}
    assert engine.structured_outputs.num_pending == 0


def test_a_grammar_needs_a_tokenizer():
    from tests.models.model_testing import random_model, tiny_config

    llm = LLM(random_model(tiny_config()), max_num_seqs=2, max_model_len=64, log_stats=False)
    with pytest.raises(ValueError, match=r"structured_outputs \(regex\) needs the model's tokenizer"):
        llm.engine.add_request("r", [1, 2, 3], SamplingParams(structured_outputs=Spec(regex="a")))
    assert not llm.engine.has_unfinished_requests()


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                 "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "role", "tags", "address"], "additionalProperties": False}
NAMES = ["Ada", "Linus", "Grace", "Alan", "Barbara", "Dennis", "Ken", "Margaret", "Edsger", "Donald",
         "Frances", "John", "Radia", "Tim", "Guido", "Bjarne", "Anita", "Niklaus", "Leslie", "Sophie"]


def test_smollm2_follows_schemas_regexes_and_choices(smollm2_gguf, optimized_compiles):
    """A real instruction-tuned model, through its chat template: 20 requests for a nested JSON
    object (enums, an array, bounded integers, required fields) all validate, where the same
    prompts unconstrained do not; a date and an email regex and a choice list match; asked for
    France's capital as JSON, it says Paris."""
    llm = LLM(str(smollm2_gguf), max_num_seqs=32, max_model_len=384, log_stats=False)
    tokenizer = llm.get_tokenizer()

    def chat(text):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True)

    prompts = [chat(f"Describe the user {name} as a JSON object with name, age, role, tags and address.")
               for name in NAMES]
    constrained = SamplingParams(temperature=0.0, max_tokens=120,
                                 structured_outputs=Spec(json=PERSON, disable_any_whitespace=True))
    free = SamplingParams(temperature=0.0, max_tokens=120)
    date = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
    email = r"[a-z]{1,12}@[a-z]{1,12}\.(com|org)"
    feelings = ["positive", "negative", "neutral"]
    capital = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                "country": {"type": "string", "maxLength": 20}},
               "required": ["city", "country"], "additionalProperties": False}
    others = [(chat("When did the Apollo 11 mission land on the Moon?"), Spec(regex=date)),
              (chat("Write an email address for Ada Lovelace."), Spec(regex=email)),
              (chat("Is the review 'I loved this film' positive, negative or neutral?"), Spec(choice=feelings)),
              (chat("Name the capital of France as JSON with keys city and country."),
               Spec(json=capital, disable_any_whitespace=True))]
    outs = llm.generate(prompts + prompts + [p for p, _ in others],
                        [constrained] * 20 + [free] * 20 + [
                            SamplingParams(temperature=0.0, max_tokens=32, structured_outputs=spec)
                            for _, spec in others])
    texts = [o.outputs[0].text for o in outs]
    for o, text in zip(outs[:20], texts[:20]):
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(text), PERSON)

    def valid(text):
        try:
            jsonschema.validate(json.loads(text), PERSON)
            return True
        except (ValueError, jsonschema.ValidationError):  # not JSON, or not the schema's
            return False

    assert sum(valid(text) for text in texts[20:40]) < 20  # the constraint did the work
    assert re.fullmatch(date, texts[40]) and re.fullmatch(email, texts[41]) and texts[42] in feelings
    assert json.loads(texts[43])["city"] == "Paris"


def test_an_unconstrained_workload_never_loads_llguidance():
    import subprocess
    import sys

    code = ("import sys; from paged_jax import LLM, SamplingParams; "
            "LLM('models/embedded', log_stats=False).generate(['x = '], SamplingParams(max_tokens=4)); "
            "print('llguidance' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"
