"""What users would run instead of the paged engine, on the same weights: a plain JAX greedy loop over
a dense contiguous KV cache with static batches, and Hugging Face transformers `generate` on torch.

Both batch statically, as FasterTransformer-style servers did (the vLLM paper's baselines): a batch
runs until its longest request is done, and its cache holds the longest prompt plus answer per row.
"""
from __future__ import annotations

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.loading import llama_hf_tensors


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def dense_forward(graphdef, params, tokens, positions, last, cache):
    """One forward of a static batch over a contiguous cache -> (greedy next token i32[B], cache).

    tokens, positions: i32[B, T]; last: i32[B], the column of each row's last real token;
    cache: (k, v), each [num_layers, B, max_len, num_kv_heads, head_dim], written at `positions`."""
    model = nnx.merge(graphdef, params)
    rows = jnp.arange(tokens.shape[0])[:, None]
    max_len = cache[0].shape[2]
    # Padding columns of a short prompt write junk past its end; a key at position p is only read by
    # queries at positions >= p, and decode overwrites position p before any real query reaches it.
    visible = jnp.arange(max_len)[None, None, :] <= positions[:, :, None]  # bool[B, T, max_len]

    def attention(q, k, v, cache, layer, sliding_window=None):  # q [B, T, H, D]; k, v [B, T, KVH, D]
        if sliding_window is not None:
            raise ValueError(f"the dense baseline attends globally; got sliding_window={sliding_window}")
        k_all = cache[0].at[layer, rows, positions].set(k)
        v_all = cache[1].at[layer, rows, positions].set(v)
        b, t, h, d = q.shape
        kvh = k.shape[2]
        qg = q.reshape(b, t, kvh, h // kvh, d)
        s = jnp.einsum("btkgd,bskd->bkgts", qg, k_all[layer], preferred_element_type=jnp.float32) * d**-0.5
        p = jax.nn.softmax(jnp.where(visible[:, None, None], s, -jnp.inf), axis=-1)
        out = jnp.einsum("bkgts,bskd->btkgd", p, v_all[layer].astype(jnp.float32))
        return out.reshape(b, t, h, d).astype(q.dtype), (k_all, v_all)

    x = model.embed[...][tokens]
    # The model's own layer scan with contiguous attention swapped in: the same math as the engine.
    x, cache = model.run_layers(x, positions, attention, cache)
    logits = model.logits(x[rows[:, 0], last])
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache


def dense_generate(model, prompts: list[list[int]], output_lens: list[int], batch_size: int) -> list[list[int]]:
    """Greedy answers of `output_lens[i]` tokens, `batch_size` requests at a time."""
    graphdef, params = nnx.split(model)
    c = model.config
    answers = []
    for start in range(0, len(prompts), batch_size):
        batch, outs = prompts[start:start + batch_size], output_lens[start:start + batch_size]
        lens = np.ones(batch_size, np.int32)  # a partial last batch keeps the compiled shape: 1-token rows
        lens[: len(batch)] = [len(p) for p in batch]
        width = _round_up(int(lens.max()), 64)  # few prompt widths, few compiled programs
        tokens = np.zeros((batch_size, width), np.int32)
        for i, p in enumerate(batch):
            tokens[i, : len(p)] = p
        steps = max(outs)
        max_len = _round_up(int(lens.max()) + steps, 256)
        shape = (c.num_layers, batch_size, max_len, c.num_kv_heads, c.head_dim)
        cache = (jnp.zeros(shape, c.dtype), jnp.zeros(shape, c.dtype))
        positions = np.broadcast_to(np.arange(width, dtype=np.int32), tokens.shape)
        token, cache = dense_forward(graphdef, params, tokens, positions, lens - 1, cache)
        generated = [token]
        zero = np.zeros(batch_size, np.int32)
        for step in range(1, steps):  # the whole batch decodes until its longest answer is done
            token, cache = dense_forward(graphdef, params, token[:, None], (lens + step - 1)[:, None], zero, cache)
            generated.append(token)
        generated = np.asarray(jnp.stack(generated, axis=1))
        answers += [generated[i, :n].tolist() for i, n in enumerate(outs)]
    return answers


def hf_available() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("torch", "transformers"))


def hf_llama(model, num_threads: int | None = None):
    """`transformers.LlamaForCausalLM` holding our model's weights (the checkpoint layout of
    models/loading.py, read backwards); `num_threads` sets torch's intra-op threads."""
    import torch
    import transformers

    if num_threads:
        torch.set_num_threads(num_threads)
    c = model.config
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**c.to_hf_config())).eval()
    ours = nnx.to_pure_dict(nnx.state(model))
    state = {}
    for name, t in llama_hf_tensors(c).items():
        x = ours
        for key in t.param:
            x = x[key]
        x = np.asarray(x if t.layer is None else x[t.layer], np.float32)
        x = x.reshape(t.shape[::-1]).T if t.transpose else x.reshape(t.shape)
        state[name] = torch.from_numpy(np.array(x)).to(getattr(torch, c.dtype))
    if c.tie_word_embeddings:  # transformers 5 lists the tied head in the state dict too
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    hf.load_state_dict(state, strict=True)
    hf.generation_config.eos_token_id = None  # ignore_eos, as every other row of the table
    return hf


def hf_generate(hf, prompts: list[list[int]], output_lens: list[int], batch_size: int) -> list[list[int]]:
    """Greedy `generate` on left-padded static batches (what HF expects of a decoder-only model)."""
    import torch

    answers = []
    for start in range(0, len(prompts), batch_size):
        batch, outs = prompts[start:start + batch_size], output_lens[start:start + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(batch):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max(outs),
                              min_new_tokens=max(outs), pad_token_id=0)
        answers += [out[i, width:width + n].tolist() for i, n in enumerate(outs)]
    return answers


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def llama_cpp_model(path, num_threads: int, n_ctx: int):
    """llama.cpp (the `llama-cpp-python` binding, an optional benchmark dependency) on a GGUF file,
    its quantized weights as they are stored, `num_threads` threads for decode and prefill."""
    from llama_cpp import Llama

    return Llama(model_path=str(path), n_threads=num_threads, n_threads_batch=num_threads, n_ctx=n_ctx,
                 verbose=False)


def llama_cpp_generate(llm, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    """Greedy answers of exactly `output_len` tokens (EOS does not stop them, as ignore_eos), one
    prompt after another: the binding's `generate` runs a single sequence (llama.cpp's multi-sequence
    batch is only reachable through its low-level C API)."""
    answers = []
    for prompt in prompts:
        tokens = []
        for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            tokens.append(int(token))
            if len(tokens) == output_len:
                break
        answers.append(tokens)
    return answers
