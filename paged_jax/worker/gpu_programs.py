"""The engine's programs for a GPU that is not here: the engine built as `LLM` builds it on that GPU
(abstract weights on compile-only devices, `abstract_engine`; its KV pool sized from the GPU's
memory as `gpu_memory_utilization` sizes it), and every jitted entry point a warmed-up engine runs,
with abstract arguments from the engine's own builders (`batching.prefill_batch` / `decode_batch` on
a synthetic plan). The one place that knows how the runner's entry points are called."""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from models.checkpoint import MODEL_REGISTRY, read_config
from models.lora import LoRAInputs, LoRAWeights
from paged_jax.attention import cache_layout, check_kv_cache_dtype, resolve_backend
from paged_jax.core.plan import Plan
from paged_jax.core.sequence import Request, Sequence
from paged_jax.engine import config as config_lib
from paged_jax.engine import spec_config
from paged_jax.engine.arg_utils import EngineArgs
from paged_jax.sampling_params import SamplingParams
from paged_jax.worker import abstract_engine, batching, ngram_proposer, penalty_state, runner, sharding, swap


class DoesNotFit(ValueError):
    """The largest prefill step's temps leave no room for the KV pool."""


@dataclasses.dataclass(frozen=True)
class Program:
    name: str
    fn: Callable  # a jitted entry point
    args: tuple  # abstract (ShapeDtypeStruct leaves, placed)
    static: dict  # its static keyword arguments
    # The host's values of the batch arguments (None: zeros), for a timed run (zero batches are dead rows).
    values: tuple = ()
    # The model work one call does, for a roofline (XLA's cost analysis counts a loop body once):
    steps: int = 0  # forwards through the model
    tokens: int = 0  # tokens each forward computes
    kv_tokens: int = 0  # cached tokens each forward's attention reads
    draft_steps: int = 0  # a draft model's decode steps alone before them (its proposals)
    draft_tokens: int = 0  # tokens each draft step computes (one a row)
    # One layer's slice of each stacked weight (elements) -> its name: copies of one are reported.
    layer_slices: dict = dataclasses.field(default_factory=dict)


def build(model_cls, model_config, devices, *, bytes_limit: int, temp_bytes: Callable[[Program], int],
          max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int | None, kv_cache_dtype: str = "auto",
          block_size: int = 16, num_decode_steps: int = 8, gpu_memory_utilization: float | None = None,
          speculative_config=None, attention_backend: str = "auto", lora: tuple[int, int] | None = None):
    """-> AbstractEngine for compile-only `devices` of one GPU kind whose jax allocator holds
    `bytes_limit` each (gpu_target.jax_bytes_limit), sized as `LLMEngine.__init__` sizes it
    (config_lib.resolve), the activation peak read from the largest prefill step compiled for that
    GPU (`temp_bytes(program)`; the KV pages are donated, so a 2-block pool gives the same figure).
    `max_model_len` None: the model's limit, cut to what the pool holds (resolve's rule for a GPU).
    `speculative_config`: vLLM's dict (or JSON), a draft's "model" an HF config.json, a directory
    holding one or a model config. `attention_backend` resolves as the engine resolves it on that
    GPU. `lora`: (max_loras, max_lora_rank) of enable_lora, or None."""
    mesh = Mesh(np.array(devices), (sharding.AXIS,))
    model = abstract_engine.abstract_model(model_cls, model_config, mesh)
    spec, draft, draft_bytes = spec_config.SpeculativeConfig.parse(speculative_config), None, 0
    with jax.default_device(devices[0]):  # the GPU's arch: Mosaic GPU on sm_90, fp8 pages refused below sm_89
        c = model.config
        backend = resolve_backend(attention_backend, dtype=c.dtype, head_dim=c.head_dim, block_size=block_size,
                                  kv_cache_dtype=kv_cache_dtype, platform="gpu")
        # "reference": what "auto" runs on a GPU that no Pallas kernel takes (a jax without Triton)
        if backend not in ("pallas", "pallas_mosaic") and (attention_backend, backend) != ("auto", "reference"):
            raise ValueError(f"attention_backend {attention_backend!r} resolves to {backend!r}, not a GPU "
                             "backend: 'auto', 'pallas_triton' or 'pallas_mosaic'")
        kv_dtype = check_kv_cache_dtype(kv_cache_dtype, backend, model.config.dtype)
        if spec is not None and spec.method == "draft_model":
            draft_config = (spec.model if hasattr(spec.model, "model_type")
                            else read_config(spec.model, dtype=model_config.dtype))
            draft_cls = MODEL_REGISTRY[draft_config.model_type].model_cls
            draft = abstract_engine.abstract_model(draft_cls, draft_config, mesh)
            draft_bytes = EngineArgs(block_size=block_size, attention_backend=backend, kv_cache_dtype=kv_cache_dtype
                                     ).draft_bytes_per_block(model.config, draft.config, backend)
    weights = sum(abstract_engine.weight_bytes_per_device(m) for m in (model, draft) if m is not None)
    sizes = dict(block_size=block_size, gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs,
                 max_num_batched_tokens=max_num_batched_tokens,
                 max_model_len=max_model_len or model.config.max_position_embeddings,
                 num_decode_steps=num_decode_steps, long_prefill_token_threshold=0, enable_prefix_caching=True,
                 attention_backend=backend, kv_dtype=kv_dtype, kv_shards=mesh.size,
                 sliding_window=getattr(model.config, "kv_window", None), kv_cache_dtype=kv_cache_dtype,
                 draft_bytes_per_block=draft_bytes, **spec_config.engine_fields(spec),
                 lora=lora and config_lib.LoRAConfig(*lora, lora[0], LoRAWeights.nbytes_for(model.config, *lora)))
    probe = abstract_engine.AbstractEngine(model, config_lib.resolve(model.config, num_blocks=2, **sizes), mesh,
                                           weights, draft)

    def peak(num_tokens, max_num_seqs):  # as model_runner.activation_bytes: -> (program, its temp bytes)
        verifies = [verify_program(probe, max_num_seqs)] if spec else []
        return max(((p, temp_bytes(p)) for p in [prefill_program(probe, num_tokens)] + verifies), key=lambda x: x[1])

    try:
        config = config_lib.resolve(model.config, num_blocks=None,
                                    activation_bytes=lambda tokens, seqs, max_len: peak(tokens, seqs)[1],
                                    memory_stats={"bytes_limit": bytes_limit, "bytes_in_use": weights}, **sizes)
    except ValueError as e:  # the activation peak left no room for the KV pool
        largest, temps = peak(max_num_batched_tokens, max_num_seqs)
        raise DoesNotFit(f"{largest.name} needs {temps} bytes of temps: {e}") from e
    if max_model_len is None and config.max_model_len > (config.num_blocks - 1) * block_size:
        config = dataclasses.replace(config, max_model_len=(config.num_blocks - 1) * block_size)
    return abstract_engine.AbstractEngine(model=model, config=config, placement=mesh, draft_model=draft,
                                          weight_bytes=weights + (config.lora.nbytes if config.lora else 0))


