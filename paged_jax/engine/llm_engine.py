"""`LLMEngine`: vLLM's add_request / step / abort_request loop.

One `step()` reads like vLLM's: the scheduler plans (host), the model runner makes one device call
(a ragged `prefill_step`, or `decode_steps` when every scheduled sequence is decoding), the
scheduler takes its output (`update_from_output`), and the output processor turns the new tokens
into text and `RequestOutput`s; with async scheduling the next call goes first (engine.step: how).
"""
from __future__ import annotations

import itertools
import time

import jax
import numpy as np

from models.llama import fit_rope
from models.quantize import quantize
from paged_jax.core.async_scheduler import AsyncScheduler
from paged_jax.core.host_pool import HostBlockPool
from paged_jax.core.prefix_cache import PrefixCache
from paged_jax.core.scheduler import Scheduler
from paged_jax.core.sequence import Request, Sequence, Status
from paged_jax.engine import config as config_lib
from paged_jax.engine import spec_config, speculative, warm_up
from paged_jax.engine import stats as stats_lib
from paged_jax.engine.arg_utils import EngineArgs
from paged_jax.engine.output_processor import OutputProcessor
from paged_jax.engine.outputs import RequestOutput
from paged_jax.engine.processor import InputProcessor
from paged_jax.engine.structured_outputs import StructuredOutputManager
from paged_jax.sampling_params import SamplingParams
from paged_jax.worker import model_runner, sharding


