"""Latency of one batch (vLLM's benchmark_latency): `--batch-size` requests of `--input-len` random
tokens, each answered with exactly `--output-len` tokens (greedy, ignore_eos), on a random Llama
(58M parameters by default); warm-up runs first, then timed runs, each with fresh prompts so that
no run hits the prefix cache of the one before.

    python scripts/benchmark_latency.py [--batch-size 8 --input-len 32 --output-len 128]

Per-token latency is the decode time per output token after the first, (finish - first token) /
(output_len - 1); the engine returns tokens K = --num-decode-steps at a time, so it is their mean.
Compile time is the first run's extra time over the median run, reported apart. Also the host's
share of the engine's time (scheduling, batching, output processing: busy time less the device
calls) per device call, and the bytes each decode call moves between host and device; run it at
`--batch-size 256` for a GPU's default concurrency. Two engines run the same prompts in turns, one
with async scheduling off (serial), one on (overlapped): tok/s of each, and the host time the
host work each device waited for per call (the runs' time beyond the device's busy time, which a
thread waiting on each call's output measures in the same runs).

On a CPU the "device" is the host's own cores: host work there slows the device's threads whatever
the schedule. `--host-core N` gives the engine's host thread core N alone and the CPU device's
compute threads the other cores, as a GPU computes apart from its host, so that what the overlap
hides is measured rather than lost to the shared cores.

`--num-requests` above `--batch-size` keeps requests waiting while the batch decodes, as on a
saturated server: each decode call then runs with requests waiting, and the call after it admits
them where rows reach their max_tokens.

`--speculative-config` (vLLM's JSON) runs both engines with speculative decoding; a draft model
"target" is the target itself, whose every draft is accepted: verification calls then follow
each other, planned ahead of their predecessors' outputs in the overlapped engine. On a CPU a
verification costs about as many steps as it has tokens, so the engine's timed costs turn it down;
`--speculate-by-acceptance` verifies anyway, to measure the overlap of verification calls.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from paged_jax import LLM, SamplingParams  # noqa: E402
from scripts import benchlib  # noqa: E402

QUANTILES = (10, 25, 50, 75, 90, 99)


class DeviceTimeline:
    """When each of an engine's device calls ends, seen by a thread that waits on its output (the
    wait releases the GIL; a short switch interval lets it take the time at once), so the device's
    own busy time is measured in the engine's runs: host work it waited for is their time beyond it."""

    def __init__(self, runner):
        self.calls = []  # (dispatched, ended) perf_counter seconds
        self._sent = 0
        self._queue = queue.SimpleQueue()
        threading.Thread(target=self._watch, daemon=True).start()
        dispatch = runner.dispatch

        def timed(plan, prev=None):
            call = dispatch(plan, prev)
            self._sent += 1
            self._queue.put((call.start, call.out))
            return call
        runner.dispatch = timed

    def _watch(self):
        while True:
            start, out = self._queue.get()
            jax.block_until_ready(out)
            self.calls.append((start, time.perf_counter()))

    def busy_seconds(self) -> float:
        """The device's busy time so far: each call from its start (or the previous call's end) to its end."""
        while len(self.calls) < self._sent:  # the watcher has yet to see the last ones end
            time.sleep(1e-3)
        busy, last_end = 0.0, 0.0
        for start, end in self.calls:
            busy += max(0.0, end - max(start, last_end))
            last_end = end
        return busy


def run_once(llm, args, prompts) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    r = benchlib.run_engine(llm, prompts, [params] * len(prompts))
    if any(len(o.outputs[0].token_ids) != args.output_len for o in r["outputs"]):
        raise RuntimeError(f"a request did not get exactly {args.output_len} tokens: the timings would not compare")
    m = [o.metrics for o in r["outputs"]]
    return dict(latency_s=r["run_s"] + r["compile_s"], compile_s=r["compile_s"],
                ttft_ms=[1e3 * t for t in r["ttft_s"]],
                tpot_ms=[1e3 * (x["finish_time"] - x["first_token_time"]) / max(args.output_len - 1, 1) for x in m])


