"""Compile an engine's programs before traffic comes, as vLLM captures its CUDA graphs at start.

The programs are those of short requests at every row bucket r up to max_num_seqs: r prompts
filling each token bucket up to r x `prompt_len` (the prefill steps; one program serves greedy and
sampled rows), then two decode calls of r rows, greedy and sampled, and the continuation that
builds the second call's batch on the device; with speculative decoding, r rows verifying k
proposals each after either call. Longer sequences compile their wider tables when they first
need them.

Each program is compiled from the plan the scheduler would make, through the runner's own input
builders (`ModelRunner.compile`), on a pool of threads: nothing runs, the engine is untouched, and
it may serve meanwhile (a step that needs a program still compiling waits for it; jit compiles it
once). Tracing holds the GIL; XLA's compilation does not, so the threads overlap it. Programs
already in the persistent compilation cache are read from it.
"""
from __future__ import annotations

import concurrent.futures
import os
import threading
import time

import jax
import numpy as np

from paged_jax.core.plan import Plan
from paged_jax.core.sequence import Request, Sequence
from paged_jax.sampling_params import SamplingParams
from paged_jax.worker import batching

_COMPILED = "/jax/core/compile/backend_compile_duration"
_CACHED = "/jax/compilation_cache/cache_retrieval_time_sec"


def max_prompt_len(config) -> int:
    """The longest warm-up prompt: max_model_len leaves room for its two decode calls (or a decode
    call and a verification)."""
    steps = config.num_decode_steps
    return config.max_model_len - 1 - max(2 * steps, steps + config.num_speculative_tokens)


def check_prompt_len(config, prompt_len: int) -> None:
    room = max_prompt_len(config)
    if not 1 <= prompt_len <= room:
        raise ValueError(f"prompt_len={prompt_len} must be in [1, {room}] (max_model_len="
                         f"{config.max_model_len} leaves room for two decode calls)")


