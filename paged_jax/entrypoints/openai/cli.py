"""The server's command line (vLLM's `vllm serve`):

    python -m paged_jax.serve [--model DIR|FILE.gguf] [--host 127.0.0.1] [--port 8000] [engine flags]
    python -m paged_jax.serve --coordinator HOST0:PORT --num-processes N --process-id I [same flags]

With several processes (jax.distributed, tensor parallelism over the devices of all of them), every
process builds and warms up the same engine; process 0 serves HTTP (api_server.build_app) and the
others follow its steps (paged_jax.entrypoints.step_broadcast). The warm-up compiles in the
background: the server listens and serves at once, and /health answers 503 until it is done.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import os
import signal
import socket
import threading
from pathlib import Path

from paged_jax.engine.arg_utils import EngineArgs
from paged_jax.engine.warm_up import WarmUp, max_prompt_len
from paged_jax.entrypoints import cli_args
from paged_jax.entrypoints.async_llm import AsyncLLM
from paged_jax.entrypoints.openai.api_server import MAX_REQUEST_BYTES, MAX_STORED_RESPONSES, build_app
from paged_jax.entrypoints.openai.metrics import Metrics
from paged_jax.entrypoints.step_broadcast import StepReceiver, StepSender, follow, summary
from paged_jax.lora.request import parse_lora_modules
from paged_jax.worker import distributed


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="paged-jax-serve", description="An OpenAI-compatible server (vLLM's flags).")
    ap.add_argument("--model", help="checkpoint directory or GGUF file (default: the embedded model)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=_port, default=8000)
    ap.add_argument("--served-model-name", help="the name clients ask for (default: --model as given)")
    ap.add_argument("--api-key", default=os.environ.get("PAGED_JAX_API_KEY"),
                    help="require `Authorization: Bearer KEY` on /v1 (default: $PAGED_JAX_API_KEY)")
    ap.add_argument("--tokenizer", metavar="PATH", help="a checkpoint directory or GGUF file whose tokenizer "
                                                        "replaces the model's (e.g. a GGUF's base model)")
    ap.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template instead of the model's")
    ap.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES)
    ap.add_argument("--max-waiting-requests", type=int, metavar="N",
                    help="requests that may wait beside a full batch of max-num-seqs; past them a request "
                         "gets 503 with Retry-After (default: 4 * max-num-seqs)")
    ap.add_argument("--max-stored-responses", type=int, default=MAX_STORED_RESPONSES, metavar="N",
                    help="/v1/responses kept in memory for previous_response_id and GET, the oldest dropped "
                         "first (0: none is stored)")
    ap.add_argument("--compilation-cache-dir", metavar="DIR", help="jax's persistent compilation cache")
    ap.add_argument("--no-compilation-cache", action="store_true")
    ap.add_argument("--warmup-prompt-len", type=int, default=32,
                    help="compile what up to max-num-seqs prompts of this length need, in the background "
                         "while the server already serves; /health is 503 until it ends "
                         "(engine/warm_up.py; 0: compile on first use)")
    ap.add_argument("--uvicorn-log-level", default="info")
    ap.add_argument("--enable-auto-tool-choice", action="store_true",
                    help='tool_choice "auto": the model decides, and --tool-call-parser reads its calls')
    ap.add_argument("--tool-call-parser", metavar="NAME",
                    help="how the model writes tool calls: hermes (<tool_call>{...}</tool_call>: Qwen 2.5/3, "
                         "Hermes) or llama3_json (Llama 3.1-3.3)")
    ap.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                    help='LoRA adapters clients ask for by name as their model (PEFT directories; NAME=PATH or '
                         '{"name": NAME, "path": PATH}; needs --enable-lora)')
    ap.add_argument("--allow-runtime-lora-updating", action="store_true",
                    help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter add and remove adapters")
    EngineArgs.add_cli_args(ap)
    cli_args.add_distributed_args(ap)
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
    cli_args.fail("paged-jax-serve", message)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        fail(f"--max-waiting-requests must be >= 0, got {args.max_waiting_requests}")
    if args.max_stored_responses < 0:
        fail(f"--max-stored-responses must be >= 0, got {args.max_stored_responses}")
    if args.tool_call_parser is not None:
        from paged_jax.structured_output.tool_parsers import get_tool_parser

        try:
            args.tool_call_parser = get_tool_parser(args.tool_call_parser)
        except ValueError as e:
            fail(f"--tool-call-parser: {e}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        fail("--enable-auto-tool-choice needs --tool-call-parser")
    try:
        args.lora_modules = parse_lora_modules(args.lora_modules)
    except ValueError as e:
        fail(f"--lora-modules: {e}")
    for flag in ("lora_modules", "allow_runtime_lora_updating"):
        if getattr(args, flag) and not args.enable_lora:
            fail(f"--{flag.replace('_', '-')} needs --enable-lora")
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
        engine_args = EngineArgs.from_cli_args(args, log_stats=args.process_id == 0)
        cli_args.initialize_distributed(args)  # before anything touches a device
    except ValueError as e:
        fail(str(e))
    if not args.no_compilation_cache:
        compilation_cache.enable(args.compilation_cache_dir)
    try:
        llm = LLM(model, tokenizer=args.tokenizer, **engine_args.kwargs())
        for lora in args.lora_modules:  # read at start: a bad adapter stops the server now
            llm.engine.add_lora(lora)
        tokenizer = llm.get_tokenizer()
        if args.chat_template:
            if tokenizer is None:
                raise ValueError(f"--chat-template needs a tokenizer; {model} has no tokenizer.json")
            tokenizer.chat_template = Path(args.chat_template).read_text(encoding="utf-8")
    except (OSError, ValueError) as e:
        fail(str(e))
    return llm


def _warm_up(args, engine) -> WarmUp | None:
    """The warm-up's compilations started in the background (the server listens meanwhile and
    /health answers 503 until they end), and a line when they end."""
    if not args.warmup_prompt_len:
        return None
    warming = WarmUp(engine, max(1, min(args.warmup_prompt_len, max_prompt_len(engine.config)))).start()

    def report():
        try:
            done = warming.wait()
        except concurrent.futures.CancelledError:  # the server stopped first
            return
        except Exception as e:  # noqa: BLE001  the engine still compiles what it needs when it needs it
            print(f"paged-jax-serve: warm-up failed, programs compile when first needed: {e!r}", flush=True)
            return
        print(f"paged-jax-serve: warm-up compiled {done['programs']} programs ({done['cached']} read from "
              f"the compilation cache) in {done['seconds']:.1f} s", flush=True)

    threading.Thread(target=report, name="paged-jax-warm-up-report", daemon=True).start()
    return warming


def _follow(args, engine) -> None:
    """A follower: no HTTP, process 0's steps replayed until it stops serving."""
    receiver = StepReceiver(args.num_processes, args.process_id, args.distributed_timeout)
    warming = _warm_up(args, engine)
    print(f"paged-jax-serve: process {args.process_id} of {args.num_processes} follows process 0's steps", flush=True)
    try:
        steps = follow(engine, receiver)
    finally:
        if warming is not None:
            warming.cancel()
    print(f"paged-jax-serve: process {args.process_id} stopped with process 0 after {summary(engine, steps)}",
          flush=True)


