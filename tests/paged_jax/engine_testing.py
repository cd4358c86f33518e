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


class StubServing:
    """What a response object reads of its server: no tokenizer, a model name."""
    tokenizer, model_name = None, "m"


async def dying_outputs():
    """An engine's outputs for one request that dies after its first: (prompt index, RequestOutput)."""
    from paged_jax.engine.outputs import CompletionOutput, RequestOutput
    from paged_jax.entrypoints.async_llm import EngineDeadError

    yield 0, RequestOutput("r", None, [1, 2], [CompletionOutput(0, "ab", [5, 6])], False)
    raise EngineDeadError("the engine stopped: boom")
