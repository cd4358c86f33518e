"""The tokenizer of a checkpoint directory: `tokenizer.json` through Hugging Face's `tokenizers`."""
from __future__ import annotations

import json
from pathlib import Path

import tokenizers


class Tokenizer:
    def __init__(self, tokenizer: tokenizers.Tokenizer, eos_token_ids: tuple[int, ...],
                 bos_token_id: int | None = None):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids  # any of these ends a generation
        self.bos_token_id = bos_token_id

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Llama 3's tokenizer.json adds BOS itself (its post-processor) when add_special_tokens."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def load_tokenizer(path) -> Tokenizer | None:
    """`path/tokenizer.json` with its eos ids, or None when the directory has no tokenizer.json.

    EOS ids are the union of generation_config.json's and config.json's: instruct checkpoints list
    their end-of-turn tokens only in generation_config.json (as vLLM and transformers read it)."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        return None
    eos, bos = [], None
    for name in ("generation_config.json", "config.json"):
        if (path / name).is_file():
            cfg = json.loads((path / name).read_text())
            eos += [i for i in _ids(cfg.get("eos_token_id")) if i not in eos]
            bos = cfg.get("bos_token_id") if bos is None else bos
    return Tokenizer(tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")), tuple(eos), bos)
