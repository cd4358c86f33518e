"""What the benchmark and picture scripts share: a random Llama of a chosen size, ShareGPT-like
request lengths, compile time told apart from run time, and the KV pool read between engine steps."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.llama import Llama, preset
from paged_jax import LLM, SamplingParams

_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")


def add_model_args(ap, *, hidden_size=512, num_layers=8, vocab_size=32000):
    """Model-size flags; the defaults (58M parameters) are a ~50M model that a CPU runs in minutes."""
    ap.add_argument("--hidden-size", type=int, default=hidden_size, help="heads of 64 dims; half as many KV heads")
    ap.add_argument("--num-layers", type=int, default=num_layers)
    ap.add_argument("--vocab-size", type=int, default=vocab_size)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--seed", type=int, default=0)


def random_weights(config, seed: int = 0) -> Llama:
    """A Llama with HF's initialisation (N(0, 0.02) weights, unit norms), drawn on the host from the
    model's shapes: no jit compile, and NNX's eager init would dispatch op by op."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)

    def draw(path, x):
        if "norm" in str(path[-1].key):
            return jnp.ones(x.shape, x.dtype)
        return jnp.asarray(0.02 * rng.standard_normal(x.shape, np.float32), x.dtype)

    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(state)))
    return nnx.merge(graphdef, state)


def random_llama(args, max_model_len: int) -> Llama:
    heads = max(1, args.hidden_size // 64)
    return random_weights(preset("tiny", vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                                 intermediate_size=3 * args.hidden_size, num_layers=args.num_layers, num_heads=heads,
                                 num_kv_heads=max(1, heads // 2), head_dim=args.hidden_size // heads,
                                 max_position_embeddings=max(max_model_len, 256), dtype=args.dtype), args.seed)


def num_params(model) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def kv_bytes_per_token(config) -> int:
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * jnp.dtype(config.dtype).itemsize


def lognormal_lengths(rng, n: int, mean: float, low: int, high: int, sigma: float = 0.8) -> np.ndarray:
    """n lengths in [low, high] from a lognormal whose clipped mean is `mean`: a long tail like the
    ShareGPT conversations of the vLLM paper's workload (means of 161 input and 338 output tokens)."""
    z = rng.standard_normal(n)
    mu = np.log(mean) - sigma**2 / 2
    for _ in range(8):  # clipping moves the mean: nudge mu until the clipped mean is the target
        lengths = np.clip(np.exp(mu + sigma * z), low, high)
        mu += np.log(mean / lengths.mean())
    return np.clip(np.round(np.exp(mu + sigma * z)), low, high).astype(int)


_COMPILE_SPANS: list[tuple[float, float]] = []


def _on_span(event, start, end, **_):
    if event in _COMPILE_EVENTS:
        _COMPILE_SPANS.append((start, end))


jax.monitoring.register_event_time_span_listener(_on_span)


def now() -> float:
    return time.time()  # the clock jax stamps its compile spans with


def compile_seconds(since: float, until: float = float("inf")) -> float:
    """Seconds jax spent tracing, lowering and compiling between `since` and `until` (`now()` times),
    overlapping spans of nested jits counted once: run time = wall time - this."""
    total, reach = 0.0, since
    for start, end in sorted(_COMPILE_SPANS):
        start, end = max(start, reach), min(end, until)
        if end > start:
            total, reach = total + end - start, end
    return total


def block_fill(pool) -> tuple[np.ndarray, np.ndarray]:
    """(tokens held per block i32[num_blocks], ref counts i32[num_blocks]) read from a block pool. A
    block shared by several sequences is counted once, with the most tokens any of them holds in it.
    Copies: the engine's pool is updated in place."""
    tables, lens = np.asarray(pool.block_tables), np.asarray(pool.seq_lens)
    bs = pool.block_size
    fill = np.clip(lens[:, None] - bs * np.arange(tables.shape[1])[None, :], 0, bs)  # i32[seqs, blocks]
    held = np.zeros(pool.num_blocks, np.int64)
    np.maximum.at(held, tables[fill > 0], fill[fill > 0])
    return held, np.array(pool.ref_cnt)


def percentiles(values, qs=(50, 90)) -> dict:
    values = np.asarray(values, float)
    return {f"p{q}": float(np.percentile(values, q)) for q in qs} | {"mean": float(values.mean())}


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """columns: (key, header, format spec); the first column is left-aligned, a missing value is '-'."""
    cells = [[h for _, h, _ in columns]]
    cells += [[format(row[k], f) if row.get(k) is not None else "-" for k, _, f in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    for line in cells:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))))


