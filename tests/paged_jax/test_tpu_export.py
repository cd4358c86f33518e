"""The engine's whole TPU path lowers on a machine without a TPU: its prefill step and decode loop with
attention_backend="tpu", exported for TPU v5e and v6e (an abstract device names the chip), hold jax's
Mosaic ragged paged attention kernel, at head_dim 128 and 64. The inputs are the shapes a real engine
step builds."""
import dataclasses

import jax
import pytest

from paged_jax import LLMEngine, SamplingParams
from paged_jax.worker import runner
from pallas_kernels import targets
from tests.models.model_testing import random_model, tiny_config


def spec(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x


@pytest.fixture(scope="module", params=[128, 64], ids=lambda d: f"hd{d}")
def step_inputs(request):
    """{name: (args, kwargs)} of the first prefill_step and decode_steps calls of an engine on the
    reference backend, as shapes, its cache swapped for the TPU layout and its flags for "tpu".
    head_dim 64 (SmolLM2, Llama-3.2-1B, Qwen2.5-0.5B): the TPU cache pads it to 128 lanes."""
    model = random_model(tiny_config(num_heads=8, num_kv_heads=2, head_dim=request.param))
    engine = LLMEngine(model, block_size=16, num_blocks=32, max_num_seqs=4, attention_backend="reference",
                       log_stats=False)
    tpu_cache = jax.eval_shape(lambda: model.init_cache(32, 16, layout="tpu"))
    seen = {}
    with pytest.MonkeyPatch.context() as mp:
        for name in ("prefill_step", "decode_steps"):
            def spy(graphdef, params, state, *rest, _real=getattr(runner, name), _name=name, **kwargs):
                if _name not in seen:
                    shapes = jax.tree.map(spec, (params, dataclasses.replace(state, cache=tpu_cache), *rest))
                    flags = dataclasses.replace(kwargs["flags"], backend="tpu")
                    seen[_name] = ((graphdef, *shapes), dict(kwargs, flags=flags))
                return _real(graphdef, params, state, *rest, **kwargs)

            mp.setattr(runner, name, spy)
        engine.add_request("a", list(range(3, 40)), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    return seen


@pytest.mark.parametrize("target", targets.TPU_TARGETS)
@pytest.mark.parametrize("name", ["prefill_step", "decode_steps"])
def test_engine_steps_lower_to_mosaic_for_tpu(step_inputs, name, target):
    args, kwargs = step_inputs[name]
    with targets.abstract_target(target):
        module = jax.export.export(getattr(runner, name), platforms=("tpu",))(*args, **kwargs).mlir_module()
    assert module.count("tpu_custom_call") >= 1
