"""`/v1/completions` and `/v1/chat/completions`: a request checked and queued, its outputs turned
into OpenAI's response, or its stream of `data:` chunks (vLLM's serving_completion.py and
serving_chat.py, in one module because the two differ only in their prompt and their shapes; the
response itself is response.py)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import uuid
from collections.abc import AsyncIterator

from paged_jax.entrypoints.async_llm import AsyncLLM, EngineBusyError, EngineDeadError
from paged_jax.entrypoints.openai import protocol
from paged_jax.entrypoints.openai.lora_adapters import LoRAAdapters
from paged_jax.entrypoints.openai.protocol import APIError, ChatCompletionRequest, CompletionRequest, busy, engine_dead
from paged_jax.entrypoints.openai.response import ChoicesResponse
from paged_jax.entrypoints.openai.tool_calling import ToolCalling, template_messages


class Serving:
    def __init__(self, llm: AsyncLLM, model_name: str, *, workers: int = 4, tool_parser=None,
                 enable_auto_tool_choice: bool = False, adapters: LoRAAdapters | None = None):
        self.llm, self.model_name = llm, model_name
        self.adapters = adapters or LoRAAdapters(())  # LoRA adapters, asked for as models
        self.tool_parser, self.enable_auto_tool_choice = tool_parser, enable_auto_tool_choice
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

    def check_model(self, name: str | None):
        """-> the LoRARequest a request's model names, None for the base model (404 for another)."""
        if name is None or name == self.model_name:
            return None
        adapter = self.adapters.get(name)
        if adapter is None:
            raise protocol.not_found(f"The model `{name}` does not exist.")
        return adapter

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

    def chat_prompt(self, request, tools: ToolCalling | None = None) -> list[int]:
        """The token ids of a request's `messages` rendered by the chat template (a chat request, or
        a /tokenize request with messages)."""
        if self.tokenizer is None or getattr(self.tokenizer, "chat_template", None) is None:
            raise APIError("this model has no chat template (no chat_template in tokenizer_config.json and no "
                           "chat_template.jinja); start the server with --chat-template FILE", param="messages")
        messages = protocol.read_messages(request.messages)
        try:
            return self.tokenizer.apply_chat_template(
                template_messages(messages), add_generation_prompt=request.add_generation_prompt,
                tokenize=True, **({"tools": tools.tools} if tools is not None else {}))
        except ValueError as e:
            raise APIError(f"the chat template failed: {e}", param="messages") from None

    # -- one endpoint ---------------------------------------------------------------------------

    async def create(self, body: dict, *, chat: bool):
        """-> a response dict, or an async iterator of SSE lines when the request streams.
        RequestValidationError when the body does not fit its model (OpenAI's 400 naming the field)."""
        request = await self.off_loop((ChatCompletionRequest if chat else CompletionRequest).parse, body)
        response, outputs = await self.submit(request)
        if response.options.stream:
            return response.events(outputs)
        await self.collect(response, outputs)
        return response.body()

    async def submit(self, request: ChatCompletionRequest | CompletionRequest):
        """Check a parsed request and queue its prompts -> (its ChoicesResponse, the merged outputs:
        an async iterator of (prompt index, RequestOutput); closing it aborts the requests)."""
        chat = isinstance(request, ChatCompletionRequest)
        options = protocol.read_options(request)
        lora = self.check_model(options.model)
        max_tokens = protocol.requested_max_tokens(request)
        params = protocol.read_sampling_params(request, max_tokens=max_tokens, options=options)
        if params.n > self.engine.config.max_num_seqs:  # before the KV-cache check, which n also fails
            raise APIError(f"n={params.n} samples exceed this server's max_num_seqs="
                           f"{self.engine.config.max_num_seqs}", param="n")
        texts = None if chat else protocol.read_prompts(request)
        count, limit = 1 if chat else len(texts), self.llm.max_requests
        if count > limit:  # could never be admitted: a 400, not a retry
            raise APIError(f"a request may hold at most {limit} prompts (this server's limit of unfinished "
                           f"requests), got {count}", param="prompt")
        if self.preparing + self.llm.num_unfinished + count > limit:
            raise busy(f"the server has {self.llm.num_unfinished + self.preparing} requests in progress, its "
                       f"limit is {limit}: retry later")
        self.preparing += count
        try:
            prompts, params, tools = await self.off_loop(self._prepare, request, texts, max_tokens, params)
        finally:
            self.preparing -= count
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        response = ChoicesResponse(self, request_id, chat, params.n, prompts, options, tools=tools,
                                   token_ids_as_tokens=request.return_tokens_as_token_ids)
        try:
            streams = self.llm.generate_many([(f"{request_id}-{i}", ids) for i, ids in enumerate(prompts)],
                                             params, cache_salt=options.cache_salt, lora_request=lora)
        except EngineBusyError as e:
            raise busy(str(e)) from None
        except EngineDeadError as e:
            raise engine_dead(e) from None
        return response, _merge(streams)

    @staticmethod
    async def collect(response: ChoicesResponse, outputs) -> None:
        """Every output of a request that does not stream, into its response."""
        try:
            async for i, out in outputs:
                response.add(i, out)
        except ValueError as e:  # the engine refused the request when it was queued
            raise APIError(str(e)) from None
        except EngineDeadError as e:
            raise engine_dead(e) from None
        finally:
            await outputs.aclose()

    def _prepare(self, request, texts: list | None, max_tokens: int | None, params):
        """On the worker pool: the request's tools (chat), its prompts as token ids, each checked to
        fit, and its grammar checked (a schema can be large) -> (prompts, params with the tools'
        grammar, ToolCalling or None)."""
        chat = texts is None
        tools = ToolCalling.from_request(request, parser=self.tool_parser, auto=self.enable_auto_tool_choice) if chat else None
        grammar_field = None if params.structured_outputs is None else protocol.structured_outputs_field(request)
        if tools is not None and tools.structured_outputs is not None:
            if params.structured_outputs is not None:
                raise APIError(f"tool_choice {tools.tool_choice!r} is a structured output: it cannot be combined "
                               f"with {grammar_field}", param="tool_choice")
            params, grammar_field = dataclasses.replace(params, structured_outputs=tools.structured_outputs), "tool_choice"
        prompts = [self.chat_prompt(request, tools)] if chat else [self.encode(p) for p in texts]
        for ids in prompts:
            self.check_fits(ids, max_tokens, params)
        if params.structured_outputs is not None:  # a 400 now, not a failed request later
            try:
                self.engine.structured_outputs.validate(params.structured_outputs)
            except ValueError as e:
                raise APIError(str(e), param=grammar_field) from None
        return prompts, params, tools


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
