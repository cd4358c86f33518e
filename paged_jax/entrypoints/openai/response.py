"""One request's OpenAI response: its choices as outputs arrive, the whole body, or the stream of
`data:` chunks (completion and chat shapes; vLLM's serving_completion.py / serving_chat.py)."""
from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator

from paged_jax.entrypoints.async_llm import EngineDeadError
from paged_jax.entrypoints.openai.protocol import APIError, engine_dead
from paged_jax.entrypoints.openai.tool_calling import finish_reason


def _prompt_logprobs_json(entries):
    """vLLM's prompt_logprobs body: None for the first token, then {token id: {logprob, rank, decoded_token}}."""
    if entries is None:
        return None
    return [None if entry is None else {str(t): dataclasses.asdict(lp) for t, lp in entry.items()}
            for entry in entries]


def _sse(payload) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class ChoicesResponse:
    """One request's choices as they accumulate, in OpenAI's completion or chat shapes."""

    def __init__(self, serving, request_id: str, chat: bool, n: int, prompts, options, *,
                 token_ids_as_tokens: bool, tools=None):
        self.serving, self.id, self.chat, self.n, self.prompts = serving, request_id, chat, n, prompts
        self.options = options
        self.model = options.model or serving.model_name  # an adapter's name when it asked for one
        self.tools = tools  # tool_calling.ToolCalling of a chat request with tools, or None
        self.token_ids_as_tokens = token_ids_as_tokens  # vLLM's return_tokens_as_token_ids: "token_id:7"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        tokenizer = serving.tokenizer
        echo = options.echo
        prompt_texts = [tokenizer.decode(ids) if tokenizer else "" for ids in prompts] if echo else None
        count = len(prompts) * n
        self.text = [prompt_texts[i // n] if echo else "" for i in range(count)]
        self.echo_pending = [echo] * count
        # completions' logprobs text_offset, per choice: echoed prompt tokens get logprobs from 0
        self.offset = [0 if options.logprobs is not None else len(t) for t in self.text]
        self.logprobs = [[] for _ in range(count)]
        self.prompt_logprobs = [None] * len(prompts)  # RequestOutput.prompt_logprobs per prompt
        self.finish = [None] * count
        self.stop_reason = [None] * count
        self.completion_tokens = 0
        self.cached_tokens = [0] * len(prompts)

    def add(self, i: int, out) -> list[tuple[int, str, object]]:
        """Take one output of prompt i -> (choice index, new text, new logprobs) per changed choice."""
        if out.error:
            raise APIError(out.error)
        self.cached_tokens[i] = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[i] = out.prompt_logprobs
        changed = []
        for c in out.outputs:
            index = i * self.n + c.index
            new, entries = c.text, list(zip(c.token_ids, c.logprobs or []))
            if self.echo_pending[index]:  # echo: the prompt (text and logprobs) leads the first chunk
                new, self.echo_pending[index] = self.text[index] + new, False
                if self.options.logprobs is not None:
                    entries = list(zip(self.prompts[i], self.prompt_logprobs[i])) + entries
            self.text[index] += c.text
            self.completion_tokens += len(c.token_ids)
            logprobs = self._logprobs(index, entries) if self.options.logprobs is not None else None
            self.finish[index], self.stop_reason[index] = c.finish_reason, c.stop_reason
            changed.append((index, new, logprobs, c))
        return changed

    def _logprobs(self, index, tokens):
        """This chunk's logprobs in the endpoint's shape: each (token, its logprobs dict) as the token
        and the top N by rank; an echoed prompt's first token has no dict (null, as vLLM sends it)."""
        top_n = self.options.logprobs

        def name(token, piece):
            return f"token_id:{token}" if self.token_ids_as_tokens else piece

        def top(lp):
            return sorted(((t, e) for t, e in lp.items() if e.rank <= top_n), key=lambda te: te[1].rank)

        if self.chat:
            def item(token, e):
                return {"token": name(token, e.decoded_token), "logprob": e.logprob,
                        "bytes": list(e.decoded_token.encode())}
            content = [{**item(token, lp[token]), "top_logprobs": [item(*te) for te in top(lp)]}
                       for token, lp in tokens]
            self.logprobs[index] += content
            return {"content": content}
        part = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        tokenizer = self.serving.tokenizer
        for token, lp in tokens:
            if lp is None:
                piece = tokenizer.decode([token], skip_special_tokens=False) if tokenizer else ""
            else:
                piece = lp[token].decoded_token
            part["tokens"].append(name(token, piece))
            part["token_logprobs"].append(None if lp is None else lp[token].logprob)
            part["top_logprobs"].append(None if lp is None else {
                name(t, e.decoded_token): e.logprob for t, e in [(token, lp[token]), *top(lp)]})
            part["text_offset"].append(self.offset[index])
            self.offset[index] += len(piece)
        self.logprobs[index].append(part)
        return part

    def usage(self) -> dict:
        prompt_tokens = sum(len(ids) for ids in self.prompts)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens)}}

    def _joined_logprobs(self, index):
        if self.options.logprobs is None:
            return None
        if self.chat:
            return {"content": self.logprobs[index]}
        parts = self.logprobs[index]
        return {key: [v for p in parts for v in p[key]] for key in ("tokens", "token_logprobs", "top_logprobs",
                                                                   "text_offset")}

    def body(self) -> dict:
        choices = []
        for index, text in enumerate(self.text):
            choice = {"index": index, "logprobs": self._joined_logprobs(index), "finish_reason": self.finish[index],
                      "stop_reason": self.stop_reason[index]}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
                if self.tools is not None:
                    content, calls = self.tools.message(text)
                    choice["message"] = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
                    choice["finish_reason"] = finish_reason(self.finish[index], bool(calls))
            else:
                choice["text"] = text
                if self.options.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = _prompt_logprobs_json(self.prompt_logprobs[index // self.n])
            choices.append(choice)
        body = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}
        if self.chat and self.options.prompt_logprobs is not None:  # vLLM puts chat's on the response
            body["prompt_logprobs"] = _prompt_logprobs_json(self.prompt_logprobs[0])
        return body

    def _tool_choices(self, streams, index, new, logprobs, c) -> list[dict]:
        """This output's deltas of a choice whose request has tools: content, tool-call deltas, and
        the finish reason on the last one ("tool_calls" when it made calls)."""
        stream = streams.setdefault(index, self.tools.stream())
        deltas = stream.feed(new) + (stream.finish() if c.finish_reason is not None else [])
        if not deltas:
            if c.finish_reason is None:
                return []
            deltas = [{}]
        choices = [{"index": index, "logprobs": None, "finish_reason": None, "delta": d} for d in deltas]
        choices[0]["logprobs"] = logprobs
        if c.finish_reason is not None:
            choices[-1].update(finish_reason=finish_reason(c.finish_reason, stream.made_calls),
                               stop_reason=c.stop_reason)
        return choices

    def _chunk(self, choices) -> dict:
        return {"id": self.id, "object": self.object + (".chunk" if self.chat else ""), "created": self.created,
                "model": self.model, "choices": choices}

    async def events(self, outputs) -> AsyncIterator[str]:
        """SSE lines: a chunk per choice that has new text (or finished), `finish_reason` once on each
        choice's last chunk, the usage chunk if asked, then `[DONE]`; an error as an error chunk."""
        try:
            if self.chat:  # OpenAI's first chunk of each choice carries the role
                yield _sse(self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None} for i in range(len(self.text))]))
            streams = {}  # choice index -> tool_calling.ChoiceStream
            async for i, out in outputs:
                choices, singles = [], []
                for index, new, logprobs, c in self.add(i, out):
                    if not new and not c.token_ids and c.finish_reason is None:
                        continue
                    if self.tools is not None:  # a chunk per delta: a tool call's come one by one
                        singles += self._tool_choices(streams, index, new, logprobs, c)
                        continue
                    choice = {"index": index, "logprobs": logprobs, "finish_reason": c.finish_reason,
                              "stop_reason": c.stop_reason}
                    choice.update({"delta": {"content": new}} if self.chat else {"text": new})
                    choices.append(choice)
                if choices:
                    yield _sse(self._chunk(choices))
                for choice in singles:
                    yield _sse(self._chunk([choice]))
            if self.options.include_usage:
                yield _sse({**self._chunk([]), "usage": self.usage()})
        except (APIError, ValueError, EngineDeadError) as e:
            error = (e if isinstance(e, APIError) else APIError(str(e)) if isinstance(e, ValueError) else
                     engine_dead(e))
            yield _sse(error.body())
        finally:
            await outputs.aclose()
        yield "data: [DONE]\n\n"
