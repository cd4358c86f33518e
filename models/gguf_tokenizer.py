"""A GGUF file's tokenizer (`tokenizer.ggml.*` metadata) as a Hugging Face `tokenizers.Tokenizer`,
wrapped in models.tokenizer_base.Tokenizer with the file's chat template, BOS and EOS.

Built the way transformers' GGUF converter builds it (integrations/gguf/gguf_tokenizer_mapping.py),
so that both encode a text alike, from either kind of vocabulary llama.cpp writes for the
architectures models.gguf loads:
- byte-level BPE (`tokenizer.ggml.model` "gpt2": Llama 3, Qwen, SmolLM): the file's tokens and
  merges, the split that `tokenizer.ggml.pre` names before the byte-level mapping (GPT-2's for a
  name not in the table, as transformers does);
- SentencePiece BPE ("llama": Llama 2, Mistral v0.1-0.3, TinyLlama, CodeLlama): the file has tokens
  and their scores but no merges; a SentencePiece BPE merges the adjacent pair whose joined piece
  scores highest, so the merges are every split of a token into two tokens, ranked by the joined
  token's score. Spaces become "▁" with one prepended to the text's start (transformers' Metaspace,
  "first": not after a special token, where llama.cpp also prepends one), and a character outside
  the vocabulary is spelled by its UTF-8 bytes' `<0xXX>` tokens; BOS is added unless the file says
  `add_bos_token` false. Gemma's files differ (`_gemma_bpe`): merges in the vocabulary's order,
  spaces stored as spaces, no "▁" prepended.
The tokens llama.cpp types CONTROL are special added tokens (kept whole, dropped by
`skip_special_tokens`), USER_DEFINED ones plain added tokens; BOS/EOS are added by the
post-processor only where `tokenizer.ggml.add_bos_token` / `add_eos_token` say so.
"""
from __future__ import annotations

import gguf
import tokenizers
from tokenizers import decoders, pre_tokenizers, processors

from models.gguf_file import GGUFFile, field
from models.tokenizer_base import Tokenizer

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the split regex, for the vocabularies of the architectures models.gguf loads.
# Any other name (SmolLM's "smollm", "gpt2", none) gets GPT-2's regex inside the ByteLevel step, as
# in transformers. (llama.cpp also isolates each digit for "smollm"; its vocabulary has no merge
# across a digit, so the ids are the same.)
PRE_TOKENIZER_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
                        "smaug-bpe": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT, "pixtral": _LLAMA3_SPLIT,
                        "tekken": _TEKKEN_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
SUPPORTED_MODELS = ("gpt2", "llama")
# Gemma's SentencePiece files need their own build (below); Phi-3's, which transformers also builds
# otherwise (its prefix space), are refused: models.gguf loads no Phi-3.
_GEMMA = ("gemma", "gemma2", "gemma3")
_OTHER_SENTENCEPIECE = ("phi3",)
SPACE = "\u2581"  # SentencePiece's visible space
# Tokens that end a generation by their text alone (llama.cpp's llama-vocab.cpp, for files that name
# no end-of-turn token: Gemma's "<end_of_turn>", ChatML's "<|im_end|>", ...).
END_OF_GENERATION = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
                               "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>",
                               "<end_of_utterance>"})


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (its `bytes_to_unicode`): printable Latin-1 bytes stand
    for themselves, the other 68 are shifted past 255, so every byte string is spelled in text."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + i) for i, b in enumerate(shifted)}}


def _byte_level_bpe(tokens: list[str], merges: list[str]) -> tokenizers.Tokenizer:
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    # A token written in raw text (some files store a few that way) is spelled in the byte alphabet.
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ")) for m in merges]
    bad = next((m for m, p in zip(merges, pairs) if len(p) != 2), None)
    if bad is not None:
        raise ValueError(f"tokenizer.ggml.merges entry {bad!r} is not two tokens separated by a space")
    return tokenizers.Tokenizer(tokenizers.models.BPE(vocab, pairs, dropout=None, fuse_unk=False,
                                                      continuing_subword_prefix="", end_of_word_suffix=""))


def sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies: each way to cut a token into two tokens,
    best first by the token's score, then by the longer left piece, then the longer right one, then
    the token's place in the vocabulary and the pieces' ids (transformers' order, ties included)."""
    ids = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for token, score in dict(zip(tokens, scores)).items():
        cuts = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in ids and token[k:] in ids]
        ranked += [(score, left, right) for left, right in sorted(cuts, key=lambda c: (ids[c[0]], ids[c[1]]))]
    ranked.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)  # stable: ties keep their order
    return [(left, right) for _, left, right in ranked]


def _sentencepiece_bpe(tokens: list[str], scores: list[float]) -> tokenizers.Tokenizer:
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE({t: i for i, t in enumerate(tokens)},
                                                           sentencepiece_merges(tokens, scores), dropout=None,
                                                           fuse_unk=True, byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)
    # Strip: the "▁" prepended to the text's start.
    tokenizer.decoder = decoders.Sequence([*_sentencepiece_decoders(), decoders.Strip(" ", 1, 0)])
    return tokenizer


def _sentencepiece_decoders() -> list:
    """Decoding a SentencePiece: "▁" back to a space, <0xXX> pieces back to their bytes, all joined."""
    return [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]


