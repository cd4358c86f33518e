"""Generate text with paged-jax: the embedded tiny model by default, or any Llama checkpoint.

    python scripts/generate.py                                  # built-in prompts, embedded model
    python scripts/generate.py --model DIR --prompt 'def add(a, b):\\n' --stream --max-tokens 128

DIR is a Hugging Face Llama directory (config.json, *.safetensors, tokenizer.json) or one written by
scripts/convert_checkpoint.py; --model also takes a GGUF file (e.g. from scripts/fetch_model.py). In --prompt and --prompts-file lines, \\n and \\t are newline and tab.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jax import monitoring  # noqa: E402

from paged_jax import LLM, LoRARequest, SamplingParams, compilation_cache  # noqa: E402
from paged_jax.engine.arg_utils import EngineArgs  # noqa: E402
from paged_jax.entrypoints import cli_args  # noqa: E402
from paged_jax.entrypoints.llm import load_model, load_tokenizer  # noqa: E402

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "models" / "embedded"
PROMPTS = ("def fibonacci(n):\n", "import os\n", "class Stack:\n    def __init__(self):\n",
           "if __name__ == \"__main__\":\n")
TQDM_FROM = 8  # prompts: from here on a progress bar beats a silent wait
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")


def unescape(text: str) -> str:
    return text.replace("\\n", "\n").replace("\\t", "\t")


def read_prompts(args) -> list[str]:
    prompts = [unescape(p) for p in args.prompt or []]
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts += [unescape(line.rstrip("\n")) for line in f if line.strip()]
    return prompts or list(PROMPTS)


@contextlib.contextmanager
def compile_timer():
    """Seconds jax spends tracing, lowering and compiling inside the block, as jax itself times them."""
    total = [0.0]

    def listener(event, seconds, **_):
        if event in _COMPILE_EVENTS:
            total[0] += seconds

    monitoring.register_event_duration_secs_listener(listener)
    try:
        yield total
    finally:
        monitoring.unregister_event_duration_listener(listener)


def fail(message: str):
    cli_args.fail("generate.py", message)


def load(args):
    try:
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    except Exception as e:  # noqa: BLE001
        fail(f"cannot load --tokenizer {args.tokenizer}: {type(e).__name__}: {(str(e) or '?').splitlines()[0]}")
    try:
        model, found = load_model(args.model, dtype=args.dtype)
    except Exception as e:  # noqa: BLE001  any failure here is the directory's: report it, not our stack
        fail(f"cannot load --model {args.model}: {type(e).__name__}: {(str(e) or '?').splitlines()[0]}")
    tokenizer = tokenizer or found
    if tokenizer is None:
        fail(f"--model {args.model} has no tokenizer (tokenizer.json, or tokenizer.ggml.* in a GGUF), "
             "which text prompts need")
    return model, tokenizer


def chat_inputs(tokenizer, prompts) -> list[list[int]]:
    """Each prompt as one user turn, rendered by the checkpoint's chat template (as transformers
    renders it) with the assistant's turn opened."""
    if tokenizer.chat_template is None:
        raise ValueError("--chat: the model has no chat template (no chat_template.jinja and none in "
                         "tokenizer_config.json)")
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=True) for p in prompts]


def stream(llm, prompts, inputs, params, lora):
    """Print each completion as its tokens arrive; requests run batched, shown one after another.
    `inputs`: what the engine is given for each prompt (the chat-templated ids with --chat)."""
    for i, prompt in enumerate(inputs):
        llm.engine.add_request(str(i), prompt, params, lora_request=lora)
    order = [(i, j) for i in range(len(prompts)) for j in range(params.n)]
    texts, finished, errors = dict.fromkeys(order, ""), set(), {}
    shown, printed = 0, -1  # order[shown] is on screen up to `printed` characters; -1: not started
    while shown < len(order):
        for out in llm.engine.step():
            for c in out.outputs:
                texts[int(out.request_id), c.index] = c.text
                if c.finish_reason is not None:
                    finished.add((int(out.request_id), c.index))
            if out.error:
                errors[int(out.request_id)] = out.error
        while shown < len(order):
            i, j = order[shown]
            if printed < 0:
                print(header(i, j, len(prompts), params.n) + prompts[i], end="")
                printed = 0
            print(texts[i, j][printed:], end="", flush=True)
            printed = len(texts[i, j])
            if (i, j) not in finished:
                break
            print(f"\n[error: {errors[i]}]" if i in errors else "", flush=True)
            shown, printed = shown + 1, -1


