"""Tensor parallelism on 8 simulated CPU devices. jax reads XLA_FLAGS once, at import, so these run
in their own process: tests/paged_jax/test_tensor_parallel_process.py starts it with
XLA_FLAGS=--xla_force_host_platform_device_count=8; in the main process they skip."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from paged_jax import LLM, SamplingParams
from paged_jax.core import block_pool as bp
from paged_jax.worker import sharding
from paged_jax.attention import AttentionMetadata
from pallas_kernels import targets
from tests.models.model_testing import GEMMA2, MISTRAL_WINDOW, max_rel_err, random_model, tiny_config

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices: run in its own process "
                                "by tests/paged_jax/test_tensor_parallel_process.py")

PROMPTS = [[5, 17, 99, 3, 42, 8, 61], list(range(10, 33)), [7, 7, 1, 90]]
TRITON = "__gpu$xla.gpu.triton"


def spec_of(x):
    return x.sharding.spec


def prefill_inputs(prompt, num_blocks, block_size=8):
    pool = bp.init(num_blocks, block_size, 1, 8)
    pool, _ = bp.allocate(pool, np.array([len(prompt)]))
    n = len(prompt)
    md = AttentionMetadata(slot_mapping=bp.slot_mapping(pool, jnp.zeros(n, jnp.int32), jnp.arange(n)),
                           block_tables=pool.block_tables, seq_lens=jnp.array([n], jnp.int32),
                           query_start_loc=jnp.array([0, n], jnp.int32))
    return jnp.array(prompt, jnp.int32), jnp.arange(n, dtype=jnp.int32), md, jnp.array([n - 1])


@jax.jit
def one_device_logits(model, tokens, positions, cache, md, rows):
    return model(tokens, positions, cache, md, rows)[0]


def assert_sharded_logits_match_one_device(config, tp):
    reference = random_model(config)
    tokens, positions, md, rows = prefill_inputs(PROMPTS[1], 16)
    want = one_device_logits(reference, tokens, positions, reference.init_cache(16, 8), md, rows)

    mesh = sharding.make_mesh(tp)
    model = sharding.shard_model(random_model(config), mesh)
    assert model.config.num_kv_heads == max(config.num_kv_heads, tp)
    cache = jax.device_put(model.init_cache(16, 8), sharding.named(sharding.cache_specs(model.init_cache(16, 8)), mesh))

    @jax.jit
    def sharded_logits(model, tokens, positions, cache, md, rows):
        return model(tokens, positions, cache, md, rows, mesh=mesh)[0]

    got = sharded_logits(model, tokens, positions, cache, md, rows)
    assert max_rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("tp", [2, 4])
def test_logits_and_greedy_tokens_match_one_device(tp):
    config = tiny_config()  # 4 query heads, 2 KV heads: tp=4 replicates each KV head twice
    assert_sharded_logits_match_one_device(config, tp)

    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    single = LLM(random_model(config), block_size=8, num_blocks=32, max_num_seqs=4, log_stats=False)
    split = LLM(random_model(config), block_size=8, num_blocks=32, max_num_seqs=4, log_stats=False,
                tensor_parallel_size=tp)
    assert ([o.outputs[0].token_ids for o in split.generate(PROMPTS, greedy)]
            == [o.outputs[0].token_ids for o in single.generate(PROMPTS, greedy)])


def test_an_int8_cache_shards_its_scales_with_its_pages_and_gives_one_devices_tokens():
    """A scale belongs to one (token, KV head): each shard quantizes and reads its own heads' pages."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engines = [LLM(random_model(tiny_config()), block_size=8, num_blocks=32, max_num_seqs=4, log_stats=False,
                   kv_cache_dtype="int8", tensor_parallel_size=tp) for tp in (1, 2)]
    cache = engines[1].engine.state.cache
    assert cache.k_pages.dtype == jnp.int8 and spec_of(cache.k_pages) == P("model")
    assert spec_of(cache.k_scales) == P("model") and spec_of(cache.v_scales) == P("model")
    assert cache.k_scales.addressable_shards[0].data.shape == (1, 2 * 32, 8)  # one KV head each
    single, split = ([o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)] for llm in engines)
    assert split == single