def _gemma_bpe(tokens: list[str], unknown: int | None) -> tokenizers.Tokenizer:
    """Gemma's SentencePiece files (transformers' GemmaTokenizer): a piece of two or more spaces is
    stored as spaces, and spelled with "▁" here; the merges follow the vocabulary's order, which its
    scores do not; every space becomes "▁" and none is prepended; no leading space is stripped."""
    tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    merges = sentencepiece_merges(tokens, [-float(i) for i in range(len(tokens))])
    unk = tokens[unknown] if unknown is not None else None
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE({t: i for i, t in enumerate(tokens)}, merges, dropout=None,
                                                           fuse_unk=True, byte_fallback=True, unk_token=unk))
    tokenizer.normalizer = tokenizers.normalizers.Replace(" ", SPACE)
    tokenizer.decoder = decoders.Sequence(_sentencepiece_decoders())
    return tokenizer


def _pre_tokenizer(pre: str | None):
    if pre not in PRE_TOKENIZER_SPLITS:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    split = pre_tokenizers.Split(tokenizers.Regex(PRE_TOKENIZER_SPLITS[pre]), behavior="isolated")
    return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _post_processor(tokens, bos: int | None, eos: int | None, add_bos: bool, add_eos: bool):
    """transformers' template for a tokenizer with these add_bos/add_eos flags; None adds nothing."""
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    if not (add_bos or add_eos):
        return None
    single = " ".join([f"{tokens[bos]}:0"] * add_bos + ["$A:0"] + [f"{tokens[eos]}:0"] * add_eos)
    pair = single + " " + " ".join([f"{tokens[bos]}:1"] * add_bos + ["$B:1"] + [f"{tokens[eos]}:1"] * add_eos)
    special = {tokens[i]: i for i, on in ((bos, add_bos), (eos, add_eos)) if on}
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(special.items()))


def gguf_tokenizer(reader: GGUFFile) -> Tokenizer | None:
    """The tokenizer the file's metadata describes, None when it has none (token-id prompts only)."""
    kind = field(reader, "tokenizer.ggml.model", None)
    if kind is None:
        return None
    file, arch = reader.path, field(reader, "general.architecture", None)
    if kind not in SUPPORTED_MODELS:
        raise ValueError(f"{file}: tokenizer.ggml.model {kind!r} is not supported "
                         f"(supported: {list(SUPPORTED_MODELS)})")
    if kind == "llama" and arch in _OTHER_SENTENCEPIECE:
        raise ValueError(f"{file}: the SentencePiece vocabulary of a {arch!r} file is not supported")
    tokens = field(reader, "tokenizer.ggml.tokens")
    types = field(reader, "tokenizer.ggml.token_type", None) or [gguf.TokenType.NORMAL] * len(tokens)
    ids = {key: field(reader, f"tokenizer.ggml.{key}_token_id", None)
           for key in ("bos", "eos", "eot", "eom", "unknown", "padding")}
    byte_level = kind == "gpt2"
    if byte_level:
        tokenizer = _byte_level_bpe(tokens, field(reader, "tokenizer.ggml.merges"))
        tokenizer.pre_tokenizer = _pre_tokenizer(field(reader, "tokenizer.ggml.pre", None))
        tokenizer.decoder = decoders.ByteLevel()
    elif arch in _GEMMA:
        tokenizer = _gemma_bpe(tokens, ids["unknown"])
    else:
        scores = field(reader, "tokenizer.ggml.scores")
        if len(scores) != len(tokens):
            raise ValueError(f"{file}: tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
        tokenizer = _sentencepiece_bpe(tokens, scores)
    # transformers adds CONTROL tokens, and the bos/eos/unk/pad it names, as special; in a byte-level
    # vocabulary one spelled outside the byte alphabet is a mislabelled raw-text token and stays an
    # ordinary one.
    alphabet = set(byte_alphabet().values()) if byte_level else None
    spelled = (lambda i: set(tokens[i]) <= alphabet) if byte_level else (lambda i: True)
    special = {i for i, t in enumerate(types) if t == gguf.TokenType.CONTROL}
    special |= {i for key, i in ids.items() if i is not None and key in ("bos", "eos", "unknown", "padding")}
    tokenizer.add_special_tokens([tokenizers.AddedToken(tokens[i], normalized=False, special=True)
                                  for i in sorted(special) if spelled(i)])
    # llama.cpp matches USER_DEFINED tokens (e.g. `<think>`) whole in text; they are not special.
    user = [i for i, t in enumerate(types) if t == gguf.TokenType.USER_DEFINED and spelled(i)]
    tokenizer.add_tokens([tokenizers.AddedToken(tokens[i], normalized=False, special=False) for i in user])
    # A SentencePiece file that does not say gets BOS, as llama.cpp and transformers give it.
    add_bos = field(reader, "tokenizer.ggml.add_bos_token", not byte_level)
    post = _post_processor(tokens, ids["bos"], ids["eos"], bool(add_bos),
                           bool(field(reader, "tokenizer.ggml.add_eos_token", False)))
    if post is not None:
        tokenizer.post_processor = post
    # Generation ends at EOS, at the end-of-turn / end-of-message tokens the file names, and at the
    # tokens llama.cpp takes for such by their text, EOS first (the chat template's `eos_token`).
    by_text = [i for i, t in enumerate(tokens) if t in END_OF_GENERATION]
    eos = tuple(dict.fromkeys(i for i in [ids["eos"], ids["eot"], ids["eom"], *by_text] if i is not None))
    return Tokenizer(tokenizer, eos, ids["bos"], chat_template=field(reader, "tokenizer.chat_template", None))
