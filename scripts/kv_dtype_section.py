"""benchmark_throughput.py --section kv-dtype: one KV byte budget, the pages stored as the model's
dtype ("auto"), int8 and fp8_e4m3. Real weights: SmolLM2-135M-Instruct when fetched
(scripts/fetch_model.py), else stories260K. Per row: bytes per block (scales included), blocks in
the budget, the most sequences that ran at once, output tok/s, and the greedy agreement with the
"auto" answers (benchlib.forced_agreement)."""
from __future__ import annotations

from pathlib import Path

from paged_jax import LLM, SamplingParams
from paged_jax.attention import bytes_per_block
from paged_jax.entrypoints.llm import load_model
from pallas_kernels.quantization import KV_CACHE_DTYPES, storage_dtype
from scripts import benchlib, fetch_model

STORIES = Path(__file__).resolve().parent.parent / "tests" / "data" / "stories260K"
PROMPTS = ["Once upon a time", "Lily wanted to", "The little dog", "Tom and Sue went to the",
           "One day, a bird", "The sun was", "Mom said", "There was a big tree",
           "Ben liked to play with his", "The cat saw a", "In the park, the kids",
           "A boy named Tim", "She was very happy because", "The car was red and",
           "After lunch, they", "The old man had a"]
COLUMNS = [("name", "kv_cache_dtype", "s"), ("bytes_per_block", "bytes/block", "d"),
           ("num_blocks", "blocks", "d"), ("seqs_fit", "full seqs fit", "d"),
           ("max_running", "max running", "d"),
           ("num_preemptions", "preempted", "d"), ("output_tok_s", "output tok/s", ".1f"),
           ("run_s", "run s", ".1f"), ("agreement", "agreement", ".1%"),
           ("logprob_diff", "mean |d logprob|", ".4f")]


def default_model() -> Path:
    smollm2 = fetch_model.model_path("smollm2-135m-instruct")
    return smollm2 if smollm2.is_file() else STORIES


def kv_dtype_rows(args):
    """-> (rows, description): 16 prompts x --output-len greedy tokens (ignore_eos) per dtype, in a
    budget of --kv-budget-seqs sequences' worth of "auto" blocks."""
    path = Path(args.kv_model or default_model())
    model, tokenizer = load_model(path)
    c = model.config
    block_size, longest = 16, 16 + args.output_len
    auto_bytes = bytes_per_block(c.num_layers, c.num_kv_heads, block_size, c.head_dim, c.dtype)
    budget = auto_bytes * args.kv_budget_seqs * -(-longest // block_size)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, logprobs=0)
    rows, reference = [], None
    for name in KV_CACHE_DTYPES:
        per_block = bytes_per_block(c.num_layers, c.num_kv_heads, block_size, c.head_dim,
                                    storage_dtype(name, c.dtype))
        llm = LLM(model, tokenizer=tokenizer, kv_cache_dtype=name, block_size=block_size,
                  num_blocks=budget // per_block + 1, max_num_seqs=len(PROMPTS),
                  max_model_len=longest + 48, log_stats=False)
        run = benchlib.run_engine(llm, PROMPTS, [params] * len(PROMPTS))  # compile time apart
        outputs = run["outputs"]
        agreement, diff = (1.0, 0.0) if reference is None else benchlib.forced_agreement(llm, reference)
        reference = reference or outputs
        rows.append(dict(name=name, bytes_per_block=per_block, num_blocks=budget // per_block + 1,
                         seqs_fit=budget // per_block // -(-longest // block_size),
                         max_running=run["max_running"], num_preemptions=run["stats"]["num_preemptions"],
                         output_tok_s=args.output_len * len(PROMPTS) / run["run_s"], run_s=run["run_s"],
                         agreement=agreement, logprob_diff=diff))
    info = (f"kv-dtype: {path.name} ({c.dtype}), {len(PROMPTS)} prompts x {args.output_len} greedy "
            f"tokens, KV budget {budget / 2**20:.2f} MiB ({args.kv_budget_seqs} sequences of "
            f"{longest} tokens at auto); agreement: the auto answers scored in context")
    return rows, info
