"""Checks shared by the engine tests (imported by name; needs neither torch nor transformers)."""
import numpy as np

from paged_jax.core import block_pool as bp


def assert_pool_drained(llm):
    engine = llm.engine
    pool = engine.block_pool
    bp.check_invariants(pool)
    assert int(bp.num_free(pool)) == engine.config.num_blocks - 1
    assert np.asarray(pool.ref_cnt).tolist() == [0] * engine.config.num_blocks
    assert llm.stats()["kv_cache_usage"] == 0.0