@pytest.mark.parametrize("tp", [2, 4])
def test_int8_weights_shard_their_scales_with_their_channels_and_give_one_devices_tokens(tp):
    """quantization="int8" with an untied head: each shard's int8 weights and their per-channel
    scales (heads, MLP columns, vocabulary split alike; tp=4 replicates each KV head and its scales)
    give the single-device int8 engine's greedy tokens."""
    config = tiny_config(tie_word_embeddings=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engines = [LLM(random_model(config), block_size=8, num_blocks=32, max_num_seqs=4, log_stats=False,
                   quantization="int8", tensor_parallel_size=n) for n in (1, tp)]
    layers = nnx.merge(engines[1].engine.model_runner.graphdef, engines[1].engine.model_runner.params).layers
    assert layers.wq[...].dtype == jnp.int8 and spec_of(layers.wq[...]) == P(None, None, "model", None)
    assert spec_of(layers.wq_scale[...]) == P(None, "model", None) and spec_of(layers.w_up_scale[...]) == P(None, "model")
    assert layers.wk_scale[...].shape[1] == max(config.num_kv_heads, tp)
    single, split = ([o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)] for llm in engines)
    assert split == single


@pytest.mark.parametrize("tp", [2, 4])
def test_lora_adapters_on_shards_give_one_devices_tokens(tmp_path, tp):
    """Requests with two adapters and none in the same calls: the single-device engine's greedy
    tokens (tp=4 replicates each KV head, and the adapters' k/v rows with them)."""
    from paged_jax import LoRARequest
    from tests.models.model_testing import save_peft_adapter

    config = tiny_config()
    save_peft_adapter(tmp_path / "one", config, rank=4, alpha=8, seed=1)
    save_peft_adapter(tmp_path / "two", config, rank=8, alpha=8, seed=2, targets=("k_proj", "v_proj", "o_proj"))
    loras = [LoRARequest("one", 1, str(tmp_path / "one")), None, LoRARequest("two", 2, str(tmp_path / "two"))]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    single, split = ([o.outputs[0].token_ids for o in LLM(
        random_model(config), block_size=8, num_blocks=32, max_num_seqs=4, log_stats=False, enable_lora=True,
        max_loras=2, max_lora_rank=8, tensor_parallel_size=n).generate(PROMPTS, greedy, lora_request=loras)]
        for n in (1, tp))
    plain = [o.outputs[0].token_ids for o in LLM(random_model(config), block_size=8, num_blocks=32, max_num_seqs=4,
                                                 log_stats=False).generate(PROMPTS, greedy)]
    assert split == single and single[1] == plain[1] and single[0] != plain[0] and single[2] != plain[2]


def test_speculative_decoding_on_two_shards_gives_one_devices_tokens(untimed_speculation):
    """n-gram proposals verified on a tp=2 engine: the plain single-device engine's greedy tokens."""
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    single = LLM(random_model(tiny_config()), block_size=8, num_blocks=32, max_num_seqs=4, log_stats=False)
    split = LLM(random_model(tiny_config()), block_size=8, num_blocks=32, max_num_seqs=4, log_stats=False,
                tensor_parallel_size=2, num_decode_steps=4, speculative_config=ngram)
    assert ([o.outputs[0].token_ids for o in split.generate(PROMPTS, greedy)]
            == [o.outputs[0].token_ids for o in single.generate(PROMPTS, greedy)])
    assert split.stats()["spec_decode_num_drafts"] > 0


def test_a_draft_model_on_two_shards_gives_one_devices_tokens(untimed_speculation):
    """A draft model (a one-layer model of the same vocabulary) sharded like the target, its pages
    beside the target's on each shard: the plain single-device engine's greedy tokens."""
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    draft = {"method": "draft_model", "model": random_model(tiny_config(num_layers=1), seed=1),
             "num_speculative_tokens": 3}
    single = LLM(random_model(tiny_config()), block_size=8, num_blocks=32, max_num_seqs=4, log_stats=False)
    split = LLM(random_model(tiny_config()), block_size=8, num_blocks=32, max_num_seqs=4, log_stats=False,
                tensor_parallel_size=2, num_decode_steps=4, speculative_config=draft)
    assert spec_of(split.engine.state.draft_cache.k_pages) == P("model")
    assert ([o.outputs[0].token_ids for o in split.generate(PROMPTS, greedy)]
            == [o.outputs[0].token_ids for o in single.generate(PROMPTS, greedy)])
    assert split.stats()["spec_decode_num_drafts"] > 0


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_qwen_biases_and_qk_norms_shard(model_type):
    """tp=4 over 2 KV heads: Qwen2's k/v biases are replicated with their heads, Qwen3's norms whole."""
    assert_sharded_logits_match_one_device(tiny_config(model_type=model_type), 4)