def make_llm(model, *, block_size: int, kv_tokens: int, max_num_seqs: int, max_model_len: int,
             max_num_batched_tokens: int = 512, enable_prefix_caching: bool = True, **engine_args):
    """An engine whose KV cache holds `kv_tokens` token slots (plus the null block), whatever the
    block size: the same memory for paged and contiguous runs. `engine_args` go to LLM."""
    return LLM(model, block_size=block_size, num_blocks=kv_tokens // block_size + 1, max_num_seqs=max_num_seqs,
               max_num_batched_tokens=max(max_num_batched_tokens, max_num_seqs), max_model_len=max_model_len,
               enable_prefix_caching=enable_prefix_caching, log_stats=False, **engine_args)


def run_engine(llm, prompts, params, *, read_pool: bool = False, loras=None) -> dict:
    """Submit every request at once (offline, as vLLM's benchmark_throughput) and step to the end.

    Besides the outputs and the engine's stats (sequences running per model step, prefill tokens
    computed), it gives run / compile seconds, each request's time to first token (compile time
    inside it left out) and, with `read_pool`, KV utilisation = tokens held / token slots of
    allocated blocks, read from the pool between steps (time spent reading is left out). `loras`:
    each request's LoRARequest or None."""
    engine = llm.engine
    held = allocated = 0
    outputs, probe_s, start = {}, 0.0, now()
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, sp, lora_request=loras[i] if loras else None)
    while engine.has_unfinished_requests():
        before = engine.counters["model_steps"]
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
        if read_pool:
            t = time.perf_counter()
            steps = engine.counters["model_steps"] - before  # weight by the model steps this call ran
            fill, ref = block_fill(engine.block_pool)
            held += steps * int(fill.sum())
            allocated += steps * int((ref[1:] > 0).sum()) * engine.config.block_size
            probe_s += time.perf_counter() - t
    wall = now() - start - probe_s
    outputs = [outputs[str(i)] for i in range(len(prompts))]
    to_now = now() - time.monotonic()  # request metrics are time.monotonic() stamps
    ttft = [o.metrics["first_token_time"] - o.metrics["arrival_time"] - compile_seconds(
        o.metrics["arrival_time"] + to_now, o.metrics["first_token_time"] + to_now) for o in outputs]
    compile_s = compile_seconds(start)
    stats = engine.stats()
    return dict(outputs=outputs, compile_s=compile_s, run_s=wall - compile_s, ttft_s=ttft,
                max_running=stats["max_num_running"], mean_running=stats["mean_num_running"],
                prefill_tokens=stats["prefill_tokens"], stats=stats,
                utilisation=held / allocated if allocated else None)



def forced_agreement(llm, reference) -> tuple[float, float]:
    """Score greedy answers of another run (RequestOutputs with logprobs=0, e.g. from an
    unquantized KV cache) under `llm`, each answer fed back as its prompt's continuation (prompt
    logprobs), so every position is judged in the same context: -> (share of answer tokens that
    are also `llm`'s greedy choice, mean |logprob difference| of those tokens between the runs).
    Free-running answers, once they part at a near tie, continue different texts and stop being
    comparable position by position."""
    prompts = [r.prompt_token_ids + r.outputs[0].token_ids for r in reference]
    scored = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))
    same, diffs = 0, []
    for ref, out in zip(reference, scored):
        start = len(ref.prompt_token_ids)
        for j, (token, logprobs) in enumerate(zip(ref.outputs[0].token_ids, ref.outputs[0].logprobs)):
            entry = out.prompt_logprobs[start + j][token]
            same += entry.rank == 1
            diffs.append(abs(entry.logprob - logprobs[token].logprob))
    return same / len(diffs), float(np.mean(diffs))
