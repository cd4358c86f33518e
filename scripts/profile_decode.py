"""Where a decode step's time goes, on a real model with `LLM`'s defaults: the weight bytes one step
reads against this CPU's memory bandwidth (measured in the same run), and the step's XLA ops from a
jax.profiler trace, grouped into the layers' matmuls, the LM head, attention, the sampler and the
rest (norms, residuals, the loop).

    python scripts/profile_decode.py                        # SmolLM2-135M-Instruct, batch 1 and 8
    python scripts/profile_decode.py --model FILE.gguf --batch-sizes 1 8 32
    python scripts/profile_decode.py --quantization int8    # the weights read as int8

A decode call of B rows runs `num_decode_steps` steps from position 64, outside the engine (the
runner's own inputs and program: `ModelRunner._decode_inputs`, `runner.decode_steps`), greedy.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from paged_jax import LLM, SamplingParams  # noqa: E402
from paged_jax.engine import warm_up  # noqa: E402
from paged_jax.worker import runner  # noqa: E402
from scripts import fetch_model  # noqa: E402

PARTS = ("layer matmuls", "weight slices", "LM head", "attention", "sampler", "other")
CONTAINERS = ("while", "call", "conditional")  # their trace events hold their body's ops


def bandwidth() -> tuple[float, float]:
    """(read, copy) bytes/s of this CPU: numpy's sum of 512 MiB and its copy, one thread, best of 5."""
    a = np.ones(128 << 20, np.float32)
    b = np.empty_like(a)
    read = copy = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        a.sum()
        read = min(read, time.perf_counter() - t)
        t = time.perf_counter()
        np.copyto(b, a)
        copy = min(copy, time.perf_counter() - t)
    return a.nbytes / read, 2 * a.nbytes / copy


def decode_call(llm, rows: int):
    """-> (a function running one decode call of `rows` rows, the call's compiled HLO text)."""
    mr, c = llm.engine.model_runner, llm.engine.config
    plan = warm_up._decode(c, rows, 64, 0.0)
    plan.scheduled[0][0].request.params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1 << 20)
    batch, sp, flags, lora = mr._decode_inputs(plan)
    batch = mr._place(batch)
    kwargs = dict(flags=flags, num_steps=c.num_decode_steps)

    def call():
        mr.state, out = runner.decode_steps(mr.graphdef, mr.params, mr.state, batch, sp, None, lora, **kwargs)
        return jax.block_until_ready(out)

    assert int(call().steps) == c.num_decode_steps
    return call, runner.decode_steps.lower(mr.graphdef, mr.params, mr.state, batch, sp, None, lora,
                                           **kwargs).compile().as_text()


def part(line: str, vocab: int) -> str:
    """The part of the model an optimized-HLO instruction belongs to (its shape, opcode, scope)."""
    result = line.split("=", 1)[1]
    if "/lm_head/" in line:  # its dots, and with int8 weights the chunks of the vocabulary it slices
        return "LM head"
    if re.search(r"\bdot\(|__ynn_fusion|kind=kCustom", line):
        return "LM head" if re.search(rf"\[\d+,{vocab}\]", result[:60]) else "layer matmuls"
    if re.match(r"\s*%dynamic-slice", line) and "/layers/" not in line.split("metadata")[0]:
        return "weight slices"  # the layer scan's copy of a layer's slice of a stacked weight
    if re.match(r"\s*%convert\w*fusion", line) and "/layers/" in line:
        return "weight slices"  # int8 weights: a layer's slice widened to the activations' dtype
    if "/attention/" in line:
        return "attention"
    if "/layers/" not in line and str(vocab) in line:
        return "sampler"
    return "other"


def profile(call, hlo: str, vocab: int, calls: int = 5) -> dict[str, float]:
    """Seconds per call of each part, from the XLA ops of a profiler trace of `calls` calls."""
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(calls):
                call()
        path = glob.glob(os.path.join(trace_dir, "**", "*.json.gz"), recursive=True)[0]
        events = json.load(gzip.open(path))["traceEvents"]
    return op_seconds(events, hlo, vocab, calls)


def op_seconds(events, hlo: str, vocab: int, calls: int) -> dict[str, float]:
    """Seconds per call of each part, from trace `events` of `calls` executions of the program
    whose compiled HLO text is `hlo`."""
    lines = {m[1]: m[0] for m in re.finditer(r"^\s*(?:ROOT )?%([\w.\-]+) = .*$", hlo, re.M)}
    runs = collections.defaultdict(list)  # run_id -> the XLA ops of one execution of a decode call
    for e in events:
        args = e.get("args", {})
        if e.get("ph") == "X" and args.get("hlo_module") == "jit_decode_steps":
            runs[args.get("run_id")].append(e)
    seconds: dict[str, float] = collections.Counter()
    for run in runs.values():
        # This program's executions only: another engine's decode_steps running meanwhile in this
        # process (a test's leftover thread) has the same module name and ops named alike, not all.
        if not all(e.get("name") in lines for e in run):
            continue
        for e in run:
            line = lines[e["name"]]
            opcode = re.search(r"\} ([\w\-]+)\(", line)
            if not (opcode and opcode[1] in CONTAINERS):
                seconds[part(line, vocab)] += e["dur"] * 1e-6 / calls
    return seconds


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a GGUF file or checkpoint (default: smollm2-135m-instruct, scripts/fetch_model.py)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--quantization", choices=["int8"], help="the model's matmul weights as int8 (LLM's quantization)")
    args = ap.parse_args(argv)
    llm = LLM(args.model or fetch_model.fetch("smollm2-135m-instruct"), log_stats=False, quantization=args.quantization)
    c, vocab = llm.engine.config, llm.engine.model_config.vocab_size
    weights = sum(x.nbytes for x in jax.tree.leaves(llm.engine.model_runner.params))
    read, copy = bandwidth()
    print(f"weights {weights / 1e6:.0f} MB, all read by every decode step; this CPU reads {read / 1e9:.1f} GB/s "
          f"(numpy sum, one thread) and copies {copy / 1e9:.1f} GB/s (read + write)")
    for rows in args.batch_sizes:
        call, hlo = decode_call(llm, rows)
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - t)
        step = best / c.num_decode_steps
        parts = profile(call, hlo, vocab)
        total = sum(parts.values())
        shares = ", ".join(f"{name} {100 * parts[name] / total:.0f}%" for name in PARTS)
        print(f"batch {rows}: {step * 1e3:.1f} ms a step, {rows / step:.1f} tok/s; weights read at "
              f"{weights / step / 1e9:.1f} GB/s ({100 * weights / step / read:.0f}% of the read bandwidth); "
              f"XLA op time: {shares}")


if __name__ == "__main__":
    main()
