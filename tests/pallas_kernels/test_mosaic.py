"""The Mosaic GPU decode and ragged kernels in the Mosaic GPU interpreter (CPU) against a dense float64
attention and the jnp reference, Hopper's (WGMMA, 64-row tiles) and Blackwell's (tcgen05, 128-row
tiles in tensor memory), and compiled on the GPU at hand (marked `gpu`). jax before 0.12 has
no usable Pallas Mosaic GPU: there every test skips, naming the jax version."""
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (mosaic, paged_attention_reference, quantization,
                            ragged_paged_attention_reference)
from tests.pallas_kernels.paged_batches import (BF16, F16, F32, TOL, dense_attention, make_batch,
                                               poison_unseen, rel_err)

pytestmark = pytest.mark.skipif(not mosaic.AVAILABLE, reason=str(mosaic.UNAVAILABLE))

NAMES = ("q", "k_pages", "v_pages", "block_tables", "seq_lens")

CASES = [  # group, head_dim, block_size, dtype
    (1, 64, 8, BF16),
    (4, 128, 16, BF16),
    (8, 64, 32, F16),
    (8, 128, 128, BF16),
    (2, 256, 16, BF16),  # two programs, each half of the output columns
    (4, 64, 8, F32),  # f32 as f16 halves: f32's tolerance
    (8, 128, 16, F32),
]


class Arch:
    INTERPRET = False
    ARCH = None  # the GPU's

    def options(self, batch):
        return dict(interpret=self.INTERPRET, arch=self.ARCH)

    def refused(self, batch, **opts):
        """True once it has checked that Blackwell refuses f32 (its halves at 128-row tiles do
        not fit shared memory), naming why; False where the kernel takes the batch."""
        if self.ARCH != "sm_100" or batch["q"].dtype != F32:
            return False
        with pytest.raises(ValueError, match="float32 runs on Hopper only"):
            self.run(batch, **opts)
        return True


class DecodeCases(Arch):
    def run(self, batch, **opts):
        return mosaic.paged_attention_mosaic(*(batch[n] for n in NAMES), **self.options(batch), **opts)

    def check(self, batch, **opts):
        out = self.run(batch, **opts)
        tol = TOL[batch["q"].dtype.type]
        assert out.shape == batch["q"].shape and out.dtype == batch["q"].dtype
        opts.pop("num_splits", None)
        assert rel_err(out, dense_attention(batch, **opts)) <= tol
        return out

    @pytest.mark.parametrize("group,head_dim,block_size,dtype", CASES)
    def test_matches_dense_float64(self, group, head_dim, block_size, dtype):
        """Lengths on and around 64-key steps and block edges, several steps, a padding row;
        every page slot no row may see holds NaN."""
        lens = [1, block_size - 1, 64, 65, 2 * block_size + 70, 0]
        batch = poison_unseen(make_batch(0, lens, [1] * len(lens), group=group, head_dim=head_dim,
                                         block_size=block_size, dtype=dtype))
        if self.refused(batch):
            return
        out = self.check(batch)
        assert not np.asarray(out[-1]).any()  # the padding row: zeros

    def test_soft_cap_and_sliding_window(self):
        """Window starts on and off 64-key steps; the pages before each window are NaN."""
        lens = [1, 10, 63, 64, 100, 150, 0]
        batch = make_batch(1, lens, [1] * len(lens), group=4, block_size=16, dtype=BF16)
        batch = poison_unseen({**batch, "q": batch["q"] * 4}, sliding_window=37)
        self.check(batch, soft_cap=3.0, sliding_window=37, sm_scale=0.2)

    @pytest.mark.parametrize("splits,group,head_dim,opts", [
        (16, 4, 64, {}),  # 5 steps over 16 programs: 11 see no key and must weigh nothing
        (3, 8, 128, dict(sliding_window=100, soft_cap=5.0)),  # shares cut inside the window
        (2, 2, 256, {}),  # with the column halves
        (3, 4, 128, dict(sliding_window=100, soft_cap=5.0, dtype=F32)),
    ])
    def test_split_k_matches_dense_float64(self, splits, group, head_dim, opts):
        """Split-k: each sequence's key steps shared over `splits` programs whose partials XLA
        merges; a long sequence, a one-key one and a padding row (zeros); unseen pages NaN."""
        lens = [300, 1, 129, 0]
        opts = dict(opts)
        dtype = opts.pop("dtype", BF16)
        batch = poison_unseen(make_batch(4, lens, [1] * len(lens), group=group, head_dim=head_dim,
                                         block_size=16, dtype=dtype), opts.get("sliding_window"))
        if self.refused(batch, num_splits=splits, **opts):
            return
        out = self.check(batch, num_splits=splits, **opts)
        assert not np.asarray(out[-1]).any()

    def test_matches_jnp_reference(self):
        """The same bf16 inputs through the engine's jnp reference (a prefix-shared block: two
        sequences' tables start with the same blocks, as after a prefix-cache hit)."""
        batch = make_batch(2, [40, 90, 17], [1, 1, 1], group=8, num_kv_heads=1, block_size=16,
                           dtype=BF16)
        tables = np.asarray(batch["block_tables"]).copy()
        tables[1, :2] = tables[0, :2]
        batch["block_tables"] = jnp.asarray(tables)
        out = self.run(batch)
        ref = paged_attention_reference(*(batch[n] for n in NAMES))
        assert rel_err(out, ref) <= TOL[BF16]
        assert rel_err(out, dense_attention(batch)) <= TOL[BF16]


