"""What structured output costs. On the host: building the LLTokenizer, compiling a grammar (cold),
a cache hit (the Future, the result and a fresh per-request Matcher), the bitmask fill of a batch
(llguidance's thread pool against a row-by-row loop), and apply_token_bitmask on the device. In the
engine (--engine): output tok/s at each --concurrency with every request constrained by a JSON
schema against the same prompts unconstrained, at the same lengths (the schema's document is longer
than --max-tokens, so every request runs to it; the unconstrained ones ignore EOS), the ratio of
the two, and time to first token with a new schema against a cached one. --speculation: greedy
requests that extract a JSON object from a text record (through the chat template), with n-gram
speculation (a constrained row drafts the tokens its grammar forces) against without, at each
--concurrency: tok/s, the ratio, the drafts accepted; the same tokens on both sides.

    python scripts/benchmark_structured_output.py                # SmolLM2-135M-Instruct's tokenizer
    python scripts/benchmark_structured_output.py --model DIR    # a checkpoint's tokenizer.json
    python scripts/benchmark_structured_output.py --engine [--concurrency 8 32 --max-tokens 64]
    python scripts/benchmark_structured_output.py --speculation [--concurrency 1 8]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402

from models.tokenizer import load_tokenizer  # noqa: E402
from paged_jax import LLM, SamplingParams  # noqa: E402
from paged_jax.structured_output import grammar, matcher, tokenizer  # noqa: E402
from paged_jax.structured_output.params import StructuredOutputsParams  # noqa: E402

# A moderate nested schema: an order with a customer, an address, line items and enums.
ORDER = {"type": "object", "properties": {
    "id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
    "customer": {"type": "object", "properties": {
        "name": {"type": "string"}, "email": {"type": "string", "format": "email"},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "country": {"enum": ["FR", "DE", "US"]}},
            "required": ["street", "city", "zip", "country"]}},
        "required": ["name", "address"]},
    "items": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
        "price": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["sku", "qty", "price"]}},
    "status": {"enum": ["new", "paid", "shipped"]}, "notes": {"type": ["string", "null"]}},
    "required": ["id", "customer", "items", "status"]}
ORDER_TEXT = ('{"id": "ORD-004217", "customer": {"name": "Ada", "email": "ada@example.com", "address": '
              '{"street": "1 Rue X", "city": "Paris", "zip": "75001", "country": "FR"}}, "items": '
              '[{"sku": "A-1", "qty": 2, "price": 9.5, "tags": ["x"]}], "status": "paid", "notes": null}')


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint dir or .gguf (default: SmolLM2-135M-Instruct, fetched)")
    ap.add_argument("--rows", type=int, default=32, help="batch rows for the bitmask fill")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--engine", action="store_true", help="also the engine's throughput and TTFT")
    ap.add_argument("--speculation", action="store_true", help="only: constrained rows with n-gram speculation")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats-engine", type=int, default=3, help="timed runs of each engine configuration")
    args = ap.parse_args()
    if args.model is None:
        from scripts import fetch_model
        args.model = fetch_model.fetch("smollm2-135m-instruct")
    if args.speculation:
        speculation(args)
        return
    host(args)
    if args.engine:
        engine(args)


# A document longer than any --max-tokens: every constrained request runs to max_tokens.
LONG = {"type": "array", "minItems": 400, "maxItems": 400,
        "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                                   "ok": {"type": "boolean"}},
                  "required": ["id", "ok"], "additionalProperties": False}}


def engine(args):
    """Throughput with every request constrained against none, at each concurrency, and TTFT."""
    llm = LLM(args.model, max_num_seqs=max(args.concurrency), max_model_len=128 + args.max_tokens,
              log_stats=False)
    tok = llm.get_tokenizer()
    spec = StructuredOutputsParams(json=LONG, disable_any_whitespace=True)
    print(f"\nengine, {args.model}, {args.max_tokens} output tokens per request:")
    print(f"{'concurrency':>11} {'unconstrained tok/s':>20} {'constrained tok/s':>18} {'ratio':>6}")
    for n in args.concurrency:
        prompts = [tok.encode(f"Record {i}: list the items as JSON.") for i in range(n)]
        both = [SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=not constrained,
                               structured_outputs=spec if constrained else None) for constrained in (False, True)]
        rates = [[], []]
        for params in both:
            llm.generate(prompts, params)  # compiles this batch's programs
        for _ in range(args.repeats_engine):  # alternated, the median of each: a shared machine drifts
            for side, params in enumerate(both):
                start = time.perf_counter()
                outs = llm.generate(prompts, params)
                seconds = time.perf_counter() - start
                tokens = [len(o.outputs[0].token_ids) for o in outs]
                assert tokens == [args.max_tokens] * n, tokens  # the same work on both sides
                rates[side].append(sum(tokens) / seconds)
        free, constrained = (statistics.median(r) for r in rates)
        print(f"{n:11} {free:20.1f} {constrained:18.1f} {constrained / free:6.2f}")
    prompt = tok.encode("Record: list the items as JSON.")

    def first_token(schema) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=1, structured_outputs=StructuredOutputsParams(json=schema))
        start = time.perf_counter()
        llm.generate([prompt], params)
        return time.perf_counter() - start

    first_token(ORDER)  # the one-request programs compile here, and ORDER is cached
    new = first_token({**ORDER, "title": f"t{time.perf_counter_ns()}"})  # a schema text never seen
    print(f"time to first token: new schema {ms(new)}, cached schema {ms(first_token(ORDER))}")
    stats = llm.engine.structured_outputs.stats()
    print(f"grammar compiles: {stats['num_compiles']}, {ms(stats['compile_seconds'] / max(stats['num_compiles'], 1))} "
          f"each on average (worker thread); cache hits: {stats['num_cache_hits']}")


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "email": {"type": "string", "maxLength": 40}, "role": {"enum": ["admin", "user", "guest"]},
    "city": {"type": "string", "maxLength": 24},
    "languages": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4}},
    "required": ["name", "age", "email", "role", "city", "languages"], "additionalProperties": False}
PEOPLE = [("Ada Lovelace", 36, "admin", "London", ["Python", "Rust"]),
          ("Alan Turing", 41, "user", "Manchester", ["C"]),
          ("Grace Hopper", 85, "guest", "Arlington", ["COBOL", "Fortran"]),
          ("Linus Torvalds", 54, "admin", "Portland", ["C"]),
          ("Barbara Liskov", 84, "user", "Boston", ["CLU", "Java"]),
          ("Dennis Ritchie", 70, "guest", "Berkeley", ["C", "B"]),
          ("Radia Perlman", 72, "user", "Seattle", ["Go"]),
          ("Guido van Rossum", 68, "admin", "Belmont", ["Python"])]


def speculation(args):
    """Constrained extraction with n-gram speculation against without, the same greedy tokens."""
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llms = [LLM(args.model, max_num_seqs=max(args.concurrency), max_model_len=256, log_stats=False,
                speculative_config=config) for config in (None, ngram)]
    tok = llms[0].get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=128,
                            structured_outputs=StructuredOutputsParams(json=PERSON, disable_any_whitespace=True))
    records = [f"{name}, {age}, works as {role} in {city}; email {name.split()[0].lower()}@example.org; "
               f"writes {' and '.join(langs)}." for name, age, role, city, langs in PEOPLE]
    print(f"\nJSON extraction, {args.model}, n-gram speculation (k = 4) against none, greedy:")
    print(f"{'concurrency':>11} {'plain tok/s':>12} {'n-gram tok/s':>13} {'ratio':>6} {'accepted':>9}")
    for n in args.concurrency:
        texts = ["Extract the person as JSON: " + records[i % len(records)] for i in range(n)]
        prompts = [tok.encode(text) if tok.chat_template is None else  # the embedded model has none
                   tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True) for text in texts]
        for _ in range(2):  # compiles this batch's programs; the speculator times its calls
            tokens = [[o.outputs[0].token_ids for o in llm.generate(prompts, params)] for llm in llms]
            assert tokens[0] == tokens[1], "speculation changed the greedy tokens"
        before = llms[1].stats()
        rates = [[], []]
        for _ in range(args.repeats_engine):  # alternated, the median of each: a shared machine drifts
            for side, llm in enumerate(llms):
                start = time.perf_counter()
                llm.generate(prompts, params)
                rates[side].append(sum(map(len, tokens[0])) / (time.perf_counter() - start))
        after = llms[1].stats()
        drafts, accepted = (after[k] - before[k] for k in ("spec_decode_num_draft_tokens",
                                                          "spec_decode_num_accepted_tokens"))
        plain, spec = (statistics.median(r) for r in rates)
        print(f"{n:11} {plain:12.1f} {spec:13.1f} {spec / plain:6.2f} {accepted:>4}/{drafts:<4}")
    print(f"output tokens per request: {statistics.mean(map(len, tokens[0])):.1f}; the first: "
          f"{tok.decode(tokens[0][0])}")


def host(args):
    tok = load_tokenizer(args.model)

    start = time.perf_counter()
    ll = tokenizer.ll_tokenizer(tok)
    print(f"LLTokenizer build ({ll.vocab_size} tokens): {ms(time.perf_counter() - start)}")

    with grammar.GrammarCompiler(ll) as compiler:
        compiled = compiler.compile(StructuredOutputsParams(json=ORDER))
        print(f"compile, nested JSON schema (cold, worker thread): {ms(compiled.compile_seconds)}")

        def hit():
            matcher.Matcher(compiler.submit(StructuredOutputsParams(json=ORDER)).result())
        print(f"cache hit + new Matcher: {ms(median_time(hit, args.repeats))} (median of {args.repeats})")

        # Rows at different points of the same document, as a batch of requests would be.
        tokens = tok.encode(ORDER_TEXT, add_special_tokens=False)
        rows = []
        for r in range(args.rows):
            m = matcher.Matcher(compiled)
            m.accept(tokens[:(r * len(tokens)) // args.rows])
            rows.append(m)
        bitmask = tokenizer.allocate_bitmask(args.rows, ll.vocab_size)
        matcher.fill_bitmasks(rows, bitmask)  # starts llguidance's thread pool
        par = median_time(lambda: matcher.fill_bitmasks(rows, bitmask), args.repeats)

        def serial():
            for i, m in enumerate(rows):
                m.fill_bitmask(bitmask[i])
        print(f"bitmask fill, {args.rows} rows: {ms(par)} (thread pool), "
              f"{ms(median_time(serial, args.repeats))} (row by row)")

    logits = jax.numpy.zeros((args.rows, ll.vocab_size), jax.numpy.float32)
    device_mask = jax.device_put(bitmask)
    matcher.apply_token_bitmask(logits, device_mask).block_until_ready()
    apply = median_time(lambda: matcher.apply_token_bitmask(logits, device_mask).block_until_ready(), args.repeats)
    print(f"apply_token_bitmask [{args.rows}, {ll.vocab_size}] on {jax.default_backend()}: {ms(apply)}")


if __name__ == "__main__":
    main()
