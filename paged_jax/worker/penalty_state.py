"""The device's penalty rows (presence / frequency / repetition penalties): each slot's output
token counts and prompt-token mask in `runner.DeviceState`, read by the rows of a call that uses
them and rebuilt from the host's tokens when a row takes a slot."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


def rows(state, slots, flags):
    """(output counts i32[B, V], prompt mask bool[B, V]) of the batch's slots, None in a call without penalties."""
    if not flags.penalties:
        return None
    safe = jnp.maximum(slots, 0)
    return state.output_counts[safe], state.prompt_mask[safe]


def count_tokens(counts, tokens):  # i32[B, V], i32[B, J] (-1: none) -> i32[B, V]
    rows = jnp.arange(tokens.shape[0])[:, None]
    return counts.at[rows, jnp.where(tokens >= 0, tokens, counts.shape[1])].add(1, mode="drop")


def put_counts(state, slots, counts):
    target = jnp.where(slots >= 0, slots, state.output_counts.shape[0])
    return dataclasses.replace(state, output_counts=state.output_counts.at[target].set(counts, mode="drop"))


@functools.partial(jax.jit, donate_argnames=("state",))
def reset_rows(state, slots, prompt_tokens, output_tokens):
    """Rebuild the penalty rows of newly admitted slots (i32[m]; -1 skip) from their prompt and
    output tokens so far (i32[m, L], -1 pad)."""
    num_slots, vocab = state.output_counts.shape
    rows = jnp.where(slots >= 0, slots, num_slots)[:, None]
    counts = state.output_counts.at[rows[:, 0]].set(0, mode="drop")
    counts = counts.at[rows, jnp.where(output_tokens >= 0, output_tokens, vocab)].add(1, mode="drop")
    mask = state.prompt_mask.at[rows[:, 0]].set(False, mode="drop")
    mask = mask.at[rows, jnp.where(prompt_tokens >= 0, prompt_tokens, vocab)].set(True, mode="drop")
    return dataclasses.replace(state, output_counts=counts, prompt_mask=mask)
