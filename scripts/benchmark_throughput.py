"""Offline throughput (vLLM's benchmark_throughput): random-token prompts with ShareGPT-like lengths,
all submitted at once with ignore_eos, greedy, on one random Llama (58M parameters by default).

    python scripts/benchmark_throughput.py                      # paged engine vs the alternatives
    python scripts/benchmark_throughput.py --section memory     # one KV budget: paged vs contiguous
    python scripts/benchmark_throughput.py --section prefix     # shared system prompt, caching on/off
    python scripts/benchmark_throughput.py --section capacity --hidden-size 256 --num-layers 4
                                                                # the same requests, rising engine capacity
    python scripts/benchmark_throughput.py --section window     # one KV budget, with and without a window
    python scripts/benchmark_throughput.py --section kv-dtype   # one KV budget: auto / int8 / fp8 pages
    python scripts/benchmark_throughput.py --section preemption # memory-starved: recompute, swap, host tier
    python scripts/benchmark_throughput.py --section spec-decode --output-len 128  # n-gram speculation, SmolLM2
    python scripts/benchmark_throughput.py --section lora       # LoRA adapters' cost, SmolLM2

Sections: `engines`: the paged engine (block_size 16); the same engine with block_size = max_model_len
(a contiguous reservation of the longest answer per request); a plain JAX greedy loop over a dense KV
cache with static batches; Hugging Face `generate` on torch (when installed). `memory`: the paper's
claim, with one KV budget small enough that it, not --max-num-seqs, limits the contiguous engine.
`prefix`: every prompt starts with the same system prompt. `capacity`: 8 requests (32 prompt, 64
output tokens) on engines of rising max_num_seqs x max_model_len up to GPU defaults (256, 131072),
then 128 requests at the largest: the cost of a step must follow the work, not the capacity.
`window`: the same weights as Llama (every layer global) and as Mistral with a sliding window (blocks
behind it go back to the pool), one KV budget, long generations. `kv-dtype`: real weights, one KV
budget, the pages in the model's dtype, int8 and fp8 (scripts/kv_dtype_section.py). `preemption`:
fixed-length requests that overflow one KV budget, preempted by recompute or by swapping, with
and without the prefix cache's host tier (scripts/bench_preemption.py). `spec-decode`: n-gram
speculative decoding on SmolLM2, repeat/edit and free-text prompts, batch 1 and 8
(scripts/spec_decode_section.py). `lora`: LoRA adapters on SmolLM2 against the engine without them
(scripts/lora_section.py). Run
time excludes jit compile time (each engine first runs other prompts of the same lengths).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from paged_jax import SamplingParams  # noqa: E402
from scripts import baselines, bench_preemption, benchlib, kv_dtype_section, lora_section, spec_decode_section  # noqa: E402

COMMON = [("name", "method", "s")]
COLUMNS = {
    "engines": COMMON + [("requests_s", "req/s", ".2f"), ("total_tok_s", "total tok/s", ".1f"),
                         ("output_tok_s", "output tok/s", ".1f"), ("ratio", "x baseline", ".2f"),
                         ("run_s", "run s", ".1f"), ("compile_s", "compile s", ".1f"),
                         ("same_tokens", "same tokens", ".0%")],
    "memory": COMMON + [("max_running", "max running", "d"), ("mean_running", "mean running", ".1f"),
                        ("utilisation", "KV util", ".1%"), ("num_preemptions", "preempted", "d"),
                        ("output_tok_s", "output tok/s", ".1f"), ("ratio", "x baseline", ".2f"),
                        ("run_s", "run s", ".1f"), ("same_tokens", "same tokens", ".0%")],
    "prefix": COMMON + [("prefill_tokens", "prefill tokens", "d"), ("ttft_mean_s", "TTFT mean s", ".2f"),
                        ("ttft_p50_s", "TTFT p50 s", ".2f"), ("hit_rate", "hit rate", ".1%"),
                        ("total_tok_s", "total tok/s", ".1f"), ("ratio", "x baseline", ".2f"),
                        ("run_s", "run s", ".1f")],
    "window": COMMON + [("peak_blocks", "peak blocks, 1 request", "d"), ("max_running", "max running", "d"),
                        ("mean_running", "mean running", ".1f"), ("num_preemptions", "preempted", "d"),
                        ("output_tok_s", "output tok/s", ".1f"), ("ratio", "x baseline", ".2f"),
                        ("run_s", "run s", ".1f")],
    "preemption": COMMON + [("num_preemptions", "preempted", "d"), ("swap_fallbacks", "swap full", "d"),
                            ("recomputed", "recomputed tokens", "d"), ("swap_mib", "swapped MiB", ".1f"),
                            ("host_hits", "host-tier hit tokens", "d"), ("tier_mib", "host-tier MiB", ".1f"),
                            ("output_tok_s", "output tok/s", ".1f"), ("ratio", "x recompute", ".2f"),
                            ("run_s", "run s", ".1f"), ("same_tokens", "same tokens", ".0%")],
    "capacity": COMMON + [("output_tok_s", "output tok/s", ".1f"), ("ratio", "x baseline", ".2f"),
                          ("run_s", "run s", ".2f"), ("compile_s", "compile s", ".1f"),
                          ("same_tokens", "same tokens", ".0%")],
}
SECTIONS = {"kv-dtype": kv_dtype_section, "spec-decode": spec_decode_section, "lora": lora_section}
CAPACITIES = ((8, 1024), (32, 1024), (256, 1024), (8, 32768), (256, 32768), (256, 131072))


def capacity_rows(args, model):
    """-> (rows, the 8 prompts): the same requests on engines of rising capacity (the 128-request row
    starts with the same 8), each engine warmed up on other prompts of the same lengths first."""
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, args.vocab_size, 32).tolist() for _ in range(128)]
    rows = []
    for num_seqs, max_len, n in [(s, m, 8) for s, m in CAPACITIES] + [(256, 131072, 128)]:
        llm = benchlib.make_llm(model, block_size=16, kv_tokens=2047 * 16, max_num_seqs=num_seqs, max_model_len=max_len)
        engine_row("warm-up", llm, [rng.integers(0, args.vocab_size, 32).tolist() for _ in range(n)], [64] * n)
        rows.append(engine_row(f"max_num_seqs {num_seqs}, max_model_len {max_len}, {n} requests", llm,
                               prompts[:n], [64] * n))
    return rows, prompts[:8]
def window_rows(args, model):
    """-> (rows, prompts, output lengths): 16 requests of 64 prompt and 448 output tokens in a KV
    budget of 4 x 512 token slots, on the model as it is and as Mistral with a 128-token window."""
    from flax import nnx

    from models.llama import Llama

    config = dataclasses.replace(model.config, model_type="mistral", sliding_window=args.window)
    windowed = Llama(config, rngs=nnx.Rngs(0))
    nnx.update(windowed, nnx.state(model))
    rng = np.random.default_rng(args.seed)
    prompts, outs = [rng.integers(0, args.vocab_size, 64).tolist() for _ in range(16)], [448] * 16
    rows = []
    for name, m in (("no window (Llama)", model), (f"sliding window {args.window} (Mistral)", windowed)):
        kw = dict(block_size=16, max_num_seqs=16, max_model_len=512, max_num_batched_tokens=512)
        one = engine_row("one", benchlib.make_llm(m, kv_tokens=4 * 512, **kw), prompts[:1], outs[:1])
        row = engine_row(name, benchlib.make_llm(m, kv_tokens=4 * 512, **kw), prompts, outs)
        rows.append(dict(row, peak_blocks=one["peak_blocks"]))
    return rows, prompts, outs


SUFFIX_LENS = (8, 64)  # prefix section: each prompt's own tokens after the shared ones, uniform in [8, 64)


def workload(args, rng):
    """(prompts, output lengths): random token ids, lengths lognormal as ShareGPT's, clipped so that
    every request fits max_model_len; with --section prefix, a shared system prompt + short suffixes."""
    n, half = args.num_requests, args.max_model_len // 2
    if args.section == "prefix":
        shared = rng.integers(0, args.vocab_size, args.prefix_len).tolist()
        suffixes = rng.integers(*SUFFIX_LENS, n)
        return [shared + rng.integers(0, args.vocab_size, m).tolist() for m in suffixes], [args.prefix_output_len] * n
    inputs = benchlib.lognormal_lengths(rng, n, args.input_len, 4, half - 1)
    outputs = benchlib.lognormal_lengths(rng, n, args.output_len, 4, half)
    return [rng.integers(0, args.vocab_size, m).tolist() for m in inputs], outputs.tolist()


def engine_row(name, llm, prompts, output_lens, read_pool=False):
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in output_lens]
    row = benchlib.run_engine(llm, prompts, params, read_pool=read_pool)
    outputs, stats, ttft = row.pop("outputs"), row.pop("stats"), row.pop("ttft_s")
    return dict(row, name=name, answers=[o.outputs[0].token_ids for o in outputs],
                ttft_mean_s=float(np.mean(ttft)), ttft_p50_s=float(np.median(ttft)),
                num_preemptions=stats["num_preemptions"], hit_rate=stats["prefix_cache_hit_rate"],
                peak_blocks=stats["peak_blocks_used"], recomputed=stats["num_recomputed_tokens"],
                swap_fallbacks=stats["num_swap_fallbacks"],
                swap_mib=(stats["swap_bytes_out"] + stats["swap_bytes_in"]) / 2**20,
                host_hits=stats["host_prefix_cache_hits"],
                tier_mib=(stats["host_prefix_cache_bytes_out"] + stats["host_prefix_cache_bytes_in"]) / 2**20)


def timed_row(name, generate, *gen_args):
    start = benchlib.now()
    answers = generate(*gen_args)
    wall = benchlib.now() - start
    compile_s = benchlib.compile_seconds(start)
    return dict(name=name, answers=answers, run_s=wall - compile_s, compile_s=compile_s)


def run_section(args, model):
    """-> (rows, index of the baseline row, workload info)."""
    prompts, outs = workload(args, np.random.default_rng(args.seed))
    kw = dict(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_num_batched_tokens)
    room = args.max_num_seqs * args.max_model_len  # max_num_seqs full-length requests: memory never binds
    paged, contiguous = dict(block_size=16), dict(block_size=args.max_model_len)
    contiguous_name = f"contiguous (block_size {args.max_model_len})"
    if args.section == "engines":
        rows = [engine_row("paged-jax (block_size 16)", benchlib.make_llm(model, **paged, kv_tokens=room, **kw),
                           prompts, outs),
                engine_row(contiguous_name, benchlib.make_llm(model, **contiguous, kv_tokens=room, **kw),
                           prompts, outs),
                timed_row(f"jax dense KV, static batch {args.max_num_seqs}", baselines.dense_generate,
                          model, prompts, outs, args.max_num_seqs)]
        if not args.no_hf and baselines.hf_available():
            rows.append(timed_row(f"HF generate (torch), static batch {args.max_num_seqs}", baselines.hf_generate,
                                  baselines.hf_llama(model, args.torch_threads), prompts, outs, args.max_num_seqs))
        baseline = len(rows) - 1
    elif args.section == "memory":  # the same bytes; max_num_seqs out of the way, so the budget binds
        kv = args.kv_budget_seqs * args.max_model_len
        kw["max_num_seqs"] = max(args.num_requests, args.max_num_seqs)
        rows = [engine_row(f"{name}, {kv} KV slots", benchlib.make_llm(model, **blocks, kv_tokens=kv, **kw),
                           prompts, outs, read_pool=True)
                for name, blocks in (("paged (block_size 16)", paged), (contiguous_name, contiguous))]
        baseline = 1
    elif args.section == "window":
        (rows, prompts, outs), baseline = window_rows(args, model), 0
    elif args.section == "preemption":
        (rows, prompts, outs), baseline = bench_preemption.preemption_rows(args, model, engine_row), 0
    elif args.section == "capacity":
        (rows, prompts), outs, baseline = capacity_rows(args, model), [64] * 8, 0
    else:
        rows = [engine_row(f"prefix caching {'on' if on else 'off'}", benchlib.make_llm(
            model, **paged, kv_tokens=room, enable_prefix_caching=on, **kw), prompts, outs) for on in (False, True)]
        baseline = 0
    # Every row does the same work (capacity: per request), so throughput ratios are ratios of tok/s.
    reference, num_in, num_out = rows[0]["answers"], sum(map(len, prompts)), sum(outs)
    for row in rows:
        run_s, answers = row["run_s"], row.pop("answers")
        scale = len(answers) / len(prompts)
        row.update(output_tok_s=scale * num_out / run_s, total_tok_s=scale * (num_in + num_out) / run_s,
                   requests_s=len(answers) / run_s,
                   same_tokens=float(np.mean([a == b for a, b in zip(answers, reference)])))
    for row in rows:
        row["ratio"] = row["output_tok_s"] / rows[baseline]["output_tok_s"]
    return rows, baseline, dict(num_requests=len(prompts), num_prompt_tokens=num_in, num_output_tokens=num_out,
                                mean_input_len=num_in / len(prompts), mean_output_len=num_out / len(prompts),
                                max_model_len=args.max_model_len)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--section", choices=(*COLUMNS, *SECTIONS), default="engines")
    ap.add_argument("--kv-model", help="kv-dtype, spec-decode: a model dir or .gguf (default: SmolLM2; kv-dtype "
                                       "takes stories260K if SmolLM2 is not fetched)")
    ap.add_argument("--num-requests", type=int, default=None, help="default: 16 (engines, memory), 32 (prefix)")
    ap.add_argument("--input-len", type=int, default=160, help="mean prompt length")
    ap.add_argument("--output-len", type=int, default=340, help="mean answer length")
    ap.add_argument("--max-model-len", type=int, default=1024, help="a power of two: the contiguous block size")
    ap.add_argument("--max-num-seqs", type=int, default=8, help="engine batch and static batch size")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512, help="engine token budget per step")
    ap.add_argument("--kv-budget-seqs", type=int, default=4, help="memory: KV budget in max_model_len requests")
    ap.add_argument("--prefix-len", type=int, default=512, help="prefix, preemption: shared system prompt tokens")
    ap.add_argument("--prefix-groups", type=int, default=0, help="preemption: distinct shared prefixes (0: none)")
    ap.add_argument("--prefix-output-len", type=int, default=16)
    ap.add_argument("--window", type=int, default=128, help="window: the sliding window in tokens")
    ap.add_argument("--no-hf", action="store_true", help="skip Hugging Face generate")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch intra-op threads (default: torch's); 1 on a CPU shared with other jobs, where "
                         "torch's spinning OpenMP threads run it 10x slower")
    ap.add_argument("--json", help="write the rows and the workload here")
    benchlib.add_model_args(ap)
    args = ap.parse_args(argv)
    if args.max_model_len & (args.max_model_len - 1):
        ap.error(f"--max-model-len {args.max_model_len}: the contiguous run's block size, so a power of two")
    if args.section in SECTIONS:  # real weights, a section of its own
        if args.output_len == ap.get_default("output_len"):
            args.output_len = {"kv-dtype": 64, "spec-decode": 128, "lora": 64}[args.section]
        module = SECTIONS[args.section]
        rows, info = getattr(module, args.section.replace("-", "_") + "_rows")(args)
        print(info)
        benchlib.print_table(rows, module.COLUMNS)
        if args.json:
            Path(args.json).write_text(json.dumps(dict(section=args.section, info=info, rows=rows), indent=2) + "\n")
        return
    args.num_requests = args.num_requests or (32 if args.section == "prefix" else 16)
    model = benchlib.random_llama(args, 131072 if args.section == "capacity" else args.max_model_len)
    rows, baseline, info = run_section(args, model)
    budget = benchlib.kv_bytes_per_token(model.config) * args.kv_budget_seqs * args.max_model_len
    print(f"{args.section}: {info['num_requests']} requests, mean input {info['mean_input_len']:.0f} / output "
          f"{info['mean_output_len']:.0f} tokens, max_model_len {args.max_model_len}; random Llama "
          f"{benchlib.num_params(model) / 1e6:.0f}M params, {args.dtype}"
          + (f"; KV budget {budget / 2**20:.1f} MiB" if args.section in ("memory", "preemption") else "")
          + f"; ratios against {rows[baseline]['name']}")
    benchlib.print_table(rows, COLUMNS[args.section])
    if args.json:
        Path(args.json).write_text(json.dumps(dict(section=args.section, **info, baseline=rows[baseline]["name"],
                                                  rows=rows), indent=2) + "\n")


if __name__ == "__main__":
    main()
