"""Which attention backend the engine resolves: "auto" picks Pallas Mosaic GPU on Hopper for the
models it takes when this jax has it, Pallas Triton for everything else on a GPU;
"pallas_triton" and "pallas_mosaic" force one."""
import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import mosaic, targets
from paged_jax.attention import check_kv_cache_dtype, resolve_backend

MOSAIC = "pallas_mosaic" if mosaic.AVAILABLE else "pallas"
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
    (dict(LLAMA, dtype=jnp.float32), "pallas"),  # WGMMA takes 16-bit inputs
    (dict(LLAMA, head_dim=256), MOSAIC),
    (dict(LLAMA, head_dim=256, kv_cache_dtype="int8", block_size=32), MOSAIC),
    (dict(LLAMA, head_dim=96), "pallas"),
    (dict(LLAMA, block_size=4), "pallas"),  # a page is whole 8-row tiles
    # a block's scales are one 128-byte-aligned TMA copy: 32 tokens at least (sm_90 faulted at 16)
    (dict(LLAMA, kv_cache_dtype="int8"), "pallas"),
    (dict(LLAMA, kv_cache_dtype="int8", block_size=32), MOSAIC),
    (dict(LLAMA, kv_cache_dtype="fp8_e4m3", block_size=64), MOSAIC),
    ({}, "pallas"),  # a caller that does not say what the model is
])
def test_auto_on_hopper(gpu, model, expected):
    assert resolve_backend("auto", **model) == expected


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_100"])
def test_auto_off_hopper_is_triton(gpu, arch):
    """Ampere/Ada: no TMA barriers, no WGMMA; Blackwell: WGMMA refused on sm_100a."""
    gpu[0] = arch
    assert resolve_backend("auto", **LLAMA) == "pallas"


def test_forced_backends():
    assert resolve_backend("pallas_triton", **LLAMA) == "pallas"
    assert resolve_backend("auto", **LLAMA) == {"cpu": "reference"}[jax.default_backend()]
    if mosaic.AVAILABLE:
        assert resolve_backend("pallas_mosaic") == "pallas_mosaic"
        assert check_kv_cache_dtype("fp8_e4m3", "pallas_mosaic", jnp.bfloat16) == jnp.float8_e4m3fn
    else:
        with pytest.raises(ValueError, match=f"jax {jax.__version__}"):
            resolve_backend("pallas_mosaic")
    with pytest.raises(ValueError, match="'pallas_triton' or one of"):
        resolve_backend("mosaic")
