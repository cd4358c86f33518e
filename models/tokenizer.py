"""The tokenizer of a checkpoint: a directory's `tokenizer.json` through Hugging Face's `tokenizers`,
with its eos ids and chat template, or a GGUF file's metadata (models.gguf_tokenizer). The
`Tokenizer` class is models.tokenizer_base's, re-exported here."""
from __future__ import annotations

import json
from pathlib import Path

import tokenizers

from models.gguf_file import open_gguf
from models.gguf_tokenizer import gguf_tokenizer
from models.tokenizer_base import Tokenizer

__all__ = ["Tokenizer", "load_tokenizer"]


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _token_content(value) -> str | None:
    """tokenizer_config.json writes a special token as a string or as an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _chat_template(path: Path, config: dict) -> str | None:
    """chat_template.jinja wins over tokenizer_config.json, as in transformers; a list of named
    templates gives its "default"."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        return {t.get("name"): t.get("template") for t in template}.get("default")
    return template


def load_tokenizer(path) -> Tokenizer | None:
    """`path/tokenizer.json` with its eos ids, or None when the directory has no tokenizer.json; a GGUF
    file's tokenizer from its metadata (models.gguf_tokenizer).

    EOS ids are the union of generation_config.json's and config.json's: instruct checkpoints list
    their end-of-turn tokens only in generation_config.json (as vLLM and transformers read it)."""
    path = Path(path)
    if path.is_file():
        return gguf_tokenizer(open_gguf(path))
    if not (path / "tokenizer.json").is_file():
        return None
    eos, bos = [], None
    for name in ("generation_config.json", "config.json"):
        if (path / name).is_file():
            cfg = json.loads((path / name).read_text())
            eos += [i for i in _ids(cfg.get("eos_token_id")) if i not in eos]
            bos = cfg.get("bos_token_id") if bos is None else bos
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    return Tokenizer(tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")), tuple(eos), bos,
                     chat_template=_chat_template(path, config),
                     bos_token=_token_content(config.get("bos_token")),
                     eos_token=_token_content(config.get("eos_token")))
