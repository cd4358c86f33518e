"""Compile the engine's programs (`gpu_programs`) for a GPU that is not here and read what XLA says
about each: compile seconds, memory (arguments, outputs, temps), cost (flops, bytes accessed) and the
roofline time those give on the GPU's peak and bandwidth; then whether the engine fits.

A compile's figures are kept in CACHE_DIR under the hash of the lowered program, the GPU's target
config, the jax version, the model steps' compiler options and the HLO audit that reads them, so a
run whose programs did not change compiles nothing again (as pallas_kernels/cubin.py keeps cubin
stats)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import time

import jax
import numpy as np

from models import layers
from pallas_kernels import gpu_target
from paged_jax.engine.arg_utils import EngineArgs
from paged_jax.worker import abstract_engine, hlo_audit

CACHE_DIR = os.environ.get("PAGED_JAX_GPU_COMPILE_CACHE",
                           os.path.join(os.path.expanduser("~"), ".cache", "paged-jax", "gpu-compile"))


@dataclasses.dataclass(frozen=True)
class ProgramStats:
    name: str
    compile_seconds: float  # 0.0 when read from CACHE_DIR
    argument_bytes: int
    output_bytes: int
    alias_bytes: int  # outputs that reuse donated arguments (the KV pages, the pool)
    temp_bytes: int
    flops: float
    bytes_accessed: float
    cached: bool = False
    # Layer slices of the stacked weights written to memory before the matmuls read them
    # (hlo_audit.copied_layer_slices): each one more read and write of that layer's weights.
    copied_layer_slices: tuple = ()

    def roofline_seconds(self, spec: gpu_target.GpuSpec) -> float:
        """The longer of compute at the bf16 matrix peak and memory traffic at full bandwidth."""
        return max(self.flops / spec.peak_bf16_flops, self.bytes_accessed / spec.bandwidth)


def _cache_file(lowered_text: str, gpu: str, layer_slices: dict) -> str:
    with open(hlo_audit.__file__) as f:  # what reads the optimized HLO for copied_layer_slices
        audit = f.read()
    key = hashlib.sha256("\0".join([lowered_text, gpu_target.target_config_text(gpu), jax.__version__,
                                    json.dumps(layers.COMPILER_OPTIONS), json.dumps(sorted(layer_slices.items())),
                                    audit]).encode())
    return os.path.join(CACHE_DIR, key.hexdigest()[:40] + ".json")


def compile_program(program, gpu: str, device, *, use_cache: bool = True) -> ProgramStats:
    """Lower and compile `program` (gpu_programs.Program) for compile-only `device` of `gpu`.
    Under jax.default_device(device) the Pallas kernels' tile tables and Triton lowering target its
    architecture. Raises what XLA raises when the program does not compile."""
    with jax.default_device(device):
        lowered = program.fn.trace(*program.args, **program.static).lower()
        path = _cache_file(lowered.as_text(), gpu, program.layer_slices)
        if use_cache and os.path.exists(path):
            with open(path) as f:
                return ProgramStats(**{**json.load(f), "name": program.name, "compile_seconds": 0.0, "cached": True})
        start = time.perf_counter()
        compiled = lowered.compile()
        seconds = time.perf_counter() - start
    memory, cost = compiled.memory_analysis(), gpu_target.compiled_cost(compiled)
    stats = ProgramStats(name=program.name, compile_seconds=seconds, argument_bytes=memory.argument_size_in_bytes,
                         output_bytes=memory.output_size_in_bytes, alias_bytes=memory.alias_size_in_bytes,
                         temp_bytes=memory.temp_size_in_bytes, flops=cost.get("flops", 0.0),
                         bytes_accessed=cost.get("bytes accessed", 0.0),
                         copied_layer_slices=tuple(hlo_audit.copied_layer_slices(compiled.as_text(),
                                                                                 program.layer_slices)))
    if use_cache:
        os.makedirs(CACHE_DIR, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=CACHE_DIR, delete=False) as f:
            json.dump(dataclasses.asdict(stats), f)
        os.replace(f.name, path)
    return stats


def does_not_fit(engine, stats: list[ProgramStats], bytes_limit: int) -> str | None:
    """-> why weights + KV pool + the largest program's temp buffers exceed what jax may allocate on
    the GPU (`bytes_limit`, one device's share of each), naming that program and the bytes; None
    when they fit."""
    largest = max(stats, key=lambda s: s.temp_bytes)
    need = engine.weight_bytes + engine.kv_bytes + largest.temp_bytes
    if need <= bytes_limit:
        return None
    return (f"does not fit: weights {engine.weight_bytes / 2**30:.2f} GiB + KV pool {engine.kv_bytes / 2**30:.2f} GiB "
            f"+ temp of {largest.name!r} {largest.temp_bytes / 2**30:.2f} GiB = {need / 2**30:.2f} GiB "
            f"({need} bytes) > jax's limit on the GPU {bytes_limit / 2**30:.2f} GiB ({bytes_limit} bytes)")


def roofline_seconds(engine, spec: gpu_target.GpuSpec, *, tokens: int, kv_tokens: int, steps: int = 1) -> float:
    """The floor of `steps` forwards of `tokens` tokens each, whose attention reads `kv_tokens`
    cached tokens: the longer of the weights' matmuls (2 flops a weight a token) at the bf16 peak
    and every weight and cached token's K/V read once at the bandwidth, one device's share of each.
    Attention's own flops are left out (small beside the weights' below ~8k tokens of context).
    With a draft model, each forward runs it too (its weights and pages are the engine's)."""
    c = engine.config
    return steps * _forward_seconds(engine, spec, engine.weight_bytes, tokens,
                                    kv_tokens * c.bytes_per_block / c.block_size)


def program_roofline_seconds(engine, spec: gpu_target.GpuSpec, program) -> float:
    """`roofline_seconds` of a program's model work (gpu_programs.Program), and of the draft model's
    decode steps alone before it where it proposes (a draft model's verification: k steps of one
    token a row, each reading the draft's weights and its K/V of the rows' contexts)."""
    seconds = roofline_seconds(engine, spec, tokens=program.tokens, kv_tokens=program.kv_tokens, steps=program.steps)
    if program.draft_steps:
        c, draft = engine.config, engine.draft_model
        draft_block = EngineArgs(block_size=c.block_size, attention_backend=c.attention_backend,
                                 kv_cache_dtype=c.kv_cache_dtype).draft_bytes_per_block(
            engine.model.config, draft.config, c.attention_backend)
        seconds += program.draft_steps * _forward_seconds(
            engine, spec, abstract_engine.weight_bytes_per_device(draft), program.draft_tokens,
            program.kv_tokens * draft_block / c.block_size)
    return seconds


def _forward_seconds(engine, spec, weight_bytes: int, tokens: int, kv_bytes: float) -> float:
    """One forward's floor: its matmuls at the bf16 peak or its bytes at the bandwidth, one device's share."""
    compute = 2 * weight_bytes / jax.numpy.dtype(engine.model.config.dtype).itemsize * tokens / spec.peak_bf16_flops
    return max(compute, (weight_bytes + kv_bytes / engine.placement.size) / spec.bandwidth)


def run_timed(engine, program, runs: int = 5):
    """On a real GPU (engine built on jax.devices()): -> (the median seconds of one call of
    `program`, its last output on the host without the state, or None), after a first call that
    compiles. Nothing of the call stays on the device: a kept state would hold a second KV pool
    while the next program allocates its own. Zero weights and KV pages; the
    batch is the program's own (`program.values`), so the rows are live, the decode loop runs its
    steps and attention reads the contexts the roofline counts through the batch's block tables."""
    from paged_jax.worker import runner

    def zeros(x):  # a ShapeDtypeStruct -> zeros where it is placed; anything else (graphdef) as is
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x
        return jax.jit(lambda: jax.numpy.zeros(x.shape, x.dtype), out_shardings=x.sharding)()

    def put(value, abstract):  # the host's batch where its abstract twin is placed
        return jax.tree.map(lambda v, a: jax.device_put(np.asarray(v), a.sharding), value, abstract)

    values = program.values or (None,) * len(program.args)
    args = [put(v, a) if v is not None and not isinstance(a, runner.DeviceState) else jax.tree.map(zeros, a)
            for a, v in zip(program.args, values)]
    state_at = next((i for i, a in enumerate(args) if isinstance(a, runner.DeviceState)), None)
    times = []
    for _ in range(runs + 1):
        start = time.perf_counter()
        out = jax.block_until_ready(program.fn(*args, **program.static))
        times.append(time.perf_counter() - start)
        if state_at is not None:  # the state was donated: the next call takes the returned one
            args[state_at] = out[0] if isinstance(out, tuple) else out
    result = jax.device_get(out[1]) if isinstance(out, tuple) and len(out) > 1 else None
    del args, out
    return sorted(times[1:])[runs // 2], result
