"""The engine's own counters (vLLM's IterationStats): what each plan and call adds, and the figures
`LLMEngine.stats()` reports beside the scheduler's, the speculator's and the model runner's."""
from __future__ import annotations

import functools

import jax

_NUM_COMPILES = [0]  # jax's traces and backend compiles in this process, once `listen_for_compiles` ran
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration")


def _count_compiles(event, duration, **_):
    if event in _COMPILE_EVENTS:
        _NUM_COMPILES[0] += 1


@functools.cache
def listen_for_compiles() -> None:
    """Count jax's compiles from now on (once per process; a Speculator's timed costs need it)."""
    jax.monitoring.register_event_duration_secs_listener(_count_compiles)


def num_compiles() -> int:
    """jax's traces and compiles in this process so far, once counted: a call during which jax
    compiled is not timed (engine/speculative.py)."""
    return _NUM_COMPILES[0]


def new_counters() -> dict:
    return dict(prompt_tokens=0, generation_tokens=0, prefill_tokens=0, prefill_steps=0, decode_calls=0,
                decode_steps=0, model_steps=0, running_steps=0, max_num_running=0, busy_seconds=0.0,
                peak_blocks_used=0, overlapped_calls=0, overlapped_verifications=0)


def count_plan(k: dict, plan) -> None:
    """A planned call: a decode call, or a ragged step and the known tokens it computes (prompts,
    and outputs recomputed after a preemption; not decode rows)."""
    if plan.is_decode:
        k["decode_calls"] += 1
        return
    k["prefill_steps"] += 1
    k["prefill_tokens"] += sum(max(0, min(seq.num_computed + n, seq.prefill_end) - seq.num_computed)
                               for seq, n in plan.scheduled)


def count_steps(k: dict, plan, steps: int) -> None:
    """A call's output: the model steps it ran over its rows."""
    running = len(plan.scheduled) + len(plan.forks)
    k["model_steps"] += steps
    k["decode_steps"] += steps if plan.is_decode else 0
    k["running_steps"] += steps * running
    k["max_num_running"] = max(k["max_num_running"], running if steps else 0)


def engine_stats(c, k: dict, scheduler: dict, speculator: dict, runner: dict) -> dict:
    """`LLMEngine.stats()`: the engine's configuration and counters (`c`, `k`) with its parts'."""
    busy = max(k["busy_seconds"], 1e-9)
    return dict(
        num_blocks=c.num_blocks, block_size=c.block_size, peak_blocks_used=k["peak_blocks_used"], **scheduler,
        prompt_tokens=k["prompt_tokens"], generation_tokens=k["generation_tokens"],
        prefill_tokens=k["prefill_tokens"], max_num_running=k["max_num_running"],
        mean_num_running=k["running_steps"] / max(k["model_steps"], 1),
        prefill_steps=k["prefill_steps"], decode_calls=k["decode_calls"], decode_steps=k["decode_steps"],
        overlapped_calls=k["overlapped_calls"], overlapped_verifications=k["overlapped_verifications"],
        busy_seconds=k["busy_seconds"], generation_throughput=k["generation_tokens"] / busy, **speculator, **runner)
