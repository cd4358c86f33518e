"""The whole engine compiled for an H100, H200, A100 (or B200) on a machine without a GPU: every program
a warmed-up engine runs, built as `LLM` builds it on that GPU (abstract weights, the KV pool sized
from the GPU's memory as gpu_memory_utilization sizes it), compiled by XLA's GPU compiler for a
compile-only device, with what XLA says each costs. Exit status 1 when a program does not compile
or weights + KV pool + the largest program's temp buffers exceed the GPU's memory.

    pip install -e '.[gpu-compile]'
    python scripts/compile_for_gpu.py --gpu h100 --model tests/data/configs/llama-3.1-8b.json
    python scripts/compile_for_gpu.py --gpu a100 --model DIR --kv-cache-dtype int8 --programs quick
    python scripts/compile_for_gpu.py --gpu h100 --model tests/data/configs/qwen3-0.6b.json --speculative-config \
        '{"method": "draft_model", "model": "tests/data/configs/qwen2.5-0.5b.json", "num_speculative_tokens": 4}'
"""
import argparse
import dataclasses
import json
import os
import sys
import time

os.environ["JAX_PLATFORMS"] = "cpu"  # the CUDA plugin otherwise looks for a driver and cuDNN
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from models.checkpoint import MODEL_REGISTRY, read_config  # noqa: E402
from pallas_kernels import gpu_target  # noqa: E402
from paged_jax.worker import gpu_compile, gpu_programs  # noqa: E402

GiB = 2**30


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", choices=sorted(gpu_target.DEVICE_NAMES), required=True)
    p.add_argument("--model", required=True, help="an HF config.json, or a checkpoint directory holding one")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's, cut to what fits")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8_e4m3"])
    p.add_argument("--attention-backend", default="auto", choices=["auto", "pallas_triton", "pallas_mosaic"],
                   help="auto: what the engine picks on that GPU (Mosaic GPU on Hopper for the models it takes)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--speculative-config", default=None,
                   help='vLLM\'s JSON, a draft\'s "model" a config.json: the engine then verifies proposals too')
    p.add_argument("--max-loras", type=int, default=0,
                   help="enable_lora with this many adapter slots (0: LoRA off); --max-lora-rank their rank")
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--programs", default="all", choices=gpu_programs.PROGRAM_SETS,
                   help="quick: the smallest and largest bucket of each; largest: the largest prefill and decode")
    p.add_argument("--no-cache", action="store_true", help="compile afresh (gpu_compile.CACHE_DIR unread)")
    p.add_argument("--json", help="also write the figures to this file")
    return p.parse_args(argv)


def table(engine, done, spec):
    """XLA's figures for each compiled program; its cost analysis counts a loop body once (the layer
    scan, the decode loop), so "model ms" is the roofline of the program's model work instead."""
    print(f"{'program':38} {'compile s':>9} {'args GiB':>8} {'out GiB':>7} {'alias GiB':>9} {'temp MiB':>8} "
          f"{'GFLOP*':>8} {'GB acc.*':>8} {'XLA ms*':>8} {'model ms':>8}")
    for program, s in done:
        model = (f"{gpu_compile.program_roofline_seconds(engine, spec, program) * 1e3:8.2f}"
                 if program.steps else f"{'-':>8}")
        print(f"{s.name:38} {s.compile_seconds:9.1f} {s.argument_bytes / GiB:8.2f} {s.output_bytes / GiB:7.2f} "
              f"{s.alias_bytes / GiB:9.2f} {s.temp_bytes / 2**20:8.1f} {s.flops / 1e9:8.1f} "
              f"{s.bytes_accessed / 1e9:8.2f} {s.roofline_seconds(spec) * 1e3:8.2f} {model}")
    print("* XLA's HloCostAnalysis of the compiled program: a loop body counted once, a Pallas kernel and a "
          "cuBLAS call as no flops, and their whole operands as bytes (a scatter's too: the KV pool, for XLA's "
          "cache writes and swap-ins)")
    for program, s in done:
        if s.copied_layer_slices:
            print(f"{s.name}: copies layer slices of the stacked weights before reading them: "
                  + ", ".join(s.copied_layer_slices))


