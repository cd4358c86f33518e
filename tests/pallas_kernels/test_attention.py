"""The decode and ragged paged-attention kernels against their jnp references and against a dense
float64 numpy attention over K/V gathered from the pages. As in jax's
tests/pallas/gpu_paged_attention_test.py, each set of cases runs compiled on a GPU (the Gpu class,
marked `gpu`) and in interpret mode on CPU (the Interpret class)."""
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (paged_attention, paged_attention_reference, ragged_paged_attention,
                            ragged_paged_attention_reference)
from tests.pallas_kernels.paged_batches import (BF16, F16, F32, TOL, dense_attention, make_batch,
                                               poison_unseen, rel_err)


def edge_lens(block_size):
    """On and around block edges, several blocks, and a padding row."""
    return [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 0]


SHAPES = [  # group, head_dim, block_size, dtype
    (1, 64, 8, F32),
    (4, 128, 16, F32),
    (8, 64, 32, BF16),
    (4, 128, 64, BF16),
    (2, 256, 256, F32),
    (4, 64, 128, F16),
]


@pytest.mark.triton
class DecodeCases:
    INTERPRET = False

    def run(self, batch, **kw):
        args = [batch[n] for n in ("q", "k_pages", "v_pages", "block_tables", "seq_lens")]
        return paged_attention(*args, interpret=self.INTERPRET, **kw)

    def check(self, batch, tuning=None, **opts):
        out = self.run(batch, **opts, **(tuning or {}))
        args = [batch[n] for n in ("q", "k_pages", "v_pages", "block_tables", "seq_lens")]
        tol = TOL[batch["q"].dtype.type]
        assert out.shape == batch["q"].shape and out.dtype == batch["q"].dtype
        assert rel_err(out, dense_attention(batch, **opts)) <= tol
        assert rel_err(out, paged_attention_reference(*args, **opts)) <= tol
        return out

    @pytest.mark.parametrize("group,head_dim,block_size,dtype", SHAPES)
    def test_matches_references(self, group, head_dim, block_size, dtype):
        lens = edge_lens(block_size)
        batch = make_batch(0, lens, [1] * len(lens), group=group, head_dim=head_dim,
                           block_size=block_size, dtype=dtype)
        out = self.check(batch)
        assert not np.asarray(out[-1]).any()  # the padding row

    @pytest.mark.parametrize("num_splits", [1, 3])
    def test_soft_cap_and_sliding_window(self, num_splits):
        lens = [1, 10, 11, 12, 40, 61, 0]
        batch = make_batch(1, lens, [1] * len(lens), group=4, block_size=8)
        batch["q"] = batch["q"] * 4  # logits past the cap, so capping changes the answer
        self.check(batch, dict(block_n=16, num_splits=num_splits), soft_cap=3.0, sliding_window=11)

    def test_split_k_uneven_lengths(self):
        lens = [1, 7, 16, 17, 100, 0, 33]
        batch = make_batch(2, lens, [1] * len(lens), group=8, num_kv_heads=1, block_size=16)
        self.check(batch, dict(block_n=16, num_splits=4), sm_scale=0.3)

    def test_any_group_and_head_dim(self):
        """group 3 (rows padded to 16 in registers), head_dim 80 (lanes padded to 128), an odd
        max_blocks_per_seq: nothing in the kernel needs them to be powers of two."""
        batch = make_batch(3, [5, 9, 23], [1, 1, 1], group=3, num_kv_heads=3, head_dim=80)
        self.check(batch)

    @pytest.mark.parametrize("num_splits", [1, 3])
    def test_writes_every_element(self, num_splits):
        """The output buffer is passed in NaN-filled (aliased to the kernel's output): any element
        the kernels left unwritten would stay NaN; padding rows must be written as zeros."""
        lens = [0, 9, 0, 30, 1, 0]
        batch = make_batch(4, lens, [1] * len(lens), block_size=8)
        out = self.run(batch, out=jnp.full_like(batch["q"], jnp.nan), block_n=16,
                       num_splits=num_splits)
        assert not np.isnan(np.asarray(out)).any()
        assert not np.asarray(out[np.array(lens) == 0]).any()
        assert rel_err(out, dense_attention(batch)) <= TOL[F32]

    @pytest.mark.parametrize("num_splits", [1, 2])
    def test_reads_nothing_outside_spans(self, num_splits):
        """Every length 0..69 with a 37-key window and 16-key tiles: window starts and sequence
        ends fall on every offset within a tile, around unmasked tiles in between."""
        lens = list(range(70))
        batch = poison_unseen(make_batch(5, lens, [1] * len(lens), block_size=8), sliding_window=37)
        out = self.run(batch, sliding_window=37, block_n=16, num_splits=num_splits)
        assert rel_err(out, dense_attention(batch, sliding_window=37)) <= TOL[F32]


@pytest.mark.gpu
class TestDecodeGpu(DecodeCases):
    INTERPRET = False