@pytest.mark.parametrize("overrides", [MISTRAL_WINDOW, GEMMA2], ids=["mistral_window", "gemma2"])
def test_sliding_windows_and_gemma2_shard(overrides):
    """tp=4 over 2 KV heads, windows shorter than the 23-token prompt: each shard's kernel gets the
    layer's window and Gemma 2's soft cap; its four norms are replicated."""
    assert_sharded_logits_match_one_device(tiny_config(**overrides), 4)


def test_params_and_pages_are_sharded_megatron_style():
    llm = LLM(random_model(tiny_config()), block_size=8, num_blocks=32, max_num_seqs=4, log_stats=False,
              tensor_parallel_size=2)
    params, state = llm.engine.model_runner.params, llm.engine.state
    layers = params["layers"]
    assert spec_of(layers["wq"][...]) == P(None, None, "model", None)  # [L, hidden, heads, head_dim]
    assert spec_of(layers["wk"][...]) == P(None, None, "model", None)
    assert spec_of(layers["wo"][...]) == P(None, "model", None, None)  # [L, heads, head_dim, hidden]
    assert spec_of(layers["w_gate"][...]) == P(None, None, "model")
    assert spec_of(layers["w_up"][...]) == P(None, None, "model")
    assert spec_of(layers["w_down"][...]) == P(None, "model", None)
    assert spec_of(params["lm_head"][...]) == P(None, "model")
    assert spec_of(params["embed"][...]) == P() and spec_of(layers["attn_norm"][...]) == P()
    assert spec_of(state.cache.k_pages) == P("model") and spec_of(state.cache.v_pages) == P("model")
    assert state.cache.k_pages.addressable_shards[0].data.shape == (1, 2 * 32, 8, 16)  # one KV head each
    assert spec_of(state.output_counts) == P() and spec_of(state.prompt_mask) == P()  # sampling state: replicated


def test_bad_tensor_parallel_sizes_are_refused():
    with pytest.raises(ValueError, match="num_heads=4 is not divisible by tensor_parallel_size=3"):
        LLM(random_model(tiny_config()), num_blocks=16, log_stats=False, tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be in \[1, 8\]"):
        sharding.make_mesh(16)


@pytest.mark.triton
def test_cuda_export_finds_the_triton_kernels_under_shard_map():
    """Lowered for two H100s that this machine does not have: an abstract mesh names the GPU (jax >=
    0.11 reads it there), and the inputs are shapes sharded over it as the engine shards them."""
    config = tiny_config(head_dim=64)
    model = sharding.shard_model(random_model(config), sharding.make_mesh(2))
    platform, device_kind, cores = targets.TARGETS["sm_90"]
    gpus = AbstractMesh((2,), (sharding.AXIS,), axis_types=(AxisType.Auto,),
                        abstract_device=AbstractDevice(device_kind=device_kind, num_cores=cores, platform=platform))

    def on_gpus(x):  # the array's shape, sharded over the abstract mesh as it is over the CPU devices
        spec = getattr(x.sharding, "spec", P()) if hasattr(x, "sharding") else P()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(gpus, spec))

    graphdef, params = nnx.split(model)
    tokens, positions, md, rows = prefill_inputs(PROMPTS[0], 16)
    inputs = (params, tokens, positions, model.init_cache(16, 8), md, rows)

    def forward(params, tokens, positions, cache, md, rows):
        return nnx.merge(graphdef, params)(tokens, positions, cache, md, rows, backend="pallas", mesh=gpus)

    with jax.sharding.use_abstract_mesh(gpus):
        exported = jax.export.export(jax.jit(forward), platforms=("cuda",),
                                     disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])(
            *jax.tree.map(on_gpus, inputs))
    module = exported.mlir_module()
    names = re.findall(r'@__gpu\$xla\.gpu\.triton\([^\n]*name = "([^"]*)"', module)
    assert {"write_kv", "ragged_paged_attention"} <= set(names)
    assert "shard_map" in module or "sdy.manual_computation" in module