def measure(model, args, seq_len, rng) -> dict:
    """Two engines, async scheduling off (serial) and on (overlapped), each warmed up, then timed in
    turns on the same fresh prompts (the order swapping each round), so the machine's drift falls on
    both -> {overlapped: (host figures, compile summary, latency rows, raw metrics, tok/s)}."""
    llms = {overlapped: LLM(model, block_size=args.block_size,
                            num_blocks=args.batch_size * -(-seq_len // args.block_size) + 1,
                            max_num_seqs=args.batch_size, max_num_batched_tokens=max(512, args.batch_size),
                            max_model_len=seq_len, num_decode_steps=args.num_decode_steps, log_stats=False,
                            async_scheduling=overlapped, speculative_config=_speculative(args, model))
            for overlapped in (False, True)}
    for llm in llms.values():
        if args.speculate_by_acceptance:  # a multi-process engine's rule, not this machine's timed costs
            llm.engine.speculator.timed = False
    timelines = {o: DeviceTimeline(llm.engine.model_runner) for o, llm in llms.items()}
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    warmup, runs, before = {o: [] for o in llms}, {o: [] for o in llms}, {}
    for i in range(args.num_iters_warmup + args.num_iters):
        if i == args.num_iters_warmup:
            before = {o: dict(llm.stats(), device_busy=timelines[o].busy_seconds()) for o, llm in llms.items()}
        prompts = [rng.integers(0, args.vocab_size, args.input_len).tolist() for _ in range(args.num_requests)]
        for o in (False, True) if i % 2 == 0 else (True, False):
            (warmup if i < args.num_iters_warmup else runs)[o].append(run_once(llms[o], args, prompts))
    sys.setswitchinterval(switch)
    return {o: summarize(args, warmup[o], runs[o], before[o], dict(llms[o].stats(), device_busy=timelines[o].busy_seconds()))
            for o in llms}


def _speculative(args, model) -> dict | None:
    """--speculative-config, its draft model "target" the target itself."""
    config = args.speculative_config
    return config and dict(config, **({"model": model} if config.get("model") == "target" else {}))


def summarize(args, warmup, runs, before, after):
    d = {k: after[k] - before[k] for k in ("busy_seconds", "device_seconds", "device_busy", "decode_calls",
                                           "prefill_steps", "overlapped_calls", "overlapped_verifications",
                                           "decode_bytes_to_device", "decode_bytes_from_device")}
    calls = d["decode_calls"] + d["prefill_steps"]
    wall = sum(r["latency_s"] for r in runs)
    exposed = wall - d["device_busy"]  # the runs' time with the device idle
    host = dict(calls=calls, busy_seconds=d["busy_seconds"], device_seconds=d["device_seconds"], wall_seconds=wall,
                device_busy_seconds=d["device_busy"], overlapped_calls=d["overlapped_calls"],
                overlapped_verifications=d["overlapped_verifications"],
                exposed_ms_per_call=1e3 * exposed / calls, exposed_share=exposed / wall,
                decode_bytes_to_device=d["decode_bytes_to_device"] / max(d["decode_calls"], 1),
                decode_bytes_from_device=d["decode_bytes_from_device"] / max(d["decode_calls"], 1))
    latency = [r["latency_s"] for r in runs]
    summary = dict(first_run_extra_s=warmup[0]["latency_s"] - float(np.median(latency)),
                   compile_s=warmup[0]["compile_s"], timed_runs_compile_s=sum(r["compile_s"] for r in runs))
    metrics = {"end-to-end latency (s)": latency,
               "time to first token (ms)": [t for r in runs for t in r["ttft_ms"]],
               "decode per token (ms)": [t for r in runs for t in r["tpot_ms"]]}
    rows = [dict(name=name, **benchlib.percentiles(values, QUANTILES)) for name, values in metrics.items()]
    tok_s = dict(decode=args.batch_size / np.median(metrics["decode per token (ms)"]) * 1e3,
                 end_to_end=args.num_requests * args.output_len / np.median(latency))
    return host, summary, rows, metrics, tok_s


def pin_host(core: int) -> None:
    """The CPU device's threads on every core but `core`, this (the engine's) thread on `core`:
    the device's thread pool starts with the affinity of the thread that first runs a program."""
    import jax
    import jax.numpy as jnp

    cores = os.sched_getaffinity(0)
    if core not in cores or len(cores) < 2:
        raise SystemExit(f"--host-core {core}: this process may run on cores {sorted(cores)}; it needs that core "
                         f"and at least one more")
    os.sched_setaffinity(0, cores - {core})
    jax.jit(lambda x: x @ x)(jnp.ones((256, 256))).block_until_ready()
    os.sched_setaffinity(0, {core})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-requests", type=int, help="requests per run (default: --batch-size); more keep requests "
                    "waiting while the batch decodes, as on a saturated server")
    ap.add_argument("--num-iters-warmup", type=int, default=2, help="vLLM: 10; fewer on a CPU")
    ap.add_argument("--num-iters", type=int, default=5, help="vLLM: 30; fewer on a CPU")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-decode-steps", type=int, default=8, help="decode steps per device call (K)")
    ap.add_argument("--host-core", type=int, help="run the engine's host thread alone on this core, the CPU "
                    "device's compute on the others (a device apart from its host, as a GPU is)")
    ap.add_argument("--speculative-config", type=json.loads, help="speculative decoding, as vLLM's JSON; a draft "
                    'model "target" is the target itself (every draft accepted)')
    ap.add_argument("--speculate-by-acceptance", action="store_true", help="verify whenever the rows' acceptance "
                    "expects enough drafts (a multi-process engine's rule), whatever this device's timed costs say")
    ap.add_argument("--json", help="write the results here")
    benchlib.add_model_args(ap)
    args = ap.parse_args(argv)
    if args.num_iters_warmup < 1 or args.num_iters < 1:
        ap.error("--num-iters-warmup and --num-iters must be at least 1 (the first run compiles)")
    if args.speculate_by_acceptance and not args.speculative_config:
        ap.error("--speculate-by-acceptance needs --speculative-config")
    args.num_requests = args.num_requests or args.batch_size
    if args.num_requests < args.batch_size:
        ap.error(f"--num-requests {args.num_requests} is below --batch-size {args.batch_size}: the batch would not fill")
    if args.host_core is not None:
        pin_host(args.host_core)
    seq_len = args.input_len + args.output_len
    model = benchlib.random_llama(args, seq_len)
    rng = np.random.default_rng(args.seed)
    measured = measure(model, args, seq_len, rng)
    serial, summary, rows, metrics, serial_tok_s = measured[False]
    overlapped, *_, overlapped_tok_s = measured[True]
    print(f"latency: batch {args.batch_size}, {args.num_requests} requests, input {args.input_len}, output "
          f"{args.output_len} tokens; random Llama {benchlib.num_params(model) / 1e6:.0f}M params, {args.dtype}; {args.num_iters_warmup} warm-up + "
          f"{args.num_iters} timed runs" + (f"; host thread on core {args.host_core}" if args.host_core is not None
                                            else ""))
    for kind in ("end_to_end", "decode"):
        print(f"{kind.replace('_', '-')}: {serial_tok_s[kind]:.1f} tok/s serial, {overlapped_tok_s[kind]:.1f} tok/s "
              f"overlapped ({overlapped_tok_s[kind] / serial_tok_s[kind]:.2f}x)")
    print(f"compile: the first run took {summary['first_run_extra_s']:.2f} s longer than the median (jax compile "
          f"events: {summary['compile_s']:.2f} s); the timed runs compiled {summary['timed_runs_compile_s']:.2f} s")
    print(f"host work the device waited for, per call: serial {serial['exposed_ms_per_call']:.2f} ms "
          f"({serial['exposed_share']:.1%} of the runs' time), overlapped {overlapped['exposed_ms_per_call']:.2f} "
          f"ms ({overlapped['exposed_share']:.1%}); the device busy {serial['device_busy_seconds']:.2f} s serial, "
          f"{overlapped['device_busy_seconds']:.2f} s overlapped; {overlapped['overlapped_calls']} of "
          f"{overlapped['calls']} calls dispatched before the one before was processed"
          + (f" ({overlapped['overlapped_verifications']} verifying proposals)" if args.speculative_config else ""))
    print(f"each decode call of {args.num_decode_steps} steps sends {serial['decode_bytes_to_device'] / 1024:.1f} KiB "
          f"and fetches {serial['decode_bytes_from_device'] / 1024:.1f} KiB")
    benchlib.print_table(rows, [("name", "metric", "s"), ("mean", "mean", ".2f")]
                         + [(f"p{q}", f"p{q}", ".2f") for q in QUANTILES])
    if args.json:
        result = dict(vars(args), **summary, serial=serial, overlapped=overlapped, tok_s=serial_tok_s,
                      overlapped_tok_s=overlapped_tok_s,
                      rows=rows, raw=metrics)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
