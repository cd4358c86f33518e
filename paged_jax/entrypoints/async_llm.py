"""`AsyncLLM`: an `LLMEngine` driven by one background thread, for servers (vLLM's AsyncLLM).

The thread owns the engine: nothing else touches it. Callers on an asyncio loop send requests and
aborts through a queue; the thread applies them between steps, runs `step()` while any request is
unfinished, and hands each request's outputs (`RequestOutputKind.DELTA`: only what is new) to its
caller's asyncio queue. It sleeps on an event while idle, so an idle server costs nothing. A step
runs on the thread, not the event loop: HTTP handlers never wait behind the device. In a server of
several processes, the thread also sends each step's applied commands to the other processes before
the step (paged_jax.entrypoints.step_broadcast), which replay them.
"""
from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
from collections.abc import AsyncIterator, Callable

from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.engine.outputs import RequestOutput
from paged_jax.engine.sampling_params import RequestOutputKind, SamplingParams
from paged_jax.entrypoints.step_broadcast import StepSender


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an exception; every request then fails with this."""


@dataclasses.dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)


class AsyncLLM:
    def __init__(self, engine: LLMEngine, *, on_step: Callable[[LLMEngine, list[RequestOutput]], None] | None = None,
                 followers: StepSender | None = None):
        """`on_step(engine, outputs)` runs on the engine thread after every step (metrics read the
        engine there, where its state is consistent). `followers`: the other processes of a
        multi-process server, told of every step before it runs and stopped at `shutdown`."""
        self.engine = engine
        self.on_step = on_step
        self.followers = followers
        self.dead: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="paged-jax-engine", daemon=True)
        self._thread.start()

    async def generate(self, request_id: str, prompt, params: SamplingParams, *,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come, the last one `finished`. Leaving the iteration early
        (a client gone, a cancelled task) aborts the request, which frees its blocks at once."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead!r}")
        params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue())
        self._send(("add", request_id, prompt, params, cache_salt, sink))
        finished = False
        try:
            while not finished:
                item = await sink.outputs.get()
                if isinstance(item, BaseException):
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
            self.dead = e
            for sink in self._sinks.values():
                sink.put(EngineDeadError(f"the engine stopped: {e!r}"))
            self._sinks.clear()
            raise

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
                    self.engine.abort_request(command[1])
                    applied.append(command)
                continue
            _, request_id, prompt, params, cache_salt, sink = command
            try:
                self.engine.add_request(request_id, prompt, params, cache_salt=cache_salt)
            except ValueError as e:
                sink.put(e)
                continue
            self._sinks[request_id] = sink
            applied.append(command[:5])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:  # aborted by its caller, who no longer listens
                continue
            if out.finished:
                del self._sinks[out.request_id]
            sink.put(out)
        if self.on_step is not None:
            self.on_step(self.engine, outputs)