@pytest.mark.gpu
class TestDecodeGpu(DecodeCases):
    INTERPRET = False


class TestDecodeInterpret(DecodeCases):
    INTERPRET = True


class TestDecodeBlackwellInterpret(DecodeCases):
    INTERPRET = True
    ARCH = "sm_100"


RAGGED_NAMES = NAMES + ("query_start_loc",)
RAGGED_CASES = [  # group, head_dim, block_size, dtype
    (1, 64, 8, BF16),  # 64 tokens a tile
    (4, 128, 16, F16),
    (8, 64, 128, BF16),  # 8 tokens a tile: a 24-token prompt takes three
    (2, 256, 16, F16),
    (4, 128, 16, F32),
]


class RaggedCases(Arch):
    def run(self, batch, **opts):
        return mosaic.ragged_paged_attention_mosaic(*(batch[n] for n in RAGGED_NAMES),
                                                    **self.options(batch), **opts)

    def check(self, batch, **opts):
        out = self.run(batch, **opts)
        assert out.shape == batch["q"].shape and out.dtype == batch["q"].dtype
        assert rel_err(out, dense_attention(batch, **opts)) <= TOL[batch["q"].dtype.type]
        return out

    @pytest.mark.parametrize("group,head_dim,block_size,dtype", RAGGED_CASES)
    def test_mixed_batch_matches_dense_float64(self, group, head_dim, block_size, dtype):
        """Decode rows, a chunk of 7 after a 70-token prefix hit, whole prompts of 24 and 23
        tokens, a padding sequence, a 10-token chunk, 3 padding tokens; unseen slots are NaN."""
        seq_lens = [block_size + 1, 1, 77, 24, 23, 0, 2 * block_size + 10]
        q_lens = [1, 1, 7, 24, 23, 0, 10]
        batch = poison_unseen(make_batch(6, seq_lens, q_lens, group=group, head_dim=head_dim,
                                         block_size=block_size, dtype=dtype, pad_tokens=3))
        if self.refused(batch):
            return
        out = self.check(batch)
        assert not np.asarray(out[-3:]).any()  # padding tokens: zeros

    def test_soft_cap_window_and_shared_prefix(self):
        """A 37-key window over prompts longer than it, a soft cap; sequences 0 and 1 share their
        first two blocks (a prefix-cache hit), checked against the jnp reference too."""
        seq_lens, q_lens = [90, 100, 40, 1], [20, 30, 40, 1]
        batch = make_batch(7, seq_lens, q_lens, group=4, block_size=16, dtype=BF16)
        tables = np.asarray(batch["block_tables"]).copy()
        tables[1, :2] = tables[0, :2]
        clean = {**batch, "block_tables": jnp.asarray(tables), "q": batch["q"] * 4}
        opts = dict(soft_cap=3.0, sliding_window=37)
        out = self.check(poison_unseen(clean, sliding_window=37), **opts)
        # the reference reads whole chunks, so it gets the batch without NaN
        ref = ragged_paged_attention_reference(*(clean[n] for n in RAGGED_NAMES), **opts)
        assert rel_err(out, ref) <= TOL[BF16]


@pytest.mark.gpu
class TestRaggedGpu(RaggedCases):
    INTERPRET = False


class TestRaggedInterpret(RaggedCases):
    INTERPRET = True


class TestRaggedBlackwellInterpret(RaggedCases):
    INTERPRET = True
    ARCH = "sm_100"


def quantized(batch, storage, sliding_window=None):
    """-> (inputs with `storage` pages and NaN scales (and fp8 NaN pages) in every slot no token
    may see, their dequantized batch for the float64 reference)."""
    unseen = np.isnan(np.asarray(poison_unseen(batch, sliding_window)["k_pages"], np.float32))
    unseen = unseen[..., 0]  # bool[num_kv_heads, num_blocks, block_size]
    out, dequantized = dict(batch), dict(batch)
    for name in ("k", "v"):
        pages, scales = quantization.quantize(batch[name + "_pages"], storage)
        dequantized[name + "_pages"] = quantization.dequantize(pages, scales)
        if storage == jnp.float8_e4m3fn:
            pages = jnp.where(unseen[..., None], jnp.nan, pages.astype(F32)).astype(storage)
        out[name + "_pages"], out[name + "_scales"] = pages, jnp.where(unseen, jnp.nan, scales)
    return out, dequantized


