"""The engine's jitted steps compiled from shapes alone: a model built with abstract weights
(`abstract_model`), a device state and a batch of `jax.ShapeDtypeStruct`s, nothing allocated. What
the compiled program holds (copies, temp bytes: `paged_jax.worker.hlo_audit`) can then be checked
at a real model's sizes on any machine, and the activation peak measured before the cache is made.

This is the one place that builds `runner.decode_steps`' and `runner.prefill_step`'s inputs from
shapes: when their signatures change, only this file follows."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from paged_jax.attention import cache_layout
from paged_jax.worker import batching, ngram_proposer, runner


@dataclasses.dataclass(frozen=True)
class Sizing:
    """The engine sizes a compiled step depends on (EngineConfig's names)."""

    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    attention_backend: str = "reference"
    kv_cache_dtype: str = "auto"

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


def abstract_model(model_cls, config):
    """`model_cls(config)` with every weight a ShapeDtypeStruct: no memory, any size."""
    return nnx.eval_shape(lambda: model_cls(config, rngs=nnx.Rngs(0)))


def abstract_state(model, sizing: Sizing, *, draft_model=None, token_pages: bool = False) -> runner.DeviceState:
    """As the engine holds it; a speculating engine's also holds the draft's pages or the tokens'."""
    s = sizing

    def cache(m):
        return jax.eval_shape(lambda: m.init_cache(s.num_blocks, s.block_size, layout=cache_layout(s.attention_backend),
                                                   kv_cache_dtype=s.kv_cache_dtype))

    return runner.DeviceState(cache=cache(model), output_counts=jax.ShapeDtypeStruct((s.max_num_seqs, 0), jnp.int32),
                              prompt_mask=jax.ShapeDtypeStruct((s.max_num_seqs, 0), bool),
                              last_sampled=_i32(s.max_num_seqs), num_rejected=_i32(s.max_num_seqs),
                              draft_cache=None if draft_model is None else cache(draft_model),
                              token_pages=ngram_proposer.TokenPages(_i32(s.num_blocks, s.block_size)) if token_pages
                              else None)


def _i32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.int32)


def decode_program(model, sizing: Sizing, *, num_rows: int, width: int, num_steps: int = 8,
                   random: bool = False) -> jax.stages.Compiled:
    """`runner.decode_steps` for `num_rows` rows with tables `width` blocks wide; `random`: the
    sampled variant (else greedy)."""
    graphdef, params = nnx.split(model)
    batch = batching.DecodeBatch(slots=_i32(num_rows), block_tables=_i32(num_rows, width), positions=_i32(num_rows),
                                 num_mapped=_i32(num_rows), live=jax.ShapeDtypeStruct((num_rows,), bool),
                                 last_tokens=_i32(num_rows), num_output=_i32(num_rows), total_len=_i32(num_rows),
                                 stop_on_finish=jax.ShapeDtypeStruct((), bool))
    sp = batching.row_params([], num_rows, (), sizing.max_model_len)
    flags = runner.Flags(sizing.attention_backend, random=random)
    return runner.decode_steps.lower(graphdef, params, abstract_state(model, sizing), batch, sp, flags=flags,
                                     num_steps=num_steps).compile()


def prefill_program(model, sizing: Sizing, *, num_tokens: int, num_rows: int, width: int,
                    num_speculative_tokens: int = 0, draft_model=None,
                    prompt_lookup: tuple[int, int] | None = None) -> jax.stages.Compiled:
    """`runner.prefill_step` for a ragged batch of `num_tokens` tokens over `num_rows` rows, tables
    `width` blocks wide (one program serves greedy and sampled rows); with `num_speculative_tokens`,
    the variant that verifies that many proposals per row. A speculating engine's step carries its
    `draft_model`, or with n-gram (`prompt_lookup`) the token pages."""
    graphdef, params = nnx.split(model)
    draft_graphdef, draft_params = nnx.split(draft_model) if draft_model is not None else (None, None)
    r, t, j = num_rows, num_tokens, num_speculative_tokens + 1 if num_speculative_tokens else 0
    batch = batching.PrefillBatch(
        slots=_i32(r), tokens=_i32(t), positions=_i32(t), token_row=_i32(t), slot_mapping=_i32(t),
        block_tables=_i32(r, width), query_start_loc=_i32(r + 1), attn_seq_lens=_i32(r), logits_rows=_i32(r),
        copy_src=_i32(0), copy_dst=_i32(0), num_output=_i32(r), total_len=_i32(r),
        prompt_lp_tokens=_i32(0), prompt_lp_targets=_i32(0), prompt_lp_rows=_i32(0), prompt_lp_positions=_i32(0),
        swap_blocks=_i32(0), spec_rows=_i32(r, j), drafts=_i32(r, max(j - 1, 0)),
        optimistic=jax.ShapeDtypeStruct((r if j else 0,), bool))
    sp = batching.row_params([], r, (), sizing.max_model_len)
    flags = runner.Flags(sizing.attention_backend, ngram=prompt_lookup)
    state = abstract_state(model, sizing, draft_model=draft_model, token_pages=prompt_lookup is not None)
    return runner.prefill_step.lower(graphdef, params, state, batch, sp, None, draft_params, flags=flags,
                                     draft_graphdef=draft_graphdef).compile()
