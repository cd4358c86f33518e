"""Greedy decoding speed of a real GGUF model, side by side in one run: the paged engine (f32, the
`LLM(gguf)` defaults a user gets), Hugging Face transformers' `generate` on the same dequantized
weights (f32), and llama.cpp on the file's own quantized weights, at each batch size.

    python scripts/benchmark_gguf.py                      # SmolLM2-135M-Instruct, batch 1 and 8
    python scripts/benchmark_gguf.py --model FILE.gguf --batch-sizes 1 8 32 --output-len 64

The default model is fetched once by scripts/fetch_model.py. Each batch is B chat-templated
questions, all submitted at once, greedy, ignore_eos, --output-len new tokens each. The engine's run
time leaves out jit compile time (timed apart); transformers and llama.cpp get one untimed warm-up
call first. torch and llama.cpp run --threads threads; XLA uses every core. llama.cpp needs
`pip install llama-cpp-python` (an optional dependency: a CPU build from source, several minutes);
its Python binding decodes one sequence at a time, so its batch B is the B prompts one after another.
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
           ("same_tokens", "same tokens", ".0%")]


def engine_row(model, tokenizer, prompts, output_len: int) -> dict:
    llm = LLM(model, tokenizer=tokenizer, log_stats=False)  # sized as a user gets it, not to the batch
    params = [SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)] * len(prompts)
    row = benchlib.run_engine(llm, prompts, params)
    c = llm.engine.config
    return dict(name=f"paged-jax ({c.num_blocks} blocks, {c.max_num_seqs} seqs)", run_s=row["run_s"], compile_s=row["compile_s"],
                answers=[o.outputs[0].token_ids for o in row["outputs"]])


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
        if cpp is not None:
            group.append(llama_cpp_row(cpp, prompts, args.output_len, args.threads))
        if hf is not None:
            group.append(hf_row(hf, prompts, args.output_len))
        reference = group[0]["answers"]
        for row in group:
            answers = row.pop("answers")
            row.update(batch=batch, output_tok_s=batch * args.output_len / row["run_s"],
                       same_tokens=float(np.mean([a == b for a, b in zip(answers, reference)])))
        for row in group:
            row["ratio"] = row["output_tok_s"] / group[-1]["output_tok_s"] if hf is not None else None
        rows += group
    print(f"{Path(path).name}: {benchlib.num_params(model) / 1e6:.0f}M params, f32 after dequantizing (llama.cpp: "
          f"as stored); greedy, {args.output_len} new tokens per request, chat-templated questions; ratios "
          f"against HF generate; same tokens: share of answers equal to the engine's")
    benchlib.print_table(rows, COLUMNS)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(model=str(path), output_len=args.output_len, rows=rows),
                                              indent=2) + "\n")


if __name__ == "__main__":
    main()
