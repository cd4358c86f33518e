"""Greedy decoding speed of a real GGUF model, side by side in one run: the paged engine (f32, the
`LLM(gguf)` defaults a user gets; and with `quantization="int8"`, its matmul weights as int8),
Hugging Face transformers' `generate` on the same dequantized weights (f32), and llama.cpp on the
file's own quantized weights, at each batch size.

    python scripts/benchmark_gguf.py                      # SmolLM2-135M-Instruct, batch 1 and 8
    python scripts/benchmark_gguf.py --model FILE.gguf --batch-sizes 1 8 32 --output-len 64

The default model is fetched once by scripts/fetch_model.py. Each batch is B chat-templated
questions, all submitted at once, greedy, ignore_eos, --output-len new tokens each. The engine's run
time leaves out jit compile time (timed apart); transformers and llama.cpp get one untimed warm-up
call first. torch and llama.cpp run --threads threads; XLA uses every core. llama.cpp needs
`pip install llama-cpp-python` (an optional dependency: a CPU build from source, several minutes);
its Python binding decodes one sequence at a time, so its batch B is the B prompts one after another.
Each answer is compared with the f32 engine's (equal, and the tokens before they first differ), and
each engine row scores a fixed text (perplexity through prompt_logprobs): what int8 weights cost.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from models.gguf import load_gguf  # noqa: E402
from paged_jax import LLM, SamplingParams  # noqa: E402
from scripts import baselines, benchlib, fetch_model  # noqa: E402

QUESTIONS = ("What is the capital of France?", "Why is the sky blue?", "Write a haiku about the sea.",
             "How do I reverse a list in Python?", "What is photosynthesis?", "Name three prime numbers.",
             "What causes the seasons on Earth?", "Explain what a hash table is.")
COLUMNS = [("name", "method", "s"), ("batch", "batch", "d"), ("output_tok_s", "output tok/s", ".1f"),
           ("ratio", "x HF", ".2f"), ("run_s", "run s", ".2f"), ("compile_s", "compile s", ".1f"),
           ("same_tokens", "same tokens", ".0%"), ("common_prefix", "common prefix", ".1f"),
           ("perplexity", "perplexity", ".3f")]
# Scored by the engine (prompt_logprobs) with each weight format: what int8 weights cost in quality.
PERPLEXITY_TEXT = (
    "The quick brown fox jumps over the lazy dog. The dog did not move, because it was asleep in the warm "
    "afternoon sun, and the fox ran on into the forest to look for its family.\n\ndef total_price(items, "
    "tax_rate):\n    subtotal = 0\n    for item in items:\n        subtotal += item.price * item.quantity\n"
    "    return subtotal * (1 + tax_rate)\n\nPhotosynthesis is the process by which green plants use "
    "sunlight, water and carbon dioxide to make glucose and release oxygen.")


def perplexity(llm) -> float:
    """exp of the mean negative log-likelihood of PERPLEXITY_TEXT's tokens after the first."""
    out, = llm.generate(PERPLEXITY_TEXT, SamplingParams(max_tokens=1, prompt_logprobs=0))
    ids = out.prompt_token_ids
    return float(np.exp(-np.mean([entry[t].logprob for t, entry in zip(ids[1:], out.prompt_logprobs[1:])])))


def engine_row(model, tokenizer, prompts, output_len: int, quantization: str | None = None) -> dict:
    llm = LLM(model, tokenizer=tokenizer, log_stats=False, quantization=quantization)  # sized as a user gets it
    params = [SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)] * len(prompts)
    row = benchlib.run_engine(llm, prompts, params)
    c = llm.engine.config
    weights = f", {quantization} weights" if quantization else ""
    return dict(name=f"paged-jax ({c.num_blocks} blocks, {c.max_num_seqs} seqs{weights})", run_s=row["run_s"],
                compile_s=row["compile_s"], answers=[o.outputs[0].token_ids for o in row["outputs"]],
                perplexity=perplexity(llm))


def common_prefix(a, b) -> int:
    """Tokens two answers share before they first differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def hf_row(hf, prompts, output_len: int) -> dict:
    baselines.hf_generate(hf, prompts[:1], [2], 1)  # warm-up: torch's first call allocates and picks kernels
    start = benchlib.now()
    answers = baselines.hf_generate(hf, prompts, [output_len] * len(prompts), len(prompts))
    return dict(name=f"HF generate (torch), static batch {len(prompts)}", run_s=benchlib.now() - start,
                compile_s=None, answers=answers)


def llama_cpp_row(llm, prompts, output_len: int, threads: int) -> dict:
    baselines.llama_cpp_generate(llm, prompts[:1], 2)  # warm-up
    start = benchlib.now()
    answers = baselines.llama_cpp_generate(llm, prompts, output_len)
    return dict(name=f"llama.cpp (GGUF as stored, {threads} threads, one sequence at a time)",
                run_s=benchlib.now() - start, compile_s=None, answers=answers)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a GGUF file (default: smollm2-135m-instruct from scripts/fetch_model.py)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--output-len", type=int, default=128, help="new tokens per request")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch's and llama.cpp's threads")
    ap.add_argument("--no-hf", action="store_true", help="skip Hugging Face generate")
    ap.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp")
    ap.add_argument("--no-int8", action="store_true", help="skip the engine with int8 weights (quantization='int8')")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    path = args.model or fetch_model.fetch("smollm2-135m-instruct")
    model, tokenizer = load_gguf(path)
    if tokenizer is None or tokenizer.chat_template is None:
        ap.error(f"--model {path}: the benchmark's prompts need the file's tokenizer and chat template")
    hf = baselines.hf_llama(model, args.threads) if not args.no_hf and baselines.hf_available() else None
    cpp = None
    if not args.no_llama_cpp and baselines.llama_cpp_available():
        cpp = baselines.llama_cpp_model(path, args.threads, n_ctx=2048)
    rows = []
    for batch in args.batch_sizes:
        questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(batch)]
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True) for q in questions]
        group = [engine_row(model, tokenizer, prompts, args.output_len)]
        if not args.no_int8:
            group.append(engine_row(model, tokenizer, prompts, args.output_len, "int8"))
        if cpp is not None:
            group.append(llama_cpp_row(cpp, prompts, args.output_len, args.threads))
        if hf is not None:
            group.append(hf_row(hf, prompts, args.output_len))
        reference = group[0]["answers"]
        for row in group:
            answers = row.pop("answers")
            row.update(batch=batch, output_tok_s=batch * args.output_len / row["run_s"],
                       same_tokens=float(np.mean([a == b for a, b in zip(answers, reference)])),
                       common_prefix=float(np.mean([common_prefix(a, b) for a, b in zip(answers, reference)])))
        for row in group:
            row["ratio"] = row["output_tok_s"] / group[-1]["output_tok_s"] if hf is not None else None
        rows += group
    print(f"{Path(path).name}: {benchlib.num_params(model) / 1e6:.0f}M params, f32 after dequantizing (llama.cpp: "
          f"as stored); greedy, {args.output_len} new tokens per request, chat-templated questions; ratios "
          f"against HF generate; same tokens: share of answers equal to the f32 engine's; common prefix: "
          f"their mean tokens before the first difference; perplexity: of a fixed text, scored by the engine")
    benchlib.print_table(rows, COLUMNS)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(model=str(path), output_len=args.output_len, rows=rows),
                                              indent=2) + "\n")


if __name__ == "__main__":
    main()
