"""benchmark_throughput.py --section spec-decode: n-gram speculative decoding on a real model
(SmolLM2-135M-Instruct's GGUF, scripts/fetch_model.py), with the engine's default sizes, greedy.

Two workloads of 8 chat prompts: `repeat/edit` asks the model to repeat or edit a text it is given
(the case prompt lookup exists for: the answer quotes the prompt), `free` asks for new text. Each
runs at batch 1 (one request at a time) and batch 8 (all at once), without speculation and with
it; per row: output tok/s, the ratio to the same workload and batch without speculation, the
acceptance rate, the mean tokens per verification (accepted drafts + 1), the share of calls
planned before the call ahead of them returned (async scheduling) and whether the tokens equal
the plain run's. Compile time is left out (benchlib.run_engine); each run is made three times,
alternating with the other engine, and the fastest kept.
"""
from __future__ import annotations

from pathlib import Path

from paged_jax import LLM, SamplingParams
from paged_jax.entrypoints.llm import load_model
from scripts import benchlib, fetch_model

TEXT = ("The quick brown fox jumps over the lazy dog. The dog did not move, because it was asleep in the "
        "warm afternoon sun, and the fox ran on into the forest to look for its family.")
CODE = ("def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n"
        "        subtotal += item.price * item.quantity\n    return subtotal * (1 + tax_rate)\n")
WORKLOADS = {
    "repeat/edit": [
        f"Repeat the following text exactly:\n\n{TEXT}",
        f"Rewrite this function with the variable `subtotal` renamed to `amount`:\n\n{CODE}",
        f"Copy this paragraph, replacing 'fox' with 'cat':\n\n{TEXT}",
        f"Add a docstring to this function and return the whole function:\n\n{CODE}",
        f"Repeat this sentence three times: {TEXT.split('.')[0]}.",
        f"Fix the indentation of this code and print it again:\n\n{CODE}",
        f"Write this text again with every sentence on its own line:\n\n{TEXT}",
        f"Rename the function below to `price_with_tax` and show the full code:\n\n{CODE}",
    ],
    "free": [
        "Write a short story about a robot who learns to paint.",
        "Explain why the sky is blue to a child.",
        "Give me five ideas for a weekend trip.",
        "What are the benefits of drinking water?",
        "Describe a busy market in the morning.",
        "Write a poem about the sea.",
        "How do plants make their food?",
        "Tell me about the history of bicycles.",
    ],
}
REPEATS = 3
CONFIG = {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
COLUMNS = [("name", "run", "s"), ("output_tokens", "output tokens", "d"), ("output_tok_s", "output tok/s", ".1f"),
           ("ratio", "x no speculation", ".2f"), ("acceptance", "acceptance", ".1%"),
           ("mean_length", "tokens / verification", ".2f"), ("verifications", "verifications", "d"),
           ("ahead", "calls planned ahead", ".0%"), ("same_tokens", "same tokens", ".0%")]


def _run(llm, inputs, params, batch: int) -> dict:
    """The workload in groups of `batch` requests submitted together; tok/s over the run time."""
    outputs, run_s = [], 0.0
    llm.engine.reset_counters()
    for start in range(0, len(inputs), batch):
        group = inputs[start:start + batch]
        run = benchlib.run_engine(llm, group, [params] * len(group))
        outputs += run["outputs"]
        run_s += run["run_s"]
    return dict(outputs=[o.outputs[0].token_ids for o in outputs], run_s=run_s, stats=llm.engine.stats())


def _inputs(tokenizer, prompts) -> list:
    """Chat turns where the model has a template (an instruct model), else the plain text."""
    if tokenizer.chat_template is None:
        return prompts
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=True) for p in prompts]


def spec_decode_rows(args):
    """-> (rows, description). --output-len: max_tokens per answer (EOS ends it earlier);
    --kv-model: another model (default SmolLM2-135M-Instruct)."""
    path = Path(args.kv_model) if args.kv_model else fetch_model.fetch("smollm2-135m-instruct")
    model, tokenizer = load_model(path)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len)
    engines = {name: LLM(model, tokenizer=tokenizer, log_stats=False, speculative_config=config)
               for name, config in (("off", None), ("ngram", CONFIG))}
    rows = []
    for workload, prompts in WORKLOADS.items():
        inputs = _inputs(tokenizer, prompts)
        for batch in (1, 8):
            runs = {}
            for _ in range(REPEATS):  # alternating, the fastest of each kept: this machine's load varies
                for name, llm in engines.items():
                    run = _run(llm, inputs, params, batch)
                    if name not in runs or run["run_s"] < runs[name]["run_s"]:
                        runs[name] = run
            plain = runs["off"]
            plain_tok_s = sum(len(t) for t in plain["outputs"]) / plain["run_s"]
            for name, run in runs.items():
                s, tokens = run["stats"], sum(len(t) for t in run["outputs"])
                same = sum(a == b for a, b in zip(run["outputs"], plain["outputs"])) / len(inputs)
                rows.append(dict(name=f"{workload}, batch {batch}, {name}", output_tokens=tokens,
                                 output_tok_s=tokens / run["run_s"], ratio=tokens / run["run_s"] / plain_tok_s,
                                 acceptance=s.get("spec_decode_acceptance_rate", 0.0),
                                 mean_length=s.get("spec_decode_mean_accepted_length", 1.0),
                                 verifications=s.get("spec_decode_num_drafts", 0), same_tokens=same,
                                 ahead=s["overlapped_calls"] / max(s["prefill_steps"] + s["decode_calls"], 1)))
    info = (f"spec-decode: {path.name}, engine defaults, greedy, max_tokens {args.output_len}; "
            f"{len(WORKLOADS['free'])} chat prompts per workload; speculative_config {CONFIG}")
    return rows, info
