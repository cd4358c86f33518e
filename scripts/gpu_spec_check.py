"""Speculative decoding on a GPU (gpu_check.sh step 5): n-gram proposals on Llama-3.2-1B's shape
(bf16, random weights: its greedy answers fall into loops, which prompt lookup predicts), batch 1
and 8, against the same engine without speculation. Prints output tok/s of each, the ratio,
whether the greedy tokens are equal, and what the engine timed: a decode step's seconds by rows
and a verification call's by tokens, the figures its choice to speculate rests on.

    python scripts/gpu_spec_check.py [--config tests/data/configs/llama-3.2-1b.json] [--max-tokens 256]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from models.checkpoint import read_config  # noqa: E402
from paged_jax import LLM, SamplingParams  # noqa: E402
from scripts import benchlib  # noqa: E402

CONFIG = {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tests/data/configs/llama-3.2-1b.json")
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args(argv)
    model = benchlib.random_weights(read_config(args.config, dtype="bfloat16"))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 1000, 24).tolist() * 2 for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    # No prefix cache: the timed run makes the calls of the run that compiled them (a second run
    # would hit the first's blocks and compile the shorter prefill inside the timed one).
    engines = {name: LLM(model, max_model_len=1024, max_num_seqs=8, log_stats=False, speculative_config=config,
                         enable_prefix_caching=False)
               for name, config in (("off", None), ("ngram", CONFIG))}
    for batch in (1, 8):
        results = {}
        for name, llm in engines.items():
            for _ in range(2):  # compiles, and the speculator times its calls (then verifies, compiling those)
                llm.generate(prompts[:batch], params)
            llm.engine.reset_counters()
            start = time.perf_counter()
            outs = llm.generate(prompts[:batch], params)
            seconds = time.perf_counter() - start
            results[name] = ([o.outputs[0].token_ids for o in outs], seconds, llm.stats())
        plain_tok_s = batch * args.max_tokens / results["off"][1]
        for name, (tokens, seconds, s) in results.items():
            tok_s = batch * args.max_tokens / seconds
            print(f"batch {batch} {name:5}: {tok_s:8.1f} tok/s, x{tok_s / plain_tok_s:.2f}, same tokens "
                  f"{tokens == results['off'][0]}, verifications {s.get('spec_decode_num_drafts', 0)}, "
                  f"acceptance {s.get('spec_decode_acceptance_rate', 0):.1%}, "
                  f"tokens per verification {s.get('spec_decode_mean_accepted_length', 1):.2f}", flush=True)
    costs = engines["ngram"].engine.speculator.costs
    for (kind, size), seconds in sorted(costs.items()):
        print(f"timed {kind} ({'rows' if kind == 'step' else 'tokens'} {size}): {seconds * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
