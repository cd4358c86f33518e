"""The tokenizer of a checkpoint directory: `tokenizer.json` through Hugging Face's `tokenizers`,
and its chat template (`models.chat_template`)."""
from __future__ import annotations

import json
from pathlib import Path

import tokenizers


class Tokenizer:
    def __init__(self, tokenizer: tokenizers.Tokenizer, eos_token_ids: tuple[int, ...],
                 bos_token_id: int | None = None, *, chat_template: str | None = None,
                 bos_token: str | None = None, eos_token: str | None = None):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids  # any of these ends a generation
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        # The strings a chat template writes as `bos_token`/`eos_token`; the first eos id stands in
        # for tokenizer_config.json's eos_token when there is none.
        self.bos_token = bos_token if bos_token is not None else self._token(bos_token_id)
        self.eos_token = eos_token if eos_token is not None else self._token(
            eos_token_ids[0] if eos_token_ids else None)

    def _token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokenizer.id_to_token(token_id)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Llama 3's tokenizer.json adds BOS itself (its post-processor) when add_special_tokens.
        `encode_batch` of one: unlike `encode` it releases the GIL, so a server's event loop keeps
        running while a worker thread tokenizes a long prompt (4 MiB: tens of seconds)."""
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids, *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            tokenize: bool = False, **extra) -> str | list[int]:
        """The prompt of `messages` (OpenAI-style dicts), or its token ids when `tokenize`.

        The ids are encoded without special tokens: the template writes BOS itself, and the
        post-processor would add a second one (as vLLM encodes chat prompts)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (no chat_template.jinja and no "
                             "chat_template in tokenizer_config.json); send a plain prompt instead")
        # Imported here: jinja2 comes with the serve extra, and plain generation needs no template.
        from models.chat_template import render_chat_template
        prompt = render_chat_template(self.chat_template, messages,
                                      add_generation_prompt=add_generation_prompt,
                                      bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        return self.encode(prompt, add_special_tokens=False) if tokenize else prompt


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
        from models.gguf import open_gguf  # imported here: models.gguf_tokenizer builds on this module
        from models.gguf_tokenizer import gguf_tokenizer

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
