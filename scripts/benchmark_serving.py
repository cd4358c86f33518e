"""Online serving figures (vLLM's benchmark_serving) against any OpenAI-compatible server: `--num-prompts`
streamed `/v1/completions` requests arriving as a Poisson process of `--request-rate` req/s.

    python scripts/benchmark_serving.py --url http://127.0.0.1:8000 --num-prompts 200 --request-rate 4

Prompts are random token ids, lengths lognormal as ShareGPT's; each asks for exactly its drawn output
length (`max_tokens`, `ignore_eos`), checked against the usage chunk. One untimed request first checks
the server (and takes its compile). TTFT: the first chunk with text or tokens; ITL: each later gap
between such chunks (K tokens per chunk show as K-token gaps); TPOT: (e2e - TTFT) / (output tokens - 1).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np

# ShareGPT's lengths are long-tailed, most turns short and a few very long (the PagedAttention paper's
# Fig. 11; means of 161 input and 338 output tokens, hence the defaults). A lognormal of sigma 0.8 has
# that shape: mode at 0.38 of the mean, standard deviation 0.95 of it. The law of benchlib's
# lognormal_lengths, which benchmark_throughput draws from (not imported: benchlib brings in jax).
SIGMA = 0.8
MIN_LEN = 4


def sample_lengths(rng, n: int, mean: float, high: int, sigma: float = SIGMA) -> np.ndarray:
    """i64[n] lengths in [MIN_LEN, high] from a lognormal whose mean after clipping is close to `mean`."""
    z = rng.standard_normal(n)
    mu = np.log(mean) - sigma**2 / 2
    for _ in range(8):  # clipping moves the mean: nudge mu until the clipped mean is the target
        mu += np.log(mean / np.clip(np.exp(mu + sigma * z), MIN_LEN, high).mean())
    return np.clip(np.round(np.exp(mu + sigma * z)), MIN_LEN, high).astype(np.int64)


def arrival_times(rng, n: int, rate: float) -> np.ndarray:
    """f64[n] send times in seconds from the start: the first at 0, then exponential gaps of mean
    1 / rate (a Poisson process, as vLLM's); rate inf sends all at once."""
    if np.isinf(rate):
        return np.zeros(n)
    return np.concatenate([[0.0], np.cumsum(rng.exponential(1.0 / rate, n - 1))])


@dataclasses.dataclass
class Record:
    """One request, times in seconds from its send; output_tokens from the usage chunk."""
    prompt_len: int
    max_tokens: int
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = dataclasses.field(default_factory=list)
    error: str | None = None


def _stats(name: str, seconds) -> dict:
    ms = 1e3 * np.asarray(seconds, float)
    if not ms.size:
        return {f"{s}_{name}_ms": None for s in ("mean", "median", "p99")}
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"p99_{name}_ms": float(np.percentile(ms, 99))}


def summarize(records: list[Record], duration_s: float) -> dict:
    """vLLM's serving metrics (its json keys) over the successful requests; ITL pools every gap."""
    ok = [r for r in records if r.error is None]
    num_in, num_out = sum(r.prompt_len for r in ok), sum(r.output_tokens for r in ok)
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return dict(completed=len(ok), failed=len(records) - len(ok),
                length_mismatches=sum(r.output_tokens != r.max_tokens for r in ok), duration=duration_s,
                total_input_tokens=num_in, total_output_tokens=num_out, request_throughput=len(ok) / duration_s,
                output_throughput=num_out / duration_s, total_token_throughput=(num_in + num_out) / duration_s,
                **_stats("ttft", [r.ttft_s for r in ok]), **_stats("tpot", tpot),
                **_stats("itl", [g for r in ok for g in r.itl_s]), **_stats("e2el", [r.e2e_s for r in ok]))


def print_summary(s: dict) -> None:
    """vLLM's result block: counts, throughputs, then mean / median / p99 of each latency in ms."""
    print(" Serving Benchmark Result ".center(50, "="))
    for label, key in (("Successful requests", "completed"), ("Failed requests", "failed"),
                       ("Output length != max_tokens", "length_mismatches"), ("Benchmark duration (s)", "duration"),
                       ("Total input tokens", "total_input_tokens"), ("Total generated tokens", "total_output_tokens"),
                       ("Request throughput (req/s)", "request_throughput"),
                       ("Output token throughput (tok/s)", "output_throughput"),
                       ("Total Token throughput (tok/s)", "total_token_throughput")):
        print(f"{label + ':':<40} {s[key] if isinstance(s[key], int) else format(s[key], '.2f')}")
    for title, name in (("Time to First Token", "ttft"), ("Time per Output Token (excl. 1st token)", "tpot"),
                        ("Inter-token Latency", "itl"), ("End-to-end Latency", "e2el")):
        print(title.center(50, "-"))
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            v = s[f"{stat}_{name}_ms"]
            print(f"{label + ' ' + name.upper() + ' (ms):':<40} {'-' if v is None else f'{v:.2f}'}")
    print("=" * 50)