# -- abstract arguments --------------------------------------------------------------------------

def _replicated(engine, tree):
    return abstract_engine.placed(tree, P(), engine.placement)


def _lora(engine, num_rows: int) -> LoRAInputs | None:
    """enable_lora's adapter slots (every program carries them) and each row's slot."""
    lora = engine.config.lora
    weights = lora and jax.eval_shape(lambda: LoRAWeights.zeros(engine.model.config, lora.max_loras, lora.max_lora_rank))
    return lora and _replicated(engine, LoRAInputs(weights, np.zeros(num_rows, np.int32)))


def _cache(engine, model):
    c = engine.config
    cache = jax.eval_shape(lambda: model.init_cache(c.num_blocks, c.block_size, layout=cache_layout(c.attention_backend),
                                                    kv_cache_dtype=c.kv_cache_dtype))
    specs = sharding.cache_specs(cache) if engine.mesh is not None else P()
    return abstract_engine.placed(cache, specs, engine.placement)


def _state(engine, *, penalties=False) -> runner.DeviceState:
    """As model_runner.ModelRunner holds it: a draft's pages and n-gram's token pages if any."""
    c = engine.config
    vocab = engine.model.config.vocab_size if penalties else 0
    tokens = None if c.prompt_lookup is None else ngram_proposer.TokenPages(
        _replicated(engine, np.zeros((c.num_blocks, c.block_size), np.int32)))
    return runner.DeviceState(cache=_cache(engine, engine.model),
                              output_counts=_replicated(engine, np.zeros((c.max_num_seqs, vocab), np.int32)),
                              prompt_mask=_replicated(engine, np.zeros((c.max_num_seqs, vocab), bool)),
                              last_sampled=_replicated(engine, np.zeros(c.max_num_seqs, np.int32)),
                              num_rejected=_replicated(engine, np.zeros(c.max_num_seqs, np.int32)),
                              draft_cache=None if engine.draft_model is None else _cache(engine, engine.draft_model),
                              token_pages=tokens)


def _sequences(lengths, slot_offset=0) -> list[Sequence]:
    """Running sequences of these token counts (one sampled token each), stopping only at max_model_len."""
    request = Request("synthetic", None, [], SamplingParams(temperature=1.0, max_tokens=None), 0.0)
    seqs = [Sequence(request, 0, [0] * n, np.zeros(2, np.uint32)) for n in lengths]
    for i, seq in enumerate(seqs):
        seq.slot = slot_offset + i
        seq.prefill_end = seq.num_tokens - 1
    return seqs


