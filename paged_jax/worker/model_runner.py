"""The host half of the worker (vLLM's GPUModelRunner): owns the device state, turns a scheduler
`Plan` into one jitted call's inputs and returns what came back, fetched to the host."""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.core import block_pool
from paged_jax.core.model_output import ModelOutput
from paged_jax.core.scheduler import Plan
from paged_jax.engine.sampling_params import SAMPLING_EPS
from paged_jax.worker import batching, programs, runner, sharding, swap
from paged_jax.worker.attention import cache_layout


class ModelRunner:
    def __init__(self, model, config, *, mesh=None, eos_token_ids=()):
        from flax import nnx

        c = self.config = config
        self.mesh = mesh
        self.eos_token_ids = tuple(eos_token_ids)
        self.vocab_size = model.config.vocab_size
        self.graphdef, self.params = nnx.split(model)
        kw = dict(layout=cache_layout(c.attention_backend), kv_cache_dtype=c.kv_cache_dtype)
        if mesh is None:
            cache = model.init_cache(c.num_blocks, c.block_size, **kw)
        else:  # made in place on the mesh: one device could not hold the whole cache
            shape = jax.eval_shape(lambda: model.init_cache(c.num_blocks, c.block_size, **kw))
            cache = jax.jit(lambda: model.init_cache(c.num_blocks, c.block_size, **kw),
                            out_shardings=sharding.named(sharding.cache_specs(shape), mesh))()
        pool = block_pool.init(c.num_blocks, c.block_size, c.max_num_seqs, c.max_blocks_per_seq)
        empty = np.zeros((c.max_num_seqs, 0))
        self.state = runner.DeviceState(cache=cache, pool=self._replicate(pool),
                                        output_counts=self._replicate(empty.astype(np.int32)),
                                        prompt_mask=self._replicate(empty.astype(bool)))
        # Swapping and the host prefix cache: swap_space GiB of host blocks, each as large as a device block.
        self.host_block_bytes = swap.HostKVCache.block_bytes(cache)
        self.num_host_blocks = int(c.swap_space * 2**30) // self.host_block_bytes if c.uses_host_memory else 0
        self.host_cache = swap.HostKVCache(cache, self.num_host_blocks) if self.num_host_blocks else None
        self.reset_counters()

    def reset_counters(self) -> None:
        # From the jitted call to its fetched output (the device's share of a step, once compiled),
        # and the bytes that crossed between host and device each way.
        self.counters = dict(device_seconds=0.0, bytes_to_device=0, bytes_from_device=0,
                             decode_bytes_to_device=0, decode_bytes_from_device=0,
                             num_blocks_swapped_out=0, num_blocks_swapped_in=0, swap_bytes_out=0, swap_bytes_in=0,
                             host_prefix_cache_blocks_out=0, host_prefix_cache_blocks_in=0,
                             host_prefix_cache_bytes_out=0, host_prefix_cache_bytes_in=0)

    def _replicate(self, x):
        """The pool and sampling state: one copy on every device of the mesh."""
        return x if self.mesh is None else sharding.replicate(x, self.mesh)

    # -- one call ------------------------------------------------------------------------------

    def execute(self, plan: Plan) -> ModelOutput:
        self.apply_pool_ops(plan)
        c = self.config
        copying = self._start_copy_out(plan)
        if plan.is_decode:
            seqs = [seq for seq, _ in plan.scheduled]
            batch, width = batching.decode_batch(plan, block_size=c.block_size, max_num_seqs=c.max_num_seqs,
                                                 max_blocks_per_seq=c.max_blocks_per_seq,
                                                 num_steps=c.num_decode_steps)
            sp = self._row_params(seqs, batch.slots.shape[0])
            start = time.perf_counter()
            self.state, out = runner.decode_steps(self.graphdef, self.params, self.state, batch, sp,
                                                  flags=self._flags(seqs), num_steps=c.num_decode_steps, width=width)
            self._finish_copy_out(plan, copying)
            return self._fetch("decode_", out, start, batch, sp)
        seqs = batching.prefill_rows(plan)
        self._reset_penalty_rows([s for s, _ in plan.scheduled if s.slot in plan.admitted]
                                 + [child for child, _ in plan.forks])
        batch = batching.prefill_batch(plan, block_size=c.block_size, max_num_seqs=c.max_num_seqs,
                                       max_blocks_per_seq=c.max_blocks_per_seq, token_cap=c.max_num_batched_tokens)
        sp = self._row_params(seqs, batch.slots.shape[0])
        start = time.perf_counter()
        self.state, out, ok = runner.prefill_step(self.graphdef, self.params, self.state, batch, sp,
                                                  self._load(plan, batch), flags=self._prefill_flags(seqs, plan, batch))
        self._finish_copy_out(plan, copying)
        out = self._fetch("", (out, ok), start, batch, sp)
        if not out[1]:
            raise RuntimeError("internal error: the device pool refused an operation the scheduler planned")
        return out[0]

    def _fetch(self, kind, out, start, *inputs):
        out = jax.device_get(out)
        k = self.counters
        k["device_seconds"] += time.perf_counter() - start
        sent = sum(np.asarray(x).nbytes for x in jax.tree.leaves(inputs))
        got = sum(np.asarray(x).nbytes for x in jax.tree.leaves(out))
        for prefix in {"", kind}:
            k[prefix + "bytes_to_device"] += sent
            k[prefix + "bytes_from_device"] += got
        return out

    def apply_pool_ops(self, plan: Plan) -> None:
        """The plan's cache marks and frees (before its step, or alone when the engine goes idle)."""
        if plan.marks or plan.free_slots or plan.skips:
            cap = self.config.max_blocks_per_seq
            width = batching.bucket(max(plan.free_blocks, 1), cap, batching.MIN_WIDTH_BUCKET)
            skipped = max((n for _, n in plan.skips), default=0)
            skip_width = skipped and batching.bucket(skipped, cap, batching.MIN_WIDTH_BUCKET)
            ops = batching.pool_ops(plan, self.config.num_blocks)
            self.counters["bytes_to_device"] += sum(x.nbytes for x in jax.tree.leaves(ops))
            self.state = runner.apply_pool_ops(self.state, ops, width=width, skip_width=skip_width)

    def fork(self, pairs: list[tuple[int, int]], max_blocks: int):
        """Fork each (parent slot, child slot) copy-on-write before the next call (beam search);
        the frees planned before it must already be applied. `max_blocks`: the most blocks a parent
        holds. Dispatched, not waited for -> the device's (PoolDelta, ok), for `fetch_fork` after
        the next call's output is in: the host waits once per step, not twice."""
        c = self.config
        num = batching.bucket(len(pairs), 1 << 30, 8)
        parents, children = np.full(num, -1, np.int32), np.full(num, -1, np.int32)
        parents[: len(pairs)], children[: len(pairs)] = zip(*pairs)
        width = batching.bucket(max_blocks, c.max_blocks_per_seq, batching.MIN_WIDTH_BUCKET)
        self.counters["bytes_to_device"] += parents.nbytes + children.nbytes
        self.state, delta, ok = runner.fork_slots(self.state, parents, children, width=width,
                                                  backend=c.attention_backend)
        return delta, ok

    def fetch_fork(self, forked):
        """`fork`'s result on the host -> its PoolDelta."""
        delta, ok = self._fetch("", forked, time.perf_counter())
        if not ok:
            raise RuntimeError("internal error: the device pool refused a fork the host planned")
        return delta

    def _start_copy_out(self, plan: Plan):
        """Dispatch the gather of the plan's device -> host copies (swapped victims, blocks the host
        prefix cache keeps), each device block once, before this step's allocations can reuse them;
        the transfer runs while the step is dispatched -> what `_finish_copy_out` takes, or None."""
        copies = plan.swap_out + plan.tier_out
        if not copies:
            return None
        unique = list(dict.fromkeys(d for d, _ in copies))
        return self.host_cache.start_copy_out(self.state.cache, batching.padded(unique)), unique

    def _finish_copy_out(self, plan: Plan, copying) -> None:
        if copying is None:
            return
        blocks, unique = copying
        position = {d: i for i, d in enumerate(unique)}
        copies = plan.swap_out + plan.tier_out
        self.host_cache.finish_copy_out(blocks, [h for _, h in copies], [position[d] for d, _ in copies])
        k, size = self.counters, self.host_block_bytes
        k["num_blocks_swapped_out"] += len(plan.swap_out)
        k["swap_bytes_out"] += len(plan.swap_out) * size
        k["host_prefix_cache_blocks_out"] += len(plan.tier_out)
        k["host_prefix_cache_bytes_out"] += len(plan.tier_out) * size

    def _load(self, plan: Plan, batch: batching.PrefillBatch):
        """The host blocks the plan loads (rows resuming after a swap, host prefix cache hits), in
        the order of batch.swap_rows: one host read for all of them, scattered by the prefill step
        -> the blocks (numpy), or None when the plan loads none."""
        host_ids = [h for _, ids, _ in plan.host_loads for h in ids]
        if not host_ids:
            return None
        blocks = self.host_cache.read(np.pad(host_ids, (0, batch.swap_rows.shape[0] - len(host_ids))))
        k, size = self.counters, self.host_block_bytes
        swapped, tier = (sum(len(ids) for _, ids, _ in loads) for loads in (plan.swap_in, plan.tier_in))
        k["num_blocks_swapped_in"] += swapped
        k["swap_bytes_in"] += swapped * size
        k["host_prefix_cache_blocks_in"] += tier
        k["host_prefix_cache_bytes_in"] += tier * size
        k["bytes_to_device"] += sum(x.nbytes for x in jax.tree.leaves(blocks))
        return blocks

    def reset_prefix_cache(self) -> None:
        self.state = runner.uncache_all(self.state)

    # -- inputs --------------------------------------------------------------------------------

    def _row_params(self, seqs, num_rows):
        return batching.row_params(seqs, num_rows, self.eos_token_ids, self.config.max_model_len)

    def _flags(self, seqs) -> runner.Flags:
        params = [s.request.params for s in seqs]
        logprobs = max([p.logprobs or 0 for p in params] + [0])
        return runner.Flags(backend=self.config.attention_backend, mesh=self.mesh,
                            random=any(p.temperature >= SAMPLING_EPS for p in params),
                            filters=any(p.uses_filters for p in params),
                            penalties=any(p.uses_penalties for p in params),
                            num_logprobs=0 if logprobs == 0 else 1 << (logprobs - 1).bit_length())

    def _prefill_flags(self, seqs, plan: Plan, batch: batching.PrefillBatch) -> runner.Flags:
        """One prefill program per shape serves greedy and sampled batches (greedy rows still take
        the argmax): its noise, rows x vocab once per step, is small beside the forward, and it
        halves the prefill programs a workload (or `LLMEngine.warm_up`) compiles."""
        top = None
        if batch.prompt_lp_tokens.shape[0]:  # some row scores prompt tokens this step
            n = max(s.request.params.prompt_logprobs or 0 for s, _ in plan.scheduled)
            top = 0 if n == 0 else 1 << (n - 1).bit_length()
        return dataclasses.replace(self._flags(seqs), forks=bool(plan.forks), random=True, num_prompt_logprobs=top)

    def _reset_penalty_rows(self, seqs):
        """Newly admitted or forked rows that use penalties start from their own tokens; the
        [max_num_seqs, vocab] arrays exist once the first such request runs, and only steps whose
        batch holds one read them."""
        seqs = [s for s in seqs if s.request.params.uses_penalties]
        if not seqs:
            return
        if self.state.output_counts.shape[1] == 0:
            shape = (self.config.max_num_seqs, self.vocab_size)
            self.state = dataclasses.replace(self.state, output_counts=self._replicate(jnp.zeros(shape, jnp.int32)),
                                             prompt_mask=self._replicate(jnp.zeros(shape, bool)))
        width = batching.token_bucket(max(len(s.token_ids) for s in seqs), 1 << 30)
        rows = batching.bucket(len(seqs), self.config.max_num_seqs)
        slots = np.full(rows, -1, np.int32)
        prompt = np.full((rows, width), -1, np.int32)
        output = np.full((rows, width), -1, np.int32)
        for i, seq in enumerate(seqs):
            slots[i] = seq.slot
            prompt[i, : seq.num_prompt_tokens] = seq.token_ids[: seq.num_prompt_tokens]
            output[i, : seq.num_output] = seq.output_ids
        self.state = runner.reset_penalty_rows(self.state, slots, prompt, output)


def activation_bytes(model, num_tokens: int, max_num_seqs: int, max_model_len: int, *, backend: str,
                     block_size: int, kv_cache_dtype: str = "auto") -> int:
    """The activation peak of the largest prefill step (`num_tokens` tokens over `max_num_seqs` rows,
    tables as wide as `max_model_len`): XLA's temp buffers for the compiled program, read from its
    memory analysis (vLLM measures a profile run; the compiler's buffer assignment is the same
    figure without running it). The KV pages are donated and aliased, so their size does not enter."""
    sizing = programs.Sizing(num_blocks=2, block_size=block_size, max_num_seqs=max_num_seqs,
                             max_model_len=max_model_len, attention_backend=backend, kv_cache_dtype=kv_cache_dtype)
    compiled = programs.prefill_program(model, sizing, num_tokens=num_tokens,
                                        num_rows=batching.bucket(min(max_num_seqs, num_tokens), max_num_seqs),
                                        width=sizing.max_blocks_per_seq)
    return int(compiled.memory_analysis().temp_size_in_bytes)
