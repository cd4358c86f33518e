"""`LLMEngine`: vLLM's add_request / step / abort_request loop around the jitted runner.

One `step()` schedules (host), runs one device call (a ragged `prefill_step`, or `decode_steps`
when every running sequence is decoding) and turns the tokens it returns into outputs.
"""
from __future__ import annotations

import dataclasses
import itertools
import time

import jax
import numpy as np
from flax import nnx

from paged_jax.core import block_pool
from paged_jax.core.prefix_cache import PrefixCache
from paged_jax.core.scheduler import Plan, Scheduler
from paged_jax.core.sequence import Request, Sequence, Status
from paged_jax.engine import config as config_lib
from paged_jax.engine.output_processor import OutputProcessor
from paged_jax.engine.outputs import RequestOutput
from paged_jax.engine.sampling_params import SamplingParams
from paged_jax.worker import batching, runner, sharding
from paged_jax.worker.attention import cache_layout, resolve_backend


class LLMEngine:
    def __init__(self, model, tokenizer=None, *, block_size=16, num_blocks=None,
                 kv_cache_memory_fraction=0.9, max_num_seqs=None, max_num_batched_tokens=None,
                 max_model_len=None, num_decode_steps=8, long_prefill_token_threshold=0,
                 enable_prefix_caching=True, attention_backend="auto", seed=0, mesh=None, log_stats=True):
        """`mesh`: a jax Mesh with a "model" axis for tensor parallelism (paged_jax.worker.sharding)."""
        if mesh is not None:
            model = sharding.shard_model(model, mesh)
        self.mesh = mesh
        self.model_config = model.config
        self.tokenizer = tokenizer
        self.output_processor = OutputProcessor(tokenizer)
        kv_dtype = np.dtype(model.config.dtype)
        self.config = config_lib.resolve(
            model.config, block_size=block_size, num_blocks=num_blocks,
            kv_cache_memory_fraction=kv_cache_memory_fraction, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            num_decode_steps=num_decode_steps, long_prefill_token_threshold=long_prefill_token_threshold,
            enable_prefix_caching=enable_prefix_caching,
            attention_backend=resolve_backend(attention_backend), kv_dtype=kv_dtype,
            kv_shards=sharding.tensor_parallel_size(mesh))
        if log_stats:
            config_lib.announce(self.config)
        c = self.config
        self.graphdef, self.params = nnx.split(model)
        pool = block_pool.init(c.num_blocks, c.block_size, c.max_num_seqs, c.max_blocks_per_seq)
        empty = np.zeros((c.max_num_seqs, 0))
        layout = cache_layout(c.attention_backend)
        if mesh is None:
            cache = model.init_cache(c.num_blocks, c.block_size, layout=layout)
        else:  # made in place on the mesh: one device could not hold the whole cache
            shape = jax.eval_shape(lambda: model.init_cache(c.num_blocks, c.block_size, layout=layout))
            cache = jax.jit(lambda: model.init_cache(c.num_blocks, c.block_size, layout=layout),
                            out_shardings=sharding.named(sharding.cache_specs(shape), mesh))()
        state = runner.DeviceState(cache=cache, pool=pool, output_counts=empty.astype(np.int32),
                                   prompt_mask=empty.astype(bool))
        if mesh is not None:  # the pool and sampling state: one copy on every device
            state = dataclasses.replace(state, **{f: sharding.replicate(getattr(state, f), mesh)
                                                  for f in ("pool", "output_counts", "prompt_mask")})
        self.state = state
        self.prefix_cache = PrefixCache(enabled=c.enable_prefix_caching)
        self.scheduler = Scheduler(
            max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
            block_size=c.block_size, num_blocks=c.num_blocks, max_blocks_per_seq=c.max_blocks_per_seq,
            long_prefill_token_threshold=c.long_prefill_token_threshold, prefix_cache=self.prefix_cache)
        self.eos_token_ids = tuple(tokenizer.eos_token_ids) if tokenizer is not None else tuple(
            np.atleast_1d(model.config.eos_token_id if model.config.eos_token_id is not None else []).tolist())
        self.requests: dict[str, Request] = {}
        self._finished_outside_step: set[str] = set()  # rejected or aborted: reported by the next step
        self.seed = seed
        self._request_counter = itertools.count()
        self.counters = dict(prompt_tokens=0, generation_tokens=0, prefill_tokens=0, prefill_steps=0,
                             decode_calls=0, decode_steps=0, model_steps=0, running_steps=0,
                             max_num_running=0, busy_seconds=0.0, peak_blocks_used=0)

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, *,
                    cache_salt: str | None = None) -> None:
        """Queue a request: `prompt` is a string (needs a tokenizer) or a list of token ids."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self.tokenize_prompt(prompt)
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop strings {params.stop!r} need a tokenizer to detokenize the output")
        now = time.monotonic()
        request = Request(request_id, text, ids, params, now, cache_salt=cache_salt)
        index = next(self._request_counter)
        for i in range(params.n):
            # A raw threefry key per sample, derived on the host (no device work per request): from
            # the request's seed, or else from the engine's seed and the request's arrival index.
            seeds = (np.random.SeedSequence(params.seed, spawn_key=(i,)) if params.seed is not None else
                     np.random.SeedSequence(self.seed, spawn_key=(1 << 31, index, i)))
            request.seqs.append(Sequence(request, i, list(ids), seeds.generate_state(2, np.uint32)))
        self.requests[request_id] = request
        self.counters["prompt_tokens"] += len(ids)
        error = self._unservable(request)
        if error:
            request.error = error
            for seq in request.seqs:
                seq.status = Status.FINISHED_ERROR
            request.finish_time = now
            self._finished_outside_step.add(request_id)
            return
        if params.uses_penalties and self.state.penalties is None:
            self._enable_penalties()
        parent = request.seqs[0]
        parent.children = request.seqs[1:]
        self.scheduler.add(parent)

    def tokenize_prompt(self, prompt):
        """(text or None, token ids) of a prompt; ValueError naming what is wrong with it."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids or a model with tokenizer.json")
            ids = self.tokenizer.encode(prompt)
            text = prompt
        else:
            ids, text = [int(t) for t in prompt], None
        if not ids:
            raise ValueError(f"the prompt is empty: {prompt!r}")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:8]} are outside [0, {vocab})")
        return text, ids

    def _unservable(self, request: Request) -> str | None:
        c, n = self.config, len(request.prompt_token_ids)
        if n >= c.max_model_len:
            return f"the prompt has {n} tokens, max_model_len is {c.max_model_len} (one more is needed for output)"
        longest = min(c.max_model_len, n + (request.params.max_tokens or c.max_model_len))
        need = -(-longest // c.block_size) + (request.params.n - 1) * int(n % c.block_size != 0)
        if need > c.num_blocks - 1:
            return f"the request may need {need} blocks, the KV cache holds {c.num_blocks - 1}"
        if request.params.n > c.max_num_seqs:
            return f"n={request.params.n} samples exceed max_num_seqs={c.max_num_seqs}"
        return None

    def abort_request(self, request_ids) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.requests.get(request_id)
            if request is None or request.finished:
                continue
            for seq in request.seqs:
                self.scheduler.finish(seq, Status.FINISHED_ABORTED)
            request.finish_time = time.monotonic()
            self._finished_outside_step.add(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(not r.finished for r in self.requests.values())

    def get_num_unfinished_requests(self) -> int:
        return sum(not r.finished for r in self.requests.values())

    # -- one step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one device call; return the outputs of requests that progressed or finished."""
        touched, self._finished_outside_step = self._finished_outside_step, set()
        if self.scheduler.has_work:
            start = time.perf_counter()
            plan = self.scheduler.schedule(self._block_versions)
            if plan.scheduled and plan.is_decode:
                out = self._decode(plan)
                self._count_steps(int(out["steps"]), len(plan.scheduled))
            elif plan.scheduled or plan.free_slots:
                out = self._prefill(plan)
                self._count_steps(1, len(plan.scheduled) + len(plan.forks))
            else:
                stuck = self.scheduler.waiting[0].request.request_id
                raise RuntimeError(f"internal error: nothing can run, request {stuck!r} waits forever")
            self.scheduler.observe(out)
            self.scheduler.after_step(plan)
            touched |= self._take_tokens(out)
            for seq in self.scheduler.running:
                self.scheduler.cache_full_blocks(seq)
            self.counters["busy_seconds"] += time.perf_counter() - start
            used = self.config.num_blocks - 1 - self.scheduler.num_free
            self.counters["peak_blocks_used"] = max(self.counters["peak_blocks_used"], used)
        if not self.scheduler.has_work and (self.scheduler.pending_free or self.scheduler.pending_marks):
            self._flush()
        outputs = []
        for request_id in touched:
            request = self.requests[request_id]
            outputs.append(self.output_processor.make_output(request))
            if request.finished:
                del self.requests[request_id]
        return outputs

    def _count_steps(self, steps, running):
        k = self.counters
        k["model_steps"] += steps
        k["running_steps"] += steps * running
        k["max_num_running"] = max(k["max_num_running"], running if steps else 0)

    def _flush(self):
        """Going idle: free the finished sequences' blocks now rather than on the next step."""
        plan = Plan(marks=self.scheduler.pending_marks, free_slots=self.scheduler.pending_free)
        self.scheduler.pending_marks, self.scheduler.pending_free = [], []
        ops = batching.host_ops(plan, self.config.max_num_seqs, self.config.max_blocks_per_seq)
        self.state, snapshot = runner.apply_host_ops(self.state, ops)
        self.scheduler.observe(jax.device_get(snapshot))

    def _block_versions(self, ids):
        padded = np.zeros(self.config.max_blocks_per_seq, np.int32)  # one compiled shape
        padded[: len(ids)] = ids
        return np.asarray(runner.block_versions(self.state.pool, padded))[: len(ids)]

    def _flags(self, seqs):
        params = [s.request.params for s in seqs]
        logprobs = max([p.logprobs or 0 for p in params] + [0])
        return runner.Flags(backend=self.config.attention_backend, mesh=self.mesh,
                            filters=any(p.uses_filters for p in params),
                            num_logprobs=0 if logprobs == 0 else 1 << (logprobs - 1).bit_length())

    def _sampling_inputs(self, seqs):
        return batching.slot_params(seqs, self.config.max_num_seqs, self.eos_token_ids, self.config.max_model_len)

    def _prefill(self, plan):
        c = self.config
        seqs = [s for s, _ in plan.scheduled] + [child for child, _ in plan.forks]
        if self.state.penalties is not None:
            self._reset_penalties([s for s, _ in plan.scheduled if s.slot in plan.admitted]
                                  + [child for child, _ in plan.forks])
        ops = batching.host_ops(plan, c.max_num_seqs, c.max_blocks_per_seq)
        batch = batching.prefill_batch(plan, c.max_num_seqs, c.max_blocks_per_seq, c.max_num_batched_tokens)
        self.state, out = runner.prefill_step(self.graphdef, self.params, self.state, ops, batch,
                                              self._sampling_inputs(seqs), flags=self._flags(seqs))
        out = jax.device_get(out)
        if not out["ok"]:
            raise RuntimeError("internal error: the device pool refused an operation the scheduler planned")
        self.counters["prefill_steps"] += 1
        # Known tokens computed (prompts, and outputs recomputed after a preemption): not decode rows.
        self.counters["prefill_tokens"] += sum(max(0, min(seq.num_computed + n, seq.prefill_end) - seq.num_computed)
                                               for seq, n in plan.scheduled)
        per_token = ("tokens", "logprob", "rank", "top_ids", "top_logprobs")
        return {k: (v[:, None] if k in per_token else v) for k, v in out.items()}

    def _decode(self, plan):
        c = self.config
        seqs = list(self.scheduler.running)
        ops = batching.host_ops(plan, c.max_num_seqs, c.max_blocks_per_seq)
        inputs = batching.decode_inputs(seqs, c.max_num_seqs)
        self.state, out = runner.decode_steps(
            self.graphdef, self.params, self.state, ops, inputs["last_tokens"], inputs["active"],
            inputs["num_output"], inputs["total_len"], np.bool_(bool(self.scheduler.waiting)),
            self._sampling_inputs(seqs), flags=self._flags(seqs), num_steps=c.num_decode_steps)
        out = jax.device_get(out)
        self.counters["decode_calls"] += 1
        self.counters["decode_steps"] += int(out["steps"])
        return out

    def _take_tokens(self, out) -> set[str]:
        touched = set()
        now = time.monotonic()
        for seq in list(self.scheduler.running):
            row = out["tokens"][seq.slot]
            taken = int(np.sum(row >= 0))
            if taken == 0:
                continue
            request = seq.request
            touched.add(request.request_id)
            request.first_token_time = request.first_token_time or now
            before = seq.num_output
            for j in range(taken):
                self.output_processor.append(seq, out, j)
            code = int(out["finish"][seq.slot])
            status = {1: Status.FINISHED_STOPPED, 2: Status.FINISHED_LENGTH}.get(code)
            if status is Status.FINISHED_STOPPED and seq.token_ids[-1] in request.params.stop_token_ids:
                seq.stop_reason = seq.token_ids[-1]
            if request.params.stop:
                status = self.output_processor.check_stop_strings(seq) or status
            self.counters["generation_tokens"] += seq.num_output - before
            if status is not None:
                self._finish(seq, status)
        return touched

    def _finish(self, seq, status):
        self.scheduler.cache_full_blocks(seq)
        self.scheduler.finish(seq, status)
        if seq.request.finished:
            seq.request.finish_time = time.monotonic()

    # -- penalties -----------------------------------------------------------------------------

    def _enable_penalties(self):
        shape = (self.config.max_num_seqs, self.model_config.vocab_size)
        counts, mask = jax.numpy.zeros(shape, np.int32), jax.numpy.zeros(shape, bool)
        if self.mesh is not None:
            counts, mask = sharding.replicate((counts, mask), self.mesh)
        self.state = dataclasses.replace(self.state, output_counts=counts, prompt_mask=mask)

    def _reset_penalties(self, seqs):
        if not seqs:
            return
        width = batching.token_bucket(max(len(s.token_ids) for s in seqs), 1 << 30)
        slots = np.full(self.config.max_num_seqs, -1, np.int32)
        prompt = np.full((self.config.max_num_seqs, width), -1, np.int32)
        output = np.full((self.config.max_num_seqs, width), -1, np.int32)
        for i, seq in enumerate(seqs):
            slots[i] = seq.slot
            prompt[i, : seq.num_prompt_tokens] = seq.token_ids[: seq.num_prompt_tokens]
            output[i, : seq.num_output] = seq.output_ids
        self.state = runner.reset_penalty_rows(self.state, slots, prompt, output)

    # -- metrics -------------------------------------------------------------------------------

    def stats(self) -> dict:
        c, k = self.config, self.counters
        running = len(self.scheduler.running)
        busy = max(k["busy_seconds"], 1e-9)
        return dict(
            kv_cache_usage=1.0 - self.scheduler.num_free / (c.num_blocks - 1),
            num_blocks=c.num_blocks, block_size=c.block_size, num_blocks_used=c.num_blocks - 1 - self.scheduler.num_free,
            peak_blocks_used=k["peak_blocks_used"],
            prefix_cache_queries=self.prefix_cache.queries, prefix_cache_hits=self.prefix_cache.hits,
            prefix_cache_hit_rate=self.prefix_cache.hits / max(self.prefix_cache.queries, 1),
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=k["prompt_tokens"], generation_tokens=k["generation_tokens"],
            num_requests_running=running, num_requests_waiting=len(self.scheduler.waiting),
            prefill_tokens=k["prefill_tokens"], max_num_running=k["max_num_running"],
            mean_num_running=k["running_steps"] / max(k["model_steps"], 1),
            prefill_steps=k["prefill_steps"], decode_calls=k["decode_calls"], decode_steps=k["decode_steps"],
            busy_seconds=k["busy_seconds"], generation_throughput=k["generation_tokens"] / busy)
