"""Which attention backend the engine resolves: "auto" picks Pallas Mosaic GPU on Hopper for the
models it takes when this jax has it, Pallas Triton for everything else on a GPU (the jnp reference
on a jax without Pallas Triton); "pallas_triton" and "pallas_mosaic" force one."""
import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import mosaic, targets, triton_call
from paged_jax.attention import check_kv_cache_dtype, mosaic_refusal, resolve_backend

TRITON = "pallas" if triton_call.AVAILABLE else "reference"  # "auto" off Mosaic GPU, on a GPU
MOSAIC = "pallas_mosaic" if mosaic.AVAILABLE else TRITON
LLAMA = dict(dtype=jnp.bfloat16, head_dim=128, block_size=16)


@pytest.fixture
def gpu(monkeypatch):
    """A GPU of the arch the test sets (default sm_90), without one."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    arch = ["sm_90"]
    monkeypatch.setattr(targets, "gpu_arch", lambda: arch[0])
    return arch


@pytest.mark.parametrize("model,expected", [
    (LLAMA, MOSAIC),
    (dict(LLAMA, dtype=jnp.float16, head_dim=64, block_size=128), MOSAIC),
    (dict(LLAMA, dtype=jnp.float32), MOSAIC),  # as f16 halves
    (dict(LLAMA, dtype=jnp.float32, head_dim=256), TRITON),  # f32 at hd 256: shared memory
    (dict(LLAMA, dtype=jnp.float32, kv_cache_dtype="int8", block_size=32), TRITON),
    (dict(LLAMA, head_dim=256), MOSAIC),
    (dict(LLAMA, head_dim=256, kv_cache_dtype="int8", block_size=32), MOSAIC),
    (dict(LLAMA, head_dim=96), TRITON),
    (dict(LLAMA, block_size=4), TRITON),  # a page is whole 8-row tiles
    # a block's scales are one 128-byte-aligned TMA copy: 32 tokens at least (sm_90 faulted at 16)
    (dict(LLAMA, kv_cache_dtype="int8"), TRITON),
    (dict(LLAMA, kv_cache_dtype="int8", block_size=32), MOSAIC),
    (dict(LLAMA, kv_cache_dtype="fp8_e4m3", block_size=64), MOSAIC),
    ({}, TRITON),  # a caller that does not say what the model is
])
def test_auto_on_hopper(gpu, model, expected):
    assert resolve_backend("auto", **model) == expected


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_100"])
def test_auto_off_hopper_is_triton(gpu, arch):
    """Ampere/Ada: no TMA barriers, no WGMMA or tcgen05; Blackwell: Mosaic GPU's tcgen05 kernel
    has not run on one yet (attention.MOSAIC_FIRST), so Triton while there is one."""
    gpu[0] = arch
    blackwell_without_triton = arch == "sm_100" and not triton_call.AVAILABLE
    assert resolve_backend("auto", **LLAMA) == (MOSAIC if blackwell_without_triton else TRITON)


def test_forced_backends():
    if triton_call.AVAILABLE:
        assert resolve_backend("pallas_triton", **LLAMA) == "pallas"
    else:
        for name in ("pallas_triton", "pallas", "pallas-interpret"):
            with pytest.raises(ValueError, match=f"'{name}'.*jax {jax.__version__} has no Pallas Triton"):
                resolve_backend(name)
    assert resolve_backend("auto", **LLAMA) == {"cpu": "reference"}[jax.default_backend()]
    if mosaic.AVAILABLE:
        assert resolve_backend("pallas_mosaic") == "pallas_mosaic"
        assert resolve_backend("pallas_mosaic-interpret") == "pallas_mosaic-interpret"
        assert check_kv_cache_dtype("fp8_e4m3", "pallas_mosaic", jnp.bfloat16) == jnp.float8_e4m3fn
    else:
        with pytest.raises(ValueError, match=f"jax {jax.__version__}"):
            resolve_backend("pallas_mosaic")
    with pytest.raises(ValueError, match="'pallas_triton' or one of"):
        resolve_backend("mosaic")


@pytest.fixture
def no_triton(monkeypatch):
    """A jax that has dropped Pallas Triton, as far as the backend choice can tell."""
    monkeypatch.setattr(triton_call, "AVAILABLE", False)
    monkeypatch.setattr(triton_call, "UNAVAILABLE", "jax 9.9 has no Pallas Triton (gone)")


def test_auto_without_triton_is_mosaic_on_hopper_else_the_reference(gpu, no_triton):
    assert resolve_backend("auto", **LLAMA) == ("pallas_mosaic" if mosaic.AVAILABLE else "reference")
    assert resolve_backend("auto", **dict(LLAMA, dtype=jnp.float32, head_dim=256)) == "reference"
    gpu[0] = "sm_100"  # Blackwell: the tcgen05 kernel, for what it takes (not f32)
    assert resolve_backend("auto", **LLAMA) == ("pallas_mosaic" if mosaic.AVAILABLE else "reference")
    assert resolve_backend("auto", **dict(LLAMA, dtype=jnp.float32)) == "reference"
    gpu[0] = "sm_80"
    assert resolve_backend("auto", **LLAMA) == "reference"
    for name in ("pallas_triton", "pallas", "pallas-interpret"):
        with pytest.raises(ValueError, match=f"attention_backend '{name}': jax 9.9 has no Pallas Triton"):
            resolve_backend(name)


def test_mosaic_refusal_says_why(gpu):
    f32 = mosaic_refusal(**dict(LLAMA, dtype=jnp.float32, head_dim=256))
    assert f32 == ("float32 takes head_dim 64 or 128 (shared memory), got 256" if mosaic.AVAILABLE
                   else mosaic.UNAVAILABLE)
    assert mosaic_refusal(None, 128, 16) == "the model's dtype, head_dim and block_size were not given"
    gpu[0] = "sm_100"
    f32 = mosaic_refusal(**dict(LLAMA, dtype=jnp.float32))
    assert f32.startswith("float32 runs on Hopper only") if mosaic.AVAILABLE else f32 == mosaic.UNAVAILABLE
    assert mosaic_refusal(**LLAMA) == (None if mosaic.AVAILABLE else mosaic.UNAVAILABLE)
    gpu[0] = "sm_80"
    assert mosaic_refusal(**LLAMA) == "Hopper (sm_90) and Blackwell (sm_100) only, this GPU is sm_80"


def test_the_engine_says_why_it_runs_the_reference_on_a_gpu(gpu, no_triton, monkeypatch, capsys):
    from paged_jax.engine.arg_utils import EngineArgs
    from tests.models.model_testing import random_model, tiny_config

    monkeypatch.setattr(targets, "platform", lambda: "gpu")
    gpu[0] = "sm_80"
    model = random_model(tiny_config(head_dim=64, dtype=jnp.bfloat16))
    config = EngineArgs(num_blocks=8, block_size=16).create_engine_config(model)
    assert config.attention_backend == "reference"
    assert ("attention runs the jnp reference (Mosaic GPU: Hopper (sm_90) and Blackwell (sm_100) "
            "only, this GPU is sm_80; jax 9.9 has no Pallas Triton (gone))") in capsys.readouterr().err
    gpu[0] = "sm_90"  # Hopper: Mosaic GPU where this jax has it, and then nothing to say
    config = EngineArgs(num_blocks=8, block_size=16).create_engine_config(model)
    assert config.attention_backend == ("pallas_mosaic" if mosaic.AVAILABLE else "reference")
    assert ("attention runs the jnp reference" in capsys.readouterr().err) != mosaic.AVAILABLE
