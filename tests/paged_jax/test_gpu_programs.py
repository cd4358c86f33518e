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


QWEN3 = os.path.join(os.path.dirname(SMOLLM2), "qwen3-0.6b.json")
QWEN25 = os.path.join(os.path.dirname(SMOLLM2), "qwen2.5-0.5b.json")


def test_an_ngram_engine_verifies_at_every_row_bucket_with_its_token_pages(built):
    config = read_config(SMOLLM2, dtype="bfloat16")
    spec = {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    engine = gpu_programs.build(MODEL_REGISTRY["llama"].model_cls, config, jax.devices("cpu")[:1],
                                bytes_limit=LIMIT, temp_bytes=lambda program: ACTIVATION, max_num_seqs=256,
                                max_num_batched_tokens=8192, max_model_len=None, speculative_config=spec)
    c = engine.config
    assert (c.num_speculative_tokens, c.prompt_lookup) == (7, (2, 4))
    assert c.bytes_per_block == built[0].config.bytes_per_block + 4 * 16  # a block's token ids, int32 a slot
    assert c.num_blocks == built[0].config.num_blocks  # both pools hold all that 256 sequences can use
    programs = gpu_programs.engine_programs(engine)
    verifies = [p.name for p in programs if p.name.startswith("verify")]
    assert verifies == [f"verify ngram k=7 T={8 * b} B={b} W=512" for b in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
    assert [p.name for p in gpu_programs.engine_programs(engine, "largest")][2] == verifies[-1]
    for program in programs:  # every step carries the token pages and looks drafts up where it verifies
        if program.steps:
            state = program.args[2]
            assert state.token_pages.token_ids.shape == (c.num_blocks, 16)
            assert program.static["flags"].ngram == (2, 4)
    verify = gpu_programs.verify_program(engine, 4)
    batch = verify.values[3]  # the host's batch: every row planned ahead, k stand-ins each
    assert batch.drafts.shape == (4, 7) and batch.spec_rows.shape == (4, 8) and bool(batch.optimistic.all())
    assert (verify.steps, verify.tokens, verify.kv_tokens) == (1, 32, 3 * 8 + 8192)


def test_a_draft_models_pages_share_the_pool_budget():
    """Qwen3-0.6B verifying Qwen2.5-0.5B's proposals (one vocabulary of 151936): each block holds
    both models' K/V, the weights are both models', every step carries the draft, and the pool is
    sized by the larger activation peak of the largest prefill and the largest verification."""
    target = read_config(QWEN3, dtype="bfloat16")
    spec = {"method": "draft_model", "model": QWEN25, "num_speculative_tokens": 4}
    probes = []

    def temp_bytes(program):  # a verification's logits are every row's 1 + k: larger here
        probes.append(program.name)
        return 3 * ACTIVATION if program.name.startswith("verify") else ACTIVATION

    sizes = dict(bytes_limit=LIMIT, max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=None)
    engine = gpu_programs.build(MODEL_REGISTRY["qwen3"].model_cls, target, jax.devices("cpu")[:1],
                                temp_bytes=temp_bytes, speculative_config=spec, **sizes)
    assert probes == ["prefill T=2048 B=64 W=2560", "verify draft k=4 T=512 B=64 W=2560"]
    c = engine.config
    target_block, draft_block = 28 * 2 * 8 * 16 * 128 * 2, 24 * 2 * 2 * 16 * 64 * 2
    assert c.bytes_per_block == target_block + draft_block
    assert c.num_blocks == int(0.9 * LIMIT - engine.weight_bytes - 3 * ACTIVATION) // c.bytes_per_block
    assert (c.num_speculative_tokens, c.prompt_lookup) == (4, None)
    plain = gpu_programs.build(MODEL_REGISTRY["qwen3"].model_cls, target, jax.devices("cpu")[:1],
                               temp_bytes=lambda program: ACTIVATION, **sizes)
    draft_weights = engine.weight_bytes - plain.weight_bytes
    assert draft_weights == 2 * (151936 * 896 + 896 + 24 * (896 * 64 * (2 * 14 + 2 * 2) + 3 * 896 * 4864 + 2 * 896
                                                             + 64 * (14 + 2 * 2)))  # q/k/v biases
    names = [p.name for p in gpu_programs.engine_programs(engine, "quick")]
    assert [n for n in names if n.startswith("verify")] == ["verify draft k=4 T=8 B=1 W=2560",
                                                            "verify draft k=4 T=512 B=64 W=2560"]
    verify = gpu_programs.verify_program(engine, 64)
    assert verify.args[2].draft_cache.k_pages.shape == (2, 24 * c.num_blocks, 16, 64)
    assert verify.static["draft_graphdef"] is not None and verify.args[6] is not None
    # Its roofline, on a GPU whose bandwidth bounds every forward here: the target's forward of
    # 64 x 5 tokens (both models' weights and pages: the draft runs over them too), and before it
    # the draft's 4 steps of one token a row, each reading the draft's weights and pages alone.
    from pallas_kernels.gpu_target import GpuSpec
    from paged_jax.worker import gpu_compile
    gpu = GpuSpec("slow memory", "9.0", 80 * 2**30, bandwidth=1e9, peak_bf16_flops=1e18)
    kv_tokens = 63 * 5 + c.max_model_len  # each row reads its drafts too
    assert (verify.steps, verify.tokens, verify.kv_tokens, verify.draft_steps, verify.draft_tokens) == (
        1, 64 * 5, kv_tokens, 4, 64)
    forward = engine.weight_bytes + kv_tokens * (target_block + draft_block) / 16
    draft_step = draft_weights + kv_tokens * draft_block / 16
    assert gpu_compile.program_roofline_seconds(engine, gpu, verify) == pytest.approx((forward + 4 * draft_step) / 1e9)
    decode = gpu_programs.decode_program(engine, 64)  # no proposals: the forwards alone
    assert gpu_compile.program_roofline_seconds(engine, gpu, decode) == pytest.approx(
        8 * (engine.weight_bytes + decode.kv_tokens * (target_block + draft_block) / 16) / 1e9)
    with pytest.raises(ValueError, match="vocab_size 49152 differs from the target's 151936"):
        gpu_programs.build(MODEL_REGISTRY["qwen3"].model_cls, target, jax.devices("cpu")[:1],
                           temp_bytes=lambda program: ACTIVATION, speculative_config=dict(spec, model=SMOLLM2), **sizes)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_verification_runs_on_zeros(method):
    """The verify program as gpu_check would time it, on this CPU with the reference backend: every
    live row scores its proposals and samples at least one token."""
    import dataclasses

    from models import Llama
    from paged_jax.worker import gpu_compile
    from tests.models.model_testing import tiny_config

    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["model"] = tiny_config(num_layers=1)
    engine = gpu_programs.build(Llama, tiny_config(), jax.devices("cpu")[:1], bytes_limit=2**28,
                                temp_bytes=lambda program: 0, max_num_seqs=4, max_num_batched_tokens=32,
                                max_model_len=64, speculative_config=spec)
    engine = dataclasses.replace(engine, config=dataclasses.replace(engine.config, attention_backend="reference"))
    program = gpu_programs.verify_program(engine, 4)
    assert program.name == f"verify {method.split('_')[0]} k=3 T=16 B=4 W=4"
    _, out = gpu_compile.run_timed(engine, program, runs=1)
    taken = (np.asarray(out.tokens) >= 0).sum(axis=1)
    assert out.tokens.shape == (4, 4) and (taken[:4] >= 1).all()
    # The draft model proposes k for every row; the device's n-gram lookup finds k in the long row
    # (60 zeros: its last 5 match) and none in a row of one token.
    assert np.asarray(out.num_drafts)[:4].tolist() == ([3] * 4 if method == "draft_model" else [0, 0, 0, 3])
