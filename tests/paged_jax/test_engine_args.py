"""EngineArgs (paged_jax/engine/arg_utils.py): the engine's parameters declared once, read by `LLM`,
`LLMEngine`, the server and scripts/generate.py with the same defaults and checks."""
import dataclasses

import jax
import pytest

from paged_jax import LLM, LLMEngine
from paged_jax.engine.arg_utils import EngineArgs
from paged_jax.entrypoints.openai import cli
from scripts import generate
from tests.models.model_testing import random_model, tiny_config


def test_every_command_line_defaults_to_the_dataclass():
    assert EngineArgs.from_cli_args(cli.parse_args([])) == EngineArgs()
    assert EngineArgs.from_cli_args(generate.parse_args([])) == EngineArgs()


def test_flags_set_fields_and_bools_take_a_no_form():
    argv = ["--block-size", "8", "--num-decode-steps", "4", "--no-async-scheduling", "--no-enable-prefix-caching",
            "--kv-cache-dtype", "int8", "--swap-space", "0.5", "--preemption-mode", "swap", "--dtype", "bfloat16"]
    want = EngineArgs(block_size=8, num_decode_steps=4, async_scheduling=False, enable_prefix_caching=False,
                      kv_cache_dtype="int8", swap_space=0.5, preemption_mode="swap", dtype="bfloat16")
    assert EngineArgs.from_cli_args(cli.parse_args(argv)) == want
    assert EngineArgs.from_cli_args(generate.parse_args(argv), log_stats=False) == dataclasses.replace(
        want, log_stats=False)
    with pytest.raises(ValueError, match="preemption_mode must be one of .*got 'offload'"):
        EngineArgs.from_cli_args(cli.parse_args(["--preemption-mode", "offload"]))


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_size=12), "block_size must be a power of two, got 12"),
    (dict(num_decode_steps=0), "num_decode_steps must be a positive integer, got 0"),
    (dict(max_num_seqs=True), "max_num_seqs must be a positive integer, got True"),
    (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold must be an integer >= 0, got -1"),
    (dict(dtype="float16"), r"dtype must be one of \('float32', 'bfloat16'\).*got 'float16'"),
    (dict(async_scheduling="yes"), "async_scheduling must be True or False, got 'yes'"),
    (dict(enable_host_prefix_cache=True, swap_space=0), "needs swap_space > 0 GiB"),
])
def test_bad_values_are_named_before_anything_is_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)


def test_llm_and_llm_engine_take_the_same_arguments():
    model = random_model(tiny_config())
    kwargs = dict(block_size=8, num_blocks=40, max_num_seqs=4, num_decode_steps=2, log_stats=False)
    by_kwargs = LLMEngine(model, **kwargs)
    by_args = LLMEngine.from_engine_args(model, None, EngineArgs(**kwargs))
    assert by_kwargs.config == by_args.config == LLM(model, **kwargs).engine.config
    assert (by_kwargs.config.block_size, by_kwargs.config.num_blocks, by_kwargs.config.num_decode_steps) == (8, 40, 2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'blocksize'"):
        LLM(model, blocksize=8)
    with pytest.raises(ValueError, match=r"engine_args or keyword arguments, not both \(got \['seed'\]\)"):
        LLMEngine(model, engine_args=EngineArgs(), seed=1)


def test_model_dependent_checks_name_the_model_and_the_mesh():
    model = random_model(tiny_config())  # float32
    with pytest.raises(ValueError, match="dtype='bfloat16' applies when loading a checkpoint; this model is float32"):
        LLM(model, dtype="bfloat16", log_stats=False)
    assert LLM(model, dtype="float32", num_blocks=8, log_stats=False).engine.config.num_blocks == 8
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("model",))
    with pytest.raises(ValueError, match="tensor_parallel_size=2 disagrees with the mesh's 'model' axis of size 1"):
        LLM(model, mesh=mesh, tensor_parallel_size=2, log_stats=False)
