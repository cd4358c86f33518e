"""The project's tokenizer as an `llguidance.LLTokenizer`, sized to the model's vocabulary.

llguidance reads Hugging Face's tokenizer JSON itself (`tokenizers.Tokenizer.to_str()`), so no
transformers is needed (llguidance.hf does the same from a transformers tokenizer). Building one walks
the whole vocabulary (about 0.25 s for SmolLM2's 49k tokens): an engine builds it once.
"""
from __future__ import annotations

import json

import llguidance
import numpy as np


def ll_tokenizer(tokenizer, vocab_size: int | None = None) -> llguidance.LLTokenizer:
    """tokenizer: a `models.tokenizer.Tokenizer` (its HF tokenizer is `.tokenizer`, its EOS ids
    `.eos_token_ids`) or a bare `tokenizers.Tokenizer` (llguidance then guesses EOS).
    vocab_size: the model's (`config.vocab_size`), often padded past the tokenizer's to a multiple
    of 64 or 128. The LLTokenizer gets the larger of the two, as vLLM's guidance backend does, so a
    mask has a bit for every logit; llguidance never allows an id that has no token."""
    hf = getattr(tokenizer, "tokenizer", tokenizer)
    num_tokens = hf.get_vocab_size(with_added_tokens=True)
    if vocab_size is not None and vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    text = hf.to_str()
    if hf.padding is not None or hf.truncation is not None:
        # Settings for batched encoding; llguidance's own tokenize calls must see whole texts
        # (llguidance.hf clears them on a copy for the same reason).
        spec = json.loads(text)
        spec["padding"] = spec["truncation"] = None
        text = json.dumps(spec)
    eos = [int(i) for i in getattr(tokenizer, "eos_token_ids", ()) or ()]
    return llguidance.LLTokenizer(text, n_vocab=max(num_tokens, vocab_size or 0), eos_token=eos or None)


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row of a token bitmask: bit t % 32 of word t // 32 allows token t."""
    return (vocab_size + 31) // 32


def allocate_bitmask(num_rows: int, vocab_size: int) -> np.ndarray:
    """i32[num_rows, bitmask_words(vocab_size)], every token allowed (-1 = all 32 bits set)."""
    return np.full((num_rows, bitmask_words(vocab_size)), -1, np.int32)