class LLMEngine:
    def __init__(self, model, tokenizer=None, *, mesh=None, engine_args: EngineArgs | None = None, **kwargs):
        """`kwargs`, or `engine_args`: EngineArgs' fields (engine/arg_utils.py: names, defaults,
        checks). `mesh`: a jax Mesh with a "model" axis for tensor parallelism
        (paged_jax.worker.sharding); without one, tensor_parallel_size > 1 makes one.
        `preemption_mode` "recompute" (vLLM V1) drops a preempted request's blocks; "swap" (vLLM V0,
        the paper's section 4.5) copies them to `swap_space` GiB of host memory and back. With
        `async_scheduling` (vLLM's name) the host plans and dispatches the next call while the
        device runs one (core/async_scheduler.py); outputs are the serial engine's."""
        if engine_args is not None and kwargs:
            raise ValueError(f"pass engine_args or keyword arguments, not both (got {sorted(kwargs)})")
        args = self.engine_args = engine_args or EngineArgs(**kwargs)
        mesh = args.create_mesh(mesh)
        draft, draft_tokenizer = spec_config.load_draft_model(args.speculative_config, dtype=args.dtype)
        model, draft = quantize(model, args.quantization), draft and quantize(draft, args.quantization)
        if mesh is not None:
            model = sharding.shard_model(model, mesh)
            draft = draft and sharding.shard_model(draft, mesh)
        self.config = args.create_engine_config(model, mesh, draft)
        model, draft = (m and fit_rope(m, self.config.max_model_len) for m in (model, draft))
        spec_config.check_draft_vocabulary(args.speculative_config, tokenizer, draft_tokenizer)
        self.mesh, self.model_config = mesh, model.config
        self.tokenizer = tokenizer
        self.output_processor = OutputProcessor(tokenizer)
        if args.log_stats:
            config_lib.announce(self.config)
        c = self.config
        eos = (tokenizer.eos_token_ids if tokenizer is not None else
               np.atleast_1d(model.config.eos_token_id if model.config.eos_token_id is not None else []).tolist())
        self.eos_token_ids = tuple(int(t) for t in eos)
        self.model_runner = model_runner.ModelRunner(model, c, mesh=mesh, eos_token_ids=self.eos_token_ids,
                                                     draft_model=draft)
        self.processor = InputProcessor(c, tokenizer, model.config.vocab_size, getattr(model.config, "kv_window", None))
        self.structured_outputs = StructuredOutputManager(tokenizer, model.config.vocab_size)
        self.model_runner.bitmask = self.structured_outputs.bitmask
        self.prefix_cache = PrefixCache(enabled=c.enable_prefix_caching)
        # Speculative decoding; its decisions follow this process's clock only when it is alone.
        self.speculator = (speculative.Speculator(args.speculative_config, c.max_model_len, max_num_seqs=c.max_num_seqs,
                                                  max_num_batched_tokens=c.max_num_batched_tokens,
                                                  timed=jax.process_count() == 1)
                           if args.speculative_config else None)
        if self.speculator and args.speculative_config.method == "ngram":  # a grammar's drafts are the host's
            self.speculator.constrain = self.structured_outputs.drafts
        self.async_scheduling = args.async_scheduling
        self.scheduler = (AsyncScheduler if self.async_scheduling else Scheduler)(
            max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
            block_size=c.block_size, num_blocks=c.num_blocks, max_blocks_per_seq=c.max_blocks_per_seq,
            long_prefill_token_threshold=c.long_prefill_token_threshold, prefix_cache=self.prefix_cache,
            sliding_window=getattr(model.config, "kv_window", None),
            host_pool=HostBlockPool(self.model_runner.num_host_blocks) if c.uses_host_memory else None,
            swap_preemption=c.preemption_mode == "swap", host_tier=c.enable_host_prefix_cache,
            num_decode_steps=c.num_decode_steps, max_model_len=c.max_model_len,
            max_loras=c.lora.max_loras if c.lora else 0)
        self._in_flight: model_runner.Call | None = None  # a call dispatched, not yet processed
        self.requests: dict[str, Request] = {}
        self._finished_outside_step: set[str] = set()  # rejected or aborted: reported by the next step
        self.seed = args.seed
        self._reset_counters()

    @classmethod
    def from_engine_args(cls, model, tokenizer, engine_args: EngineArgs, mesh=None) -> LLMEngine:
        """vLLM's constructor from an EngineArgs (a command line's: EngineArgs.from_cli_args)."""
        return cls(model, tokenizer, mesh=mesh, engine_args=engine_args)

    def _reset_counters(self) -> None:
        self._request_counter = itertools.count()  # arrival indices seed unseeded requests
        self.counters = stats_lib.new_counters()

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, *,
                    cache_salt: str | None = None, lora_request=None) -> None:
        """Queue a request: `prompt` is a string (needs a tokenizer) or a list of token ids;
        `lora_request`: a paged_jax.LoRARequest, its adapter."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self.tokenize_prompt(prompt)
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop strings {params.stop!r} need a tokenizer to detokenize the output")
        if lora_request is not None:  # a bad adapter raises here, before anything is queued
            self.add_lora(lora_request)
        request = Request(request_id, text, ids, params, time.monotonic(), cache_salt=cache_salt,
                          lora_request=lora_request)
        index = next(self._request_counter)
        for i in range(params.n):
            # A raw threefry key per sample, derived on the host (no device work per request): from
            # the request's seed, or else from the engine's seed and the request's arrival index.
            seeds = (np.random.SeedSequence(params.seed, spawn_key=(i,)) if params.seed is not None else
                     np.random.SeedSequence(self.seed, spawn_key=(1 << 31, index, i)))
            request.seqs.append(Sequence(request, i, list(ids), seeds.generate_state(2, np.uint32)))
        error = self.unservable(ids, params)
        constrained = params.structured_outputs is not None and error is None
        if constrained:  # a bad grammar raises here, before anything is queued
            self.structured_outputs.add(request)
        self.requests[request_id] = request
        self.counters["prompt_tokens"] += len(ids)
        if error:
            request.error = error
            self._fail(request)
            self._finished_outside_step.add(request_id)
            return
        if not constrained:  # else the scheduler gets it once its grammar is compiled (step)
            self._schedule(request)

    def _schedule(self, request: Request) -> None:
        parent = request.seqs[0]
        parent.children = request.seqs[1:]
        self.scheduler.add(parent)

    def _fail(self, request: Request) -> None:
        for seq in request.seqs:
            seq.status = Status.FINISHED_ERROR
        request.finish_time = time.monotonic()

    def add_lora(self, lora_request) -> bool:
        """Read a LoRA adapter into host memory now (vLLM's name; ValueError naming what is wrong)."""
        self.model_runner.load_lora(lora_request)
        return True

    def tokenize_prompt(self, prompt):
        """(text or None, token ids) of a prompt; ValueError naming what is wrong with it."""
        return self.processor.tokenize_prompt(prompt)

    def unservable(self, prompt_token_ids, params: SamplingParams) -> str | None:
        """Why this engine can never serve the request, or None (engine/processor.py)."""
        return self.processor.unservable(prompt_token_ids, params)

    def abort_request(self, request_ids) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.requests.get(request_id)
            if request is None or request.finished:
                continue
            self.structured_outputs.abort(request_id)
            self.scheduler.finish(request.seqs, Status.FINISHED_ABORTED)
            request.finish_time = time.monotonic()
            self._finished_outside_step.add(request_id)

    def has_unfinished_requests(self) -> bool:
        return self._in_flight is not None or any(not r.finished for r in self.requests.values())

    def get_num_unfinished_requests(self) -> int:
        return sum(not r.finished for r in self.requests.values())

    # -- one step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one device call; return the outputs of requests that progressed or finished. With
        async scheduling the next call is dispatched before this one's output is processed: while
        it runs if its plan needs nothing of that output (AsyncScheduler.schedule_next), else once
        the scheduler took it; the output side (text, stop strings, RequestOutputs) runs beside it."""
        touched, self._finished_outside_step = self._finished_outside_step, set()
        start = time.perf_counter()
        call, self._in_flight = self._in_flight, None
        idle = call is None and not self.scheduler.has_work
        for request in self.structured_outputs.ready(wait=0.05 if idle else 0.0):  # grammars compiled
            if request.error:  # it failed to compile: the request ends with the reason
                self._fail(request)
                touched.add(request.request_id)
            else:
                self._schedule(request)
        after, spec = None, self.speculator
        if call is not None and spec is not None and spec.plans_ahead(call.plan, self.scheduler.running):
            after = self.scheduler.schedule_next(call.plan, spec.propose_ahead)
        elif call is not None and (spec is None or spec.quiet):
            after = self.scheduler.schedule_next(call.plan)
        if after is not None:  # planned while `call` runs
            if spec:
                spec.planned_ahead(self.scheduler.running)
            stats_lib.count_plan(self.counters, after)
            self.counters["overlapped_calls"] += 1
            self.counters["overlapped_verifications"] += bool(after.drafts)
            self._in_flight = self.model_runner.dispatch(after, prev=call if after.continues else None)
            touched |= self._report(call, self._apply(call))
            call = None
        elif call is not None:  # the next call is planned from its output, before the output side runs
            applied = self._apply(call)
            call, done = self._launch(), call
            touched |= self._report(done, applied)
        else:
            call = self._launch()
        if call is not None and self.async_scheduling and not call.plan.one_step:
            self._in_flight = call  # processed next step
        elif call is not None:
            touched |= self._report(call, self._apply(call))
        self.counters["busy_seconds"] += time.perf_counter() - start
        used = self.config.num_blocks - 1 - self.scheduler.num_free
        self.counters["peak_blocks_used"] = max(self.counters["peak_blocks_used"], used)
        outputs = self.output_processor.make_outputs([self.requests[request_id] for request_id in touched])
        for out in outputs:
            if out.finished:
                del self.requests[out.request_id]
        return outputs

    def _launch(self) -> model_runner.Call | None:
        """Plan the next call from what the host holds (speculation's proposals need the latest
        tokens) and dispatch it onto the idle device; None when there is nothing to run."""
        if not self.scheduler.has_work:
            return None
        drafts = self.speculator.propose(self.scheduler.running) if self.speculator else None
        plan = self.scheduler.schedule(drafts)
        if self.speculator:
            self.speculator.limit_decode(plan)
        stats_lib.count_plan(self.counters, plan)
        compiles = stats_lib.num_compiles()
        call = self.model_runner.dispatch(plan)
        call.compiles = compiles
        return call

    def _apply(self, call: model_runner.Call):
        """Fetch a call's output and apply what the next plan depends on (the scheduler's transitions,
        the speculator's acceptance and costs, the grammars' advance) -> (output, progressed)."""
        plan, output = call.plan, self.model_runner.fetch(call)
        if self.speculator and call.compiles is not None:  # dispatched onto an idle device
            self.speculator.observe_call(plan, int(output.steps), time.perf_counter() - call.start, call.compiles)
        progressed = self.scheduler.update_from_output(plan, output)
        if self.speculator:
            self.speculator.record_call(plan, output, progressed)
        complete, refused = self.structured_outputs.advance(progressed)
        self.scheduler.finish(complete, Status.FINISHED_STOPPED)
        self.scheduler.finish(refused, Status.FINISHED_ERROR)
        stats_lib.count_steps(self.counters, plan, int(output.steps))
        return output, progressed

    def _report(self, call: model_runner.Call, applied) -> set[str]:
        """The output side of an applied call (logprobs, text, stop strings) and the finishes of
        the stop strings it found -> the requests touched. A row finished here that the next call
        already runs is discarded from that call's output (Scheduler.update_from_output)."""
        output, progressed = applied
        stopped, num_new = self.output_processor.process_outputs(call.plan, output, progressed)
        self.scheduler.finish(stopped, Status.FINISHED_STOPPED)
        self.counters["generation_tokens"] += num_new
        return {seq.request.request_id for seq, _, _ in progressed}

    def warm_up(self, prompt_len: int = 32, *, workers: int | None = None) -> dict:
        """Compile what short requests run on `workers` threads, running nothing (engine/warm_up.py)
        -> {"programs": compiled or loaded, "cached": of those, loaded, "seconds": wall clock}."""
        return warm_up.WarmUp(self, prompt_len, workers).start().wait()

    def reset_counters(self) -> None:
        """Every counter of the engine, its scheduler and its runner back to zero."""
        self.scheduler.reset_counters()
        self.model_runner.reset_counters()
        if self.speculator:
            self.speculator.reset_counters()
        self._reset_counters()

    @property
    def state(self):
        """The device state (KV pages, sampling state)."""
        return self.model_runner.state

    @property
    def block_pool(self):
        """The block pool (host arrays updated in place: copy what you keep), the scheduler's."""
        return self.scheduler.kv_manager.pool

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (vLLM's name); False, changing nothing, while a request holds a block."""
        return self.scheduler.reset_prefix_cache()

    # -- metrics -------------------------------------------------------------------------------

    def stats(self) -> dict:
        return stats_lib.engine_stats(self.config, self.counters, self.scheduler.stats(),
                                      self.speculator.stats() if self.speculator else {}, self.model_runner.counters)
