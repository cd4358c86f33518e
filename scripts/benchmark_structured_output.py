"""What structured output costs on the host: building the LLTokenizer, compiling a grammar (cold),
a cache hit (the Future, the result and a fresh per-request Matcher), the bitmask fill of a batch
(llguidance's thread pool against a row-by-row loop), and apply_token_bitmask on the device.

    python scripts/benchmark_structured_output.py                # SmolLM2-135M-Instruct's tokenizer
    python scripts/benchmark_structured_output.py --model DIR    # a checkpoint's tokenizer.json
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
    args = ap.parse_args()
    if args.model is None:
        from scripts import fetch_model
        args.model = fetch_model.fetch("smollm2-135m-instruct")
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
