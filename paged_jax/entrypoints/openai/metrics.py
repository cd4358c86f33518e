"""vLLM's Prometheus metrics (vllm/v1/metrics/loggers.py): the same names, labels and buckets, so
dashboards and alerts written for vLLM read ours. Updated on the engine thread after each step
(`AsyncLLM(on_step=...)`); prometheus_client's metrics are thread-safe for the scrape."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# vLLM's buckets (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
# engine.stats() key -> counter name; vLLM counts prefix-cache queries and hits in tokens, as we do.
COUNTERS = {"prompt_tokens": "vllm:prompt_tokens", "generation_tokens": "vllm:generation_tokens",
            "prefix_cache_queries": "vllm:prefix_cache_queries", "prefix_cache_hits": "vllm:prefix_cache_hits",
            "num_preemptions": "vllm:num_preemptions"}
# With speculative decoding (vLLM's SpecDecodingProm); per position: accepted drafts at each index.
SPEC_COUNTERS = {"spec_decode_num_drafts": "vllm:spec_decode_num_drafts",
                 "spec_decode_num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
                 "spec_decode_num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens"}


class Metrics:
    def __init__(self, model_name: str, num_speculative_tokens: int = 0):
        self.registry = CollectorRegistry()
        labels = dict(labelnames=["model_name", "engine"], registry=self.registry)
        values = dict(model_name=model_name, engine="0")

        def gauge(name, doc):
            return Gauge(name, doc, multiprocess_mode="mostrecent", **labels).labels(**values)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, buckets=buckets, **labels).labels(**values)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        names = {**COUNTERS, **(SPEC_COUNTERS if num_speculative_tokens else {})}
        self.counters = {key: Counter(name, f"Number of {key.replace('_', ' ')}.", **labels).labels(**values)
                         for key, name in names.items()}
        self._seen = dict.fromkeys(names, 0)
        self.per_pos, self._seen_per_pos = [], [0] * num_speculative_tokens
        if num_speculative_tokens:
            per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                              labelnames=["model_name", "engine", "position"], registry=self.registry)
            self.per_pos = [per_pos.labels(position=str(i), **values) for i in range(num_speculative_tokens)]
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          labelnames=["model_name", "engine", "finished_reason"], registry=self.registry)
        self.success = {reason: success.labels(finished_reason=reason, **values)
                        for reason in ("stop", "length", "abort", "error")}
        # Ours (vLLM has no such limit): requests refused with 503, past --max-waiting-requests.
        self.refused = Counter("paged_jax:requests_refused", "Requests refused with 503 while the server was full.",
                               **labels).labels(**values)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.",
                             E2E_BUCKETS)
        self._last_token_time: dict[str, float] = {}

    def on_step(self, engine, outputs) -> None:
        """After one engine step (engine thread): gauges, counters by how much they grew, latencies."""
        stats = engine.stats()
        self.running.set(stats["num_requests_running"])
        self.waiting.set(stats["num_requests_waiting"])
        self.kv_usage.set(stats["kv_cache_usage"])
        for key, counter in self.counters.items():
            counter.inc(stats[key] - self._seen[key])
            self._seen[key] = stats[key]
        for i, counter in enumerate(self.per_pos):
            value = stats["spec_decode_num_accepted_tokens_per_pos"][i]
            counter.inc(value - self._seen_per_pos[i])
            self._seen_per_pos[i] = value
        now = time.monotonic()
        for out in outputs:
            self._observe(out, now)

    def _observe(self, out, now: float) -> None:
        new_tokens = max((len(c.token_ids) for c in out.outputs), default=0)
        times = out.metrics or {}
        last = self._last_token_time.get(out.request_id)
        if new_tokens and last is None and times.get("first_token_time") is not None:
            self.ttft.observe(times["first_token_time"] - times["arrival_time"])
            last, new_tokens = times["first_token_time"], new_tokens - 1
        if new_tokens and last is not None:
            # K tokens from one multi-step decode call arrive together: each is charged its share.
            for _ in range(new_tokens):
                self.itl.observe((now - last) / new_tokens)
        if last is not None:
            self._last_token_time[out.request_id] = now
        for c in out.outputs:
            if c.finish_reason is not None:  # vLLM V1 counts each of n samples as a request
                self.success[c.finish_reason].inc()
        if out.finished:
            self._last_token_time.pop(out.request_id, None)
            if times.get("finish_time") is not None:
                self.e2e.observe(times["finish_time"] - times["arrival_time"])