class QuantizedCases(Arch):
    """int8/fp8 pages: dequantized into q's dtype in shared memory (scaled per (token, KV head))."""

    @pytest.mark.parametrize("storage,splits,head_dim", [(jnp.int8, 1, 128), (jnp.float8_e4m3fn, 1, 128),
                                                         (jnp.int8, 3, 128), (jnp.float8_e4m3fn, 1, 256)])
    def test_decode(self, storage, splits, head_dim):
        """At head_dim 256 the keys are cast 128 columns at a time and each program writes half
        the output columns."""
        lens = [1, 15, 64, 65, 150, 0]
        batch = make_batch(8, lens, [1] * len(lens), group=8, head_dim=head_dim, block_size=32,
                           dtype=BF16)
        inputs, dequantized = quantized(batch, storage, sliding_window=100)
        out = mosaic.paged_attention_mosaic(
            *(inputs[n] for n in NAMES), k_scales=inputs["k_scales"],
            v_scales=inputs["v_scales"], sliding_window=100, num_splits=splits,
            **self.options(batch))
        assert rel_err(out, dense_attention(dequantized, sliding_window=100)) <= TOL[BF16]

    @pytest.mark.parametrize("head_dim", [64, 256])
    def test_ragged_int8(self, head_dim):
        batch = make_batch(9, [77, 24, 1], [7, 24, 1], group=4, head_dim=head_dim, block_size=32,
                           dtype=F16)
        inputs, dequantized = quantized(batch, jnp.int8)
        out = mosaic.ragged_paged_attention_mosaic(
            *(inputs[n] for n in RAGGED_NAMES), k_scales=inputs["k_scales"],
            v_scales=inputs["v_scales"], **self.options(batch))
        assert rel_err(out, dense_attention(dequantized)) <= TOL[F16]


@pytest.mark.gpu
class TestQuantizedGpu(QuantizedCases):
    INTERPRET = False


class TestQuantizedInterpret(QuantizedCases):
    INTERPRET = True


class TestQuantizedBlackwellInterpret(QuantizedCases):
    INTERPRET = True
    ARCH = "sm_100"


@pytest.mark.parametrize("change,message", [
    (dict(q=F32, head_dim=256), r"float32 takes head_dim 64 or 128 \(shared memory\), got 256"),
    (dict(head_dim=96), "head_dim must be one of"),
    (dict(block_size=4), "block_size must be a power of two"),
])
def test_rejects_what_it_does_not_take(change, message):
    dtype = change.get("q", BF16)
    batch = make_batch(3, [5], [1], head_dim=change.get("head_dim", 64),
                       block_size=change.get("block_size", 8), dtype=dtype)
    with pytest.raises(ValueError, match=message):
        mosaic.paged_attention_mosaic(*(batch[n] for n in NAMES), interpret=True)


def test_f32_pages_go_with_f32_queries_only():
    """What the generic checks let through (f32 queries with int8/fp8 pages) and the engine asks."""
    assert (mosaic.supports(F32, 128, 32, jnp.int8)
            == "float32 queries need float32 pages (their f16 halves), got int8")
    assert mosaic.supports(BF16, 128, 16, F32) == "pages must be 16-bit, int8 or float8_e4m3fn, got float32"
    assert mosaic.supports(F32, 64, 8) is None


@pytest.mark.parametrize("splits", [0, 2.0, True])
def test_rejects_a_bad_split_count(splits):
    batch = make_batch(3, [5], [1], dtype=BF16)
    with pytest.raises(ValueError, match=f"num_splits must be a positive int, got {splits!r}"):
        mosaic.paged_attention_mosaic(*(batch[n] for n in NAMES), num_splits=splits, interpret=True)


@pytest.mark.parametrize("num_seqs,head_dim,max_len,window,expected", [
    (64, 128, 8192, None, 1),  # the benchmark's batch: 512 programs already
    (1, 128, 8192, None, 16),  # one sequence, 8 KV heads: 64 programs wanted, 16 at most
    (16, 128, 1024, None, 4),  # 128 programs want 4; 16 steps allow 4 of 4 steps each
    (1, 128, 512, None, 2),  # 8 steps: 2 splits of 4
    (1, 128, 8192, 100, 1),  # a 100-key window: 3 steps, too few to share
    (2, 256, 8192, None, 16),  # the column halves count as programs: 32
])
def test_default_splits(num_seqs, head_dim, max_len, window, expected):
    from pallas_kernels.mosaic.decode import default_splits
    assert default_splits(num_seqs, 8, head_dim, max_len, window) == expected


@pytest.mark.parametrize("head_dim,block_size,message", [
    # a block's scales are one TMA copy, 128-byte aligned in shared memory (an H200 faulted at 16)
    (64, 16, r"int8 pages need block_size >= 32 \(a block's f32 scales are one 128-byte-aligned "
             r"TMA copy\), got 16"),
])
def test_rejects_quantized_pages_it_cannot_read(head_dim, block_size, message):
    batch = make_batch(3, [5], [1], head_dim=head_dim, block_size=block_size, dtype=BF16)
    inputs, _ = quantized(batch, jnp.int8)
    with pytest.raises(ValueError, match=message):
        mosaic.paged_attention_mosaic(*(inputs[n] for n in NAMES), k_scales=inputs["k_scales"],
                                      v_scales=inputs["v_scales"], interpret=True)