def _rows(config, lengths: list[int], mapped: list[int], temperature: float):
    """(sequences of these token counts, tables that map `mapped` tokens of each, the counts)."""
    params = SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=2 * config.num_decode_steps + 1)
    request = Request("warm-up", None, [], params, 0.0)
    seqs = [Sequence(request, 0, [0] * n, np.zeros(2, np.uint32), slot=i) for i, n in enumerate(lengths)]
    blocks = max(-(-m // config.block_size) for m in mapped)
    return seqs, np.ones((len(seqs), blocks), np.int32), np.array(mapped, np.int32)


def _prefill(config, num_rows: int, length: int) -> Plan:
    seqs, tables, mapped = _rows(config, [length] * num_rows, [length] * num_rows, 1.0)
    return Plan(scheduled=[(s, length) for s in seqs], admitted={s.slot for s in seqs}, block_tables=tables,
                num_mapped=mapped)


def _decode(config, num_rows: int, length: int, temperature: float) -> Plan:
    """A decode call of rows `length` tokens long (one not yet in the cache), each mapping the next
    num_decode_steps tokens."""
    seqs, tables, mapped = _rows(config, [length] * num_rows, [length - 1 + config.num_decode_steps] * num_rows,
                                 temperature)
    for seq in seqs:
        seq.num_computed = seq.prefill_end = length - 1
    return Plan(scheduled=[(s, 1) for s in seqs], is_decode=True, block_tables=tables, num_mapped=mapped)


def _verify(config, num_rows: int, length: int, num_tokens: int) -> Plan:
    """A verification of speculative proposals: decoding rows `length` tokens long, `num_tokens` in
    all (each row's last token and up to k proposals; stand-ins, whose values select nothing)."""
    k = config.num_speculative_tokens
    seqs, tables, mapped = _rows(config, [length] * num_rows, [length + k] * num_rows, 0.0)
    drafts = {}
    for i, seq in enumerate(seqs):
        seq.num_computed = seq.prefill_end = length - 1
        n = (num_tokens - num_rows) // num_rows + (i < (num_tokens - num_rows) % num_rows)
        if n:
            drafts[seq] = [0] * n
    return Plan(scheduled=[(s, 1 + len(drafts.get(s, ()))) for s in seqs], block_tables=tables,
                num_mapped=mapped, drafts=drafts)


def plans(config, prompt_len: int) -> dict[tuple, Plan]:
    """The warm-up's plans, one per program (keyed by what selects it), batch-1 ones first: the
    programs a first short request needs."""
    check_prompt_len(config, prompt_len)
    room, steps = max_prompt_len(config), config.num_decode_steps
    rows = sorted({min(1 << i, config.max_num_seqs) for i in range(config.max_num_seqs.bit_length() + 1)})
    out: dict[tuple, Plan] = {}

    def add(plan: Plan):
        seqs = [s for s, _ in plan.scheduled]
        batch = (batching.decode_batch(plan, max_num_seqs=config.max_num_seqs, max_blocks_per_seq=config.max_blocks_per_seq)
                 if plan.is_decode else
                 batching.prefill_batch(plan, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
                                        max_blocks_per_seq=config.max_blocks_per_seq,
                                        token_cap=config.max_num_batched_tokens,
                                        num_speculative_tokens=config.num_speculative_tokens))
        key = (plan.is_decode, seqs[0].request.params.temperature > 0 and plan.is_decode,
               tuple(np.shape(x) for x in jax.tree.leaves(batch)))
        out.setdefault(key, plan)

    for r in rows:
        tokens = 1 << max(4, (r - 1).bit_length())  # batching.MIN_TOKEN_BUCKET, or r rounded up
        lengths = []
        while True:  # every token bucket up to the one holding r x prompt_len
            lengths.append(min(tokens // r, room))
            if tokens >= min(r * prompt_len, config.max_num_batched_tokens):
                break
            tokens *= 2
        for n in lengths:
            add(_prefill(config, r, n))
        for n, temperature in [(n, 1.0) for n in lengths] + [(min(prompt_len, room), 0.0)]:
            for call in range(2):  # two calls: the second's tables reach num_decode_steps further
                add(_decode(config, r, n + 1 + call * steps, temperature))
        most = r * (1 + config.num_speculative_tokens)  # tokens of r rows verifying k proposals each
        verifies = {min(1 << b, most) for b in range(r.bit_length(), most.bit_length() + 1)} if most > r else ()
        for tokens in sorted(verifies):
            for call in range(2):  # verifications of every token bucket, after either decode call
                add(_verify(config, r, min(prompt_len, room) + 1 + call * steps, tokens))
    return out


class WarmUp:
    """The warm-up's compilations on `workers` threads: `start()`, then `progress` or `wait()`."""

    def __init__(self, engine, prompt_len: int = 32, workers: int | None = None):
        self.runner = engine.model_runner
        self.plans = list(plans(engine.config, prompt_len).values())
        self.workers = workers or min(4, os.cpu_count() or 1)
        self.done = 0
        self.error: BaseException | None = None
        self._events: list[str] = []
        self._lock = threading.Lock()
        self._futures: list[concurrent.futures.Future] = []
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._start = 0.0

    @property
    def total(self) -> int:
        return len(self.plans)

    @property
    def finished(self) -> bool:
        return self.done == self.total or self.error is not None

    def start(self) -> WarmUp:
        self._start = time.perf_counter()
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        self._pool = concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix="paged-jax-warm-up")
        self._futures = [self._pool.submit(self._compile, plan) for plan in self.plans]
        return self

    def cancel(self) -> None:
        """Drop the compilations not started (a server stopping mid-warm-up exits after the running ones)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _listen(self, event, duration, **kwargs):
        if event in (_COMPILED, _CACHED):
            with self._lock:
                self._events.append(event)

    def _compile(self, plan: Plan) -> None:
        if self.error is not None:
            return
        try:
            self.runner.compile(plan)
        except BaseException as e:  # noqa: BLE001  reported by wait() and on /health
            self.error = e
            raise
        finally:
            with self._lock:
                self.done += 1

    def wait(self) -> dict:
        """Block until every program is compiled -> {"programs": compiled or loaded (XLA
        compilations while it ran, the continuations' and any the engine needed meanwhile
        included), "cached": of those, loaded, "seconds": wall clock}. Raises what a compilation raised."""
        try:
            for future in self._futures:
                future.result()
        finally:
            jax.monitoring.unregister_event_duration_listener(self._listen)
            self._pool.shutdown(wait=False)
        return {"programs": self._events.count(_COMPILED), "cached": self._events.count(_CACHED),
                "seconds": time.perf_counter() - self._start}