def _set_tables(config, plan: Plan, mapped: list[int]) -> None:
    """What the pool gives a plan: each row (scheduled, then forks) distinct blocks for its `mapped` tokens."""
    blocks = [-(-n // config.block_size) for n in mapped]
    plan.block_tables = np.zeros((len(mapped), max(blocks + [1])), np.int32)
    for i, n in enumerate(blocks):
        plan.block_tables[i, :n] = 1 + (np.arange(n) + i) % (config.num_blocks - 1)
    plan.num_mapped = np.array(mapped, np.int32)


def _models(engine, flags_kw: dict):
    """-> (graphdef, params, draft params, the step's static arguments: its Flags and draft graphdef)."""
    graphdef, params = nnx.split(engine.model)
    draft_graphdef, draft_params = (None, None) if engine.draft_model is None else nnx.split(engine.draft_model)
    c = engine.config
    flags = runner.Flags(backend=c.attention_backend, mesh=engine.mesh, ngram=c.prompt_lookup, **flags_kw)
    return graphdef, params, draft_params, dict(flags=flags, draft_graphdef=draft_graphdef)


def prefill_program(engine, num_tokens: int, *, forks=False, swap_in=False) -> Program:
    """A prefill step of `num_tokens` spread over as many rows as fit, the last row's chunk ending
    at max_model_len so its table is as wide as any; `forks`: a row forks (the
    copy-on-write kernel runs); `swap_in`: a row resumes from host memory."""
    c = engine.config
    num_rows = min(num_tokens, c.max_num_seqs)
    counts = [num_tokens // num_rows + (i < num_tokens % num_rows) for i in range(num_rows)]
    seqs = _sequences(counts[:-1] + [max(c.max_model_len, counts[-1])])
    for seq, n in zip(seqs, counts):
        seq.num_computed = seq.num_tokens - n
    plan = Plan(scheduled=list(zip(seqs, counts)))
    if forks:
        plan.forks = [(_sequences([c.max_model_len], slot_offset=num_rows)[0], seqs[-1])]
        plan.copies = [(1, 2)]
    if swap_in:
        plan.swap_in = [(seqs[-1].slot, [1], 0)]
    _set_tables(c, plan, [s.num_tokens for s in seqs] + [child.num_tokens for child, _ in plan.forks])
    batch = batching.prefill_batch(plan, block_size=c.block_size, max_num_seqs=c.max_num_seqs,
                                   max_blocks_per_seq=c.max_blocks_per_seq, token_cap=c.max_num_batched_tokens,
                                   num_speculative_tokens=c.num_speculative_tokens)
    label = "+forks" if forks else "+swap-in" if swap_in else ""
    return _prefill(engine, f"prefill{label}", plan, batch, dict(random=True, forks=forks), num_tokens)


def _prefill(engine, label: str, plan: Plan, batch, flags_kw: dict, num_tokens: int) -> Program:
    c = engine.config
    sp = batching.row_params(batching.prefill_rows(plan), batch.slots.shape[0], (), c.max_model_len)
    state = _state(engine)
    swapped = None
    if plan.swap_in:  # swap-in is not built with tensor parallelism: replicated
        ids = jax.ShapeDtypeStruct(batch.swap_blocks.shape, jnp.int32)
        swapped = tuple(_replicated(engine, jax.eval_shape(swap.gather_blocks, cache, ids)) for cache in state.caches)
    graphdef, params, draft_params, static = _models(engine, flags_kw)
    return Program(f"{label} T={batch.tokens.shape[0]} B={len(plan.scheduled)} W={batch.block_tables.shape[1]}",
                   runner.prefill_step, (graphdef, params, state, _replicated(engine, batch), _replicated(engine, sp),
                                         swapped, draft_params, _lora(engine, batch.slots.shape[0])), static,
                   steps=1, tokens=num_tokens, kv_tokens=int(batch.attn_seq_lens.sum()),
                   values=(None, None, None, batch, sp, None, None, None), layer_slices=engine.layer_slices())


def verify_program(engine, num_rows: int) -> Program:
    """A verification of `num_rows` decoding rows' k proposals each (speculative decoding), planned
    while the call before it ran (Plan.optimistic: the device moves its rows back by what that call
    rejected, and looks their n-gram drafts up or runs the draft model); one row's table is as wide
    as max_model_len."""
    c = engine.config
    k = c.num_speculative_tokens
    seqs = _sequences([1] * (num_rows - 1) + [c.max_model_len - k])
    for seq in seqs:
        seq.num_computed = seq.num_tokens - 1
    plan = Plan(scheduled=[(s, 1 + k) for s in seqs], drafts={s: [0] * k for s in seqs}, optimistic=set(seqs))
    _set_tables(c, plan, [s.num_tokens + k for s in seqs])
    batch = batching.prefill_batch(plan, block_size=c.block_size, max_num_seqs=c.max_num_seqs,
                                   max_blocks_per_seq=c.max_blocks_per_seq, token_cap=c.max_num_batched_tokens,
                                   num_speculative_tokens=k)
    method = "ngram" if c.prompt_lookup else "draft"
    program = _prefill(engine, f"verify {method} k={k}", plan, batch, dict(random=True), num_rows * (1 + k))
    return program if c.prompt_lookup else dataclasses.replace(program, draft_steps=k, draft_tokens=num_rows)


def decode_program(engine, num_rows: int, *, random=True, penalties=False) -> Program:
    """A K-step decode call of `num_rows` rows, one of them at max_model_len (the widest table)."""
    c = engine.config
    lengths = [1] * (num_rows - 1) + [c.max_model_len - c.num_decode_steps]
    seqs = _sequences(lengths)
    plan = Plan(scheduled=[(s, 1) for s in seqs], is_decode=True)
    _set_tables(c, plan, [min(s.num_tokens - 1 + c.num_decode_steps, c.max_model_len) for s in seqs])
    batch = batching.decode_batch(plan, max_num_seqs=c.max_num_seqs, max_blocks_per_seq=c.max_blocks_per_seq)
    width = batch.block_tables.shape[1]
    sp = batching.row_params(seqs, batch.slots.shape[0], (), c.max_model_len)
    graphdef, params, draft_params, static = _models(engine, dict(random=random, penalties=penalties))
    kind = "" if random else " greedy"
    kind += " +penalties" if penalties else ""
    return Program(f"decode{kind} K={c.num_decode_steps} B={num_rows} W={width}", runner.decode_steps,
                   (graphdef, params, _state(engine, penalties=penalties), _replicated(engine, batch),
                    _replicated(engine, sp), draft_params, _lora(engine, batch.slots.shape[0])),
                   dict(static, num_steps=c.num_decode_steps), steps=c.num_decode_steps, tokens=num_rows,
                   kv_tokens=sum(lengths), values=(None, None, None, batch, sp, None, None),
                   layer_slices=engine.layer_slices())


def pool_programs(engine) -> list[Program]:
    """The small programs beside the steps: a beam-search fork's block copies, penalty rows, swap-out."""
    c = engine.config
    i32 = functools.partial(np.zeros, dtype=np.int32)
    state = _state(engine)
    return [
        Program("copy_blocks_step F=8", runner.copy_blocks_step,
                (state, _replicated(engine, i32(8)), _replicated(engine, i32(8))), dict(backend=c.attention_backend)),
        Program("reset_penalty_rows", penalty_state.reset_rows,
                (_state(engine, penalties=True), _replicated(engine, i32(8)),
                 _replicated(engine, i32((8, c.max_model_len))), _replicated(engine, i32((8, c.max_model_len)))), {}),
        Program("swap out (gather 8 blocks)", swap.gather_blocks, (state.cache, _replicated(engine, i32(8))), {}),
    ]


PROGRAM_SETS = ("all", "quick", "largest")


def engine_programs(engine, which: str = "all") -> list[Program]:
    """The programs a warmed-up engine runs, at the widest tables (the most memory each takes).
    "all": each prefill token bucket and decode row bucket (warm_up's), the greedy decode loop,
    forks, swap-in, penalties and the pool operations; "quick": the same with only the smallest and
    largest bucket of each; "largest": the largest prefill and decode and the pool operations."""
    if which not in PROGRAM_SETS:
        raise ValueError(f"program set must be one of {PROGRAM_SETS}, got {which!r}")
    c = engine.config
    tokens = [t for t in (1 << i for i in range(4, 31)) if t < c.max_num_batched_tokens] + [c.max_num_batched_tokens]
    rows = sorted({min(1 << i, c.max_num_seqs) for i in range(c.max_num_seqs.bit_length() + 1)})
    verifies = [] if not c.num_speculative_tokens else [verify_program(engine, rows[-1])]
    if which == "largest":
        largest = [prefill_program(engine, tokens[-1]), decode_program(engine, rows[-1])]
        return largest + verifies + pool_programs(engine)
    if which == "quick":
        tokens, rows = [tokens[0], tokens[-1]], [rows[0], rows[-1]]
    programs = [prefill_program(engine, t) for t in tokens]
    programs += [decode_program(engine, r) for r in rows]
    if verifies:
        programs += [verify_program(engine, r) for r in rows[:-1]] + verifies
    programs += [decode_program(engine, rows[-1], random=False), prefill_program(engine, tokens[0], forks=True)]
    if which == "all":
        programs += [decode_program(engine, rows[-1], penalties=True)]
    if engine.mesh is None:  # preemption_mode="swap" is not built with tensor parallelism
        programs += [prefill_program(engine, tokens[0], swap_in=True)]
    return programs + pool_programs(engine)
