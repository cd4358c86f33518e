"""The host half of the worker (vLLM's GPUModelRunner): owns the device state, turns a scheduler
`Plan` into one jitted call's inputs and returns what came back, fetched to the host."""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.attention import cache_layout
from paged_jax.core.model_output import ModelOutput
from paged_jax.core.plan import Plan
from paged_jax.lora.request import LoRARequest
from paged_jax.sampling_params import SAMPLING_EPS
from paged_jax.worker import batching, ngram_proposer, penalty_state, programs, runner, sampler, sharding
from paged_jax.worker.host_transfers import CopyOut, HostTransfers
from paged_jax.worker.lora_manager import LoRAManager


def _abstract(tree):
    """ShapeDtypeStructs of a tree's arrays: a device array's with its placement, a host array's
    without one (as jit sees it)."""
    def leaf(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)
    return jax.tree.map(leaf, tree)


def _rows(lora):
    """What a call sends of its LoRA inputs: the rows' slots (the weights are on the device)."""
    return () if lora is None else lora.slots


@dataclasses.dataclass
class Call:
    """A dispatched device call whose output the host has not fetched yet."""

    plan: Plan
    out: ModelOutput  # device arrays
    batch: object  # the batch as the call read it (a continuation builds on it)
    sp: sampler.SlotParams
    start: float  # perf_counter when the step's jitted call began (its inputs built)
    copying: CopyOut | None  # device -> host copies in flight
    kind: str  # "decode_" or "": the counters it adds to
    # Dispatched onto an idle device (the call before it fetched), so its start is the device's:
    # jax's compiles so far then (speculation times such a call unless jax compiled meanwhile).
    compiles: int | None = None
    lora: object = None  # the call's models.lora.LoRAInputs (a continuation reads them again)


