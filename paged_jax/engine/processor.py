"""vLLM's Processor (vllm/v1/engine/processor.py): a request's prompt checked and tokenized, and
whether the engine could ever serve it, before anything is queued. It reads only the engine's
configuration, so a server's request threads may ask it too."""
from __future__ import annotations

from paged_jax.engine import config as config_lib
from paged_jax.engine.config import EngineConfig
from paged_jax.sampling_params import SamplingParams


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer, vocab_size: int, sliding_window: int | None):
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.sliding_window = sliding_window

    def tokenize_prompt(self, prompt):
        """(text or None, token ids) of a prompt; ValueError naming what is wrong with it."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids or a model with tokenizer.json")
            ids = self.tokenizer.encode(prompt)
            text = prompt
        else:
            ids, text = [int(t) for t in prompt], None
        if not ids:
            raise ValueError(f"the prompt is empty: {prompt!r}")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:8]} are outside [0, {self.vocab_size})")
        return text, ids

    def unservable(self, prompt_token_ids, params: SamplingParams) -> str | None:
        """Why this engine can never serve the request, or None (a request queued anyway finishes
        with this error)."""
        c, n = self.config, len(prompt_token_ids)
        if n >= c.max_model_len:
            return f"the prompt has {n} tokens, max_model_len is {c.max_model_len} (one more is needed for output)"
        longest = min(c.max_model_len, n + (params.max_tokens or c.max_model_len))
        chunk = min(n, c.max_num_batched_tokens, c.long_prefill_token_threshold or n)
        step = max(chunk, c.num_decode_steps, c.num_speculative_tokens + 1)
        need = (config_lib.blocks_per_seq(longest, c.block_size, self.sliding_window, step)
                + (params.n - 1) * int(n % c.block_size != 0))
        if need > c.num_blocks - 1:
            return f"the request may need {need} blocks, the KV cache holds {c.num_blocks - 1}"
        if params.n > c.max_num_seqs:
            return f"n={params.n} samples exceed max_num_seqs={c.max_num_seqs}"
        return None
