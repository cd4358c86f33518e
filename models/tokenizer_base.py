"""The tokenizer the engine uses: a Hugging Face `tokenizers.Tokenizer` with its end-of-generation ids,
BOS and chat template (`models.chat_template`). Its two builders sit above it: models.tokenizer (a
checkpoint directory's files, and the dispatch by path) and models.gguf_tokenizer (a GGUF file's
metadata), as vLLM's tokenizer_base.py sits below its get_tokenizer."""
from __future__ import annotations

import tokenizers

from models.chat_template import render_chat_template


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
        `encode_batch` of one: unlike `encode`, which holds the GIL throughout, it releases it, so a
        server's event loop and engine thread keep running while a worker thread tokenizes a long
        prompt (4 MiB: 3.6 s on this machine)."""
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
        prompt = render_chat_template(self.chat_template, messages,
                                      add_generation_prompt=add_generation_prompt,
                                      bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        return self.encode(prompt, add_special_tokens=False) if tokenize else prompt
