"""Paged attention on Pallas Mosaic GPU, the backend jax wants Pallas GPU code on (jax 0.11
deprecated Pallas Triton). Hopper (sm_90a: TMA copies, mbarriers, WGMMA) and Blackwell (sm_100a:
the same with tcgen05 and tensor memory, mma.py).

Usable from jax 0.12 on (`plgpu.kernel` and the Mosaic GPU interpreter, `plgpu.InterpretGPUParams`);
on older jax, `AVAILABLE` is False and `UNAVAILABLE` says why, and the engine never picks it."""
from pallas_kernels.mosaic.support import ARCHS, AVAILABLE, UNAVAILABLE, supports

if AVAILABLE:
    from pallas_kernels.mosaic.decode import paged_attention_mosaic
    from pallas_kernels.mosaic.ragged import ragged_paged_attention_mosaic

__all__ = ["ARCHS", "AVAILABLE", "UNAVAILABLE", "supports"] + (
    ["paged_attention_mosaic", "ragged_paged_attention_mosaic"] if AVAILABLE else [])