def header(i, j, num_prompts, n):
    return f"\n=== prompt {i + 1}/{num_prompts}" + (f", sample {j + 1}/{n}" if n > 1 else "") + " ===\n"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="checkpoint directory or GGUF file (default: the embedded model)")
    ap.add_argument("--tokenizer", metavar="PATH", help="a checkpoint directory or GGUF file whose tokenizer replaces "
                                                        "the model's (e.g. a GGUF's base model)")
    ap.add_argument("--prompt", action="append", help="a prompt (repeatable); default: built-in Python prompts")
    ap.add_argument("--prompts-file", help="a file of prompts, one per line")
    for flag, kind, default in (("--max-tokens", int, 96), ("--temperature", float, 0.7), ("--top-p", float, 0.95),
                                ("--top-k", int, 0), ("--n", int, 1)):
        ap.add_argument(flag, type=kind, default=default, help=f"default: {default}")
    ap.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    ap.add_argument("--lora-path", metavar="DIR", help="a PEFT LoRA adapter every prompt runs with (turns on "
                                                       "--enable-lora; --max-lora-rank bounds its rank)")
    ap.add_argument("--chat", action="store_true",
                    help="send each prompt as a user message through the model's chat template")
    ap.add_argument("--compilation-cache-dir", metavar="DIR",
                    help=f"jax's persistent compilation cache (default: {compilation_cache.default_cache_dir()})")
    ap.add_argument("--no-compilation-cache", action="store_true", help="compile everything afresh, cache nothing")
    ap.add_argument("--print-all-processes", action="store_true", help="every process prints (default: process 0)")
    EngineArgs.add_cli_args(ap)
    cli_args.add_distributed_args(ap)
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        engine_args = EngineArgs.from_cli_args(args, log_stats=args.process_id == 0 or args.print_all_processes,
                                               enable_lora=args.enable_lora or args.lora_path is not None)
        lora = args.lora_path and LoRARequest("adapter", 1, args.lora_path)
        cli_args.initialize_distributed(args)  # before anything touches a device
        if not args.no_compilation_cache:  # before anything compiles: jax opens the cache once
            compilation_cache.enable(args.compilation_cache_dir)
        prompts = read_prompts(args)
        params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens)
        model, tokenizer = load(args)
        inputs = chat_inputs(tokenizer, prompts) if args.chat else prompts
        llm = LLM(model, tokenizer=tokenizer, **engine_args.kwargs())
        if lora:  # read now: a bad adapter is one line, before anything runs
            llm.engine.add_lora(lora)
    except (OSError, ValueError, ImportError) as e:  # ImportError: --chat without jinja2
        fail(str(e))
    # Every process runs the same generation (each step is one program across all of them); one prints.
    quiet = args.process_id != 0 and not args.print_all_processes
    with open(os.devnull, "w") if quiet else contextlib.nullcontext(sys.stdout) as out, contextlib.redirect_stdout(out):
        report(args, llm, prompts, inputs, params, lora)


def report(args, llm, prompts, inputs, params, lora):
    start = time.perf_counter()
    with compile_timer() as compile_s:
        if args.stream:
            stream(llm, prompts, inputs, params, lora)
        else:
            outputs = llm.generate(inputs, params, use_tqdm=len(prompts) >= TQDM_FROM, lora_request=lora)
            for i, out in enumerate(outputs):
                for c in out.outputs:
                    print(header(i, c.index, len(prompts), args.n) + prompts[i] + c.text)
                if out.error:
                    print(f"[error: {out.error}]")
    run_s = max(time.perf_counter() - start - compile_s[0], 1e-9)
    s = llm.stats()
    print(f"\nrequests {len(prompts)}, generated tokens {s['generation_tokens']}, "
          f"{s['generation_tokens'] / run_s:.1f} tok/s ({run_s:.2f} s run + {compile_s[0]:.2f} s compile), "
          f"KV cache peak usage {s['peak_blocks_used'] / (s['num_blocks'] - 1):.1%} of {s['num_blocks'] - 1} blocks, "
          f"prefix-cache hit rate {s['prefix_cache_hit_rate']:.1%}, preemptions {s['num_preemptions']}"
          + (f", speculation: {s['spec_decode_num_drafts']} verifications, acceptance rate "
             f"{s['spec_decode_acceptance_rate']:.1%}, mean accepted length {s['spec_decode_mean_accepted_length']:.2f}"
             if "spec_decode_num_drafts" in s else ""))


if __name__ == "__main__":
    main()
