"""`AsyncLLM`: an `LLMEngine` driven by one background thread, for servers (vLLM's AsyncLLM).

The thread owns the engine: nothing else touches it. Callers on an asyncio loop send requests and
aborts through a queue; the thread applies them between steps, runs `step()` while any request is
unfinished, and hands each request's outputs (`RequestOutputKind.DELTA`: only what is new) to its
caller's asyncio queue. It sleeps on an event while idle, so an idle server costs nothing. A step
runs on the thread, not the event loop: HTTP handlers never wait behind the device. In a server of
several processes, the thread also sends each step's applied commands to the other processes before
the step (paged_jax.entrypoints.step_broadcast), which replay them.

Every queue is bounded. At most `max_requests` requests are unfinished at once (a request counts from
`generate` until the engine thread has finished or dropped it): past that `generate` raises
`EngineBusyError` at once, so the command queue and the scheduler's waiting list hold at most that
many adds. Each request's output queue holds at most one item per step of that request, so its
`max_tokens`. An engine that dies fails every request it holds and every add still queued, and
later calls at once: no caller waits forever.
"""
from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
from collections.abc import AsyncIterator, Callable

from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.engine.outputs import RequestOutput
from paged_jax.sampling_params import RequestOutputKind, SamplingParams
from paged_jax.entrypoints.step_broadcast import StepSender


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an exception; every request then fails with this."""


class EngineBusyError(RuntimeError):
    """`max_requests` requests are unfinished already: the caller should retry later (HTTP 503)."""


@dataclasses.dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)


class AsyncLLM:
    def __init__(self, engine: LLMEngine, *, on_step: Callable[[LLMEngine, list[RequestOutput]], None] | None = None,
                 followers: StepSender | None = None, max_requests: int | None = None):
        """`on_step(engine, outputs)` runs on the engine thread after every step (metrics read the
        engine there, where its state is consistent). `followers`: the other processes of a
        multi-process server, told of every step before it runs and stopped at `shutdown`.
        `max_requests`: unfinished requests at most (default: 5 * max_num_seqs, the server's default
        of 4 * max_num_seqs waiting beside a full batch)."""
        self.engine = engine
        self.on_step = on_step
        self.followers = followers
        self.max_requests = 5 * engine.config.max_num_seqs if max_requests is None else max_requests
        if self.max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        self.dead: BaseException | None = None
        self._unfinished = 0  # requests counted against max_requests; changed under _lock
        self._lock = threading.Lock()  # orders an add against the engine's death (see _fail_all)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="paged-jax-engine", daemon=True)
        self._thread.start()

    def generate(self, request_id: str, prompt, params: SamplingParams, *, cache_salt: str | None = None,
                 lora_request=None) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come, the last one `finished`. The request is queued by this
        call (EngineDeadError, EngineBusyError raised here); leaving the iteration early (a client
        gone, a cancelled task) aborts it, which frees its blocks at once."""
        return self.generate_many([(request_id, prompt)], params, cache_salt=cache_salt, lora_request=lora_request)[0]

    def generate_many(self, requests: list[tuple[str, object]], params: SamplingParams, *,
                      cache_salt: str | None = None, lora_request=None) -> list[AsyncIterator[RequestOutput]]:
        """`generate` for each (request id, prompt), all queued or none (a list prompt's requests)."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead!r}")
        params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        loop = asyncio.get_running_loop()
        sinks = [_Sink(loop, asyncio.Queue()) for _ in requests]
        with self._lock:
            if self.dead is not None:
                raise EngineDeadError(f"the engine stopped: {self.dead!r}")
            if self._unfinished + len(requests) > self.max_requests:
                raise EngineBusyError(f"the server has {self._unfinished} unfinished requests, its limit "
                                      f"is {self.max_requests}: retry later")
            self._unfinished += len(requests)
            for (request_id, prompt), sink in zip(requests, sinks):
                self._send(("add", request_id, prompt, params, cache_salt, lora_request, sink))
        return [self._outputs(request_id, sink) for (request_id, _), sink in zip(requests, sinks)]

    def _release(self, count: int) -> None:
        with self._lock:
            self._unfinished -= count

    @property
    def num_unfinished(self) -> int:
        return self._unfinished

    async def _outputs(self, request_id: str, sink: _Sink) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await sink.outputs.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine dropped it (refused or dead): nothing to abort
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join()
        if self.followers is not None:  # after the thread's last step: no step can follow the stop
            self.followers.stop()

    def _send(self, command) -> None:
        self._commands.put(command)
        self._wake.set()

    # -- the engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                self._wake.clear()  # before draining: a command sent after the drain sets it again
                if self._stop:  # read after the clear: a shutdown's wake-up cannot be cleared unseen
                    return
                changed, applied = self._apply_commands()
                if changed or self.engine.has_unfinished_requests():
                    if self.followers is not None:
                        self.followers.send_step(applied)
                    self._deliver(self.engine.step())
                else:
                    self._wake.wait()
        except BaseException as e:  # noqa: BLE001  reported to every caller, not lost in a thread
            self._fail_all(e)
            raise

    def _fail_all(self, cause: BaseException) -> None:
        """Every request held and every add still queued gets the error. Under the lock `generate`
        queues under: an add is either queued before `dead` is set (and failed here) or sees it."""
        error = EngineDeadError(f"the engine stopped: {cause!r}")
        with self._lock:
            self.dead = cause
            sinks = list(self._sinks.values())
            self._sinks.clear()
            while True:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                if command[0] == "add":
                    sinks.append(command[-1])
            self._unfinished = 0
        for sink in sinks:
            sink.put(error)

    def _apply_commands(self) -> tuple[bool, list[tuple]]:
        """-> (whether any command came, the ones the engine took, in order). Only those are
        replayed by followers: an add the engine refused changed nothing to replay."""
        changed, applied = False, []
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return changed, applied
            changed = True
            if command[0] == "abort":
                # A request aborted before the thread saw it added was never added (nothing to free).
                if self._sinks.pop(command[1], None) is not None:
                    self._release(1)
                    self.engine.abort_request(command[1])
                    applied.append(command)
                continue
            _, request_id, prompt, params, cache_salt, lora_request, sink = command
            try:
                if request_id in self._sinks:  # the engine would refuse it too, after we replaced its sink
                    raise ValueError(f"request id {request_id!r} is already in use")
                self._sinks[request_id] = sink  # first: an engine that dies inside add_request fails it too
                self.engine.add_request(request_id, prompt, params, cache_salt=cache_salt, lora_request=lora_request)
            except ValueError as e:
                if self._sinks.get(request_id) is sink:
                    del self._sinks[request_id]
                self._release(1)
                sink.put(e)
                continue
            applied.append(command[:6])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:  # aborted by its caller, who no longer listens
                continue
            if out.finished:
                del self._sinks[out.request_id]
                self._release(1)
            sink.put(out)
        if self.on_step is not None:
            self.on_step(self.engine, outputs)