def _serve(args, llm, model: str) -> None:
    import uvicorn

    followers = None
    if args.num_processes > 1:
        host, _ = distributed.parse_coordinator(args.coordinator)
        followers = StepSender(host, args.num_processes, args.distributed_timeout)
    name = args.served_model_name or (args.model or "embedded")
    metrics = Metrics(name, llm.engine.config.num_speculative_tokens)
    seqs = llm.engine.config.max_num_seqs
    waiting = 4 * seqs if args.max_waiting_requests is None else args.max_waiting_requests
    async_llm = AsyncLLM(llm.engine, on_step=metrics.on_step, followers=followers, max_requests=seqs + waiting)
    warming = _warm_up(args, llm.engine)
    app = build_app(async_llm, model_name=name, metrics=metrics, api_key=args.api_key,
                    max_request_bytes=args.max_request_bytes, model_root=model, tool_parser=args.tool_call_parser,
                    enable_auto_tool_choice=args.enable_auto_tool_choice, warm_up=warming,
                    lora_modules=args.lora_modules, allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                    max_stored_responses=args.max_stored_responses)
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
        if warming is not None:
            warming.cancel()
        async_llm.shutdown()
        if followers is not None:
            print(f"paged-jax-serve: process 0 stopped its followers after {summary(llm.engine, followers.steps)}",
                  flush=True)
