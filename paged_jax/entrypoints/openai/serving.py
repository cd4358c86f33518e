"""`/v1/completions` and `/v1/chat/completions`: a request checked and queued, its outputs turned
into OpenAI's response, or its stream of `data:` chunks (vLLM's serving_completion.py and
serving_chat.py, in one module because the two differ only in their prompt and their shapes)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator

from paged_jax.entrypoints.async_llm import AsyncLLM, EngineBusyError, EngineDeadError
from paged_jax.entrypoints.openai import protocol
from paged_jax.entrypoints.openai.protocol import APIError, field


def busy(message: str) -> APIError:
    """vLLM's 503 when the engine cannot take more now (the handler adds Retry-After)."""
    return APIError(message, status=503, type="ServiceUnavailableError")


def engine_dead(e: EngineDeadError) -> APIError:
    return APIError(str(e), status=500, type="InternalServerError")


class Serving:
    def __init__(self, llm: AsyncLLM, model_name: str, *, workers: int = 4):
        self.llm, self.model_name = llm, model_name
        self.engine = llm.engine  # only its tokenizer and configuration are read here (thread-safe)
        self.tokenizer = self.engine.tokenizer
        # Tokenizing and chat rendering take time proportional to the prompt (a 4 MiB prompt: seconds);
        # on the event loop they would stop every stream meanwhile.
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="paged-jax-tokenize")
        self.preparing = 0  # requests being tokenized: with the engine's, at most llm.max_requests

    async def off_loop(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) on the worker pool, awaited; its exceptions are raised here."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args, **kwargs))

    # -- checking a request ---------------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise protocol.not_found(f"The model `{name}` does not exist.")

    def encode(self, prompt) -> list[int]:
        try:
            return self.engine.tokenize_prompt(prompt)[1]
        except ValueError as e:
            raise APIError(str(e), param="prompt") from None

    def check_fits(self, ids: list[int], max_tokens: int | None, params) -> None:
        """vLLM's 400 for a prompt that leaves no room for what was asked, and the engine's own
        reasons it could never serve the request (n above max_num_seqs, more blocks than the pool)."""
        limit, wanted = self.engine.config.max_model_len, max_tokens or 1
        if len(ids) + wanted > limit:
            raise APIError(f"This model's maximum context length is {limit} tokens. However, you requested "
                           f"{len(ids) + wanted} tokens ({len(ids)} in the prompt, {wanted} in the "
                           "completion).", param="max_tokens" if max_tokens else "prompt")
        reason = self.engine.unservable(ids, params)
        if reason is not None:
            raise APIError(reason, param="n" if reason.startswith("n=") else None)

    def chat_prompt(self, body: dict) -> list[int]:
        if self.tokenizer is None or getattr(self.tokenizer, "chat_template", None) is None:
            raise APIError("this model has no chat template (no chat_template in tokenizer_config.json and no "
                           "chat_template.jinja); start the server with --chat-template FILE", param="messages")
        messages = protocol.read_messages(body)
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=field(body, "add_generation_prompt", bool, True), tokenize=True)
        except ValueError as e:
            raise APIError(f"the chat template failed: {e}", param="messages") from None

    # -- one endpoint ---------------------------------------------------------------------------

    async def create(self, body: dict, *, chat: bool):
        """-> a response dict, or an async iterator of SSE lines when the request streams."""
        options = protocol.read_options(body, chat=chat)
        self.check_model(options.model)
        max_tokens = protocol.requested_max_tokens(body, chat=chat)
        params = protocol.read_sampling_params(body, max_tokens=max_tokens, options=options)
        if params.n > self.engine.config.max_num_seqs:  # before the KV-cache check, which n also fails
            raise APIError(f"n={params.n} samples exceed this server's max_num_seqs="
                           f"{self.engine.config.max_num_seqs}", param="n")
        texts = None if chat else protocol.read_prompts(body)
        count, limit = 1 if chat else len(texts), self.llm.max_requests
        if count > limit:  # could never be admitted: a 400, not a retry
            raise APIError(f"a request may hold at most {limit} prompts (this server's limit of unfinished "
                           f"requests), got {count}", param="prompt")
        if self.preparing + self.llm.num_unfinished + count > limit:
            raise busy(f"the server has {self.llm.num_unfinished + self.preparing} requests in progress, its "
                       f"limit is {limit}: retry later")
        self.preparing += count
        try:
            prompts = await self.off_loop(self._prompts, body, texts, max_tokens, params)
        finally:
            self.preparing -= count
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        response = _Response(self, request_id, chat, params.n, prompts, options,
                             token_ids_as_tokens=field(body, "return_tokens_as_token_ids", bool, False))
        try:
            streams = self.llm.generate_many([(f"{request_id}-{i}", ids) for i, ids in enumerate(prompts)],
                                             params, cache_salt=options.cache_salt)
        except EngineBusyError as e:
            raise busy(str(e)) from None
        except EngineDeadError as e:
            raise engine_dead(e) from None
        if options.stream:
            return response.events(_merge(streams))
        try:
            async for i, out in _merge(streams):
                response.add(i, out)
        except ValueError as e:  # the engine refused the request when it was queued
            raise APIError(str(e)) from None
        except EngineDeadError as e:
            raise engine_dead(e) from None
        return response.body()

    def _prompts(self, body: dict, texts: list | None, max_tokens: int | None, params) -> list[list[int]]:
        """The request's prompts as token ids, each checked to fit (on the worker pool)."""
        prompts = [self.chat_prompt(body)] if texts is None else [self.encode(p) for p in texts]
        for ids in prompts:
            self.check_fits(ids, max_tokens, params)
        return prompts


