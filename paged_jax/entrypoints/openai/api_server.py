"""The OpenAI-compatible HTTP server (vLLM's `vllm serve`): FastAPI routes over an `AsyncLLM`.
Its command line (`python -m paged_jax.serve`) is paged_jax/entrypoints/openai/cli.py."""
from __future__ import annotations

import asyncio
import functools
import hmac
import json
import re
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import ClientDisconnect

import paged_jax
from paged_jax.entrypoints.async_llm import AsyncLLM, EngineDeadError
from paged_jax.entrypoints.openai import protocol
from paged_jax.entrypoints.openai.lora_adapters import LoRAAdapters
from paged_jax.entrypoints.openai.metrics import Metrics
from paged_jax.entrypoints.openai.protocol import APIError, DetokenizeRequest, TokenizeRequest, engine_dead
from paged_jax.entrypoints.openai.responses import Responses
from paged_jax.entrypoints.openai.serving import Serving

MAX_REQUEST_BYTES = 4 << 20  # a body past this is refused, and never held in memory
DRAIN_BYTES = 64 << 20
MAX_STORED_RESPONSES = 1024  # /v1/responses kept for previous_response_id and GET
RETRY_AFTER_S = 1  # a refused request's Retry-After: a step or a few free a batch's worth of room


async def _disconnected(receive) -> None:
    """Return once the ASGI client has gone (the request body is already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class _EventStream(StreamingResponse):
    """An SSE response that notices a client gone while it waits for the engine (starlette's own
    notices only on the next write, under ASGI 2.4): streaming and listening race, and the loser is
    cancelled, which closes the output stream and so aborts the request."""

    async def __call__(self, scope, receive, send):
        stream = asyncio.ensure_future(self.stream_response(send))
        listener = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({stream, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, listener):
                task.cancel()
            await asyncio.gather(stream, listener, return_exceptions=True)
            await self.body_iterator.aclose()
        if stream.done() and not stream.cancelled() and stream.exception() is not None:
            raise stream.exception()


async def _unless_disconnected(request: Request, work):
    """Await `work`; if the client goes first, cancel it (which aborts its requests) -> None."""
    task, listener = asyncio.ensure_future(work), asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, listener, return_exceptions=True)
    return task.result() if not task.cancelled() else None


class _APIKey:
    """vLLM's --api-key: every /v1 request needs `Authorization: Bearer KEY`; /health, /metrics,
    /version, /tokenize and /detokenize stay open (vLLM guards only /v1)."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError("Unauthorized: a valid API key is required (Authorization: Bearer KEY)",
                                 status=401, type="AuthenticationError")
                await JSONResponse(error.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


# A UTF-16 surrogate, escaped or raw: JSON allows a lone one, which no tokenizer can encode.
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def _parse_json(data: bytes) -> dict:
    """The body's JSON object, or a 400: not JSON, nested deeper than Python's recursion limit,
    a lone surrogate in a string, not an object."""
    try:
        body = json.loads(data)
    except ValueError as e:
        raise APIError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError("the request body is nested too deeply") from None
    if _SURROGATE.search(data):  # pairs (an escaped emoji) are fine: encoding finds only lone ones
        try:
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError as e:
            raise APIError(f"the request body has a lone UTF-16 surrogate in a string ({e.reason})") from None
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


async def _read_json(request: Request, limit: int, serving: Serving) -> dict:
    """The JSON object of the body, parsed on the worker pool. A body over `limit` is read to its end
    but not kept (a client that sends it whole before reading would see a reset connection, not the
    400), up to DRAIN_BYTES; past that the connection is dropped."""
    data, size = bytearray(), 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            data += chunk
        elif size > DRAIN_BYTES:
            break
    if size > limit:
        raise APIError(f"the request body of {size}{'+' if size > DRAIN_BYTES else ''} bytes is over this "
                       f"server's limit of {limit} bytes (--max-request-bytes)")
    return await serving.off_loop(_parse_json, bytes(data))


def build_app(llm: AsyncLLM, *, model_name: str, metrics: Metrics, api_key: str | None = None,
              max_request_bytes: int = MAX_REQUEST_BYTES, model_root: str | None = None,
              tool_parser=None, enable_auto_tool_choice: bool = False, warm_up=None, lora_modules=(),
              allow_runtime_lora_updating: bool = False, max_stored_responses: int = MAX_STORED_RESPONSES) -> FastAPI:
    """`warm_up`: an engine.warm_up.WarmUp running in the background: /health is 503 (with its
    progress) until it ends, while requests are served (compiling what they need if it is not
    ready yet). `lora_modules`: LoRARequests that clients name as their model;
    `allow_runtime_lora_updating`: /v1/load_lora_adapter and /v1/unload_lora_adapter add and remove them.
    `max_stored_responses`: the newest /v1/responses kept for previous_response_id and GET."""
    app = FastAPI(title="paged-jax", version=paged_jax.__version__)
    engine = llm.engine
    adapters = LoRAAdapters(lora_modules, engine)
    serving = Serving(llm, model_name, tool_parser=tool_parser, enable_auto_tool_choice=enable_auto_tool_choice,
                      adapters=adapters)
    responses = Responses(serving, max_stored_responses)

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        if e.status != 503:
            return JSONResponse(e.body(), status_code=e.status)
        metrics.refused.inc()
        return JSONResponse(e.body(), status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(RequestValidationError)
    async def invalid(_, e: RequestValidationError):  # a body its model refused (vLLM's handler too)
        error = protocol.validation_error(e)
        return JSONResponse(error.body(), status_code=400)

    @app.exception_handler(EngineDeadError)
    async def dead(_, e: EngineDeadError):
        return JSONResponse(engine_dead(e).body(), status_code=500)

    @app.exception_handler(ClientDisconnect)
    async def gone(_, e: ClientDisconnect):  # mid-upload: nobody reads the answer, nothing to log
        return Response(status_code=499)

    async def generate(request: Request, create):
        # The body is read before listening for a disconnect: both would take the same messages.
        work = create(await _read_json(request, max_request_bytes, serving))
        result = await _unless_disconnected(request, work)
        if result is None:  # the client left before the answer: nobody reads this response
            return Response(status_code=499)
        if isinstance(result, dict):
            return result
        return _EventStream(result, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, functools.partial(serving.create, chat=False))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, functools.partial(serving.create, chat=True))

    @app.post("/v1/responses")
    async def create_response(request: Request):
        return await generate(request, responses.create)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        return responses.store.get(response_id)[0]

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        return responses.store.delete(response_id)

    @app.get("/v1/models")
    async def models():
        card = dict(object="model", created=int(time.time()), owned_by="paged-jax",
                    max_model_len=engine.config.max_model_len)
        return {"object": "list", "data": [{"id": model_name, **card, "root": model_root or model_name, "parent": None}]
                + [{"id": r.lora_name, **card, "root": r.lora_path, "parent": model_name}
                   for r in list(adapters.by_name.values())]}

    if allow_runtime_lora_updating:
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request):
            body = await _read_json(request, max_request_bytes, serving)
            return PlainTextResponse(await serving.off_loop(adapters.add, body, model_name))

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request):
            return PlainTextResponse(adapters.remove(await _read_json(request, max_request_bytes, serving)))

    @app.get("/health")
    async def health():
        if llm.dead is not None:
            return Response(status_code=503)
        if warm_up is not None and not warm_up.finished:
            return JSONResponse({"status": "warming up", "programs_compiled": warm_up.done,
                                 "programs": warm_up.total}, status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": paged_jax.__version__}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = TokenizeRequest.parse(await _read_json(request, max_request_bytes, serving))
        serving.check_model(body.model)
        if body.messages is not None:
            ids = await serving.off_loop(serving.chat_prompt, body)
        else:
            if body.prompt is None or serving.tokenizer is None:
                raise APIError("prompt (a string) or messages is required, and a model with a tokenizer",
                               param="prompt")
            ids = await serving.off_loop(serving.tokenizer.encode, body.prompt,
                                         add_special_tokens=body.add_special_tokens)
        return {"count": len(ids), "max_model_len": engine.config.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = DetokenizeRequest.parse(await _read_json(request, max_request_bytes, serving))
        serving.check_model(body.model)
        tokens = body.tokens
        try:
            engine.tokenize_prompt(tokens or [0])  # the same range check as a prompt's
        except ValueError as e:
            raise APIError(str(e), param="tokens") from None
        return {"prompt": await serving.off_loop(serving.tokenizer.decode, tokens) if serving.tokenizer else ""}

    return _APIKey(app, api_key) if api_key else app
