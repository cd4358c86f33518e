"""Random allocate / free / share / fork / mark_cached sequences against a plain-Python model of vLLM
V1's free queue (a list: pop from the head, unhashed blocks prepended, hashed ones appended), and
the same operations under jax.jit against eager execution."""
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paged_jax.core import block_pool as bp

NUM_BLOCKS, BLOCK_SIZE, MAX_SEQS, MAX_BLOCKS = 14, 4, 5, 6


class QueueModel:
    """The pool as vLLM writes it: a free list and per-slot Python lists."""

    def __init__(self):
        self.queue = list(range(1, NUM_BLOCKS))
        self.ref = [0] * NUM_BLOCKS
        self.cached = set()
        self.version = [0] * NUM_BLOCKS
        self.tables = [[] for _ in range(MAX_SEQS)]
        self.lens = [0] * MAX_SEQS

    def _take(self):
        block = self.queue.pop(0)
        self.cached.discard(block)
        self.version[block] += 1
        self.ref[block] = 1
        return block

    def allocate(self, new_lens):
        need = [max(0, -(-max(n, old) // BLOCK_SIZE) - len(t)) for n, old, t in zip(new_lens, self.lens, self.tables)]
        if sum(need) > len(self.queue):
            return False
        for s, k in enumerate(need):
            self.tables[s] += [self._take() for _ in range(k)]
            self.lens[s] = max(self.lens[s], new_lens[s])
        return True

    def free(self, mask):
        for s in range(MAX_SEQS):
            if not mask[s]:
                continue
            for block in reversed(self.tables[s]):
                self.ref[block] -= 1
                if self.ref[block] == 0:
                    if block in self.cached:
                        self.queue.append(block)
                    else:
                        self.queue.insert(0, block)
            self.tables[s], self.lens[s] = [], 0

    def share(self, seq, blocks):
        for block in blocks:
            if self.ref[block] == 0:
                self.queue.remove(block)
            self.ref[block] += 1
        self.tables[seq] = list(blocks)
        self.lens[seq] = len(blocks) * BLOCK_SIZE

    def fork(self, parent, child):
        length = self.lens[parent]
        full = self.tables[parent][: length // BLOCK_SIZE]
        has_tail = length % BLOCK_SIZE != 0
        if has_tail and not self.queue:
            return False, -1, -1
        for block in full:
            self.ref[block] += 1
        self.tables[child] = list(full)
        src = dst = -1
        if has_tail:
            src, dst = self.tables[parent][len(full)], self._take()
            self.tables[child].append(dst)
        self.lens[child] = length
        return True, src, dst


class PoolMachine(RuleBasedStateMachine):
    host = False  # the jnp pool; HostPoolMachine runs the same rules on the host's numpy pool

    def __init__(self):
        super().__init__()
        self.pool = bp.init(NUM_BLOCKS, BLOCK_SIZE, MAX_SEQS, MAX_BLOCKS, host=self.host)
        self.model = QueueModel()

    @rule(data=st.data())
    def allocate(self, data):
        grow = data.draw(st.lists(st.integers(0, 9), min_size=MAX_SEQS, max_size=MAX_SEQS))
        new_lens = [min(n + g, MAX_BLOCKS * BLOCK_SIZE) for n, g in zip(self.model.lens, grow)]
        self.pool, ok = bp.allocate(self.pool, np.array(new_lens))
        assert bool(ok) == self.model.allocate(new_lens)

    @rule(mask=st.lists(st.booleans(), min_size=MAX_SEQS, max_size=MAX_SEQS))
    def free(self, mask):
        self.pool = bp.free(self.pool, np.array(mask))
        self.model.free(mask)

    @precondition(lambda self: 0 in self.model.lens)
    @rule(data=st.data())
    def share(self, data):
        hittable = [b for b in range(1, NUM_BLOCKS) if self.model.ref[b] > 0 or b in self.model.cached]
        seq = data.draw(st.sampled_from([s for s in range(MAX_SEQS) if self.model.lens[s] == 0]))
        blocks = data.draw(st.lists(st.sampled_from(hittable), unique=True, max_size=MAX_BLOCKS)) if hittable else []
        ids = np.zeros(MAX_BLOCKS, np.int32)
        ids[: len(blocks)] = blocks
        self.pool, ok = bp.share(self.pool, seq, ids, len(blocks))
        assert bool(ok)
        self.model.share(seq, blocks)

    @precondition(lambda self: 0 in self.model.lens and any(self.model.lens))
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from([s for s in range(MAX_SEQS) if self.model.lens[s] > 0]))
        child = data.draw(st.sampled_from([s for s in range(MAX_SEQS) if self.model.lens[s] == 0]))
        self.pool, ok, src, dst = bp.fork(self.pool, parent, child)
        assert (bool(ok), int(src), int(dst)) == self.model.fork(parent, child)

    @precondition(lambda self: any(self.model.lens))
    @rule(data=st.data())
    def mark_cached(self, data):
        used = [b for b in range(1, NUM_BLOCKS) if self.model.ref[b] > 0]
        blocks = data.draw(st.lists(st.sampled_from(used), unique=True, min_size=1, max_size=4))
        self.pool = bp.mark_cached(self.pool, np.array(blocks + [0] * (4 - len(blocks))), len(blocks))
        self.model.cached.update(blocks)

    @invariant()
    def matches_the_model_and_holds_its_invariants(self):
        bp.check_invariants(self.pool)
        model = self.model
        assert bp.free_order(self.pool).tolist() == model.queue
        assert np.asarray(self.pool.ref_cnt).tolist() == model.ref
        assert np.asarray(self.pool.version).tolist() == model.version
        assert np.asarray(self.pool.seq_lens).tolist() == model.lens
        tables = np.asarray(self.pool.block_tables)
        for s in range(MAX_SEQS):
            assert tables[s, : len(model.tables[s])].tolist() == model.tables[s]
            # every mapped length is covered by exactly ceil(len / block_size) blocks
            assert len(model.tables[s]) == -(-model.lens[s] // BLOCK_SIZE)
        assert 0 not in [b for t in model.tables for b in t]


PoolMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
TestPoolAgainstQueueModel = PoolMachine.TestCase


class HostPoolMachine(PoolMachine):
    host = True


HostPoolMachine.TestCase.settings = PoolMachine.TestCase.settings
TestHostPoolAgainstQueueModel = HostPoolMachine.TestCase


def _script(pool):
    pool, ok1 = bp.allocate(pool, jnp.array([9, 0, 21, 4, 0]))
    pool = bp.mark_cached(pool, pool.block_tables[2], 5)
    pool = bp.free(pool, jnp.array([False, False, True, False, False]))
    pool, ok2 = bp.share(pool, 1, pool.block_tables[2].at[:3].set(jnp.array([5, 4, 3])), 3)
    pool, ok3, src, dst = bp.fork(pool, 0, 4)
    pool, ok4 = bp.allocate(pool, pool.seq_lens + jnp.array([3, 5, 0, 1, 7]))
    pool = bp.free(pool, jnp.array([True, False, False, True, False]))
    slots = bp.slot_mapping(pool, jnp.array([1, 4, 4]), jnp.array([13, 8, 15]))
    return pool, jnp.stack([ok1, ok2, ok3, ok4]), src, dst, slots


def test_jit_and_eager_give_the_same_pool():
    pool = bp.init(NUM_BLOCKS, BLOCK_SIZE, MAX_SEQS, MAX_BLOCKS)
    jitted = jax.jit(_script)(pool)
    with jax.disable_jit():
        eager = _script(pool)
    assert np.asarray(jitted[1]).tolist() == [True, True, True, True]
    for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager)):
        np.testing.assert_array_equal(a, b)
    bp.check_invariants(jitted[0])