async def _merge(streams) -> AsyncIterator[tuple[int, object]]:
    """(prompt index, output) from several requests' streams as they come. Closing this closes
    them all (their requests are aborted)."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001  raised again on the reading side
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        for _ in range(len(tasks)):
            while True:
                i, item = await queue.get()
                if item is None:
                    break
                if isinstance(item, Exception):
                    raise item
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _prompt_logprobs_json(entries):
    """vLLM's prompt_logprobs body: None for the first token, then {token id: {logprob, rank, decoded_token}}."""
    if entries is None:
        return None
    return [None if entry is None else {str(t): dataclasses.asdict(lp) for t, lp in entry.items()}
            for entry in entries]


def _sse(payload) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _Response:
    """One request's choices as they accumulate, in OpenAI's completion or chat shapes."""

    def __init__(self, serving: Serving, request_id: str, chat: bool, n: int, prompts, options, *,
                 token_ids_as_tokens: bool):
        self.serving, self.id, self.chat, self.n, self.prompts = serving, request_id, chat, n, prompts
        self.options = options
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
            else:
                choice["text"] = text
                if self.options.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = _prompt_logprobs_json(self.prompt_logprobs[index // self.n])
            choices.append(choice)
        body = {"id": self.id, "object": self.object, "created": self.created, "model": self.serving.model_name,
                "choices": choices, "usage": self.usage()}
        if self.chat and self.options.prompt_logprobs is not None:  # vLLM puts chat's on the response
            body["prompt_logprobs"] = _prompt_logprobs_json(self.prompt_logprobs[0])
        return body

    def _chunk(self, choices) -> dict:
        return {"id": self.id, "object": self.object + (".chunk" if self.chat else ""), "created": self.created,
                "model": self.serving.model_name, "choices": choices}

    async def events(self, outputs) -> AsyncIterator[str]:
        """SSE lines: a chunk per choice that has new text (or finished), `finish_reason` once on each
        choice's last chunk, the usage chunk if asked, then `[DONE]`; an error as an error chunk."""
        try:
            if self.chat:  # OpenAI's first chunk of each choice carries the role
                yield _sse(self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None} for i in range(len(self.text))]))
            async for i, out in outputs:
                choices = []
                for index, new, logprobs, c in self.add(i, out):
                    if not new and not c.token_ids and c.finish_reason is None:
                        continue
                    choice = {"index": index, "logprobs": logprobs, "finish_reason": c.finish_reason,
                              "stop_reason": c.stop_reason}
                    choice.update({"delta": {"content": new}} if self.chat else {"text": new})
                    choices.append(choice)
                if choices:
                    yield _sse(self._chunk(choices))
            if self.options.include_usage:
                yield _sse({**self._chunk([]), "usage": self.usage()})
        except (APIError, ValueError, EngineDeadError) as e:
            error = (e if isinstance(e, APIError) else APIError(str(e)) if isinstance(e, ValueError) else
                     engine_dead(e))
            yield _sse(error.body())
        finally:
            await outputs.aclose()
        yield "data: [DONE]\n\n"
