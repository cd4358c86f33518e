"""What one device call returns (vLLM's ModelRunnerOutput): the sampled tokens of each batch row.
Registered pytrees: the jitted step returns them with device
arrays, `jax.device_get` turns them into the same classes holding numpy arrays."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    """`SamplingParams.prompt_logprobs`: entry i scores prompt token `positions[i]` of batch row
    `rows[i]` from the logits at the position before it (-1 rows: padding)."""

    rows: np.ndarray  # i32[p]
    positions: np.ndarray  # i32[p]
    logprob: np.ndarray  # f32[p]
    rank: np.ndarray  # i32[p]
    top_ids: np.ndarray  # i32[p, num_prompt_logprobs]
    top_logprobs: np.ndarray  # f32[p, num_prompt_logprobs]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelOutput:
    """Row i of every array belongs to the plan's i-th row (its scheduled sequences, then forked children)."""

    tokens: np.ndarray  # i32[n, k]; the tokens sampled for each row, -1 where none
    logprob: np.ndarray  # f32[n, k]; of each sampled token
    rank: np.ndarray  # i32[n, k]; 1 = the most likely
    top_ids: np.ndarray  # i32[n, k, num_logprobs]
    top_logprobs: np.ndarray  # f32[n, k, num_logprobs]
    finish: np.ndarray  # i32[n]; 0 running, 1 stop token, 2 length
    steps: np.ndarray  # i32[]; model steps the call ran
    prompt_logprobs: PromptLogprobs | None = None  # prefill steps whose batch asked for them
    num_accepted: np.ndarray | None = None  # i32[n]; drafts each row accepted (calls that verify proposals)
    num_drafts: np.ndarray | None = None  # i32[n]; drafts each row verified (the device may find fewer than reserved)
