"""The OpenAI-compatible HTTP server (vLLM's `vllm serve`): FastAPI routes over an `AsyncLLM`.

    python -m paged_jax.serve [--model DIR|FILE.gguf] [--host 127.0.0.1] [--port 8000] [engine flags]
    python -m paged_jax.serve --coordinator HOST0:PORT --num-processes N --process-id I [same flags]

With several processes (jax.distributed, tensor parallelism over the devices of all of them), every
process builds and warms up the same engine; process 0 serves HTTP and the others follow its steps
(paged_jax.entrypoints.step_broadcast).
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import importlib
import json
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import ClientDisconnect

import paged_jax
from paged_jax.entrypoints.async_llm import AsyncLLM, EngineDeadError
from paged_jax.entrypoints.openai.metrics import Metrics
from paged_jax.entrypoints.openai.protocol import APIError, field
from paged_jax.entrypoints.openai.serving import Serving, engine_dead
from paged_jax.entrypoints.step_broadcast import StepReceiver, StepSender, follow, summary
from paged_jax.worker import distributed

MAX_REQUEST_BYTES = 4 << 20  # a body past this is refused, and never held in memory
DRAIN_BYTES = 64 << 20
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
              max_request_bytes: int = MAX_REQUEST_BYTES, model_root: str | None = None) -> FastAPI:
    app = FastAPI(title="paged-jax", version=paged_jax.__version__)
    serving = Serving(llm, model_name)
    engine = llm.engine

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        if e.status != 503:
            return JSONResponse(e.body(), status_code=e.status)
        metrics.refused.inc()
        return JSONResponse(e.body(), status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(EngineDeadError)
    async def dead(_, e: EngineDeadError):
        return JSONResponse(engine_dead(e).body(), status_code=500)

    @app.exception_handler(ClientDisconnect)
    async def gone(_, e: ClientDisconnect):  # mid-upload: nobody reads the answer, nothing to log
        return Response(status_code=499)

    async def generate(request: Request, chat: bool):
        # The body is read before listening for a disconnect: both would take the same messages.
        work = serving.create(await _read_json(request, max_request_bytes, serving), chat=chat)
        result = await _unless_disconnected(request, work)
        if result is None:  # the client left before the answer: nobody reads this response
            return Response(status_code=499)
        if isinstance(result, dict):
            return result
        return _EventStream(result, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": int(time.time()), "owned_by": "paged-jax",
            "root": model_root or model_name, "parent": None, "max_model_len": engine.config.max_model_len}]}

    @app.get("/health")
    async def health():
        return Response(status_code=200 if llm.dead is None else 503)

    @app.get("/version")
    async def version():
        return {"version": paged_jax.__version__}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _read_json(request, max_request_bytes, serving)
        serving.check_model(field(body, "model", str))
        if "messages" in body:
            ids = await serving.off_loop(serving.chat_prompt, body)
        else:
            prompt = field(body, "prompt", str)
            if prompt is None or serving.tokenizer is None:
                raise APIError("prompt (a string) or messages is required, and a model with a tokenizer",
                               param="prompt")
            ids = await serving.off_loop(serving.tokenizer.encode, prompt,
                                         add_special_tokens=field(body, "add_special_tokens", bool, True))
        return {"count": len(ids), "max_model_len": engine.config.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await _read_json(request, max_request_bytes, serving)
        serving.check_model(field(body, "model", str))
        tokens = field(body, "tokens", list)
        if tokens is None or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise APIError(f"tokens must be a list of token ids, got {body.get('tokens')!r}", param="tokens")
        try:
            engine.tokenize_prompt(tokens or [0])  # the same range check as a prompt's
        except ValueError as e:
            raise APIError(str(e), param="tokens") from None
        return {"prompt": await serving.off_loop(serving.tokenizer.decode, tokens) if serving.tokenizer else ""}

    return _APIKey(app, api_key) if api_key else app


# -- the command line --------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="paged-jax-serve", description="An OpenAI-compatible server (vLLM's flags).")
    ap.add_argument("--model", help="checkpoint directory or GGUF file (default: the embedded model)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=_port, default=8000)
    ap.add_argument("--served-model-name", help="the name clients ask for (default: --model as given)")
    for flag, kind in (("--block-size", int), ("--num-blocks", int), ("--max-num-seqs", int),
                       ("--max-model-len", int), ("--max-num-batched-tokens", int), ("--num-decode-steps", int),
                       ("--gpu-memory-utilization", float), ("--seed", int)):
        ap.add_argument(flag, type=kind, help="default: the engine's")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), help="default: the checkpoint's")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--kv-cache-dtype", default="auto", help='"auto" (the model\'s dtype), "int8" or "fp8_e4m3"')
    ap.add_argument("--preemption-mode", default="recompute", help='"recompute" or "swap" (to host memory)')
    ap.add_argument("--swap-space", type=float, default=4,
                    help="GiB of host memory for swapped blocks and the host prefix cache")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                    help="plan the next decode call while the device runs this one (vLLM's; default: on)")
    ap.add_argument("--enable-host-prefix-cache", action="store_true",
                    help="keep the prefix cache's evicted blocks in that host memory")
    ap.add_argument("--api-key", default=os.environ.get("PAGED_JAX_API_KEY"),
                    help="require `Authorization: Bearer KEY` on /v1 (default: $PAGED_JAX_API_KEY)")
    ap.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template instead of the model's")
    ap.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES)
    ap.add_argument("--max-waiting-requests", type=int, metavar="N",
                    help="requests that may wait beside a full batch of max-num-seqs; past them a request "
                         "gets 503 with Retry-After (default: 4 * max-num-seqs)")
    ap.add_argument("--compilation-cache-dir", metavar="DIR", help="jax's persistent compilation cache")
    ap.add_argument("--no-compilation-cache", action="store_true")
    ap.add_argument("--warmup-prompt-len", type=int, default=32,
                    help="compile, before serving, what up to max-num-seqs prompts of this length need "
                         "(LLMEngine.warm_up; 0: compile on first use)")
    ap.add_argument("--uvicorn-log-level", default="info")
    distributed.add_cli_flags(ap)
    return ap.parse_args(argv)


def _port(text: str) -> int:
    port = int(text)
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"a port is in [1, 65535], got {port}")
    return port


def _check_port_free(host: str, port: int) -> None:
    """A port in use is said now, not after minutes of loading and warm-up (uvicorn binds it later)."""
    try:
        socket.create_server((host, port)).close()
    except OSError as e:
        fail(f"cannot listen on {host}:{port}: {e.strerror or e}")


def embedded_model() -> Path:
    return Path(importlib.import_module("models").__file__).parent / "embedded"


def fail(message: str):
    """One line on stderr and exit status 2; the other processes of a job stop too, not at a timeout."""
    print(f"paged-jax-serve: error: {message}", file=sys.stderr)
    distributed.exit_after_error(2)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        fail(f"--max-waiting-requests must be >= 0, got {args.max_waiting_requests}")
    if args.process_id == 0:
        _check_port_free(args.host, args.port)
    model = args.model or str(embedded_model())
    llm = _build(args, model)
    if args.process_id == 0:
        _serve(args, llm, model)
    else:
        _follow(args, llm.engine)


def _build(args, model: str):
    """The engine, the same on every process of a job (each one's steps are a program across all)."""
    from paged_jax import LLM, compilation_cache

    try:
        distributed.initialize_from_args(args)  # before anything touches a device
    except ValueError as e:
        fail(str(e))
    if not args.no_compilation_cache:
        compilation_cache.enable(args.compilation_cache_dir)
    engine_args = {k: getattr(args, k) for k in ("block_size", "num_blocks", "max_num_seqs", "max_model_len",
                                                 "max_num_batched_tokens", "num_decode_steps",
                                                 "gpu_memory_utilization", "seed") if getattr(args, k) is not None}
    try:
        llm = LLM(model, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size,
                  enable_prefix_caching=args.enable_prefix_caching, kv_cache_dtype=args.kv_cache_dtype,
                  preemption_mode=args.preemption_mode, swap_space=args.swap_space,
                  enable_host_prefix_cache=args.enable_host_prefix_cache, async_scheduling=args.async_scheduling,
                  log_stats=args.process_id == 0, **engine_args)
        tokenizer = llm.get_tokenizer()
        if args.chat_template:
            if tokenizer is None:
                raise ValueError(f"--chat-template needs a tokenizer; {model} has no tokenizer.json")
            tokenizer.chat_template = Path(args.chat_template).read_text(encoding="utf-8")
        if args.warmup_prompt_len:
            c = llm.engine.config
            done = llm.engine.warm_up(max(1, min(args.warmup_prompt_len, c.max_model_len - 2 * c.num_decode_steps - 1)))
            print(f"paged-jax-serve: warm-up compiled {done['programs']} programs ({done['cached']} read from "
                  f"the compilation cache) in {done['seconds']:.1f} s", flush=True)
    except (OSError, ValueError) as e:
        fail(str(e))
    return llm


def _follow(args, engine) -> None:
    """A follower: no HTTP, process 0's steps replayed until it stops serving."""
    receiver = StepReceiver(args.num_processes, args.process_id, args.distributed_timeout)
    print(f"paged-jax-serve: process {args.process_id} of {args.num_processes} follows process 0's steps", flush=True)
    steps = follow(engine, receiver)
    print(f"paged-jax-serve: process {args.process_id} stopped with process 0 after {summary(engine, steps)}",
          flush=True)


def _serve(args, llm, model: str) -> None:
    import uvicorn

    followers = None
    if args.num_processes > 1:
        host, _ = distributed.parse_coordinator(args.coordinator)
        followers = StepSender(host, args.num_processes, args.distributed_timeout)
    name = args.served_model_name or (args.model or "embedded")
    metrics = Metrics(name)
    seqs = llm.engine.config.max_num_seqs
    waiting = 4 * seqs if args.max_waiting_requests is None else args.max_waiting_requests
    async_llm = AsyncLLM(llm.engine, on_step=metrics.on_step, followers=followers, max_requests=seqs + waiting)
    app = build_app(async_llm, model_name=name, metrics=metrics, api_key=args.api_key,
                    max_request_bytes=args.max_request_bytes, model_root=model)
    print(f"paged-jax-serve: serving {name!r} on http://{args.host}:{args.port}", flush=True)
    # uvicorn stops gracefully on SIGINT or SIGTERM and then raises the signal again, under the
    # handlers it found: ignored, so that the shutdown below runs (a job's followers need its stop
    # message) and the server exits 0.
    found = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    finally:
        for sig, handler in found.items():
            signal.signal(sig, handler)
        async_llm.shutdown()
        if followers is not None:
            print(f"paged-jax-serve: process 0 stopped its followers after {summary(llm.engine, followers.steps)}",
                  flush=True)