async def send(client, model: str, prompt: list[int], max_tokens: int, send_at: float) -> Record:
    await asyncio.sleep(max(0.0, send_at - time.perf_counter()))
    r, start, last, usage = Record(len(prompt), max_tokens), time.perf_counter(), None, None
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            t = time.perf_counter()
            usage = chunk.usage or usage
            if chunk.choices and (chunk.choices[0].text or getattr(chunk.choices[0], "token_ids", None)):
                if last is None:
                    r.ttft_s = t - start
                else:
                    r.itl_s.append(t - last)
                last = t
        r.e2e_s, r.output_tokens = time.perf_counter() - start, usage.completion_tokens if usage else 0
        if last is None or usage is None:
            r.error = "no content chunk" if last is None else "no usage chunk (stream_options.include_usage)"
    except Exception as e:  # a failed request is counted, not fatal: the others' timings still stand
        r.error = f"{type(e).__name__}: {e}"
    return r


async def benchmark(args, prompts: list[list[int]], max_tokens: list[int], arrivals, warmup_prompt: list[int]):
    """(a Record per prompt, seconds from the first send to the last answer)."""
    from openai import AsyncOpenAI  # only the network part needs it

    async with AsyncOpenAI(base_url=args.url.rstrip("/") + "/v1", api_key=args.api_key, max_retries=0) as client:
        if args.model is None:
            args.model = (await client.models.list()).data[0].id
        warm = await send(client, args.model, warmup_prompt, max_tokens[0], 0.0)
        if warm.error:
            raise SystemExit(f"the untimed first request failed: {warm.error}")
        start = time.perf_counter()
        records = await asyncio.gather(*(send(client, args.model, p, m, start + a)
                                         for p, m, a in zip(prompts, max_tokens, arrivals)))
        return list(records), time.perf_counter() - start


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the server; requests go to URL/v1/completions")
    ap.add_argument("--model", help="default: the first id from GET /v1/models")
    ap.add_argument("--api-key", default=os.environ.get("PAGED_JAX_API_KEY", "EMPTY"))
    ap.add_argument("--num-prompts", type=int, default=100, help="vLLM: 1000")
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="req/s; inf sends all at once")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--input-len-mean", type=float, default=160)
    ap.add_argument("--input-len-max", type=int, default=512, help="with --output-len-max: within max_model_len")
    ap.add_argument("--output-len-mean", type=float, default=340)
    ap.add_argument("--output-len-max", type=int, default=512)
    ap.add_argument("--vocab-size", type=int, default=512, help="prompt token ids are drawn from [0, vocab-size)")
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args(argv)
    lens = ((args.input_len_mean, args.input_len_max), (args.output_len_mean, args.output_len_max))
    if args.num_prompts < 1 or not args.request_rate > 0 or not all(MIN_LEN <= m <= h for m, h in lens):
        ap.error(f"need --num-prompts >= 1, --request-rate > 0 and {MIN_LEN} <= each length's mean <= its max")
    rng = np.random.default_rng(args.seed)  # lengths and prompts first: the same workload at every rate
    input_lens = sample_lengths(rng, args.num_prompts, args.input_len_mean, args.input_len_max)
    max_tokens = sample_lengths(rng, args.num_prompts, args.output_len_mean, args.output_len_max).tolist()
    prompts = [rng.integers(0, args.vocab_size, n).tolist() for n in input_lens]
    arrivals = arrival_times(rng, args.num_prompts, args.request_rate)
    warmup_prompt = rng.integers(0, args.vocab_size, input_lens[0]).tolist()  # not a prompt: no prefix-cache hit
    records, duration = asyncio.run(benchmark(args, prompts, max_tokens, arrivals, warmup_prompt))
    summary = summarize(records, duration)
    print(f"serving: {args.num_prompts} prompts at {args.request_rate} req/s to {args.url}, model {args.model}; mean "
          f"input {np.mean(input_lens):.0f} / output {np.mean(max_tokens):.0f} tokens")
    for r in [r for r in records if r.error][:3]:
        print(f"failed: {r.error}")
    print_summary(summary)
    if args.json:
        result = {k: v for k, v in vars(args).items() if k != "api_key"} | summary
        result |= dict(request_rate=args.request_rate if np.isfinite(args.request_rate) else "inf",
                       requests=[dataclasses.asdict(r) for r in records])
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