class ModelRunner:
    def __init__(self, model, config, *, mesh=None, eos_token_ids=(), draft_model=None):
        """`draft_model`: speculative decoding's draft (sharded like `model` under a mesh), whose
        pages share the target's block ids: each block holds both models' K/V."""
        from flax import nnx

        c = self.config = config
        self.mesh = mesh
        self.eos_token_ids = tuple(eos_token_ids)
        self.vocab_size = model.config.vocab_size
        self.graphdef, self.params = nnx.split(model)
        self.draft_graphdef, self.draft_params = nnx.split(draft_model) if draft_model is not None else (None, None)
        # Every argument of a step committed to where it lives (nothing moves: the arrays are there):
        # jit compiles a program per placement, committed or not, of its arguments.
        self.placement = jax.sharding.SingleDeviceSharding(next(iter(jax.tree.leaves(self.params)[0].devices()))) \
            if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        if mesh is None:
            self.params, self.draft_params = jax.device_put((self.params, self.draft_params), self.placement)
        empty = np.zeros((c.max_num_seqs, 0))
        self.state = runner.DeviceState(cache=self._init_cache(model),
                                        output_counts=self._place(empty.astype(np.int32)),
                                        prompt_mask=self._place(empty.astype(bool)),
                                        last_sampled=self._place(np.zeros(c.max_num_seqs, np.int32)),
                                        num_rejected=self._place(np.zeros(c.max_num_seqs, np.int32)),
                                        draft_cache=None if draft_model is None else self._init_cache(draft_model),
                                        token_pages=None if c.prompt_lookup is None else ngram_proposer.TokenPages(
                                            self._place(np.zeros((c.num_blocks, c.block_size), np.int32))))
        # Swapping and the host prefix cache: swap_space GiB of host blocks, each as large as a device
        # block (both models' K/V with a draft, and the tokens with n-gram speculation).
        self.host = HostTransfers(self.state.caches, c.swap_space, c.uses_host_memory)
        self.num_host_blocks = self.host.num_blocks
        # (seqs, num_rows, drafts, width) -> the masks of the rows' allowed next tokens and each
        # row's (SlotParams.allowed, mask_row), or None: the engine's structured-output manager
        # (engine/structured_outputs.py)
        self.bitmask = None
        self.lora = None if c.lora is None else LoRAManager(model.config, c.lora, self._place)
        self.reset_counters()

    def _init_cache(self, model):
        c = self.config
        kw = dict(layout=cache_layout(c.attention_backend), kv_cache_dtype=c.kv_cache_dtype)
        if self.mesh is None:
            return jax.device_put(model.init_cache(c.num_blocks, c.block_size, **kw), self.placement)
        # Made in place on the mesh: one device could not hold the whole cache.
        shape = jax.eval_shape(lambda: model.init_cache(c.num_blocks, c.block_size, **kw))
        return jax.jit(lambda: model.init_cache(c.num_blocks, c.block_size, **kw),
                       out_shardings=sharding.named(sharding.cache_specs(shape), self.mesh))()

    def reset_counters(self) -> None:
        # From the jitted call to its fetched output (the device's share of a step, once compiled),
        # and the bytes that crossed between host and device each way.
        self.counters = dict(device_seconds=0.0, bytes_to_device=0, bytes_from_device=0,
                             decode_bytes_to_device=0, decode_bytes_from_device=0,
                             num_blocks_swapped_out=0, num_blocks_swapped_in=0, swap_bytes_out=0, swap_bytes_in=0,
                             host_prefix_cache_blocks_out=0, host_prefix_cache_blocks_in=0,
                             host_prefix_cache_bytes_out=0, host_prefix_cache_bytes_in=0)

    def _place(self, tree):
        """Arrays (host or device) on the device, or one copy on every device of the mesh."""
        return jax.device_put(tree, self.placement) if self.mesh is None else sharding.replicate(tree, self.mesh)

    # -- one call ------------------------------------------------------------------------------

    def execute(self, plan: Plan) -> ModelOutput:
        """Run the plan's call and fetch its output."""
        return self.fetch(self.dispatch(plan))

    def dispatch(self, plan: Plan, prev: Call | None = None) -> Call:
        """Start the plan's call without waiting for it. `prev`: the decode call dispatched before,
        not yet fetched, that this decode call continues (overlapped scheduling): its rows, in the
        same order, resume on the device from its output."""
        c = self.config
        copying = self.host.start_copy_out(plan, self.state.caches)
        self.copy_blocks(plan.copies_first)
        if plan.is_decode:
            batch, sp, flags, lora = self._decode_inputs(plan)
            start = time.perf_counter()  # the host's inputs are built: from here on it is the device's call
            if prev is None:
                sent = (batch, sp, _rows(lora))
                batch = self._place(batch)  # placed as continue_decode leaves it: one program for both
            else:
                sp, lora, sent = prev.sp, prev.lora, (batch.slots, batch.block_tables, batch.num_mapped)
                batch = runner.continue_decode(prev.batch, prev.out, *sent)
            self.state, out = runner.decode_steps(self.graphdef, self.params, self.state, batch, sp, self.draft_params,
                                                  lora, flags=flags, num_steps=c.num_decode_steps,
                                                  draft_graphdef=self.draft_graphdef)
            return Call(plan, out, batch, sp, start, copying, self._count_sent("decode_", sent), lora=lora)
        self._reset_penalty_rows([s for s, _ in plan.scheduled if s.slot in plan.admitted]
                                 + [child for child, _ in plan.forks])
        batch, sp, flags, lora = self._prefill_inputs(plan)
        loads = self.host.load(plan, batch.swap_blocks.shape[0], self.counters)
        start = time.perf_counter()
        self.state, out = runner.prefill_step(self.graphdef, self.params, self.state, batch, sp, loads,
                                              self.draft_params, lora, flags=flags, draft_graphdef=self.draft_graphdef)
        return Call(plan, out, batch, sp, start, copying, self._count_sent("", batch, sp, _rows(lora)), lora=lora)

    def _decode_inputs(self, plan: Plan):
        """(batch, sampling rows, flags, LoRA inputs or None) of a decode plan's call, on the host."""
        c, seqs = self.config, [seq for seq, _ in plan.scheduled]
        batch = batching.decode_batch(plan, max_num_seqs=c.max_num_seqs, max_blocks_per_seq=c.max_blocks_per_seq)
        rows = batch.slots.shape[0]
        return batch, self._row_params(seqs, rows), self._flags(seqs), self._lora(seqs, rows)

    def _prefill_inputs(self, plan: Plan):
        """(batch, sampling rows, flags, LoRA inputs or None) of a prefill plan's call, on the host."""
        c, seqs = self.config, batching.prefill_rows(plan)
        batch = batching.prefill_batch(plan, block_size=c.block_size, max_num_seqs=c.max_num_seqs,
                                       max_blocks_per_seq=c.max_blocks_per_seq, token_cap=c.max_num_batched_tokens,
                                       num_speculative_tokens=c.num_speculative_tokens)
        sp = self._row_params(seqs, batch.slots.shape[0], plan.drafts, batch.drafts.shape[1] + 1)
        return batch, sp, self._prefill_flags(seqs, plan, batch), self._lora(seqs, batch.slots.shape[0])

    def compile(self, plan: Plan) -> None:
        """Compile the programs `dispatch` runs for `plan` without running them: its step, and after
        a decode step the continuation that builds the next call's batch. The arguments are the
        real ones' shapes and placements, so the step's later calls find the programs in jit's
        cache. Any thread may compile while the engine runs (jit waits for a program another
        thread is compiling); the plan must not swap, load or copy blocks (the warm-up's)."""
        c = self.config
        held = _abstract((self.params, self.state, self.draft_params))
        if not plan.is_decode:
            batch, sp, flags, lora = self._prefill_inputs(plan)
            runner.prefill_step.lower(self.graphdef, *held[:2], *_abstract((batch, sp)), None, held[2], _abstract(lora),
                                      flags=flags, draft_graphdef=self.draft_graphdef).compile()
            return
        batch, sp, flags, lora = self._decode_inputs(plan)
        placed = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=self.placement), batch)
        step = runner.decode_steps.lower(self.graphdef, *held[:2], placed, *_abstract((sp, held[2], lora)),
                                         flags=flags, num_steps=c.num_decode_steps,
                                         draft_graphdef=self.draft_graphdef).compile()
        out = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), step.out_info[1])
        runner.continue_decode.lower(placed, out, *_abstract((batch.slots, batch.block_tables, batch.num_mapped))).compile()

    def fetch(self, call: Call) -> ModelOutput:
        """Wait for the call and bring its output to the host."""
        out = jax.device_get(call.out)
        self.host.finish_copy_out(call.copying, self.counters)
        k = self.counters
        k["device_seconds"] += time.perf_counter() - call.start
        got = sum(np.asarray(x).nbytes for x in jax.tree.leaves(out))
        for prefix in {"", call.kind}:
            k[prefix + "bytes_from_device"] += got
        return out

    def _count_sent(self, kind, *inputs) -> str:
        sent = sum(np.asarray(x).nbytes for x in jax.tree.leaves(inputs))
        for prefix in {"", kind}:
            self.counters[prefix + "bytes_to_device"] += sent
        return kind

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write copies (src, dst) the host decided between steps (beam search's forks),
        dispatched before the next call, which the device runs after them."""
        if copies:
            src, dst = batching.padded([s for s, _ in copies], -1), batching.padded([d for _, d in copies], -1)
            self.counters["bytes_to_device"] += src.nbytes + dst.nbytes
            self.state = runner.copy_blocks_step(self.state, src, dst, backend=self.config.attention_backend)

    # -- inputs --------------------------------------------------------------------------------

    def load_lora(self, request) -> None:
        """Read a request's LoRA adapter into host memory now (ValueError naming what is wrong)."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a paged_jax.LoRARequest, got {request!r}")
        if self.lora is None:
            raise ValueError(f"lora_request {request.lora_name!r} needs an engine built with enable_lora=True")
        self.lora.load(request)

    def _lora(self, seqs, num_rows):
        return None if self.lora is None else self.lora.inputs(seqs, num_rows)

    def _row_params(self, seqs, num_rows, drafts=None, width=1):
        bitmask = self.bitmask(seqs, num_rows, drafts, width) if self.bitmask is not None else None
        return batching.row_params(seqs, num_rows, self.eos_token_ids, self.config.max_model_len, bitmask)

    def _flags(self, seqs) -> runner.Flags:
        params = [s.request.params for s in seqs]
        logprobs = max([p.logprobs or 0 for p in params] + [0])
        return runner.Flags(backend=self.config.attention_backend, mesh=self.mesh,
                            random=any(p.temperature >= SAMPLING_EPS for p in params),
                            filters=any(p.uses_filters for p in params),
                            penalties=any(p.uses_penalties for p in params),
                            num_logprobs=0 if logprobs == 0 else 1 << (logprobs - 1).bit_length(),
                            ngram=self.config.prompt_lookup)

    def _prefill_flags(self, seqs, plan: Plan, batch: batching.PrefillBatch) -> runner.Flags:
        """One prefill program per shape serves greedy and sampled batches (greedy rows still take
        the argmax): its noise, rows x vocab once per step, is small beside the forward, and it
        halves the prefill programs a workload (or `LLMEngine.warm_up`) compiles."""
        top = None
        if batch.prompt_lp_tokens.shape[0]:  # some row scores prompt tokens this step
            n = max(s.request.params.prompt_logprobs or 0 for s, _ in plan.scheduled)
            top = 0 if n == 0 else 1 << (n - 1).bit_length()
        return dataclasses.replace(self._flags(seqs), forks=bool(plan.copies), random=True, num_prompt_logprobs=top)

    def _reset_penalty_rows(self, seqs):
        """Newly admitted or forked rows that use penalties start from their own tokens; the
        [max_num_seqs, vocab] arrays exist once the first such request runs, and only steps whose
        batch holds one read them."""
        seqs = [s for s in seqs if s.request.params.uses_penalties]
        if not seqs:
            return
        if self.state.output_counts.shape[1] == 0:
            shape = (self.config.max_num_seqs, self.vocab_size)
            self.state = dataclasses.replace(self.state, output_counts=self._place(jnp.zeros(shape, jnp.int32)),
                                             prompt_mask=self._place(jnp.zeros(shape, bool)))
        width = batching.token_bucket(max(len(s.token_ids) for s in seqs), 1 << 30)
        rows = batching.bucket(len(seqs), self.config.max_num_seqs)
        slots = np.full(rows, -1, np.int32)
        prompt = np.full((rows, width), -1, np.int32)
        output = np.full((rows, width), -1, np.int32)
        for i, seq in enumerate(seqs):
            slots[i] = seq.slot
            prompt[i, : seq.num_prompt_tokens] = seq.token_ids[: seq.num_prompt_tokens]
            output[i, : seq.num_output] = seq.output_ids
        self.state = penalty_state.reset_rows(self.state, slots, prompt, output)


def activation_bytes(model, num_tokens: int, max_num_seqs: int, max_model_len: int, *, backend: str,
                     block_size: int, kv_cache_dtype: str = "auto", num_speculative_tokens: int = 0,
                     draft_model=None, prompt_lookup: tuple[int, int] | None = None) -> int:
    """The activation peak of the largest prefill step (`num_tokens` tokens over `max_num_seqs` rows,
    tables as wide as `max_model_len`): XLA's temp buffers for the compiled program, read from its
    memory analysis (vLLM measures a profile run; the compiler's buffer assignment is the same
    figure without running it). The KV pages are donated and aliased, so their size does not enter.
    Speculating (`num_speculative_tokens`, a `draft_model` or n-gram's `prompt_lookup`): the larger
    of that and the largest verification's, whose logits are every row's 1 + k (Qwen3-0.6B with a
    draft of k = 4 at 256 rows: 2.0 GiB of temps on an H100 against the prefill's 0.3)."""
    sizing = programs.Sizing(num_blocks=2, block_size=block_size, max_num_seqs=max_num_seqs,
                             max_model_len=max_model_len, attention_backend=backend, kv_cache_dtype=kv_cache_dtype)
    spec = dict(draft_model=draft_model, prompt_lookup=prompt_lookup)
    steps = [dict(num_tokens=num_tokens, num_rows=batching.bucket(min(max_num_seqs, num_tokens), max_num_seqs))]
    if num_speculative_tokens:
        rows = batching.bucket(max_num_seqs, max_num_seqs)
        verifying = batching.token_bucket(rows * (1 + num_speculative_tokens), num_tokens, verifying=True)
        steps.append(dict(num_rows=rows, num_speculative_tokens=num_speculative_tokens, num_tokens=verifying))
    return max(int(programs.prefill_program(model, sizing, width=sizing.max_blocks_per_seq, **step, **spec)
                   .memory_analysis().temp_size_in_bytes) for step in steps)