class TestDecodeInterpret(DecodeCases):
    INTERPRET = True


def ragged_mix(block_size):
    """(seq_lens, q_lens): decode rows, a chunked-prefill row (a middle chunk of a longer
    sequence), whole prompts (on block edges while blocks are small), a padding sequence."""
    prompt = min(block_size, 24)  # bounds the token count (and the numpy reference's time)
    seq_lens = [block_size + 1, 1, 3 * block_size + 5, prompt, prompt - 1, 0, 2 * block_size]
    q_lens = [1, 1, 7, prompt, prompt - 1, 0, 10]
    return seq_lens, q_lens


@pytest.mark.triton
class RaggedCases:
    INTERPRET = False

    def run(self, batch, **kw):
        return ragged_paged_attention(*self.args(batch), interpret=self.INTERPRET, **kw)

    @staticmethod
    def args(batch):
        names = ("q", "k_pages", "v_pages", "block_tables", "seq_lens", "query_start_loc")
        return [batch[n] for n in names]

    def check(self, batch, tuning=None, **opts):
        out = self.run(batch, **opts, **(tuning or {}))
        tol = TOL[batch["q"].dtype.type]
        assert out.shape == batch["q"].shape and out.dtype == batch["q"].dtype
        assert rel_err(out, dense_attention(batch, **opts)) <= tol
        assert rel_err(out, ragged_paged_attention_reference(*self.args(batch), **opts)) <= tol
        return out

    @pytest.mark.parametrize("group,head_dim,block_size,dtype", SHAPES)
    def test_matches_references(self, group, head_dim, block_size, dtype):
        seq_lens, q_lens = ragged_mix(block_size)
        batch = make_batch(10, seq_lens, q_lens, group=group, head_dim=head_dim,
                           block_size=block_size, dtype=dtype, pad_tokens=3)
        out = self.check(batch)
        assert not np.asarray(out[-3:]).any()  # tokens past query_start_loc[-1]

    @pytest.mark.parametrize("block_m", [16, 64])
    def test_soft_cap_and_sliding_window(self, block_m):
        seq_lens, q_lens = ragged_mix(8)
        batch = make_batch(11, seq_lens, q_lens, group=4, block_size=8, pad_tokens=2)
        batch["q"] = batch["q"] * 4
        self.check(batch, dict(block_m=block_m, block_n=16), soft_cap=3.0, sliding_window=11)

    def test_any_group_and_head_dim(self):
        """group 3 with 16-row tiles: 5 tokens x 3 heads per tile, one dead row; head_dim 80."""
        batch = make_batch(12, [5, 20, 23], [5, 1, 11], group=3, num_kv_heads=3, head_dim=80)
        self.check(batch, dict(block_m=16, block_n=16))

    def test_writes_every_element(self):
        """NaN-filled `out` aliased to the kernel's output. Zeros for padding tokens and for
        tokens before their sequence's start (the last sequence claims 5 tokens of 3), as in
        the reference."""
        seq_lens, q_lens = ragged_mix(8)
        batch = make_batch(13, seq_lens + [3], q_lens + [5], block_size=8, pad_tokens=5)
        out = self.run(batch, out=jnp.full_like(batch["q"], jnp.nan), block_m=16, block_n=16)
        assert not np.isnan(np.asarray(out)).any()
        assert not np.asarray(out[-10:-8]).any() and not np.asarray(out[-5:]).any()
        assert np.asarray(out[-8:-5]).all()
        assert rel_err(out, dense_attention(batch)) <= TOL[F32]
        reference = ragged_paged_attention_reference(*self.args(batch))
        assert rel_err(out, reference) <= TOL[F32]

    @pytest.mark.parametrize("sliding_window", [None, 6, 29])
    def test_reads_nothing_outside_spans(self, sliding_window):
        """Tiles of 5 tokens (group 3, 16 rows) over 16-key tiles: across a 70-token prompt and a
        69-token chunk, tile edges meet the causal diagonal and the window start at every
        offset; a 29-key window leaves unmasked tiles between its start and the diagonal."""
        seq_lens, q_lens = [70, 1, 100, 9], [70, 1, 69, 9]
        batch = make_batch(14, seq_lens, q_lens, group=3, block_size=8, pad_tokens=2)
        batch = poison_unseen(batch, sliding_window)
        out = self.run(batch, sliding_window=sliding_window, block_m=16, block_n=16)
        assert rel_err(out, dense_attention(batch, sliding_window=sliding_window)) <= TOL[F32]

    def test_decode_batch_matches_decode_kernel(self):
        lens = edge_lens(16)
        batch = make_batch(15, lens, [1] * len(lens), block_size=16)
        decode = paged_attention(*self.args(batch)[:5], interpret=self.INTERPRET)
        assert rel_err(self.run(batch), decode) <= TOL[F32]


@pytest.mark.gpu
class TestRaggedGpu(RaggedCases):
    INTERPRET = False


class TestRaggedInterpret(RaggedCases):
    INTERPRET = True
