#!/usr/bin/env bash
# Everything that needs a GPU, in one run on a lent one, under 10 minutes, into one report:
#   1. the gpu-marked tests: the compiled kernels against the references, the engine on the GPU
#      (scripts/gpu_tests.py: each failure isolated in its own process)
#   2. the kernel benchmark: ours at its DECODE_TILES row, jax's own kernel where this jax has it,
#      dense attention over contiguous K/V (also written as JSON); at batch 64, then one sequence of
#      Llama-3.1-8B's heads at 8k and 32k context (where both our kernels split each sequence's keys)
#   3. the engine end to end on the embedded model: the Pallas backends (Triton, and Mosaic GPU
#      where this jax has it, on Hopper or Blackwell) against the reference backend, greedy tokens compared
#      and tok/s of each
#   4. the engine's programs for Llama-3.1-8B at GPU defaults, each timed beside its roofline
#      estimate (scripts/time_gpu_programs.py; the estimates are what compile_for_gpu.py prints)
#   5. speculative decoding (n-gram) on Llama-3.2-1B's shape: tok/s against the plain engine, the
#      same greedy tokens, and the timed costs of a decode step and a verification
#      (scripts/gpu_spec_check.py)
#   6. overlapped against serial scheduling at 256 running sequences with 256 more waiting, as on
#      a saturated server (scripts/benchmark_latency.py: end-to-end and decode tok/s of both, and
#      the host work each device waited for)
# From a source checkout with no install step (pytest's pythonpath is ".", the scripts put the
# checkout on sys.path); it needs jax with CUDA, flax and the project's dependencies present.
#   bash scripts/gpu_check.sh [REPORT_DIR]    (default: gpu_check/; the report is REPORT_DIR/report.md)
# GPU_CHECK_STEPS (default "1 2 3 4 5 6") runs some of the steps: a 15-minute lease is better spent as
# two calls (steps 1-3, then 4 or a rerun) than as one that leaves no time to rerun a fix.
set -uo pipefail  # not -e: every step runs, and a failed one makes the exit status 1
cd "$(dirname "$0")/.."
out="${1:-gpu_check}"
mkdir -p "$out"
report="$out/report.md"
python="${PYTHON:-python3}"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda,cpu}"  # the CPU too: tests that compare against it use it
status=0

steps="${GPU_CHECK_STEPS:-1 2 3 4 5 6}"
step() {  # step N TITLE SECONDS COMMAND...: run under a time limit; its output goes to the report
    local n=$1 title=$2 limit=$3 start=$SECONDS rc
    shift 3
    case " $steps " in *" $n "*) ;; *) return 0;; esac
    echo "== $title (limit $limit s)"
    timeout --kill-after=10 "$limit" "$@" > "$out/step$n.log" 2>&1
    rc=$?
    tail -n 120 "$out/step$n.log"
    { echo "## $title"; echo; echo '```'; tail -n 120 "$out/step$n.log"; echo '```'; echo
      echo "exit status $rc after $((SECONDS - start)) s (limit $limit s)"; echo; } >> "$report"
    [ "$rc" -eq 0 ] || status=1
}

{ echo "# GPU check, $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null)"
  echo; echo '```'; nvidia-smi -L 2>&1
  "$python" -c 'import jax; print("jax", jax.__version__, jax.devices())' 2>&1; echo '```'; echo
} > "$report"

# each failure in a fresh process (a kernel's fault poisons the CUDA context), the first fault
# again under compute-sanitizer; the rounds' logs go to $out/tests/
step 1 "gpu-marked tests" 200 "$python" scripts/gpu_tests.py --log-dir "$out/tests" --budget 180
step 2 "kernel benchmark" 130 bash -c "'$python' scripts/benchmark_kernel.py --out '$out/benchmark_kernel.json' &&
  '$python' scripts/benchmark_kernel.py --batch 1 --contexts 8192 32768 --num-kv-heads 8 \
    --out '$out/benchmark_kernel_one_sequence.json'"
step 3 "engine on the embedded model: pallas backends against reference" 100 "$python" - <<'EOF'
# Greedy tokens in bf16 may part where the model's top two are a near tie: a difference counts
# only where the reference's own logprobs put its token more than TIE above the kernel's.
import sys
import time

from pallas_kernels import mosaic, targets
from paged_jax import LLM, SamplingParams

TIE = 0.1  # nats: bf16 logits (2^-8 relative) of magnitude ~10 move by a few hundredths
PROMPTS = ["def fibonacci(n):\n", "import os\n", "class Stack:\n    def __init__(self):\n",
           'if __name__ == "__main__":\n']
params = SamplingParams(temperature=0.0, max_tokens=64, logprobs=5)
outputs = {}
on_mosaic = mosaic.AVAILABLE and targets.gpu_arch() in mosaic.ARCHS  # Hopper, Blackwell
pallas = ["pallas"] + (["pallas_mosaic"] if on_mosaic else [])
for backend in (*pallas, "reference"):
    llm = LLM("models/embedded", attention_backend=backend, log_stats=False)
    llm.generate(PROMPTS, params)  # compiles
    start = time.perf_counter()
    result = llm.generate(PROMPTS, params)
    seconds = time.perf_counter() - start
    outputs[backend] = [o.outputs[0] for o in result]
    generated = sum(len(o.token_ids) for o in outputs[backend])
    print(f"{backend:13} {generated} tokens in {seconds:.2f} s: {generated / seconds:.0f} tok/s")
real = []
for backend in pallas:
    for i, (a, ref) in enumerate(zip(outputs[backend], outputs["reference"])):
        j = next((j for j, (x, y) in enumerate(zip(a.token_ids, ref.token_ids)) if x != y), None)
        if j is None:
            print(f"{backend} prompt {i}: identical")
            continue
        tops = ref.logprobs[j]
        ours = tops.get(a.token_ids[j])
        margin = tops[ref.token_ids[j]].logprob - ours.logprob if ours else float("inf")
        verdict = "a near tie" if margin <= TIE else "A REAL DIFFERENCE"
        print(f"{backend} prompt {i}: first difference at token {j}: the reference ranks its token "
              f"{margin:.3f} nats above ours: {verdict}")
        if margin > TIE:
            real.append((backend, i))
sys.exit(1 if real else 0)
EOF

# 4. the engine's programs at the sizes users run (Llama-3.1-8B's config, 256 sequences, its whole
#    context), timed beside the roofline estimates scripts/compile_for_gpu.py prints without a GPU
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
case "$gpu" in *H200*) target=h200;; *A100*) target=a100;; *B200*) target=b200;; *) target=h100;; esac
step 4 "engine programs: measured beside the roofline ($target)" 180 "$python" scripts/time_gpu_programs.py \
    --gpu "$target" --model tests/data/configs/llama-3.1-8b.json --programs quick

step 5 "speculative decoding: n-gram against plain decoding (Llama-3.2-1B shape, bf16)" 200 \
    "$python" scripts/gpu_spec_check.py

step 6 "overlapped against serial scheduling at 256 running sequences, 256 more waiting (random 58M Llama)" 200 \
    "$python" scripts/benchmark_latency.py --batch-size 256 --num-requests 512 --input-len 32 --output-len 32 \
    --json "$out/benchmark_latency.json"

echo "wrote $report (exit status $status)"
exit $status
