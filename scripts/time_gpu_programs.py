"""On a lent GPU: the programs scripts/compile_for_gpu.py compiles without one, built the same way on
this machine's GPU (its memory stats size the KV pool) and run, each timed beside its roofline
estimate (scripts/gpu_check.sh runs it). Zero weights and KV pages; the pool grown to each program's
contexts, so the memory traffic is the one the estimate counts.

    python scripts/time_gpu_programs.py --gpu h100 --model tests/data/configs/llama-3.1-8b.json --programs quick
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402

from models.checkpoint import MODEL_REGISTRY, read_config  # noqa: E402
from pallas_kernels import gpu_target  # noqa: E402
from paged_jax.worker import gpu_compile, gpu_programs  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", choices=sorted(gpu_target.DEVICE_NAMES), required=True,
                   help="the target config whose bandwidth and peak the estimates use")
    p.add_argument("--model", required=True)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--programs", default="quick", choices=gpu_programs.PROGRAM_SETS)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--speculative-config", default=None, help="as compile_for_gpu.py takes it")
    args = p.parse_args()
    device = jax.devices()[0]
    if device.platform != "gpu":
        sys.exit(f"needs a GPU; jax's default device is {device}")
    spec = gpu_target.gpu_spec(args.gpu)
    if device.device_kind != spec.name:
        print(f"note: this GPU is {device.device_kind!r}; estimates use {spec.name!r}'s figures")
    model_config = read_config(args.model, dtype="bfloat16")

    def temp_bytes(program):
        return gpu_compile.compile_program(program, args.gpu, device, use_cache=False).temp_bytes

    engine = gpu_programs.build(MODEL_REGISTRY[model_config.model_type].model_cls, model_config, [device],
                                bytes_limit=device.memory_stats()["bytes_limit"], temp_bytes=temp_bytes,
                                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                max_model_len=args.max_model_len, speculative_config=args.speculative_config)
    print(engine.config.describe())
    print(f"{'program':38} {'model ms':>9} {'measured ms':>11} {'ratio':>6}")
    failed = []
    for program in gpu_programs.engine_programs(engine, args.programs):
        if not program.steps:
            continue
        estimate = gpu_compile.program_roofline_seconds(engine, spec, program)
        try:
            measured, _ = gpu_compile.run_timed(engine, program, args.runs)
        except Exception as e:  # one program failing (out of memory, say) must not hide the rest
            failed.append(program.name)
            print(f"{program.name:38} {estimate * 1e3:9.2f} failed: {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:200] if str(e) else ''}", flush=True)
            continue
        print(f"{program.name:38} {estimate * 1e3:9.2f} {measured * 1e3:11.2f} {measured / estimate:6.2f}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
