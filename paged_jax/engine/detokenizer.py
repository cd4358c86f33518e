"""Incremental detokenization (vLLM's `detokenize_incrementally`, the state of its V1
`IncrementalDetokenizer`): each new token is decoded in a short window of the tokens before it, so
a step costs O(new tokens), not a decode of the whole output.

Offsets count output tokens. `[prefix_offset, read_offset)` is the context: the tokens whose text
was emitted last, decoded again so that what a tokenizer does at the start of a decode (a
sentencepiece leading space dropped, a WordPiece "##" joined) happens identically in both decodes
and cancels out. Before the first output token the context is the prompt's last few tokens (a
negative prefix_offset), so the first token keeps its leading space, as in vLLM. The text of the
window `[prefix_offset, end)` past the context's text is the new text. A window whose text ends in
U+FFFD may end inside a multi-byte character that the next byte token completes, so it emits nothing
and the window grows until the character is whole: no chunk of text ever holds half a character.
"""
from __future__ import annotations

REPLACEMENT = "\ufffd"  # what a byte-level decode shows for bytes that are not (yet) a whole character
PROMPT_CONTEXT = 5  # vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET


def prompt_context(tokenizer, token_ids: list[int], num_prompt: int, *, skip_special_tokens: bool) -> int:
    """How many of the prompt's last tokens the first output token is decoded after: the most, up to
    PROMPT_CONTEXT, whose text holds no broken character (one would end the context inside a
    character that the output completes), 0 where none."""
    for n in range(min(PROMPT_CONTEXT, num_prompt), 0, -1):
        if REPLACEMENT not in tokenizer.decode(token_ids[num_prompt - n: num_prompt],
                                               skip_special_tokens=skip_special_tokens):
            return n
    return 0


def decode_next(tokenizer, window: list[int], num_context: int, *, skip_special_tokens: bool,
                final: bool = False) -> str | None:
    """`window`: output tokens from prefix_offset to the newest, the first `num_context` of them
    already emitted -> the new text, or None while it may end inside a character. `final`: the
    sequence has ended, so an unfinished character is what it is (U+FFFD, as a full decode shows)."""
    text = tokenizer.decode(window, skip_special_tokens=skip_special_tokens)
    if text.endswith(REPLACEMENT) and not final:
        return None
    # A window whose new tokens decode to nothing (a skipped special token) still advances: vLLM
    # waits for text there, which regrows the window on every step of a run of special tokens.
    context = tokenizer.decode(window[:num_context], skip_special_tokens=skip_special_tokens) if num_context else ""
    return text[len(context):]


def find_stop(text: str, num_new: int, stops) -> tuple[str, int] | None:
    """The first of `stops` (in their order, as vLLM) that ends inside the last `num_new` characters
    of `text` -> (stop, where it starts); only those could the newest token have completed, so the
    search covers them and len(stop) - 1 characters before."""
    if not num_new:
        return None
    for stop in stops:
        at = text.find(stop, max(0, len(text) - num_new - len(stop) + 1))
        if at >= 0:
            return stop, at
    return None
