"""The `preemption` section of benchmark_throughput.py: one memory-starved workload (every request
`--input-len` prompt and `--output-len` output tokens, more of them than the KV budget holds at
once) run with preemption by recompute, by swapping to host memory, and by swapping with the
prefix cache's host tier (evicted cached blocks kept in host memory), on the same KV budget. With
`--prefix-groups G`, request i's prompt starts with shared prefix i mod G (`--prefix-len` tokens):
more prefixes than the device keeps cached beside the running requests, which the tier serves.

Recompute drops a victim's blocks and computes its prompt and output so far again when it resumes
(prefix-cache hits on its own not-yet-reused blocks spare some); swap copies its blocks to host
memory and back, whatever their length. So swap's advantage grows with what a victim has computed:
long prompts. The host tier spares the prefixes the device evicted. On a GPU the comparison is compute of the recomputed tokens against PCIe copies of
their KV; on a CPU host and device memory are the same memory, so a copy is nearly free.
"""
from __future__ import annotations

import numpy as np

from scripts import benchlib

MODES = (("recompute", dict(preemption_mode="recompute")),
         ("swap", dict(preemption_mode="swap", swap_space=1)),
         ("swap + host tier", dict(preemption_mode="swap", swap_space=1, enable_host_prefix_cache=True)))


def preemption_rows(args, model, engine_row):
    """-> (rows, prompts, output lengths): one row per preemption mode, the same requests and KV
    budget (`--kv-budget-seqs` x `--max-model-len` token slots), max_num_seqs out of the way so the
    budget binds."""
    rng = np.random.default_rng(args.seed)
    prefixes = [rng.integers(0, args.vocab_size, args.prefix_len).tolist() for _ in range(args.prefix_groups)]
    prompts = [(prefixes[i % len(prefixes)] if prefixes else []) + rng.integers(0, args.vocab_size, args.input_len).tolist()
               for i in range(args.num_requests)]
    outs = [args.output_len] * args.num_requests
    kv = args.kv_budget_seqs * args.max_model_len
    rows = []
    for name, mode in MODES:
        llm = benchlib.make_llm(model, block_size=16, kv_tokens=kv, max_num_seqs=args.num_requests,
                                max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                                **mode)
        rows.append(engine_row(f"{name}, {kv} KV slots", llm, prompts, outs))
    return rows, prompts, outs
