"""int8 / fp8 pages with per-(token, KV head) scales: write_kv quantizes as the reference does, and
the decode and ragged kernels (compiled on a GPU, in interpret mode on CPU) and their jnp
references equal a float64 attention over the dequantized pages to f32 tolerance, and a float64
attention over the unquantized pages within the bound derived in pallas_kernels/quantization.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (paged_attention, paged_attention_reference, ragged_paged_attention,
                            ragged_paged_attention_reference, targets, write_kv, write_kv_reference)
from pallas_kernels.quantization import QMAX, REL_ERROR, quantize
from tests.pallas_kernels.paged_batches import F32, TOL, dense_attention, make_batch, rel_err, spans

I8, FP8 = jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn)
ARGS = ("q", "k_pages", "v_pages", "block_tables", "seq_lens")


def quantized_batch(batch, dtype):
    """The batch with its pages quantized, and its float64 dequantized twin (the reference input)."""
    out, exact = dict(batch), dict(batch)
    for name in ("k", "v"):
        pages, scales = quantize(batch[f"{name}_pages"], dtype)
        out[f"{name}_pages"], out[f"{name}_scales"] = pages, scales
        exact[f"{name}_pages"] = (np.asarray(pages.astype(F32), np.float64)
                                  * np.asarray(scales, np.float64)[..., None])
    return out, exact


def error_bound(batch, dtype):
    """Per (token, head): (exp(2E) - 1) * max|v'|_inf + max REL_ERROR * amax(v) over the token's
    visible keys, E = sm_scale * |q|_1 * max REL_ERROR * amax(k) (quantization.py's bound)."""
    q = np.asarray(batch["q"], np.float64)
    k, v = (np.asarray(batch[n], np.float64) for n in ("k_pages", "v_pages"))
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k.shape
    group = num_heads // num_kv_heads
    delta = REL_ERROR[dtype] * 1.001  # f32 rounding in the scale and the products
    tables = np.asarray(batch["block_tables"])
    bound = np.zeros((num_tokens, num_heads))
    for s, rows in spans(batch):
        kk, vv = (np.repeat(x[:, tables[s]].reshape(num_kv_heads, -1, head_dim), group, axis=0)
                  for x in (k, v))
        for t, lo, hi in rows:
            ka, va = np.abs(kk[:, lo:hi]).max(-1), np.abs(vv[:, lo:hi])  # [H, keys], [H, keys, D]
            e = head_dim**-0.5 * np.abs(q[t]).sum(-1) * delta * ka.max(-1)
            v_max = va.max(axis=(1, 2)) * (1 + delta)
            bound[t] = np.expm1(2 * e) * v_max + delta * va.max(-1).max(-1)
    return bound


@pytest.mark.triton
class QuantizedCases:
    INTERPRET = False

    @pytest.mark.parametrize("dtype", [I8, FP8])
    def test_write_kv_quantizes_per_token_and_head(self, dtype):
        """37 tokens (two programs) at head_dim 40 (padded in registers) into random slots, two
        skipped (-1): the kernel stores the reference's bytes and scales, each scale is its row's
        amax / QMAX (float64), and each stored value is within REL_ERROR * amax of the input."""
        rng = np.random.default_rng(0)
        kvh, blocks, bs, hd, n = 2, 10, 8, 40, 37
        pages = jnp.zeros((kvh, blocks, bs, hd), dtype)
        scales = jnp.zeros((kvh, blocks, bs), jnp.float32)
        slots = rng.permutation(blocks * bs)[:n].astype(np.int32)
        slots[[3, 20]] = -1
        k, v = (jnp.asarray(rng.standard_normal((n, kvh, hd)) * 3, F32) for _ in range(2))
        got = write_kv(pages, pages, k, v, jnp.asarray(slots), k_scales=scales, v_scales=scales,
                       interpret=self.INTERPRET)
        want = write_kv_reference(pages, pages, k, v, jnp.asarray(slots), k_scales=scales,
                                  v_scales=scales)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
        k_pages, _, k_scales, _ = (np.asarray(x, np.float64) for x in got)
        live = slots >= 0
        block, offset = slots[live] // bs, slots[live] % bs
        x = np.asarray(k, np.float64)[live].swapaxes(0, 1)  # [kvh, live tokens, hd]
        amax = np.abs(x).max(-1)
        np.testing.assert_allclose(k_scales[:, block, offset], amax / QMAX[dtype], rtol=1e-6)
        stored = k_pages[:, block, offset] * k_scales[:, block, offset][..., None]
        assert np.all(np.abs(stored - x) <= REL_ERROR[dtype] * 1.001 * amax[..., None])
        assert np.abs(k_pages[:, block, offset]).max(-1).min() == QMAX[dtype]  # amax maps to QMAX
        assert (k_scales != 0).sum() == kvh * live.sum()  # nothing else was written

    @pytest.mark.parametrize("dtype", [I8, FP8])
    @pytest.mark.parametrize("kernel", ["decode", "ragged"])
    def test_attention_on_quantized_pages(self, kernel, dtype):
        """Lengths on and around block edges, a padding row, GQA 4, head_dim 64."""
        lens = [1, 7, 8, 9, 29, 0]
        q_lens = [1] * len(lens) if kernel == "decode" else [1, 3, 8, 2, 11, 0]
        batch = make_batch(2, lens, q_lens, group=4, head_dim=64, block_size=8)
        quant, exact = quantized_batch(batch, dtype)
        args = [quant[n] for n in ARGS]
        scales = dict(k_scales=quant["k_scales"], v_scales=quant["v_scales"])
        if kernel == "decode":
            out = paged_attention(*args, interpret=self.INTERPRET, **scales)
            ref = paged_attention_reference(*args, **scales)
        else:
            qsl = quant["query_start_loc"]
            out = ragged_paged_attention(*args, qsl, interpret=self.INTERPRET, **scales)
            ref = ragged_paged_attention_reference(*args, qsl, **scales)
        on_dequantized = dense_attention(exact)
        assert rel_err(out, on_dequantized) <= TOL[F32]
        assert rel_err(ref, on_dequantized) <= TOL[F32]
        err = np.abs(np.asarray(out, np.float64) - dense_attention(batch)).max(-1)
        bound = error_bound(batch, dtype)
        assert np.all(err <= bound) and err.max() > 0
        if kernel == "decode":
            assert not np.asarray(out[-1]).any()  # the padding row


@pytest.mark.gpu
class TestQuantizedGpu(QuantizedCases):
    INTERPRET = False


class TestQuantizedInterpret(QuantizedCases):
    INTERPRET = True


def test_bad_scales_and_unsupported_fp8_are_named():
    batch = make_batch(3, [5], [1], group=1, num_kv_heads=1, head_dim=16, block_size=8)
    quant, _ = quantized_batch(batch, I8)
    args = [quant[n] for n in ARGS]
    with pytest.raises(ValueError, match="int8 pages need k_scales"):
        paged_attention(*args, interpret=True)
    with pytest.raises(ValueError, match=r"v_scales must be f32\[1, 5, 8\]"):
        paged_attention(*args, k_scales=quant["k_scales"], v_scales=quant["k_scales"][:, :1],
                        interpret=True)
    with pytest.raises(ValueError, match="k_scales/v_scales are for int8 or float8_e4m3fn"):
        write_kv(batch["k_pages"], batch["v_pages"], batch["q"], batch["q"], jnp.zeros(1, jnp.int32),
                 k_scales=quant["k_scales"], v_scales=quant["v_scales"])
    fp8, _ = quantized_batch(batch, FP8)
    scales = dict(k_scales=fp8["k_scales"], v_scales=fp8["v_scales"])
    with targets.abstract_target("sm_80"), pytest.raises(ValueError, match="need sm_89 .* sm_80"):
        jax.eval_shape(lambda: paged_attention(*[fp8[n] for n in ARGS], **scales))