def main(argv=None):
    args = parse_args(argv)
    spec = gpu_target.gpu_spec(args.gpu)
    model_config = read_config(args.model, dtype=args.dtype)
    devices = gpu_target.compile_only_devices(args.gpu, args.tensor_parallel_size)
    print(f"{spec.name} (sm_{spec.compute_capability.replace('.', '')}): {spec.memory_bytes / GiB:.1f} GiB, "
          f"{spec.bandwidth / 1e12:.2f} TB/s, {spec.peak_bf16_flops / 1e12:.0f} TFLOP/s bf16; "
          f"{len(devices)} compile-only device(s); ptxas first on PATH: {gpu_target.pip_ptxas()}")
    limit = gpu_target.jax_bytes_limit(spec.memory_bytes)
    probes = []

    def temp_bytes(program):
        stats = gpu_compile.compile_program(program, args.gpu, devices[0], use_cache=not args.no_cache)
        probes.append(stats)
        return stats.temp_bytes

    try:
        engine = gpu_programs.build(
            MODEL_REGISTRY[model_config.model_type].model_cls, model_config, devices, bytes_limit=limit,
            temp_bytes=temp_bytes, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len, kv_cache_dtype=args.kv_cache_dtype,
            gpu_memory_utilization=args.gpu_memory_utilization, speculative_config=args.speculative_config,
            attention_backend=args.attention_backend,
            lora=(args.max_loras, args.max_lora_rank) if args.max_loras else None)
    except gpu_programs.DoesNotFit as e:
        sys.exit(f"does not fit: {e}")
    c = engine.config
    print(c.describe())
    print(f"per device: weights {engine.weight_bytes / GiB:.2f} GiB, KV pool {engine.kv_bytes / GiB:.2f} GiB "
          f"({c.num_blocks} blocks x {c.bytes_per_block // engine.placement.size} bytes)")
    done, failed = [], []
    start = time.perf_counter()
    for program in gpu_programs.engine_programs(engine, args.programs):
        try:
            done.append((program, gpu_compile.compile_program(program, args.gpu, devices[0],
                                                              use_cache=not args.no_cache)))
        except Exception as e:  # noqa: BLE001 -- XLA's errors have no common type; report and go on
            failed.append(program.name)
            print(f"FAILED to compile {program.name}: {type(e).__name__}: {str(e)[:2000]}", file=sys.stderr)
    table(engine, done, spec)
    stats = [s for _, s in done]
    print(f"{len(stats)} programs in {time.perf_counter() - start:.1f} s "
          f"({sum(s.cached for s in stats)} read from {gpu_compile.CACHE_DIR})")
    print("one decode step's roofline, every row at the context (weights + K/V read once):")
    for batch in (1, 64, 256):
        line = [f"{ctx // 1024}k ctx {gpu_compile.roofline_seconds(engine, spec, tokens=batch, kv_tokens=batch * ctx) * 1e3:.2f} ms"
                for ctx in (2048, 8192)]
        print(f"  batch {batch:3}: " + ", ".join(line))
    verdict = gpu_compile.does_not_fit(engine, stats, limit) if stats else None
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": args.gpu, "config": dataclasses.asdict(c), "weight_bytes": engine.weight_bytes,
                       "kv_bytes": engine.kv_bytes, "bytes_limit": limit,
                       "activation_bytes": max(p.temp_bytes for p in probes),
                       "programs": [dataclasses.asdict(s) for s in stats],
                       "failed": failed, "does_not_fit": verdict}, f, indent=1)
    if failed:
        sys.exit(f"{len(failed)} program(s) failed to compile: {', '.join(failed)}")
    if verdict:
        sys.exit(verdict)
    largest = max(stats, key=lambda s: s.temp_bytes)
    print(f"fits: weights + KV pool + temp of {largest.name!r} = "
          f"{(engine.weight_bytes + engine.kv_bytes + largest.temp_bytes) / GiB:.2f} GiB of jax's "
          f"{limit / GiB:.2f} GiB (XLA_PYTHON_CLIENT_MEM_FRACTION of {spec.memory_bytes / GiB:.2f} GiB)")


if __name__ == "__main__":
    main()
