"""benchmark_throughput.py --section lora: what serving LoRA adapters costs, on a real model
(SmolLM2-135M-Instruct's GGUF, scripts/fetch_model.py), greedy, ignore_eos so every run makes the
same tokens.

Adapters of rank 16 on every projection (random, small: A ~ N(0, 1/in), B ~ N(0, 0.01^2), in PEFT's
format) are written to a temporary directory. The same 8 chat prompts run at batch 8 through: the
engine without LoRA (the baseline), then one with 4 adapter slots (`enable_lora`, max_loras 4)
running them with no adapter, all with one adapter, and two each of four adapters; and one with
a single slot running the four adapters (the scheduler runs one adapter's requests at a time). Per
row: output tok/s, the ratio to the baseline, the adapters written into slots over all its runs, and
whether the tokens equal the baseline's (only the rows without an adapter can). Each run is made
three times, alternating, the fastest kept; compile time is left out (benchlib.run_engine).
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from paged_jax import LLM, LoRARequest, SamplingParams
from paged_jax.entrypoints.llm import load_model
from scripts import benchlib, fetch_model
from scripts.spec_decode_section import WORKLOADS, _inputs

RANK, REPEATS = 16, 3
MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
COLUMNS = [("name", "run", "s"), ("output_tokens", "output tokens", "d"), ("output_tok_s", "output tok/s", ".1f"),
           ("ratio", "x no LoRA", ".2f"), ("loads", "slot loads, all runs", "d"),
           ("same_tokens", "same tokens", ".0%")]


def write_adapter(directory: Path, config, seed: int) -> None:
    """A PEFT LoRA adapter of rank RANK on every projection of every layer."""
    c, rng, tensors = config, np.random.default_rng(seed), {}
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"q_proj": (q, c.hidden_size), "k_proj": (kv, c.hidden_size), "v_proj": (kv, c.hidden_size),
              "o_proj": (c.hidden_size, q), "gate_proj": (c.intermediate_size, c.hidden_size),
              "up_proj": (c.intermediate_size, c.hidden_size), "down_proj": (c.hidden_size, c.intermediate_size)}
    for layer in range(c.num_layers):
        for module, (out_f, in_f) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{MODULES[module]}.{module}"
            tensors[key + ".lora_A.weight"] = (rng.standard_normal((RANK, in_f)) / np.sqrt(in_f)).astype(np.float32)
            tensors[key + ".lora_B.weight"] = (0.01 * rng.standard_normal((out_f, RANK))).astype(np.float32)
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(dict(peft_type="LORA", r=RANK, lora_alpha=2 * RANK,
                                                                   target_modules=list(MODULES))))


def lora_rows(args):
    """-> (rows, description). --output-len: tokens per answer; --kv-model: another model."""
    path = Path(args.kv_model) if args.kv_model else fetch_model.fetch("smollm2-135m-instruct")
    model, tokenizer = load_model(path)
    inputs = _inputs(tokenizer, WORKLOADS["free"])
    params = [SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)] * len(inputs)
    tmp = Path(tempfile.mkdtemp(prefix="paged-jax-lora-"))
    adapters = []
    for i in range(4):
        write_adapter(tmp / f"adapter{i}", model.config, seed=i)
        adapters.append(LoRARequest(f"adapter{i}", i + 1, str(tmp / f"adapter{i}")))
    engines = {"off": LLM(model, tokenizer=tokenizer, log_stats=False, max_num_seqs=8),
               "4 slots": LLM(model, tokenizer=tokenizer, log_stats=False, max_num_seqs=8, enable_lora=True,
                              max_loras=4, max_lora_rank=RANK),
               "1 slot": LLM(model, tokenizer=tokenizer, log_stats=False, max_num_seqs=8, enable_lora=True,
                             max_loras=1, max_cpu_loras=4, max_lora_rank=RANK)}
    runs = [("no LoRA", "off", None), ("LoRA on, no adapter", "4 slots", [None] * 8),
            ("LoRA on, 1 adapter", "4 slots", [adapters[0]] * 8),
            ("LoRA on, 4 adapters x 2", "4 slots", adapters * 2),
            ("1 slot, 4 adapters x 2", "1 slot", adapters * 2)]
    best, loads = {}, dict.fromkeys([name for name, *_ in runs], 0)
    for _ in range(REPEATS):  # alternating, the fastest of each kept: this machine's load varies
        for name, engine, loras in runs:
            llm = engines[engine]
            before = _loads(llm)
            run = benchlib.run_engine(llm, inputs, params, loras=loras)
            loads[name] += _loads(llm) - before
            run["tokens"] = [o.outputs[0].token_ids for o in run["outputs"]]
            if name not in best or run["run_s"] < best[name]["run_s"]:
                best[name] = run
    base = best["no LoRA"]
    base_tok_s = sum(map(len, base["tokens"])) / base["run_s"]
    rows = []
    for name, *_ in runs:
        run = best[name]
        n = sum(map(len, run["tokens"]))
        rows.append(dict(name=name, output_tokens=n, output_tok_s=n / run["run_s"],
                         ratio=n / run["run_s"] / base_tok_s, loads=loads[name],
                         same_tokens=np.mean([a == b for a, b in zip(run["tokens"], base["tokens"])])))
    info = (f"lora: {path.name}, batch 8, greedy, {args.output_len} tokens per answer (ignore_eos); adapters of "
            f"rank {RANK} on q/k/v/o/gate/up/down")
    return rows, info


def _loads(llm) -> int:
    lora = llm.engine.model_runner.lora
    return lora.num_loads if lora is not None else 0
