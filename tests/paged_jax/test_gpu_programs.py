"""The engine's programs as scripts/compile_for_gpu.py builds them (paged_jax/worker/gpu_programs.py),
here on this machine's CPU device with a stated activation peak: the pool sizing, the program set
and its abstract arguments, without compiling anything (test_compile_for_gpu.py compiles them)."""
import os

import jax
import numpy as np
import pytest

from models.checkpoint import MODEL_REGISTRY, read_config
from paged_jax.worker import gpu_programs

SMOLLM2 = os.path.join(os.path.dirname(__file__), "..", "data", "configs", "smollm2-135m-instruct.json")
LIMIT = 60 * 2**30
ACTIVATION = 100 * 2**20


@pytest.fixture(scope="module")
def built():
    config = read_config(SMOLLM2, dtype="bfloat16")
    probes = []

    def temp_bytes(program):
        probes.append(program.name)
        return ACTIVATION

    engine = gpu_programs.build(MODEL_REGISTRY["llama"].model_cls, config, jax.devices("cpu")[:1],
                                bytes_limit=LIMIT, temp_bytes=temp_bytes, max_num_seqs=256,
                                max_num_batched_tokens=8192, max_model_len=None)
    return engine, probes


def test_the_pool_is_sized_as_gpu_memory_utilization_sizes_it(built):
    engine, probes = built
    c = engine.config
    assert probes == ["prefill T=8192 B=256 W=512"]  # the largest step, at the widest tables
    assert engine.weight_bytes == 2 * 134_515_008  # SmolLM2-135M in bf16
    assert c.bytes_per_block == 30 * 2 * 3 * 16 * 64 * 2
    budget = int(0.9 * LIMIT - engine.weight_bytes - ACTIVATION)
    useful = 256 * (8192 // 16) + 1  # 256 sequences of the model's whole context, and the null block
    assert c.num_blocks == min(useful, budget // c.bytes_per_block) == useful
    assert (c.max_model_len, engine.kv_bytes) == (8192, useful * c.bytes_per_block)


def test_a_pool_smaller_than_the_context_cuts_max_model_len():
    config = read_config(SMOLLM2, dtype="bfloat16")
    engine = gpu_programs.build(MODEL_REGISTRY["llama"].model_cls, config, jax.devices("cpu")[:1],
                                bytes_limit=2**29, temp_bytes=lambda program: ACTIVATION, max_num_seqs=256,
                                max_num_batched_tokens=8192, max_model_len=None)
    c = engine.config
    blocks = int(0.9 * 2**29 - 2 * 134_515_008 - ACTIVATION) // c.bytes_per_block
    assert (c.num_blocks, c.max_model_len) == (blocks, (blocks - 1) * 16)


def test_every_bucket_a_warmed_up_engine_runs(built):
    engine, _ = built
    names = [p.name for p in gpu_programs.engine_programs(engine)]
    prefills = [f"prefill T={t} B={min(t, 256)} W=512" for t in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)]
    decodes = [f"decode K=8 B={b} W=512" for b in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
    assert names == prefills + decodes + [
        "decode greedy K=8 B=256 W=512", "prefill+forks T=16 B=16 W=512", "decode +penalties K=8 B=256 W=512",
        "prefill+swap-in T=16 B=16 W=512", "copy_blocks_step F=8", "reset_penalty_rows",
        "swap out (gather 8 blocks)"]
    assert [p.name for p in gpu_programs.engine_programs(engine, "largest")][:2] == [prefills[-1], decodes[-1]]
    with pytest.raises(ValueError, match="'everything'"):
        gpu_programs.engine_programs(engine, "everything")


def test_arguments_are_abstract_and_placed(built):
    engine, _ = built
    program = gpu_programs.decode_program(engine, 64)
    leaves = jax.tree.leaves(program.args)
    assert all(isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None for x in leaves)
    state = program.args[2]
    assert state.cache.k_pages.shape == (3, 30 * engine.config.num_blocks, 16, 64)
    assert state.cache.k_pages.dtype == np.dtype("bfloat16")
    batch = program.args[3]
    assert batch.slots.shape == (64,)
    assert (program.steps, program.tokens, program.kv_tokens) == (8, 64, 63 + 8192 - 8)


def test_a_program_runs_on_zeros_through_its_tables():
    """gpu_compile.run_timed, what scripts/gpu_check.sh times on a lent GPU, run here on the CPU
    with the reference backend: the decode loop's donated state is fed back and every call runs
    all its steps on every row. (On an H200 the decode programs once timed at 0.4 ms for 8 steps
    of Llama-3.1-8B: the batch was zeros, every row dead, and the loop ran no step.)"""
    import dataclasses

    from models import Llama
    from paged_jax.worker import gpu_compile
    from tests.models.model_testing import tiny_config

    engine = gpu_programs.build(Llama, tiny_config(), jax.devices("cpu")[:1], bytes_limit=2**28,
                                temp_bytes=lambda program: 0, max_num_seqs=4, max_num_batched_tokens=32,
                                max_model_len=64)
    engine = dataclasses.replace(engine, config=dataclasses.replace(engine.config, attention_backend="reference"))
    program = gpu_programs.decode_program(engine, 4)
    assert program.args[3].block_tables.shape == (4, 4)  # the long row's table: 64 tokens, blocks of 16
    seconds, out = gpu_compile.run_timed(engine, program, runs=2)
    assert seconds > 0
    assert int(out.steps) == engine.config.num_decode_steps
    assert (np.asarray(out.tokens)[:4] >= 0).all()  # every live row sampled a token at every step
    _, out = gpu_compile.run_timed(engine, gpu_programs.prefill_program(engine, 32), runs=1)
    assert (np.asarray(out.tokens)[:4] >= 0).all()
